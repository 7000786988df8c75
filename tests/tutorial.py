"""Run the README's tutorial ("Tutorial: add an architecture in one spec") exactly as written.

It writes the tutorial's ```yaml blocks to the paths their steps name (in backticks, before the
block), in a fresh directory, then runs its ```sh blocks there with bash, stopping at the first
failing command. Only the standard library: it runs under any Python, with whichever `mlxc` is
on PATH. tests/test_tutorial.py runs it on a non-editable install of the checkout; .ci/run on
the plain `pip install .` of its packaging step:

    python tests/tutorial.py [--bin DIR]     # DIR: where the `mlxc` to run is (default: PATH)
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"
SECTION = "## Tutorial: add an architecture in one spec"
_BLOCK = re.compile(r"^( *)```(\w+)\n(.*?)^\1```$", re.DOTALL | re.MULTILINE)


class TutorialError(AssertionError):
    pass


def blocks(readme: Path = README) -> tuple[dict[str, str], list[str]]:
    """The tutorial's files (path -> text, from its ```yaml blocks) and shell scripts."""
    text = readme.read_text(encoding="utf-8")
    start = text.index(SECTION)
    end = text.find("\n## ", start + len(SECTION))
    section = text[start : end if end > 0 else len(text)]
    files: dict[str, str] = {}
    scripts: list[str] = []
    previous = 0
    for m in _BLOCK.finditer(section):
        indent, lang, body = m.groups()
        body = "".join(line.removeprefix(indent) for line in body.splitlines(keepends=True))
        if lang == "yaml":
            names = re.findall(r"`([^`\s]+\.ya?ml)`", section[previous : m.start()])
            if not names:
                raise TutorialError(f"no file name (`path.yaml`) before the block:\n{body}")
            files[names[-1]] = body
        elif lang in ("sh", "bash"):
            scripts.append(body)
        previous = m.end()
    commands = "".join(scripts)
    for needed in ("mlxc checkpoint ", "mlxc generate --specs "):
        if needed not in commands:
            raise TutorialError(f"the tutorial runs no `{needed.strip()}`")
    if not files:
        raise TutorialError("the tutorial writes no spec")
    return files, scripts


def run(workdir: Path, env: dict[str, str] | None = None) -> str:
    """Write the tutorial's files into ``workdir`` and run its commands there; their output.
    Raises TutorialError naming the command that failed."""
    files, scripts = blocks()
    for name, text in files.items():
        (workdir / name).parent.mkdir(parents=True, exist_ok=True)
        (workdir / name).write_text(text, encoding="utf-8")
    log = []
    for script in scripts:
        # -x: each command is echoed ("+ mlxc ...") before its output.
        proc = subprocess.run(
            ["bash", "-euxo", "pipefail", "-c", script],
            check=False,
            cwd=workdir,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=600,
        )
        log.append(proc.stdout)
        if proc.returncode != 0:
            raise TutorialError(f"the tutorial failed (exit {proc.returncode}):\n{''.join(log)}")
    return "".join(log)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bin", help="directory of the `mlxc` to run (put first on PATH)")
    args = parser.parse_args()
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    if args.bin:
        env["PATH"] = f"{Path(args.bin).resolve()}{os.pathsep}{env.get('PATH', '')}"
    with tempfile.TemporaryDirectory(prefix="mlxc-tutorial-") as tmp:
        env["MLXC_HOME"] = str(Path(tmp) / "home")
        try:
            print(run(Path(tmp), env), end="")
        except TutorialError as e:
            print(f"tutorial: {e}", file=sys.stderr)
            return 1
    print("tutorial: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
