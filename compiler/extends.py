"""``extends: base``: a spec built on another spec of the same directory.

The base's fields are the starting point; the spec's own mappings are merged over them key by
key, recursively (params per param name, and each param per field). Anything that is not a
mapping on both sides (a scalar, a list, a mapping over a scalar) replaces the base's value:
lists are replaced, never concatenated. Keys keep the base's order; keys only the spec has
come after them. Three top-level fields are the spec's own and never inherited: ``name`` (it
names the module), ``extends`` and ``tiny_config`` (a config.json is per model: the spec's
replaces the base's whole, and a spec without one has none).

A base is a real spec (it builds its own module) named by its file stem, in the same
directory; a base may extend another. Every inherited value keeps its position in the file it
was written in, so findings about it point there. The spec's text hashes with its bases' texts
(``Loaded.source``), so a change to a base rebuilds every spec built on it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path as FsPath

from mlxc.compiler.findings import Finding
from mlxc.compiler.source import Positions, load_yaml

OWN = ("name", "extends", "tiny_config")  # top-level fields never inherited
_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


@dataclass
class Loaded:
    data: object  # the merged plain data; None when unusable
    positions: Positions
    findings: list[Finding] = field(default_factory=list)
    source: str = ""  # own text, then each base's text: what the generated header hashes


def read(path: FsPath) -> tuple[str | None, Finding | None]:
    """A spec file's text, or a Y001 finding when it is not UTF-8."""
    try:
        return path.read_text(encoding="utf-8"), None
    except UnicodeDecodeError as err:
        raw = path.read_bytes()
        line = raw.count(b"\n", 0, err.start) + 1
        col = err.start - raw.rfind(b"\n", 0, err.start)
        return None, Finding(str(path), line, col, "Y001", f"not UTF-8 text ({err.reason})")


def load(text: str, path: str, _stack: tuple[str, ...] = ()) -> Loaded:
    """Parse ``text`` (the spec at ``path``) and merge it over its base, if it names one."""
    data, positions, findings = load_yaml(text, path)
    loaded = Loaded(data, positions, list(findings), text)
    if not isinstance(data, dict) or "extends" not in data:
        return loaded
    name = data.pop("extends")

    def finding(code: str, message: str) -> Loaded:
        line, col = positions.value(("extends",))
        loaded.findings.append(Finding(path, line, col, code, message))
        loaded.data = None
        return loaded

    if not isinstance(name, str):
        return finding("S003", "'extends' must be the name of a spec in this directory")
    if "/" in name or "\\" in name or name.endswith((".yaml", ".yml")) or name.startswith("."):
        return finding(
            "X003",
            f"extends '{name}': a base is a spec of the same directory, named by its file stem",
        )
    directory = FsPath(path).parent
    base_path = next(
        (p for p in (directory / f"{name}.yaml", directory / f"{name}.yml") if p.is_file()), None
    )
    if not _NAME.match(name) or base_path is None:
        return finding("X001", f"extends '{name}': no spec {name}.yaml in {directory}")
    chain = (*_stack, FsPath(path).stem)
    if name in chain:
        return finding("X002", f"extends cycle: {' -> '.join((*chain, name))}")
    base_text, bad = read(base_path)
    if bad is not None:
        loaded.findings.append(bad)
        loaded.data = None
        return loaded
    base = load(base_text, str(base_path), chain)
    loaded.findings += base.findings
    loaded.source = text + f"\n# extends {name}\n" + base.source
    if not isinstance(base.data, dict):
        loaded.data = None
        return loaded
    base_data = {k: v for k, v in base.data.items() if k not in OWN}
    inherited: list[tuple] = []
    loaded.data = _merge(base_data, data, (), inherited)
    _inherit_positions(positions, base.positions, str(base_path), inherited)
    return loaded


def _merge(base, own, path: tuple, inherited: list[tuple]):
    if not (isinstance(base, dict) and isinstance(own, dict)):
        return own
    out = {}
    for key, value in base.items():
        if key in own:
            out[key] = _merge(value, own[key], path + (key,), inherited)
        else:
            out[key] = value
            inherited.append(path + (key,))
    for key, value in own.items():
        out.setdefault(key, value)
    return out


def _inherit_positions(
    positions: Positions, base: Positions, base_path: str, inherited: list[tuple]
) -> None:
    """Copy the base's positions of every inherited subtree, marked with the file they are in."""
    roots = set(inherited)

    def taken(p: tuple) -> bool:
        return any(p[:i] in roots for i in range(1, len(p) + 1))

    for p in [p for p in {*base.values, *base.keys} if taken(p)]:
        if p in base.values:
            positions.values[p] = base.values[p]
        if p in base.keys:
            positions.keys[p] = base.keys[p]
        if p in base.quoted:
            positions.quoted.add(p)
        positions.files[p] = base.files.get(p, base_path)
