"""Checkpoint loading: single file and shards, strict checks, quantised weights, dtypes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx import nn
from mlx.utils import tree_flatten

sys.path.insert(0, str(Path(__file__).parent))  # the toy model lives beside the tests
import _toy_model as toy

from mlxc.runtime.checkpoint import loading
from mlxc.runtime.checkpoint.loading import CheckpointError, load, load_model


@pytest.fixture(autouse=True)
def use_toy(monkeypatch):
    """Serve model_type "toy" from the toy module instead of the generated registry."""
    monkeypatch.setattr(loading, "model_types", lambda: {"toy": toy.__name__})


def params(model) -> dict[str, np.ndarray]:
    return {k: np.array(v) for k, v in tree_flatten(model.parameters())}


def test_single_file_and_shards_load_the_same(tmp_path):
    weights = toy.random_weights()
    one = load_model(toy.write_checkpoint(tmp_path / "one", weights))
    three = load_model(toy.write_checkpoint(tmp_path / "three", weights, shards=3))
    assert (tmp_path / "three" / loading.INDEX_FILE).is_file()
    a, b = params(one), params(three)
    assert a.keys() == b.keys() == {k for k in weights}
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
        np.testing.assert_array_equal(a[k], np.array(weights[k]))
    # The loaded model runs.
    assert one(mx.array([[1, 2, 3]])).shape == (1, 3, toy.CONFIG["vocab_size"])


def test_sanitize_rules_apply(tmp_path):
    # HF buffers are dropped and a tied lm_head is ignored, by the module's own rules.
    config = dict(toy.CONFIG, tie_word_embeddings=True)
    weights = toy.random_weights(config)
    weights["model.layers.0.self_attn.rotary_emb.inv_freq"] = mx.ones((4,))
    weights["lm_head.weight"] = mx.ones((260, 32))
    model = load_model(toy.write_checkpoint(tmp_path, weights, config))
    assert "lm_head.weight" not in params(model)


def test_load_returns_tokenizer_or_none(tmp_path):
    path = toy.write_checkpoint(tmp_path)
    assert load(path)[1] is None
    toy.write_tokenizer(path)
    model, tokenizer = load(path)
    assert isinstance(model, toy.Model)
    assert tokenizer.eos_token_id == 257


def expect_error(path, *needles):
    with pytest.raises(CheckpointError) as info:
        load_model(path)
    for needle in needles:
        assert needle in str(info.value)
    return str(info.value)


def test_missing_tensors_are_all_named(tmp_path):
    weights = toy.random_weights()
    del weights["model.norm.weight"]
    del weights["model.layers.1.up_proj.weight"]
    msg = expect_error(
        toy.write_checkpoint(tmp_path, weights),
        "2 missing",
        "model.norm.weight",
        "model.layers.1.up_proj.weight",
        "model.safetensors",
    )
    assert "\n" not in msg


def test_unexpected_tensor_is_named_with_its_file(tmp_path):
    weights = toy.random_weights()
    weights["model.layers.0.extra.weight"] = mx.zeros((2, 2))
    path = toy.write_checkpoint(tmp_path, weights, shards=2)
    index = json.loads((path / loading.INDEX_FILE).read_text())
    shard = index["weight_map"]["model.layers.0.extra.weight"]
    expect_error(path, "unexpected", f"model.layers.0.extra.weight [{shard}]")


def test_wrong_shape_is_named(tmp_path):
    weights = toy.random_weights()
    weights["model.layers.0.self_attn.q_proj.weight"] = mx.zeros((32, 16))
    expect_error(
        toy.write_checkpoint(tmp_path, weights),
        "wrong shape",
        "model.layers.0.self_attn.q_proj.weight",
        "(32, 16)",
        "(32, 32)",
    )


def test_long_mismatch_lists_are_capped(tmp_path):
    weights = {f"junk.{i}": mx.zeros((1,)) for i in range(30)}
    msg = expect_error(toy.write_checkpoint(tmp_path, weights), "30 unexpected", "and 20 more")
    assert len(msg) < 2000


def test_unknown_and_missing_model_type(tmp_path):
    expect_error(
        toy.write_checkpoint(tmp_path / "a", config=dict(toy.CONFIG, model_type="gpt9")),
        "'gpt9'",
        "supported model types: toy",
    )
    config = {k: v for k, v in toy.CONFIG.items() if k != "model_type"}
    expect_error(toy.write_checkpoint(tmp_path / "b", config=config), "no model_type", "toy")


def test_bad_config_values(tmp_path):
    path = toy.write_checkpoint(tmp_path)
    (path / "config.json").write_text(json.dumps(dict(toy.CONFIG, num_attention_heads=5)))
    expect_error(path, "config.json", "multiple of num_attention_heads")


def test_missing_or_invalid_config(tmp_path):
    path = toy.write_checkpoint(tmp_path)
    (path / "config.json").write_text("{not json")
    expect_error(path, "config.json")
    (path / "config.json").unlink()
    expect_error(path, "no config.json")
    expect_error(tmp_path / "nowhere", "does not exist")


def test_no_weight_files(tmp_path):
    path = toy.write_checkpoint(tmp_path)
    (path / "model.safetensors").unlink()
    expect_error(path, "no *.safetensors")


def test_truncated_safetensors_names_the_file(tmp_path):
    path = toy.write_checkpoint(tmp_path, shards=2)
    shard = path / "model-00002-of-00002.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    expect_error(path, "model-00002-of-00002.safetensors", "re-download")
    shard.write_bytes(b"garbage")
    expect_error(path, "model-00002-of-00002.safetensors")


def test_index_naming_a_missing_shard(tmp_path):
    path = toy.write_checkpoint(tmp_path, shards=2)
    (path / "model-00001-of-00002.safetensors").unlink()
    expect_error(path, "model-00001-of-00002.safetensors", "missing")


def test_failed_load_leaves_nothing_half_loaded(tmp_path, monkeypatch):
    # The check runs before the model receives weights: update is never reached.
    weights = toy.random_weights()
    del weights["model.norm.weight"]
    path = toy.write_checkpoint(tmp_path, weights)
    calls = []
    monkeypatch.setattr(nn.Module, "load_weights", lambda *a, **k: calls.append(a))
    monkeypatch.setattr(nn.Module, "update", lambda *a, **k: calls.append(a))
    expect_error(path, "model.norm.weight")
    assert calls == []


def test_dtypes(tmp_path):
    weights = {k: v.astype(mx.bfloat16) for k, v in toy.random_weights().items()}
    path = toy.write_checkpoint(tmp_path, weights)
    assert mx.default_device() == mx.cpu  # the suite runs on CPU: bf16 becomes float32
    dtypes = {v.dtype for _, v in tree_flatten(load_model(path).parameters())}
    assert dtypes == {mx.float32}
    kept = {v.dtype for _, v in tree_flatten(load_model(path, dtype="bfloat16").parameters())}
    assert kept == {mx.bfloat16}
    half = {v.dtype for _, v in tree_flatten(load_model(path, dtype=mx.float16).parameters())}
    assert half == {mx.float16}
    with pytest.raises(ValueError):
        load_model(path, dtype="int8")


def test_quantized_checkpoint(tmp_path):
    reference = toy.Model(toy.ModelArgs.from_config(toy.CONFIG))
    reference.load_weights(list(toy.random_weights().items()))
    # Quantise the linear layers only (the embedding stays dense), as a converter might.
    nn.quantize(
        reference, group_size=32, bits=4, class_predicate=lambda p, m: isinstance(m, nn.Linear)
    )
    weights = dict(tree_flatten(reference.parameters()))
    assert any(k.endswith(".scales") for k in weights)
    config = dict(toy.CONFIG, quantization={"group_size": 32, "bits": 4})
    model = load_model(toy.write_checkpoint(tmp_path, weights, config))
    assert isinstance(model.model.layers[0].self_attn.q_proj, nn.QuantizedLinear)
    assert isinstance(model.model.embed_tokens, nn.Embedding)
    ids = mx.array([[5, 6, 7, 8]])
    np.testing.assert_allclose(np.array(model(ids)), np.array(reference(ids)), atol=1e-5)


def test_bad_quantization_config(tmp_path):
    config = dict(toy.CONFIG, quantization={"bits": 4})
    expect_error(toy.write_checkpoint(tmp_path, config=config), "group_size")


def test_unread_hf_quantization_is_named(tmp_path):
    """A GPTQ checkpoint packs its linears as qweight / qzeros / scales: the mismatch names the
    format, not a config.json that does not belong."""
    weights = toy.random_weights()
    w = weights.pop("model.layers.0.self_attn.q_proj.weight")
    out, inp = w.shape
    weights["model.layers.0.self_attn.q_proj.qweight"] = mx.zeros((inp // 8, out), mx.int32)
    weights["model.layers.0.self_attn.q_proj.qzeros"] = mx.zeros((inp // 32, out // 8), mx.int32)
    weights["model.layers.0.self_attn.q_proj.scales"] = mx.ones((inp // 32, out), mx.float16)
    gptq = {"quant_method": "gptq", "bits": 4, "group_size": 32}
    path = toy.write_checkpoint(tmp_path, weights, dict(toy.CONFIG, quantization_config=gptq))
    message = expect_error(path, "q_proj.qweight", "quant_method is 'gptq'", "mlxc convert")
    assert "belongs to these weights" not in message


def test_a_tied_head_is_dropped_under_any_layout_name():
    """mlx-vlm saves Gemma 3's tied head as ``language_model.lm_head`` (quantised where the rest
    is): after the renames it is the model's ``lm_head``, which a tied model does not have."""
    from mlxc.runtime.model.weights import WeightRules

    rules = WeightRules(
        rename=((r"^language_model\.lm_head\.", "lm_head."), (r"^language_model\.", ""))
    )
    head = [f"language_model.lm_head.{part}" for part in ("weight", "scales", "biases")]
    weights = {k: mx.zeros((2,)) for k in ["language_model.model.embed_tokens.weight", *head]}
    assert set(rules.apply(weights, tied_lm_head=True)) == {"model.embed_tokens.weight"}
    untied = rules.apply(weights, tied_lm_head=False)
    assert set(untied) == {
        "model.embed_tokens.weight",
        "lm_head.weight",
        "lm_head.scales",
        "lm_head.biases",
    }
