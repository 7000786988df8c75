"""mistral4 (MLA + MoE + yarn + Llama-4 query scale): logits against transformers.

Tiny random checkpoints, every parameter re-randomised (transformers' near-zero init hides
bugs), float32, atol 1e-4 (independent float32 implementations agree to ~1e-5). The prompt is
longer than ``original_max_position_embeddings`` (16) so the Llama-4 scale and yarn both act.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
import torch
from checkpoints import rerandomise
from mlx.utils import tree_flatten

import mlxc

ATOL = 1e-4
ROPE = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 16,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "llama_4_scaling_beta": 0.1,
}


def make_checkpoint(path, *, q_lora_rank=32, rope=ROPE, seed=0, **overrides):
    """A tiny re-randomised Mistral4ForCausalLM saved to ``path``; ``overrides`` are
    Mistral4Config fields (other tests reuse this with their own widths and token ids)."""
    from transformers import Mistral4Config, Mistral4ForCausalLM

    fields = {
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "vocab_size": 128,
        "q_lora_rank": q_lora_rank,
        "kv_lora_rank": 24,
        "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 8,
        "v_head_dim": 12,
        "head_dim": 16,
        "n_routed_experts": 6,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 24,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.5,
        "max_position_embeddings": 64,
        "rope_parameters": dict(rope),
        "tie_word_embeddings": False,
    }
    model = Mistral4ForCausalLM(Mistral4Config(**(fields | overrides))).eval()
    rerandomise(model, seed)
    model.save_pretrained(path)
    return model


def reference(model, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(input_ids=torch.from_numpy(ids)).logits.numpy()


@pytest.fixture(scope="module", params=[32, None], ids=["q-lora", "no-q-lora"])
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("mistral4")
    return make_checkpoint(path, q_lora_rank=request.param), path


def test_logits_match_transformers(checkpoint):
    hf, path = checkpoint
    ids = np.random.default_rng(0).integers(0, 128, size=(2, 40))
    model = mlxc.load_model(path)
    got = np.array(model(mx.array(ids), cache=model.make_cache()))
    np.testing.assert_allclose(got, reference(hf, ids), atol=ATOL, rtol=0)


def test_chunked_prefill_and_decode_equal_full_forward(checkpoint):
    hf, path = checkpoint
    ids = np.random.default_rng(1).integers(0, 128, size=(1, 36))
    model = mlxc.load_model(path)
    cache, parts = model.make_cache(), []
    for a, b in [(0, 13), (13, 30), (30, 33), (33, 34), (34, 35), (35, 36)]:
        parts.append(np.array(model(mx.array(ids[:, a:b]), cache=cache)))
    got = np.concatenate(parts, axis=1)
    np.testing.assert_allclose(got, reference(hf, ids), atol=ATOL, rtol=0)
    assert cache.offset == 36


def test_the_llama4_scale_and_yarn_matter(tmp_path):
    """Guard for the tolerance above: switching the scale off moves transformers' logits."""
    ids = np.random.default_rng(2).integers(0, 128, size=(1, 40))
    with_scale = reference(make_checkpoint(tmp_path / "a", q_lora_rank=None, seed=3), ids)
    plain = dict(ROPE, llama_4_scaling_beta=0.0)
    without = reference(make_checkpoint(tmp_path / "b", q_lora_rank=None, seed=3, rope=plain), ids)
    assert np.abs(with_scale - without)[:, 16:].max() > 1e-2
    assert np.abs(with_scale - without)[:, :16].max() < 1e-5  # positions < 16: scale is 1


def test_latent_cache_holds_the_latent_not_per_head_kv(checkpoint):
    _, path = checkpoint
    model = mlxc.load_model(path)
    cache = model.make_cache()
    model(mx.array([[1, 2, 3, 4, 5]]), cache=cache)
    keys, values = cache[0].keys, cache[0].values
    # One shared head: the latent as the keys, the rope key as the values.
    assert keys.shape[1] == 1 and keys.shape[-1] == 24
    assert values.shape[1] == 1 and values.shape[-1] == 8
    # Per token and layer: 32 floats, where per-head K/V would be 4 * (16 + 12) = 112.
    assert cache[0].nbytes == 5 * 32 * 4


def decode_logits(model, ids: np.ndarray) -> np.ndarray:
    """Prefill all but the last token, then decode the last one (the absorbed path)."""
    cache = model.make_cache()
    model(mx.array(ids[:, :-1]), cache=cache)
    return np.array(model(mx.array(ids[:, -1:]), cache=cache).astype(mx.float32)), cache


def test_decode_split_of_kv_b_proj_follows_reloaded_weights(checkpoint, tmp_path):
    """The per-head kv_b_proj split is cached; new weights must not meet a stale split."""
    hf, path = checkpoint
    other = make_checkpoint(tmp_path, q_lora_rank=hf.config.q_lora_rank, seed=7)
    ids = np.random.default_rng(5).integers(0, 128, size=(1, 20))
    model = mlxc.load_model(path)
    first, _ = decode_logits(model, ids)  # computes and keeps the split
    np.testing.assert_allclose(first, reference(hf, ids)[:, -1:], atol=ATOL, rtol=0)
    model.load_weights(tree_flatten(mlxc.load_model(tmp_path).parameters()), strict=True)
    again, _ = decode_logits(model, ids)
    np.testing.assert_allclose(again, reference(other, ids)[:, -1:], atol=ATOL, rtol=0)


def test_bf16_stays_bf16(checkpoint):
    """No float32 promotion (the Llama-4 scale once made every layer after the first run, and
    cache, in float32): the latent cache holds bf16 in every layer."""
    _, path = checkpoint
    model = mlxc.load_model(path, dtype="bfloat16")
    ids = np.random.default_rng(6).integers(0, 128, size=(1, 20))  # past position 16: scale != 1
    logits, cache = decode_logits(model, ids)
    assert all(c.keys.dtype == mx.bfloat16 for c in cache)
    assert all(c.nbytes == 20 * (24 + 8) * 2 for c in cache)
    assert model(mx.array(ids[:, :4]), cache=model.make_cache()).dtype == mx.bfloat16
    assert np.isfinite(logits).all()


def test_quantised_kv_b_proj_decodes(tmp_path):
    """A quantised kv_b_proj is dequantised once for the absorbed split: decode equals the
    float model holding the dequantised weights."""
    from mlx import nn

    make_checkpoint(tmp_path, kv_lora_rank=32)
    ids = np.random.default_rng(7).integers(0, 128, size=(1, 20))
    model = mlxc.load_model(tmp_path)
    nn.quantize(model, group_size=32, bits=8, class_predicate=lambda p, m: "kv_b_proj" in p)
    got, _ = decode_logits(model, ids)
    for layer in model.model.layers:
        q = layer.self_attn.kv_b_proj
        assert isinstance(q, nn.QuantizedLinear)
        w = mx.dequantize(q.weight, q.scales, q.biases, group_size=32, bits=8)
        layer.self_attn.kv_b_proj = nn.Linear(w.shape[1], w.shape[0], bias=False)
        layer.self_attn.kv_b_proj.weight = w
    want, _ = decode_logits(model, ids)
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)
