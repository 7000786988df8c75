"""Your own specs, no reinstall: compile specs in memory and import their generated code.

``compile_specs(paths, builtin)`` lints the specs under ``paths`` (a directory or spec files),
reports as R001 any registry key that ``builtin`` (the built-in registry) already serves, renders
them with ``mlxc.compiler.build`` and executes each generated file as a module that exists only
in this process (in ``sys.modules``). Nothing is written to disk.
``mlxc.runtime.checkpoint.loading`` merges the result into its registry (``registry(specs)``); ``mlxc verify`` and
``mlxc checkpoint`` import generated source with the same :func:`load_source`.

Compiles are cached on the specs' text: the same specs compile once per process, and an edited
spec gets a module of its own (its name carries a hash of the spec), so models built from the
old text keep their module.
"""

from __future__ import annotations

import hashlib
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlxc.compiler import build, lint
from mlxc.compiler.findings import Finding, render

MODULE_PREFIX = "mlxc_spec_"


class SpecError(Exception):
    """Specs that cannot be compiled: ``findings`` are their lint findings (``str`` lists them,
    one ``path:line:col: CODE message`` a line)."""

    def __init__(self, findings: list[Finding]) -> None:
        self.findings = sorted(findings)
        super().__init__("lint findings in the specs:\n" + render(self.findings, "text"))


def load_source(name: str, source: str) -> types.ModuleType:
    """Execute generated source as the module ``mlxc_spec_<name>`` (registered in
    ``sys.modules``: dataclasses resolve annotations through it, the registry imports it)."""
    module = types.ModuleType(MODULE_PREFIX + name)
    sys.modules[module.__name__] = module
    exec(compile(source, f"<generated {name}>", "exec"), module.__dict__)  # noqa: S102 - mlxc output
    return module


@dataclass(frozen=True)
class Compiled:
    path: str  # the spec file
    spec: Any  # the validated spec (mlxc.compiler.lint.Checked.spec)
    module: types.ModuleType

    def registry(self) -> dict[str, str]:
        """Registry key -> module name, as ``checkpoint.loading.model_types()`` has them."""
        return dict.fromkeys(self.spec.serves.registry_keys(), self.module.__name__)


_CACHE: dict[tuple, list[Compiled]] = {}


def compile_specs(paths: list[str | Path], builtin: dict[str, str]) -> list[Compiled]:
    """The specs under ``paths``, linted, compiled and imported; :class:`SpecError` on any
    finding (R001 where a spec serves a key of ``builtin``, registry key -> module name), and
    ``mlxc.compiler.lint.UnusableInput`` for a path that does not exist or holds no specs."""
    paths = [str(p) for p in paths]
    checked = lint.check_all(paths)
    key = (tuple((c.path, c.source) for c in checked), tuple(sorted(builtin.items())))
    if key in _CACHE:
        return _CACHE[key]
    findings = [f for c in checked for f in c.findings] + _builtin_clashes(checked, builtin)
    if findings:
        raise SpecError(findings)
    result = build.render(paths)
    if result.findings:  # C001: generated code that does not compile (an mlxc bug)
        raise SpecError(result.findings)
    compiled = []
    for c in checked:
        name = c.spec.name
        digest = hashlib.sha256(c.source.encode()).hexdigest()[:12]
        module = load_source(f"{name}_{digest}", result.files[f"{name}.py"])
        compiled.append(Compiled(c.path, c.spec, module))
    _CACHE[key] = compiled
    return compiled


def _builtin_clashes(checked: list[lint.Checked], builtin: dict[str, str]) -> list[Finding]:
    """R001 at each ``serves.model_types`` entry whose registry key a built-in spec serves."""
    findings = []
    for c in checked:
        if c.spec is None:
            continue
        for key in c.spec.serves.registry_keys():
            if key in builtin:
                i = c.spec.serves.model_types.index(key.split(":")[0])
                line, col = c.positions.value(("serves", "model_types", i))
                spec = builtin[key].rsplit(".", 1)[-1]
                findings.append(
                    Finding(
                        c.path,
                        line,
                        col,
                        "R001",
                        f"model_type '{key}' is already served by the built-in spec {spec}",
                    )
                )
    return findings
