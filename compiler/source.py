"""YAML loading that keeps the line and column of every node, and reports duplicate keys.

``load_yaml`` returns plain Python data plus a ``Positions`` table keyed by path tuples such as
``("text", "layers", "attention", "inputs", "mask")``; lint findings use it to point at lines.

Specs are plain data: strings, numbers, booleans, null, lists and mappings. Anchors and aliases
are refused (the builder walks an alias's node each time it is used, so nested aliases grow
exponentially: a "billion laughs"), and so is every tag beyond the core ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import yaml

from mlxc.compiler.findings import Finding

Path = tuple

_CORE = "tag:yaml.org,2002:"
PLAIN_TAGS = {_CORE + t for t in ("null", "bool", "int", "float", "str", "seq", "map")}
MAX_DEPTH = 100  # nesting levels; specs use fewer than 10, and composing recurses per level


def _refuse(message: str, mark) -> yaml.MarkedYAMLError:
    return yaml.composer.ComposerError(None, None, message, mark)


class _SpecLoader(yaml.SafeLoader):
    """SafeLoader's composer, refusing anchors, aliases, foreign tags and deep nesting."""

    depth = 0

    def compose_node(self, parent, index):
        event = self.peek_event()
        if event.anchor is not None:
            kind = "alias *" if isinstance(event, yaml.AliasEvent) else "anchor &"
            raise _refuse(
                f"{kind}{event.anchor}: specs do not use YAML anchors and aliases; "
                "write the value out",
                event.start_mark,
            )
        if self.depth == MAX_DEPTH:
            raise _refuse(f"nested deeper than {MAX_DEPTH} levels", event.start_mark)
        self.depth += 1
        try:
            node = super().compose_node(parent, index)
        finally:
            self.depth -= 1
        if node.tag not in PLAIN_TAGS:
            raise _refuse(
                f"unsupported tag {_short(node.tag)}: specs hold only strings, numbers, "
                "booleans, null, lists and mappings (quote a value to make it a string)",
                node.start_mark,
            )
        return node


def _short(tag: str) -> str:
    return tag.replace(_CORE, "!!", 1) if tag.startswith(_CORE) else tag


@dataclass
class Positions:
    """1-based (line, col) of each value and of each mapping key, by path."""

    values: dict[Path, tuple[int, int]] = field(default_factory=dict)
    keys: dict[Path, tuple[int, int]] = field(default_factory=dict)
    quoted: set[Path] = field(default_factory=set)
    # The file a value (and its key) was written in, for values inherited through `extends:`;
    # a path not here was written in the spec's own file.
    files: dict[Path, str] = field(default_factory=dict)

    def _nearest(self, path: Path) -> Path:
        path = tuple(path)
        while path and path not in self.values:
            path = path[:-1]
        return path

    def value(self, path: Path) -> tuple[int, int]:
        """Position of the value at ``path``, or of its nearest existing ancestor."""
        return self.values.get(self._nearest(path), (1, 1))

    def key(self, path: Path) -> tuple[int, int]:
        """Position of the mapping key naming ``path`` (falls back to the value)."""
        path = tuple(path)
        return self.keys.get(path) or self.value(path)

    def value_file(self, path: Path) -> str | None:
        """The file holding ``value(path)``; None for the spec's own file."""
        return self.files.get(self._nearest(path))

    def key_file(self, path: Path) -> str | None:
        """The file holding ``key(path)``; None for the spec's own file."""
        path = tuple(path)
        return self.files.get(path) if path in self.keys else self.value_file(path)


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
        try:
            return self._scalars.construct_object(node, deep=True)
        except (ValueError, KeyError):  # e.g. `!!float abc`, `!!bool maybe`
            raise _refuse(f"cannot read {node.value!r} as {_short(node.tag)}", node.start_mark)

    def _error(self, node: yaml.Node, code: str, message: str) -> None:
        m = node.start_mark
        self.findings.append(Finding(self.filename, m.line + 1, m.column + 1, code, message))


def load_yaml(text: str, filename: str) -> tuple[object, Positions, list[Finding]]:
    """Parse ``text``; on malformed YAML return ``(None, positions, [Y001 finding])``."""
    builder = _Builder(filename)

    def malformed(line: int, col: int, problem: str):
        return None, builder.positions, [Finding(filename, line, col, "Y001", problem)]

    try:
        node = yaml.compose(text, Loader=_SpecLoader)
        if node is None:
            return malformed(1, 1, "empty document")
        data = builder.build(node, ())
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        line, col = (mark.line + 1, mark.column + 1) if mark else (1, 1)
        problem = err.problem or "cannot parse"
        if err.context:
            problem = f"{err.context}: {problem}"
        return malformed(line, col, problem)
    except yaml.reader.ReaderError as err:  # a control character: the error has no mark
        line = text.count("\n", 0, err.position) + 1
        col = err.position - text.rfind("\n", 0, err.position)
        return malformed(line, col, f"unacceptable character #x{err.character:04x}: {err.reason}")
    return data, builder.positions, builder.findings
