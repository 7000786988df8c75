"""Spec text reaches generated code only as checked names or as literals (issue 10, items 14, 17).

Each test builds a real spec directory in tmp_path and runs it through the `mlxc` CLI.
"""

import ast
import json
import math
import runpy
from pathlib import Path

import pytest
from click.testing import CliRunner

from mlxc.cli import main
from mlxc.compiler import codegen, lint
from mlxc.verify import load_source

OK_SPEC = (Path(__file__).parent / "fixtures" / "lint" / "ok.yaml").read_text()


def spec_dir(tmp_path: Path, *edits: tuple[str, str]) -> Path:
    """specs/ok.yaml: the ok fixture with each (old, new) replaced once."""
    text = OK_SPEC
    for old, new in edits:
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    specs = tmp_path / "specs"
    specs.mkdir()
    (specs / "ok.yaml").write_text(text)
    return specs


def mlxc(*args: str):
    return CliRunner().invoke(main, list(args))


def payload(marker: Path) -> str:
    """Python that creates ``marker`` if it ever runs."""
    return f'__import__("pathlib").Path("{marker}").touch(), #'


# --- item 14: names are identifiers ----------------------------------------------------------


def test_injected_param_name_is_a_finding_and_never_runs(tmp_path):
    marker = tmp_path / "MARKER"
    # First param, so the injected keyword argument leads the generated call and compiles.
    injected = f"  '{payload(marker)}': {{type: int, default: 1}}\n"
    first = "  hidden_size: {type: int}\n"
    specs = spec_dir(tmp_path, (first, injected + first))
    out = tmp_path / "gen"
    result = mlxc("lint", str(specs))
    assert result.exit_code == 1, result.output
    [line] = result.output.splitlines()
    assert line.startswith(f"{specs}/ok.yaml:5:3: S003 '__import__(")
    assert "is not a Python name" in line
    assert mlxc("build", str(specs), "-o", str(out)).exit_code == 1
    assert not out.exists()
    assert mlxc("verify", str(specs)).exit_code == 1
    assert not marker.exists()


def test_injected_layer_field_name_is_a_finding(tmp_path):
    marker = tmp_path / "MARKER"
    layers = (
        f"    for_each: blocks\n    fields:\n      '{payload(marker)}': {{type: int, from: x}}\n"
    )
    specs = spec_dir(
        tmp_path,
        ("  rope: {type: rope}\n", "  rope: {type: rope}\n  blocks: {type: list}\n"),
        ("    repeat: num_hidden_layers\n", layers),
    )
    result = mlxc("lint", str(specs))
    assert result.exit_code == 1
    [line] = result.output.splitlines()
    assert line.startswith(f"{specs}/ok.yaml:16:7: S003 '__import__(")
    assert mlxc("verify", str(specs)).exit_code == 1
    assert not marker.exists()


@pytest.mark.parametrize("name", ["class", "None", "a b", "1st", "x-y", "naïve", "", "a\nb"])
def test_param_names_must_be_python_names(name):
    text = OK_SPEC.replace(
        "  rope: {type: rope}", f"  rope: {{type: rope}}\n  {json.dumps(name)}: {{type: int}}"
    )
    findings = lint.check_source(text, "ok.yaml").findings
    assert [(f.line, f.col, f.code) for f in findings] == [(10, 3, "S003")], findings
    assert "\n" not in findings[0].message


def test_model_type_with_quotes_is_a_literal(tmp_path):
    marker = tmp_path / "MARKER"
    model_type = f'x": {payload(marker)} "'
    specs = spec_dir(
        tmp_path, ("model_types: [fixture-ok]", f"model_types: [{json.dumps(model_type)}]")
    )
    out = tmp_path / "gen"
    result = mlxc("build", str(specs), "-o", str(out))
    assert result.exit_code == 0, result.output
    assert runpy.run_path(str(out / "registry.py"))["MODEL_TYPES"] == {model_type: "ok"}
    module = load_source("ok_quotes", (out / "ok.py").read_text())
    assert module.MODEL_TYPES == (model_type,)
    assert f"Serves model_type {model_type}." in module.__doc__
    assert not marker.exists()


def test_spec_directory_name_cannot_leave_the_header_comment(tmp_path):
    specs = tmp_path / "specs\nimport os\n#"
    specs.mkdir()
    (specs / "ok.yaml").write_text(OK_SPEC)
    out = tmp_path / "gen"
    assert mlxc("build", str(specs), "-o", str(out)).exit_code == 0
    header = (out / "ok.py").read_text().splitlines()[:2]
    assert header[0].startswith(f"{codegen.GENERATED_MARK} from 'specs\\nimport os\\n#/ok.yaml' (")
    assert header[1].startswith("# Do not edit")


# --- item 17: values keep every character ---------------------------------------------------


def test_doc_regex_and_escapes_survive_into_generated_code(tmp_path):
    doc = 'Ends a docstring: """ then \\\' and a backslash \\ and "quotes".'
    drop = "a\nb"
    rename = "it\\'s"
    model_type = "a\\'b"
    weights = f"weights:\n  drop: [{json.dumps(drop)}]\n"
    weights += f"  rename: [{{pattern: {json.dumps(rename)}, to: '\"'}}]\n"
    specs = spec_dir(
        tmp_path,
        (
            "doc: A minimal valid spec the other fixtures are mutations of.",
            f"doc: {json.dumps(doc)}",
        ),
        ("model_types: [fixture-ok]", f"model_types: [{json.dumps(model_type)}]"),
        ("tiny_config:", weights + "tiny_config:"),
    )
    out = tmp_path / "gen"
    result = mlxc("build", str(specs), "-o", str(out))
    assert result.exit_code == 0, result.output
    module = load_source("ok_escapes", (out / "ok.py").read_text())
    assert doc in module.__doc__
    assert module.WEIGHT_RULES.drop == (drop,)
    assert module.WEIGHT_RULES.rename == ((rename, '"'),)
    assert module.MODEL_TYPES == (model_type,)
    assert runpy.run_path(str(out / "registry.py"))["MODEL_TYPES"] == {model_type: "ok"}


STRINGS = [
    "", "'", '"', "'\"", "\\'", "\\\\'", "\\", "x\\", '\\"', "a\nb", "a\\nb", "\\.x$", '"""',
    "'''", "\r", "\t", "\x00", "\u2028", "é", "\\N{DASH}", "a\\\nb", "#", "\\x41",
]  # fmt: skip


@pytest.mark.parametrize("value", STRINGS)
def test_pyrepr_reads_back_every_string(value):
    for literal in (codegen.pyrepr(value), codegen.pydocstring(value)):
        assert ast.literal_eval(literal) == value, literal
        assert "\n" not in literal or literal.startswith(('"""', 'r"""')), literal


def test_pyrepr_writes_non_finite_floats_as_calls():
    for value in (math.inf, -math.inf):
        assert eval(codegen.pyrepr(value)) == value
    assert math.isnan(eval(codegen.pyrepr([math.nan]))[0])


def test_nan_default_builds_code_that_runs(tmp_path):
    specs = spec_dir(
        tmp_path,
        ("  rope: {type: rope}\n", "  rope: {type: rope}\n  eps: {type: float, default: .nan}\n"),
    )
    out = tmp_path / "gen"
    assert mlxc("build", str(specs), "-o", str(out)).exit_code == 0
    module = load_source("ok_nan", (out / "ok.py").read_text())
    args = module.ModelArgs.from_config(
        {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "vocab_size": 64}
    )
    assert math.isnan(args.eps)


# --- item 14: build compiles everything before writing --------------------------------------


def test_build_compiles_every_file_before_writing(tmp_path, monkeypatch):
    specs = spec_dir(tmp_path)
    out = tmp_path / "gen"
    real = codegen.render_model
    monkeypatch.setattr(codegen, "render_model", lambda *a: real(*a) + "def broken(:\n")
    result = mlxc("build", str(specs), "-o", str(out))
    assert result.exit_code == 1
    assert f"{specs}/ok.yaml:1:1: C001 generated ok.py does not compile" in result.output
    assert "nothing written" in result.output
    assert not out.exists()
    assert mlxc("build", str(specs), "-o", str(out), "--check").exit_code == 1


def test_build_refuses_code_with_invalid_escapes(tmp_path, monkeypatch):
    specs = spec_dir(tmp_path)
    out = tmp_path / "gen"
    real = codegen.render_model
    monkeypatch.setattr(codegen, "render_model", lambda *a: real(*a) + 'X = "\\d"\n')
    result = mlxc("build", str(specs), "-o", str(out))
    assert result.exit_code == 1
    assert "C001 generated ok.py does not compile: invalid escape sequence" in result.output
    assert not out.exists()
