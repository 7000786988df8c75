"""``mlxc build``: render every spec, then write generated/ atomically (or diff it, ``--check``)."""

from __future__ import annotations

import difflib
import os
import tempfile
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
    """Lint and render; ``files`` is empty when there are findings."""
    checked = lint.check_all(paths)
    findings = [f for c in checked for f in c.findings]
    if findings:
        return BuildResult(findings, {})
    files: dict[str, str] = {"__init__.py": codegen.render_package_init()}
    registry: list[tuple[str, str]] = []
    for c in checked:
        files[f"{c.spec.name}.py"] = codegen.render_model(c.spec, c.source, spec_label(c.path))
        registry += [(key, c.spec.name) for key in c.spec.serves.registry_keys()]
    files["registry.py"] = codegen.render_registry(registry)
    return BuildResult([], files)


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
