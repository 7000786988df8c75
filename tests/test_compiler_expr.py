"""Spec expressions evaluate in bounded time and memory (issue 10, item 17).

The bound is static: lint rejects what could grow without limit, at the expression's line.
"""

from pathlib import Path

import pytest
from click.testing import CliRunner

from mlxc.cli import main
from mlxc.compiler import expr

OK_SPEC = (Path(__file__).parent / "fixtures" / "lint" / "ok.yaml").read_text()
MLP = "    mlp: {kind: swiglu, hidden: 4 * hidden_size}"  # line 24; the value at column 33


def scope() -> expr.Scope:
    """Params of every type, one layer field, layer_idx."""
    return expr.Scope(
        frozenset({"hidden_size", "eps", "flag", "blocks", "name", "anything"}),
        frozenset({"ffn_mult"}),
        layer_idx=True,
        numbers=frozenset({"hidden_size", "eps", "flag", "ffn_mult"}),
    )


def test_power_tower_is_a_lint_finding(tmp_path):
    # Before: lint passed it, and `mlxc verify` hung evaluating the width.
    path = tmp_path / "ok.yaml"
    path.write_text(OK_SPEC.replace(MLP, "    mlp: {kind: swiglu, hidden: 9 ** 9 ** 9 ** 9}"))
    result = CliRunner().invoke(main, ["lint", str(path)])
    assert result.exit_code == 1
    [line] = result.output.splitlines()
    assert line == (
        f"{path}:24:38: P002 the exponent of ** must be a number literal (at most 64), "
        "so that the value stays bounded"
    )


def test_param_default_is_bounded_too(tmp_path):
    path = tmp_path / "ok.yaml"
    text = OK_SPEC.replace(
        "  vocab_size: {type: int}", "  vocab_size: {type: int, default: (hidden_size ** 64) ** 2}"
    )
    path.write_text(text)
    result = CliRunner().invoke(main, ["lint", str(path)])
    assert result.exit_code == 1
    [line] = result.output.splitlines()
    assert line.startswith(f"{path}:8:36: P002 '(hidden_size ** 64) ** 2' may grow too large")


@pytest.mark.parametrize(
    "text",
    [
        "hidden_size ** 2",
        "eps ** -0.5",
        "2 ** 10",
        "hidden_size ** 64",
        "round_up(int(2 * ffn_mult * hidden_size / 3), 256)",
        "layer_idx in blocks or (layer_idx + 1) % hidden_size != 0",
        "len(blocks) * hidden_size",
        "max(hidden_size, 2) * 4",
        "(hidden_size if flag else 2) * 3",
        "-hidden_size // 2",
        "name == 'full'",
        "hidden_size * hidden_size * hidden_size",
    ],
)
def test_bounded_expressions_pass(text):
    expr.check(text, scope())


@pytest.mark.parametrize(
    "text, message",
    [
        ("9 ** 9 ** 9 ** 9", "the exponent of ** must be a number literal"),
        ("hidden_size ** hidden_size", "the exponent of ** must be a number literal"),
        ("2 ** 65", "the exponent of ** must be a number literal (at most 64)"),
        ("hidden_size ** 1e300", "the exponent of ** must be a number literal (at most 64)"),
        ("(hidden_size ** 8) ** 9", "may grow too large"),
        ("(hidden_size ** 64) * hidden_size", "may grow too large"),
        ("0x" + "f" * 40, "integer literal"),
        ("[0] * hidden_size", "arithmetic takes numbers, not a list"),
        ("'a' * hidden_size", "arithmetic takes numbers, not a str"),
        ("'%0999999999d' % 1", "arithmetic takes numbers, not a str"),
        ("blocks * 10 ** 9", "arithmetic takes numbers, not 'blocks'"),
        ("anything + 1", "arithmetic takes numbers, not 'anything'"),
        ("-blocks", "arithmetic takes numbers, not 'blocks'"),
        ("min(blocks) * 1000", "arithmetic takes numbers"),
        ("(blocks if flag else 2) * 1000", "arithmetic takes numbers"),
        ("(flag or blocks) * 1000", "arithmetic takes numbers"),
    ],
)
def test_unbounded_expressions_fail(text, message):
    with pytest.raises(
        expr.ExprError,
    ) as err:
        expr.check(text, scope())
    assert err.value.code == "P002"
    assert message in str(err.value), str(err.value)
