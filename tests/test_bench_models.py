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
from bench.run import peer_checkpoint

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


def _checkpoint(arch: str, path):
    cfg = {**models.config(arch, "small"), **TINY[arch], "vocab_size": VOCAB}
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
