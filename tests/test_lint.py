"""Every lint rule: a failing fixture under tests/fixtures/lint and the exact line it prints."""

import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from mlxc.cli import main
from mlxc.compiler.findings import RULES

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).parent / "fixtures" / "lint"
F = "tests/fixtures/lint"

EXPECTED = {
    "malformed": "malformed.yaml:3:7: Y001 while parsing a flow sequence: expected ',' or ']', "
    "but got ':'",
    "duplicate_key": "duplicate_key.yaml:10:3: Y002 duplicate key 'hidden_size' "
    "(first defined on line 5)",
    "unknown_field": "unknown_field.yaml:19:7: S001 unknown field 'head_dims'",
    "missing_field": "missing_field.yaml:15:5: S002 missing required field 'kv_heads' "
    "in 'attention'",
    "type_error": "type_error.yaml:13:13: S003 'repeat' must be an integer or an expression "
    "string, got a list",
    "unknown_kind": "unknown_kind.yaml:24:17: S004 unknown kind 'swishglu' "
    "(expected 'swiglu', 'linear', 'none', 'moe', 'dense')",
    "variant_fallback": "variant_fallback.yaml:25:9: S005 every variant but the last needs `when`",
    "mask_monotonic": "mask_monotonic.yaml:23:15: L001 mask labelled monotonic-position: after "
    "trim_front the cache returns live_len keys, so a mask sized from offset is wider than K/V "
    "(broadcast_shapes); label it live-window",
    "positions_live": "positions_live.yaml:22:20: L002 positions labelled live-window: live_len "
    "shrinks on trim_front, so positions would regress after a trim; label it "
    "monotonic-position (cache.offset)",
    "missing_label": "missing_label.yaml:21:7: L003 gqa attention consumes 'mask' but has no "
    "label for it (add `mask: live-window` under inputs)",
    "unknown_label": "unknown_label.yaml:23:15: L004 'live_window' is not a label: use "
    "monotonic-position or live-window",
    "unknown_input": "unknown_input.yaml:24:9: L005 unknown attention input 'offset' "
    "(known: positions, rope_deltas, attn_scale, mask, window)",
    "undefined_param": "undefined_param.yaml:24:37: P001 undefined name 'hidden' (defined here: "
    "hidden_size, num_attention_heads, num_hidden_layers, rope, vocab_size, layer_idx)",
    "bad_expression": "bad_expression.yaml:24:38: P001 unknown function '__import__' "
    "(known: ceil, float, floor, int, len, max, min, round_up)",
    "bad_syntax": "bad_syntax.yaml:24:38: P002 invalid expression '4 * (hidden_size': "
    "'(' was never closed",
    "disallowed_expression": "disallowed_expression.yaml:24:33: P002 'Attribute' is not allowed "
    "in spec expressions",
    "param_cycle": "param_cycle.yaml:8:27: P003 cyclic param defaults: vocab_size -> "
    "padded_vocab -> vocab_size",
    "name_mismatch": "name_mismatch.yaml:1:7: R002 spec name 'something_else' must match its "
    "file name",
    "not_compiled": "not_compiled.yaml:20:34: C001 mrope positions need a qwen vision tower",
    "extends_unknown": "extends_unknown.yaml:2:10: X001 extends 'no_such_spec': no spec "
    "no_such_spec.yaml in tests/fixtures/lint",
    "extends_cycle": "extends_cycle.yaml:2:10: X002 extends cycle: extends_cycle -> extends_cycle",
    "extends_outside": "extends_outside.yaml:2:10: X003 extends '../specs_elsewhere/ok': a base "
    "is a spec of the same directory, named by its file stem",
}


def lint(*args):
    return CliRunner().invoke(main, ["lint", *args])


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_rule_fixture_prints_exact_line(name):
    result = lint(f"{F}/{name}.yaml")
    assert result.exit_code == 1, result.output
    assert f"{F}/{EXPECTED[name]}" in result.output.splitlines()


def codes(output: str) -> set[str]:
    return {line.split(": ", 1)[1].split()[0] for line in output.splitlines()}


def test_every_rule_has_a_fixture():
    covered = {line.split(": ", 1)[1].split()[0] for line in EXPECTED.values()}
    covered.add("R001")  # cross-file: test_model_type_served_twice
    assert covered == set(RULES)


@pytest.mark.parametrize("rule", RULES.values(), ids=list(RULES))
def test_each_rules_fixture_shows_it(rule):
    result = lint(f"{F}/{rule.fixture}")
    assert result.exit_code == 1, result.output
    assert rule.code in codes(result.output)


def test_every_code_the_compiler_reports_is_a_rule():
    source = "".join(p.read_text() for p in (ROOT / "compiler").rglob("*.py"))
    assert set(re.findall(r'"([A-Z]\d{3})"', source)) == set(RULES)


def test_model_type_served_twice():
    result = lint(f"{F}/dup_type")
    assert result.exit_code == 1
    assert result.output.strip() == (
        f"{F}/dup_type/second.yaml:3:24: R001 model_type 'fixture-ok' is already served by "
        f"{F}/dup_type/first.yaml"
    )


def test_clean_spec_and_shipped_specs_exit_zero():
    assert lint(f"{F}/ok.yaml").exit_code == 0
    result = lint("specs/")
    assert result.exit_code == 0, result.output
    assert result.output == ""


def test_unusable_input_exits_two():
    assert lint("no/such/path.yaml").exit_code == 2
    assert lint("tests/").exit_code == 2  # a directory with no specs


def test_json_and_github_formats():
    result = lint("--format", "json", f"{F}/mask_monotonic.yaml")
    assert result.exit_code == 1
    [finding] = json.loads(result.output)
    assert finding["code"] == "L001"
    assert (finding["path"], finding["line"], finding["col"]) == (
        f"{F}/mask_monotonic.yaml",
        23,
        15,
    )
    result = lint("--format", "github", f"{F}/mask_monotonic.yaml")
    assert result.output.startswith(
        f"::error file={F}/mask_monotonic.yaml,line=23,col=15,title=L001::L001 mask labelled"
    )
    clean = lint("--format", "json", f"{F}/ok.yaml")
    assert clean.exit_code == 0 and json.loads(clean.output) == []


def test_fixtures_differ_from_ok_only_where_intended():
    # Guard against a fixture that fails for a reason other than the one it is named for.
    for name in EXPECTED:
        result = lint(f"{F}/{name}.yaml")
        expected_code = EXPECTED[name].split(": ", 1)[1].split()[0]
        extra = codes(result.output) - {expected_code}
        if name == "unknown_field":
            extra -= {"S002"}  # renaming a required field also leaves it missing
        assert not extra, (name, result.output)


def test_readme_rule_table_is_the_rules():
    # Both ways, in order: every rule with its doc, and no row that is not a rule.
    section = (ROOT / "README.md").read_text().split("\n## Lint rules\n", 1)[1]
    section = section.split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(\w+)` \| (.*) \|$", section, re.MULTILINE)
    assert rows == [(rule.code, rule.doc) for rule in RULES.values()]


def test_a_ropes_default_is_a_number(tmp_path):
    """A rope param's ``default`` is the theta of a config that names none (gemma3_text's 1e6)."""
    ok = (FIXTURES / "ok.yaml").read_text()
    assert "  rope: {type: rope}\n" in ok
    for default, bad in (("1000000.0", False), ("'1e6'", True), ("{rope_theta: 1}", True)):
        spec = tmp_path / "ok.yaml"
        spec.write_text(
            ok.replace("rope: {type: rope}", f"rope: {{type: rope, default: {default}}}")
        )
        result = lint(str(spec))
        assert (result.exit_code == 1) == bad, result.output
        if bad:
            assert "S003 a rope's default is its theta, a number" in result.output
