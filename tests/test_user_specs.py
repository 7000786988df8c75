"""Your own specs, no reinstall: `--specs DIR` on generate / serve / verify and
`mlxc.load(path, specs=DIR)` compile DIR in memory next to the built-in specs; a model_type a
built-in spec (or another of DIR's) serves is R001, pointing at the user spec's line; lint
findings exit 1 (CLI) or raise SpecError (API), and nothing is written."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest
from click.testing import CliRunner

import mlxc
from mlxc.checkpoint import write_checkpoint
from mlxc.cli import main
from mlxc.compiler.lint import UnusableInput
from mlxc.runtime.checkpoint import loading
from mlxc.runtime.checkpoint.loading import CheckpointError, registry, resolve_module
from mlxc.runtime.checkpoint.user_specs import MODULE_PREFIX, SpecError

SPECS = Path(__file__).parent.parent / "specs"


def user_spec(directory: Path, name: str, model_types: str, text: str | None = None) -> Path:
    """specs/qwen3.yaml renamed to ``name``, serving ``model_types`` (``a, b``)."""
    first = model_types.split(",")[0].strip()
    text = text or (SPECS / "qwen3.yaml").read_text()
    text = text.replace("name: qwen3", f"name: {name}")
    text = text.replace("model_types: [qwen3]", f"model_types: [{model_types}]")
    text = text.replace("  model_type: qwen3\n", f"  model_type: {first}\n")
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.yaml"
    path.write_text(text)
    return path


def line_of(path: Path, needle: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if needle in line)


@pytest.fixture(scope="module")
def mine(tmp_path_factory):
    """A specs directory serving model_type `mine`, and a random checkpoint for it."""
    root = tmp_path_factory.mktemp("mine")
    spec = user_spec(root / "myspecs", "mine", "mine")
    write_checkpoint(spec, root / "ckpt")
    return root / "myspecs", root / "ckpt"


def test_registry_adds_the_user_specs_next_to_the_built_in_ones(mine):
    specs, _ = mine
    types = registry(specs)
    assert types["mine"].startswith(MODULE_PREFIX + "mine_")
    assert {k: v for k, v in types.items() if k != "mine"} == loading.model_types()
    module = resolve_module("mine", specs)
    assert module.MODEL_TYPES == ("mine",) and module is resolve_module("mine", specs)  # cached
    with pytest.raises(CheckpointError, match="unsupported model_type 'mine'"):
        resolve_module("mine")  # the built-in registry alone does not serve it


def test_load_with_specs(mine):
    specs, ckpt = mine
    model, tokenizer = mlxc.load(ckpt, specs=specs)
    assert model(mx.array([[1, 2, 3]])).shape == (1, 3, len(tokenizer))
    assert type(mlxc.load_model(ckpt, specs=str(specs))) is type(model)
    with pytest.raises(CheckpointError, match="unsupported model_type 'mine'"):
        mlxc.load_model(ckpt)


def test_an_edited_spec_gets_a_module_of_its_own(tmp_path):
    spec = user_spec(tmp_path, "mine", "mine")
    before = resolve_module("mine", tmp_path)
    spec.write_text(spec.read_text().replace("doc: Qwen3", "doc: Edited Qwen3"))
    after = resolve_module("mine", tmp_path)
    assert after is not before and "Edited" in after.__doc__


def test_a_built_in_model_type_is_R001_at_the_user_spec_line(tmp_path):
    spec = user_spec(tmp_path, "mine", "mine, qwen2")
    with pytest.raises(SpecError) as err:
        registry(tmp_path)
    line = line_of(spec, "model_types:")
    col = spec.read_text().splitlines()[line - 1].index("qwen2") + 1
    expected = f"{spec}:{line}:{col}: R001 model_type 'qwen2' is already served by the "
    assert [f.text() for f in err.value.findings] == [expected + "built-in spec qwen2"]
    assert expected in str(err.value)  # the API's error lists the findings


def test_two_user_specs_serving_one_model_type_are_R001(tmp_path):
    user_spec(tmp_path, "first", "mine")
    second = user_spec(tmp_path, "second", "mine")
    with pytest.raises(SpecError) as err:
        registry(tmp_path)
    (finding,) = err.value.findings
    assert (finding.path, finding.line, finding.code) == (str(second), 4, "R001")


def test_unusable_specs(tmp_path):
    with pytest.raises(UnusableInput, match="no such file"):
        registry(tmp_path / "nope")
    with pytest.raises(UnusableInput, match="no \\*.yaml specs"):
        registry(tmp_path)


# --- the CLI -------------------------------------------------------------------------------


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def test_generate_with_specs(mine):
    specs, ckpt = mine
    r = run("generate", "--specs", specs, "--model", ckpt, "--prompt", "Hi", "--max-tokens", 4)
    assert r.exit_code == 0, r.output
    assert "generated: 4 tokens" in r.stderr
    r = run("generate", "--model", ckpt, "--prompt", "Hi")  # without --specs: unknown
    assert r.exit_code == 1 and r.stderr.startswith("error: ") and "'mine'" in r.stderr


def bad_specs(tmp_path) -> tuple[Path, str]:
    """A specs dir with a clash (R001) and a lint finding (L001), and the findings' text."""
    user_spec(tmp_path / "bad", "mine", "qwen3")
    source = (SPECS / "qwen3.yaml").read_text()
    assert "mask: live-window" in source
    wrong = user_spec(
        tmp_path / "bad",
        "wrong",
        "wrong",
        source.replace("mask: live-window", "mask: monotonic-position"),
    )
    return tmp_path / "bad", f"{wrong}:{line_of(wrong, 'mask: monotonic')}:"


@pytest.mark.parametrize("command", ["generate", "serve", "verify"])
def test_findings_in_specs_exit_1_before_anything_runs(tmp_path, command, mine):
    specs, where = bad_specs(tmp_path)
    args = {"generate": ["--model", mine[1], "--prompt", "Hi"], "serve": ["--port", 1]}
    before = sorted(tmp_path.rglob("*"))
    r = run(command, "--specs", specs, *args.get(command, []))
    assert r.exit_code == 1, r.output
    lines = r.stderr.splitlines()
    assert lines[-1] == f"error: lint findings in --specs {specs}; nothing run"
    assert any(line.startswith(where) and " L001 " in line for line in lines)
    assert any(
        " R001 model_type 'qwen3' is already served by the built-in spec qwen3" in line
        for line in lines
    )
    assert r.stdout == "" and sorted(tmp_path.rglob("*")) == before  # nothing written


def test_specs_dir_without_specs_exits_2(tmp_path):
    r = run("generate", "--specs", tmp_path, "--prompt", "Hi")
    assert (r.exit_code, r.stderr) == (2, f"error: {tmp_path}: no *.yaml specs in this directory\n")


def test_verify_specs_verifies_only_that_directory(mine):
    specs, _ = mine
    r = run("verify", "--specs", specs)
    assert r.exit_code == 0, r.output
    assert [line.split(":")[0] for line in r.stdout.splitlines()] == ["ok   mine"]
    for args in ([], ["--specs", specs, SPECS]):
        r = run("verify", *args)
        assert (r.exit_code, r.stderr) == (
            2,
            "error: give spec PATHS or --specs DIR (one of them)\n",
        )


def test_serve_engine_with_specs(mine):
    from mlxc.runtime.serving.server import Engine

    specs, ckpt = mine
    engine = Engine.from_path(ckpt, specs=specs, max_concurrency=1)
    try:
        assert engine.model_id == "ckpt" and engine.processor is None
    finally:
        engine.stop()
