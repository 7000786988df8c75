"""`mlxc checkpoint SPEC --out DIR`: random weights of real variance for a spec, deterministic in
--seed, that load strictly; a tokenizer whose every id decodes; written atomically."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from click.testing import CliRunner
from test_user_specs import user_spec

import mlxc
from mlxc.cli import main
from mlxc.runtime.checkpoint import demo
from mlxc.runtime.checkpoint.tokenizer import StreamingDetokenizer, encode_prompt, load_tokenizer

SPECS = Path(__file__).parent.parent / "specs"
TEXT_SPECS = ["llama", "mistral4", "nemotron_nas", "qwen2", "qwen3"]


def run(*args):
    return CliRunner().invoke(main, ["checkpoint", *map(str, args)])


@pytest.fixture(scope="module")
def mine(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return user_spec(root / "myspecs", "mine", "mine")


def test_writes_a_checkpoint_that_loads_strictly(mine, tmp_path):
    r = run(mine, "--out", tmp_path / "out")
    assert r.exit_code == 0, r.output
    assert r.stdout.startswith(f"wrote {tmp_path / 'out'}: spec mine, RANDOM weights (seed 0), ")
    assert "tiny_config" in r.stdout and "tokenizer of 128 ids" in r.stdout
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["model_type"] == "mine" and config["architectures"] == ["Qwen3ForCausalLM"]
    model, tokenizer = mlxc.load(tmp_path / "out", specs=mine.parent)  # strict
    # Real variance: N(0, 1/fan_in) matrices, norm scales around 1.
    layer = model.model.layers[0]
    q = np.array(layer.self_attn.qkv_proj.weight)  # q|k|v, fused at load: all N(0, 1/fan_in)
    assert abs(q.std() * np.sqrt(q.shape[1]) - 1) < 0.1
    norm = np.array(layer.input_layernorm.weight)
    assert abs(norm.mean() - 1) < 0.05 and 0.05 < norm.std() < 0.2
    logits = model(mx.array([encode_prompt(tokenizer, "Hello")]))
    assert logits.shape[-1] == len(tokenizer) == config["vocab_size"]
    assert float(logits.std()) > 0.1  # not a constant model


@pytest.mark.parametrize("vocab_size", [128, 262, 300])
def test_every_id_decodes(tmp_path, vocab_size):
    ids = demo.write_tokenizer(tmp_path, vocab_size)
    tokenizer = load_tokenizer(tmp_path)
    assert len(tokenizer) == vocab_size
    assert None not in tokenizer.convert_ids_to_tokens(list(range(vocab_size)))
    detok = StreamingDetokenizer(tokenizer)
    text = "".join(detok.add(i) for i in range(vocab_size)) + detok.finalize()
    assert "abc" in text
    encoded = encode_prompt(tokenizer, "héllo wörld ∑ 123\n")
    assert max(encoded) < vocab_size and ids["bos_token_id"] == encoded[0]
    if vocab_size >= 262:  # every byte fits: text round-trips
        assert "héllo wörld ∑ 123" in tokenizer.decode(encoded)


def test_demo_tokenizer_is_unchanged(tmp_path):
    ids = demo.write_tokenizer(tmp_path)
    assert ids == {k: demo.CONFIG[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    assert len(load_tokenizer(tmp_path)) == 256 + len(demo.SPECIALS)


def test_seed_makes_the_weights(mine, tmp_path):
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        assert run(mine, "--out", tmp_path / name, "--seed", seed).exit_code == 0
    data = {n: (tmp_path / n / "model.safetensors").read_bytes() for n in "abc"}
    assert data["a"] == data["b"] != data["c"]


def test_config_file(mine, tmp_path):
    config = dict(user_tiny_config(mine), vocab_size=300)
    (tmp_path / "config.json").write_text(json.dumps(config))
    r = run(mine, "--out", tmp_path / "out", "--config", tmp_path / "config.json")
    assert r.exit_code == 0, r.output
    assert "from the given config" in r.stdout and "tokenizer of 300 ids" in r.stdout
    assert len(load_tokenizer(tmp_path / "out")) == 300
    (tmp_path / "other.json").write_text(json.dumps(dict(config, model_type="llama")))
    r = run(mine, "--out", tmp_path / "other", "--config", tmp_path / "other.json")
    assert r.exit_code == 1 and "model_type 'llama' is not one the spec serves (mine)" in r.stderr
    (tmp_path / "list.json").write_text("[]")
    r = run(mine, "--out", tmp_path / "other", "--config", tmp_path / "list.json")
    assert r.exit_code == 1 and r.stderr.endswith("must hold a JSON object\n")
    assert not (tmp_path / "other").exists()


def user_tiny_config(spec: Path) -> dict:
    from mlxc.compiler.lint import check_all

    (checked,) = check_all([str(spec)])
    return checked.spec.tiny_config


def test_refuses_a_non_empty_out(mine, tmp_path):
    (tmp_path / "out").mkdir()
    assert run(mine, "--out", tmp_path / "out").exit_code == 0  # empty: fine
    r = run(mine, "--out", tmp_path / "out")
    assert r.exit_code == 1
    assert (
        r.stderr
        == f"error: --out {tmp_path / 'out'} already exists: remove it or choose another directory\n"
    )


def test_nothing_half_written(mine, tmp_path, monkeypatch):
    def fail(*args):
        raise OSError("disk full")

    monkeypatch.setattr(demo, "write_tokenizer", fail)
    r = run(mine, "--out", tmp_path / "out")
    assert (r.exit_code, r.stderr) == (1, f"error: cannot write {tmp_path / 'out'}: disk full\n")
    assert list(tmp_path.iterdir()) == []


def test_lint_findings_write_nothing(tmp_path):
    source = (SPECS / "qwen3.yaml").read_text().replace("mask: live-window", "mask: oops")
    spec = user_spec(tmp_path / "s", "mine", "mine", source)
    r = run(spec, "--out", tmp_path / "out")
    assert r.exit_code == 1
    assert r.stderr.splitlines()[-1] == f"error: lint findings in {spec}; nothing written"
    assert " L004 " in r.stderr and not (tmp_path / "out").exists()


def test_vision_specs_are_refused(tmp_path):
    r = run(SPECS / "qwen2_vl.yaml", "--out", tmp_path / "out")
    assert r.exit_code == 1 and "writes text models only" in r.stderr
    assert len(r.stderr.splitlines()) == 1


@pytest.mark.parametrize("name", TEXT_SPECS)
def test_every_built_in_text_spec(name, tmp_path):
    """The model's own tensor names survive its weight rules (renames, experts), so the
    checkpoint loads with the built-in registry, strictly, and runs."""
    r = run(SPECS / f"{name}.yaml", "--out", tmp_path / name)
    assert r.exit_code == 0, r.output
    model, tokenizer = mlxc.load(tmp_path / name)
    logits = model(mx.array([encode_prompt(tokenizer, "Hello")]))
    assert bool(mx.all(mx.isfinite(logits))) and logits.shape[-1] == len(tokenizer)
