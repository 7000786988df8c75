"""YAML loading that keeps the line and column of every node, and reports duplicate keys.

``load_yaml`` returns plain Python data plus a ``Positions`` table keyed by path tuples such as
``("text", "layers", "attention", "inputs", "mask")``; lint findings use it to point at lines.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import yaml

from mlxc.compiler.findings import Finding

Path = tuple


@dataclass
class Positions:
    """1-based (line, col) of each value and of each mapping key, by path."""

    values: dict[Path, tuple[int, int]] = field(default_factory=dict)
    keys: dict[Path, tuple[int, int]] = field(default_factory=dict)
    quoted: set[Path] = field(default_factory=set)

    def value(self, path: Path) -> tuple[int, int]:
        """Position of the value at ``path``, or of its nearest existing ancestor."""
        path = tuple(path)
        while path and path not in self.values:
            path = path[:-1]
        return self.values.get(path, (1, 1))

    def key(self, path: Path) -> tuple[int, int]:
        """Position of the mapping key naming ``path`` (falls back to the value)."""
        path = tuple(path)
        return self.keys.get(path) or self.value(path)


class _Builder:
    def __init__(self, filename: str) -> None:
        self.filename = filename
        self.positions = Positions()
        self.findings: list[Finding] = []
        self._scalars = yaml.constructor.SafeConstructor()

    def build(self, node: yaml.Node, path: Path):
        mark = node.start_mark
        self.positions.values[path] = (mark.line + 1, mark.column + 1)
        if isinstance(node, yaml.MappingNode):
            out: dict = {}
            first_seen: dict = {}
            for key_node, value_node in node.value:
                key = self.build(key_node, path + ("<key>",))
                if not isinstance(key, (str, int, float, bool)) or key is None:
                    self._error(key_node, "S003", "mapping keys must be plain scalars")
                    continue
                kmark = key_node.start_mark
                if key in first_seen:
                    self._error(
                        key_node,
                        "Y002",
                        f"duplicate key '{key}' (first defined on line {first_seen[key]})",
                    )
                else:
                    first_seen[key] = kmark.line + 1
                self.positions.keys[path + (key,)] = (kmark.line + 1, kmark.column + 1)
                out[key] = self.build(value_node, path + (key,))
            self.positions.values.pop(path + ("<key>",), None)
            return out
        if isinstance(node, yaml.SequenceNode):
            return [self.build(item, path + (i,)) for i, item in enumerate(node.value)]
        if node.style in ("'", '"'):
            self.positions.quoted.add(path)
        return self._scalars.construct_object(node, deep=True)

    def _error(self, node: yaml.Node, code: str, message: str) -> None:
        m = node.start_mark
        self.findings.append(Finding(self.filename, m.line + 1, m.column + 1, code, message))


def load_yaml(text: str, filename: str) -> tuple[object, Positions, list[Finding]]:
    """Parse ``text``; on malformed YAML return ``(None, positions, [Y001 finding])``."""
    builder = _Builder(filename)
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        line, col = (mark.line + 1, mark.column + 1) if mark else (1, 1)
        problem = err.problem or "cannot parse"
        if err.context:
            problem = f"{err.context}: {problem}"
        return None, builder.positions, [Finding(filename, line, col, "Y001", problem)]
    if node is None:
        return None, builder.positions, [Finding(filename, 1, 1, "Y001", "empty document")]
    data = builder.build(node, ())
    return data, builder.positions, builder.findings
