"""Every module the installed package imports comes with a plain `pip install .` (issue 10,
item 12: Pillow was only in the test extra, so `mlxc generate` failed after a plain install).

.ci/run checks the same end to end: a fresh venv, a non-editable install, `mlxc generate`."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from importlib.metadata import packages_distributions, requires
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _name(dist: str) -> str:
    return re.sub(r"[-_.]+", "-", dist).lower()


def _runtime_requirements(reqs: list[str]) -> set[str]:
    """Names of the requirements that apply here without any extra."""
    out = set()
    for text in reqs:
        req = Requirement(text)
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            out.add(_name(req.name))
    return out


def installed_sources() -> list[Path]:
    """The .py files `pip install .` installs: the packages pyproject.toml lists."""
    setuptools = PYPROJECT["tool"]["setuptools"]
    package_dir = setuptools["package-dir"]

    def directory(package: str) -> Path:
        # As setuptools maps it: the nearest package-dir entry, then the rest as folders.
        head, _, tail = package.rpartition(".")
        if package in package_dir or not head:
            return ROOT / package_dir.get(package, package)
        return directory(head) / tail

    dirs = [directory(p) for p in setuptools["packages"]]
    assert all(d.is_dir() for d in dirs), dirs
    # Every package folder under the listed roots is listed too: setuptools installs only
    # those, so a new subpackage left out imports in the editable checkout and nowhere else.
    roots = [directory(p) for p in package_dir]
    found = {i.parent for root in roots for i in root.rglob("__init__.py")}
    assert found <= set(dirs), f"packages missing from pyproject.toml: {sorted(found - set(dirs))}"
    return sorted(f for d in dirs for f in d.glob("*.py"))


def imported_modules(files: list[Path]) -> dict[str, str]:
    """Top-level module -> the first file importing it (imports inside functions included)."""
    found: dict[str, str] = {}
    for f in files:
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                found.setdefault(name.split(".")[0], str(f.relative_to(ROOT)))
    return found


def test_every_runtime_import_is_a_runtime_dependency():
    declared = _runtime_requirements(PYPROJECT["project"]["dependencies"])
    # A declared dependency's own requirements come with it (starlette with fastapi,
    # tokenizers with transformers).
    provided = set(declared)
    for dist in declared:
        provided |= _runtime_requirements(requires(dist) or [])
    dists = packages_distributions()
    files = installed_sources()
    assert any(f.name == "processor.py" for f in files)
    undeclared = {}
    for module, where in imported_modules(files).items():
        if module in sys.stdlib_module_names or module == "mlxc":
            continue
        if not {_name(d) for d in dists.get(module, [module])} & provided:
            undeclared[module] = where
    assert not undeclared, f"imported at run time but not in [project] dependencies: {undeclared}"
