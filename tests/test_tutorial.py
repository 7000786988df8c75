"""The README tutorial runs exactly as written (its spec, `mlxc checkpoint`, `mlxc generate
--specs`) on a non-editable install of this checkout (issue 11). The runner is tests/tutorial.py;
.ci/run also runs it on a plain `pip install .` in a fresh venv."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tutorial

ROOT = Path(__file__).parent.parent
# What `pip install .` builds from (pyproject.toml names the package directories).
SOURCES = ("pyproject.toml", "README.md", "mlxc", "compiler", "runtime", "generated")


def test_the_tutorial_blocks():
    files, scripts = tutorial.blocks()
    assert list(files) == ["myspecs/mymodel.yaml"]
    assert files["myspecs/mymodel.yaml"].startswith("name: mymodel\n")
    assert "mlxc checkpoint myspecs/mymodel.yaml --out mymodel-tiny\n" in scripts[0]


def test_the_tutorial_runs_as_written_on_a_non_editable_install(tmp_path):
    pytest.importorskip("setuptools", reason="an offline build needs setuptools in the venv")
    # A copy of the sources, installed as a wheel into a directory of its own: not the
    # editable checkout (nor a build/ in it, where others work).
    src, site, work = tmp_path / "src", tmp_path / "site", tmp_path / "work"
    src.mkdir()
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(ROOT / name, src / name)
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation"]
    subprocess.run([*pip, "--target", str(site), str(src)], check=True, capture_output=True)
    env = {
        **os.environ,
        "PYTHONPATH": str(site),
        "PATH": f"{site / 'bin'}{os.pathsep}{os.environ['PATH']}",
        "HF_HUB_OFFLINE": "1",
        "MLXC_HOME": str(tmp_path / "home"),
    }
    work.mkdir()
    where = subprocess.run(
        ["mlxc", "--help"], cwd=work, env=env, capture_output=True, text=True, check=True
    )
    assert "checkpoint" in where.stdout
    imported = subprocess.run(
        [
            sys.executable,
            "-c",
            "import mlxc.cli, mlxc.runtime.checkpoint.loading as m; print(m.__file__)",
        ],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert imported.stdout.startswith(str(site)), imported.stdout  # the install, not the checkout
    assert shutil.which("mlxc", path=env["PATH"]) == str(site / "bin" / "mlxc")

    log = tutorial.run(work, env)
    assert "+ mlxc generate --specs myspecs/" in log
    assert "ok   mymodel" in log  # mlxc verify --specs
    assert "wrote mymodel-tiny: spec mymodel, RANDOM weights" in log
    assert "| generated: " in log  # the stats line of mlxc generate
