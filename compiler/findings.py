"""Lint findings: one rule code each, printed ruff/gcc style as ``path:line:col: CODE message``."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

# Stable rule codes and their one-line docs (the README lists them from here).
RULES: dict[str, str] = {
    "Y001": "malformed YAML",
    "Y002": "duplicate key in a mapping",
    "S001": "unknown field",
    "S002": "missing required field",
    "S003": "wrong type or value for a field",
    "S004": "unknown block kind",
    "S005": "variant list misuse: every variant but the last needs `when`, the last has none",
    "L001": "a live-window input (mask, window) labelled monotonic-position",
    "L002": "a monotonic-position input (positions, rope_deltas, attn_scale) labelled live-window",
    "L003": "an attention input the block consumes has no label",
    "L004": "a label that is neither monotonic-position nor live-window",
    "L005": "a labelled input that this block kind does not consume",
    "P001": "reference to an undefined param, layer field or function",
    "P002": "invalid expression",
    "P003": "params whose defaults depend on each other in a cycle",
    "R001": "model_type served by more than one spec",
    "R002": "spec name differs from its file name (it names the generated module)",
    "C001": "construct the schema accepts but the code generator does not compile yet",
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
