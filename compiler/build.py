"""``mlxc build``: render every spec, then write generated/ atomically (or diff it, ``--check``)."""

from __future__ import annotations

import difflib
import os
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

from mlxc.compiler import codegen, lint
from mlxc.compiler.findings import Finding


@dataclass
class BuildResult:
    findings: list[Finding]
    files: dict[str, str]  # file name in the output dir -> content


def spec_label(path: str) -> str:
    """How a generated header names its spec: ``<dir>/<file>``, the same on every machine."""
    p = Path(path)
    return f"{p.parent.name}/{p.name}" if p.parent.name else p.name


def render(paths: list[str]) -> BuildResult:
    """Lint, render and compile; ``files`` is empty when there are findings."""
    checked = lint.check_all(paths)
    findings = [f for c in checked for f in c.findings]
    if findings:
        return BuildResult(findings, {})
    files: dict[str, str] = {"__init__.py": codegen.render_package_init()}
    origins: dict[str, str] = {}  # model file -> its spec, where a compile error is reported
    registry: list[tuple[str, str]] = []
    for c in checked:
        name = f"{c.spec.name}.py"
        files[name] = codegen.render_model(c.spec, c.source, spec_label(c.path))
        origins[name] = c.path
        registry += [(key, c.spec.name) for key in c.spec.serves.registry_keys()]
    files["registry.py"] = codegen.render_registry(registry)
    findings = [
        Finding(origins.get(name, name), 1, 1, "C001", f"generated {name} does not compile: {err}")
        for name, err in _compile_errors(files).items()
    ]
    return BuildResult(findings, {} if findings else files)


def _compile_errors(files: dict[str, str]) -> dict[str, str]:
    """Compile every file (warnings are errors): the last guard before anything is written."""
    errors = {}
    for name, content in files.items():
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # e.g. an invalid escape sequence
            try:
                compile(content, name, "exec", dont_inherit=True)
            except SyntaxError as err:
                errors[name] = f"{err.msg} (its line {err.lineno}); this is an mlxc bug"
            except ValueError as err:  # a NUL byte
                errors[name] = f"{err}; this is an mlxc bug"
    return errors


def _is_generated(path: Path) -> bool:
    try:
        with path.open(encoding="utf-8") as f:
            return f.readline().startswith(codegen.GENERATED_MARK)
    except OSError:
        return False


def stale(files: dict[str, str], out_dir: Path) -> tuple[dict[str, str], list[str]]:
    """(files whose content differs or is missing, generated files no spec produces any more)."""
    changed = {}
    for name, content in files.items():
        target = out_dir / name
        if not target.exists() or target.read_text(encoding="utf-8") != content:
            changed[name] = content
    orphans = sorted(
        p.name for p in out_dir.glob("*.py") if p.name not in files and _is_generated(p)
    )
    return changed, orphans


def diff(files: dict[str, str], out_dir: Path) -> str:
    changed, orphans = stale(files, out_dir)
    chunks = []
    for name, content in sorted(changed.items()):
        target = out_dir / name
        old = target.read_text(encoding="utf-8") if target.exists() else ""
        chunks += difflib.unified_diff(
            old.splitlines(keepends=True),
            content.splitlines(keepends=True),
            fromfile=str(target),
            tofile=f"{target} (from specs)",
        )
    for name in orphans:
        old = (out_dir / name).read_text(encoding="utf-8")
        chunks += difflib.unified_diff(
            old.splitlines(keepends=True), [], fromfile=str(out_dir / name), tofile="/dev/null"
        )
    return "".join(chunks)


def write(files: dict[str, str], out_dir: Path) -> list[str]:
    """Write changed files atomically (temp file + rename), remove orphans; return what changed.

    Every file is rendered before the first write, so a failure leaves no half-built output.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    changed, orphans = stale(files, out_dir)
    for name, content in sorted(changed.items()):
        fd, tmp = tempfile.mkstemp(dir=out_dir, prefix=f".{name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as f:
                f.write(content)
            os.replace(tmp, out_dir / name)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    for name in orphans:
        (out_dir / name).unlink()
    return sorted(changed) + orphans
