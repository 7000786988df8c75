"""bench.models writes the six architectures added last by hand (config keys, tensor names and
shapes as the hub has them). If a name or shape drifted, the benchmark would time a model that
is not the real one, or one side would not load it. Each is shrunk here, keeping every key,
written as the benchmark writes it, and read by transformers (the reference), by mlxc (logits
equal within float32 atol 1e-4, the README's tolerance) and by mlx-lm, the peer (strict load;
gpt_oss through ``bench.run.peer_checkpoint``, its layout for mlx-lm; logits compared where
mlx-lm follows transformers, ``MLX_LM_DEPARTS`` says where it does not)."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
import torch

import mlxc
from bench import models
from bench.run import peer_checkpoint, peer_convert

TINY = {  # sizes only; every other key as bench.models writes it
    "qwen2": {"hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 96},
    "deepseek_v2": {
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "intermediate_size": 96,
        "moe_intermediate_size": 32,
        "n_routed_experts": 8,
        "num_experts_per_tok": 3,
    },
    "minicpm3": {  # 16 LongRoPE factors: rope dims 32
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": 32,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 16,
        "intermediate_size": 96,
    },
    "gpt_oss": {
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 32,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "experts_per_token": 2,
        "sliding_window": 8,
    },
    "jamba": {
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 96,
        "num_experts": 4,
        "mamba_dt_rank": 8,
    },
    "granitemoehybrid": {
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 32,
        "shared_intermediate_size": 48,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "mamba_n_heads": 4,
        "mamba_d_head": 32,
        "mamba_chunk_size": 8,
    },
}
# mlx-lm departs from transformers on these (so only its loading is checked): minicpm3's LongRoPE
# (long factors at every length), jamba's router (top-k weights renormalised), gpt_oss's yarn
# (gpt-oss sets ``truncate: false``, which mlx-lm ignores: with true, it agrees within 2e-6).
MLX_LM_DEPARTS = {"minicpm3", "jamba", "gpt_oss"}
VOCAB = 256


def _checkpoint(arch: str, path, sizes: dict | None = None):
    cfg = {**models.config(arch, "small"), **(sizes or TINY[arch]), "vocab_size": VOCAB}
    if cfg.get("pad_token_id") is not None:  # transformers checks it against the vocabulary
        cfg["pad_token_id"] = VOCAB - 1
    path.mkdir()
    (path / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    models.write_tensors(path, models.shapes(cfg), seed=1)
    return path


@pytest.mark.parametrize("arch", sorted(TINY))
def test_bench_checkpoint_is_what_transformers_mlxc_and_mlx_lm_read(arch, tmp_path):
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model as peer_load
    from transformers import AutoModelForCausalLM

    assert set(TINY[arch]) <= set(models.config(arch, "small")), "a size key the config lacks"
    path = _checkpoint(arch, tmp_path / arch)
    ids = np.random.default_rng(0).integers(0, VOCAB, size=(1, 20))

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf(torch.from_numpy(ids)).logits.numpy()
    assert np.abs(want).max() > 0.1  # weights with real variance, not a degenerate model

    ours = mlxc.load_model(path)
    got = np.array(ours(mx.array(ids), cache=ours.make_cache()).astype(mx.float32))
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)

    peer, _ = peer_load(peer_checkpoint(path))  # strict: every tensor used, none missing
    peer.set_dtype(mx.float32)
    theirs = np.array(peer(mx.array(ids), cache=make_prompt_cache(peer)))
    if arch not in MLX_LM_DEPARTS:
        np.testing.assert_allclose(theirs, want, atol=1e-4, rtol=0)


# What mlx-lm's converter writes (mlx-community's 4-bit checkpoints): the MoE routers at 8 bits
# as per-layer overrides keyed by mlx-lm's module names (gpt-oss's ``mlp.router``, jamba's
# ``feed_forward.router``, granite's ``block_sparse_moe.router.layer``, which mlxc's sanitize
# renames), and MLA's kv_b_proj quantised whole (deepseek_v2) or split per head into embed_q /
# unembed_out, each quantised along its own input axis (glm4_moe_lite, as deepseek_v3).
GLM4_TINY = {
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 32,
    "kv_lora_rank": 64,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "n_routed_experts": 8,
    "num_hidden_layers": 3,
}
MLA_QUANTISED = {"deepseek_v2": "kv_b_proj", "glm4_moe_lite": "unembed_out"}


def _mlx_lm_quantized(arch, tmp_path, sizes=None, **quantize):
    """``arch``'s tiny checkpoint quantised by mlx-lm and saved as its converter saves it
    (``bench.run.peer_convert``): (mlxc's model of the saved directory, mlx-lm's, the config
    it wrote, the saved tensors)."""
    from mlx_lm.utils import load_model as peer_load

    out = peer_convert(_checkpoint(arch, tmp_path / arch, sizes), tmp_path / "mlx-lm", **quantize)
    peer, config = peer_load(out)  # the file, as bench.run --q4-file mlx-lm loads it
    return mlxc.load_model(out), peer, config, mx.load(str(out / "model.safetensors"))


def _same_logits(arch, ours, peer):
    from mlx_lm.models.cache import make_prompt_cache

    ids = mx.array(np.random.default_rng(0).integers(0, VOCAB, size=(1, 20)))
    got = np.array(ours(ids, cache=ours.make_cache()).astype(mx.float32))
    peer.set_dtype(mx.float32)  # as mlxc computes on the CPU; the quantised weights unchanged
    theirs = np.array(peer(ids, cache=make_prompt_cache(peer)))
    assert np.abs(theirs).max() > 0.1
    if arch not in MLX_LM_DEPARTS:
        np.testing.assert_allclose(got, theirs, atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    "arch", ["deepseek_v2", "glm4_moe_lite", "gpt_oss", "jamba", "granitemoehybrid"]
)
def test_mlx_lm_quantized_checkpoint(arch, tmp_path):
    sizes = GLM4_TINY if arch == "glm4_moe_lite" else None
    ours, peer, config, saved = _mlx_lm_quantized(arch, tmp_path, sizes, group_size=32, bits=4)
    overrides = [k for k, v in config["quantization"].items() if isinstance(v, dict)]
    # each layer quantised as its tensors are
    eight_bit = [p for p, m in ours.named_modules() if getattr(m, "bits", None) == 8]
    assert len(eight_bit) == len(overrides)
    if arch in MLA_QUANTISED:
        assert any(k.endswith(f"{MLA_QUANTISED[arch]}.scales") for k in saved)
    else:
        assert overrides and all(p.endswith(".gate") for p in eight_bit)
    _same_logits(arch, ours, peer)


def test_mlx_lm_mixed_mode_checkpoint(tmp_path):
    """A mixed recipe: the experts in mxfp4 (uint8 scales, no biases), the rest 8-bit affine.
    mlx-lm keys the experts' overrides ``mlp.switch_mlp.*``, mlxc's ``mlp.experts.*``: their
    mode comes from the tensors."""
    mxfp4 = {"group_size": 32, "bits": 4, "mode": "mxfp4"}
    recipe = {
        "group_size": 32,
        "bits": 8,
        "quant_predicate": lambda p, m: mxfp4 if "switch_mlp" in p else True,
    }
    ours, peer, config, _ = _mlx_lm_quantized("deepseek_v2", tmp_path, **recipe)
    assert any(".switch_mlp." in k and v == mxfp4 for k, v in config["quantization"].items())
    modes = {p: m.mode for p, m in ours.named_modules() if hasattr(m, "mode")}
    assert {m for p, m in modes.items() if ".experts." in p} == {"mxfp4"}
    assert {m for p, m in modes.items() if ".experts." not in p} == {"affine"}
    _same_logits("deepseek_v2", ours, peer)
