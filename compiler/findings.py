"""Lint findings: one rule code each, printed ruff/gcc style as ``path:line:col: CODE message``."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Rule:
    """A lint rule: its stable code, a one-line doc (the README's rule table is tested against
    it) and the failing spec that shows it, under tests/fixtures/lint."""

    code: str
    doc: str
    fixture: str


RULES: dict[str, Rule] = {
    r.code: r
    for r in (
        Rule("Y001", "malformed YAML", "malformed.yaml"),
        Rule("Y002", "duplicate key in a mapping", "duplicate_key.yaml"),
        Rule("S001", "unknown field", "unknown_field.yaml"),
        Rule("S002", "missing required field", "missing_field.yaml"),
        Rule("S003", "wrong type or value for a field", "type_error.yaml"),
        Rule("S004", "unknown block kind", "unknown_kind.yaml"),
        Rule(
            "S005",
            "variant list misuse: every variant but the last needs `when`, the last has none",
            "variant_fallback.yaml",
        ),
        Rule(
            "L001",
            "a live-window input (mask, window) labelled monotonic-position",
            "mask_monotonic.yaml",
        ),
        Rule(
            "L002",
            "a monotonic-position input (positions, rope_deltas, attn_scale) labelled live-window",
            "positions_live.yaml",
        ),
        Rule("L003", "an attention input the block consumes has no label", "missing_label.yaml"),
        Rule(
            "L004",
            "a label that is neither monotonic-position nor live-window",
            "unknown_label.yaml",
        ),
        Rule(
            "L005", "a labelled input that this block kind does not consume", "unknown_input.yaml"
        ),
        Rule(
            "P001",
            "reference to an undefined param, layer field or function",
            "undefined_param.yaml",
        ),
        Rule("P002", "invalid expression", "bad_syntax.yaml"),
        Rule("P003", "params whose defaults depend on each other in a cycle", "param_cycle.yaml"),
        Rule("R001", "model_type served by more than one spec", "dup_type"),
        Rule(
            "R002",
            "spec name differs from its file name (it names the generated module)",
            "name_mismatch.yaml",
        ),
        Rule("X001", "`extends` names no spec in the spec's directory", "extends_unknown.yaml"),
        Rule("X002", "specs that extend each other in a cycle", "extends_cycle.yaml"),
        Rule(
            "X003",
            "`extends` names a spec in another directory (a base is a file stem, same directory)",
            "extends_outside.yaml",
        ),
        Rule(
            "C001",
            "construct the schema accepts but the code generator does not compile yet",
            "not_compiled.yaml",
        ),
    )
}


@dataclass(frozen=True, order=True)
class Finding:
    path: str
    line: int
    col: int
    code: str
    message: str

    def text(self) -> str:
        return f"{self.path}:{self.line}:{self.col}: {self.code} {self.message}"

    def github(self) -> str:
        # GitHub Actions workflow command: shows up as an annotation on the line.
        msg = self.message.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")
        return (
            f"::error file={self.path},line={self.line},col={self.col},"
            f"title={self.code}::{self.code} {msg}"
        )


def render(findings: list[Finding], fmt: str) -> str:
    findings = sorted(findings)
    if fmt == "json":
        return json.dumps([asdict(f) for f in findings], indent=2)
    if fmt == "github":
        return "\n".join(f.github() for f in findings)
    return "\n".join(f.text() for f in findings)
