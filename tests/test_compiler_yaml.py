"""Specs are plain YAML data: no anchors, aliases or foreign tags (issue 10, items 15, 16).

Whatever the YAML, `mlxc lint` ends with findings (exit 1), never a traceback.
"""

from pathlib import Path

import pytest
from click.testing import CliRunner

from mlxc.cli import main
from mlxc.compiler import lint

OK_SPEC = (Path(__file__).parent / "fixtures" / "lint" / "ok.yaml").read_text()
NORM = "    norm: {eps: 1.0e-6}"  # line 14 of ok.yaml, the value at column 17


def lint_text(tmp_path: Path, text: str, name: str = "ok.yaml") -> tuple[int, list[str]]:
    """Run `mlxc lint` on one spec file; (exit code, output lines)."""
    path = tmp_path / name
    path.write_bytes(text.encode("utf-8") if isinstance(text, str) else text)
    result = CliRunner().invoke(main, ["lint", str(path)])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    return result.exit_code, [
        line.removeprefix(f"{tmp_path}/") for line in result.output.splitlines()
    ]


def billion_laughs(depth: int = 7) -> str:
    """A mapping where each level lists the one before nine times: 9**depth leaves."""
    lines = ["  l0: &l0 [" + ", ".join(["lol"] * 9) + "]"]
    for i in range(1, depth + 1):
        lines.append(f"  l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 9) + "]")
    return "\n".join(lines) + "\n"


def test_alias_bomb_is_refused_at_its_first_anchor(tmp_path):
    bomb = billion_laughs()
    assert len(bomb) < 700
    text = OK_SPEC.replace("tiny_config: {", "bomb:\n" + bomb + "tiny_config: {")
    code, lines = lint_text(tmp_path, text)
    assert code == 1
    assert lines == [
        "ok.yaml:27:7: Y001 anchor &l0: specs do not use YAML anchors and aliases; write the "
        + "value out"
    ]


def test_an_alias_is_refused_at_its_line(tmp_path):
    # An alias of an anchor outside the document is still an alias.
    code, lines = lint_text(tmp_path, OK_SPEC.replace(NORM, "    norm: *eps"))
    assert code == 1
    assert lines == [
        "ok.yaml:14:11: Y001 alias *eps: specs do not use YAML anchors and aliases; write the "
        + "value out"
    ]
    code, lines = lint_text(tmp_path, OK_SPEC.replace("tiny_config: {", "x: *a\ntiny_config: {"))
    assert code == 1 and lines[0].startswith("ok.yaml:26:4: Y001 alias *a:")


def test_shipped_specs_use_no_anchors():
    assert [f for c in lint.check_all(["specs"]) for f in c.findings] == []


@pytest.mark.parametrize(
    "value, message",
    [
        ("!!python/name:os.system x", "tag !!python/name:os.system"),
        ("!!python/object/apply:os.system [echo]", "tag !!python/object/apply:os.system"),
        ("!foo 1", "tag !foo"),
        ("!!set {a: null}", "tag !!set"),
        ("!!binary aGk=", "tag !!binary"),
        ("2001-01-01", "tag !!timestamp"),
        ("{<<: {a: 1}}", "tag !!merge"),
        ("!!float abc", "cannot read 'abc' as !!float"),
        ("!!int 1.5", "cannot read '1.5' as !!int"),
        ("!!bool maybe", "cannot read 'maybe' as !!bool"),
    ],
)
def test_tags_beyond_plain_data_are_y001(tmp_path, value, message):
    code, lines = lint_text(tmp_path, OK_SPEC.replace(NORM, f"    norm: {{eps: {value}}}"))
    assert code == 1
    [line] = lines
    col = 18 if value.startswith("{") else 17
    assert line.startswith(f"ok.yaml:14:{col}: Y001 "), line
    assert message in line, line


def test_plain_tags_still_read(tmp_path):
    text = OK_SPEC.replace(NORM, "    norm: {eps: !!float 1e-6}")
    assert lint_text(tmp_path, text) == (0, [])


def test_deep_nesting_is_y001(tmp_path):
    text = OK_SPEC.replace(NORM, "    norm: {eps: " + "[" * 5000 + "]" * 5000 + "}")
    code, lines = lint_text(tmp_path, text)
    assert code == 1 and lines == ["ok.yaml:14:113: Y001 nested deeper than 100 levels"]


def test_unreadable_text_is_y001(tmp_path):
    code, lines = lint_text(tmp_path, OK_SPEC.replace("A minimal", "A \x01 minimal"))
    assert code == 1 and lines[0].startswith("ok.yaml:2:8: Y001 unacceptable character #x0001")
    raw = OK_SPEC.encode().replace(b"A minimal", b"A \xff minimal")
    code, lines = lint_text(tmp_path, raw)
    assert code == 1 and lines[0].startswith("ok.yaml:2:8: Y001 not UTF-8 text")
