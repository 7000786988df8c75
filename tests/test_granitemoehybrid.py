"""granitemoehybrid (Granite 4.0 hybrid: Mamba2 and GQA layers by layer_types, routed experts
plus a shared MLP, muP multipliers) against transformers' GraniteMoeHybridForCausalLM: tiny
re-randomised checkpoints, float32, atol 1e-4. The checks are tests/_hybrid.py's."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import mlxc

sys.path.insert(0, str(Path(__file__).parent))
import checkpoints as ckpt
from _hybrid import (
    CHUNK_SIZES,
    check_chunked,
    check_decode,
    check_decode_after_trims,
    close,
    ours,
    reference,
)

LAYERS = ["mamba", "attention", "mamba", "mamba", "attention", "mamba"]
# The keys of a granitemoehybrid config.json as the hub has them (transformers' docs example,
# granite-4.0-h-tiny's key set), sizes shrunk; the multipliers as released.
HUB_CONFIG = {
    "architectures": ["GraniteMoeHybridForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "attention_multiplier": 0.015625,
    "bos_token_id": ckpt.BOS_ID,
    "eos_token_id": ckpt.EOS_ID,
    "embedding_multiplier": 12,
    "hidden_act": "silu",
    "hidden_size": 64,
    "initializer_range": 0.1,
    "intermediate_size": 32,
    "layer_types": LAYERS,
    "logits_scaling": 2,
    "mamba_chunk_size": 8,
    "mamba_conv_bias": True,
    "mamba_d_conv": 4,
    "mamba_d_head": 16,
    "mamba_d_state": 16,
    "mamba_expand": 2,
    "mamba_n_groups": 2,
    "mamba_n_heads": 8,
    "mamba_proj_bias": False,
    "max_position_embeddings": 512,
    "model_type": "granitemoehybrid",
    "normalization_function": "rmsnorm",
    "num_attention_heads": 4,
    "num_experts_per_tok": 2,
    "num_hidden_layers": len(LAYERS),
    "num_key_value_heads": 2,
    "num_local_experts": 4,
    "output_router_logits": False,
    "pad_token_id": ckpt.PAD_ID,
    "position_embedding_type": "nope",
    "residual_multiplier": 0.22,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "rope_theta": 10000,
    "router_aux_loss_coef": 0.0,
    "shared_intermediate_size": 48,
    "tie_word_embeddings": True,
    "torch_dtype": "float32",
    "use_cache": True,
    "vocab_size": ckpt.VOCAB_SIZE,
}


def rerandomise(model: torch.nn.Module, seed: int) -> None:
    """Every parameter with real variance; the Mamba2 ones as Mamba2 draws them."""
    g = ckpt.rerandomise(model, seed)
    with torch.no_grad():
        for layer in model.model.layers:
            mixer = layer.mamba
            if mixer is None:
                continue
            H = mixer.num_heads
            mixer.A_log.copy_(torch.log(1 + 15 * torch.rand(H, generator=g)))
            dt = torch.exp(math.log(1e-3) + math.log(100) * torch.rand(H, generator=g))
            mixer.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
            mixer.D.copy_(1 + 0.5 * torch.randn(H, generator=g))


def make_granite(path, seed: int = 0, naming: str = "hub", **overrides):
    """A tiny re-randomised GraniteMoeHybridForCausalLM at ``path`` with the factory tokenizer;
    ``naming`` "hub": what save_pretrained writes; "tf5": transformers 5's names in memory."""
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    config = GraniteMoeHybridConfig(**(HUB_CONFIG | overrides))
    hf = GraniteMoeHybridForCausalLM(config).to(torch.float32).eval()
    hf.config._attn_implementation = "eager"  # takes the float masks of the trim check
    rerandomise(hf, seed)
    if naming == "hub":
        hf.save_pretrained(path)
    else:
        hf.config.save_pretrained(path)
        state = {k: v.contiguous() for k, v in hf.state_dict().items()}
        if hf.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    ckpt.write_tokenizer(path)
    return hf, path


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    return make_granite(tmp_path_factory.mktemp("granite"))


@pytest.fixture(
    scope="module",
    params=["hub", "tf5", "rope", "dense"],
    ids=["hub", "tf5", "rope", "dense"],
)
def checkpoint(request, hub, tmp_path_factory):
    """Both namings; RoPE attention (position_embedding_type rope); no experts (the shared MLP
    alone, granite-4.0-h-micro)."""
    path = tmp_path_factory.mktemp(f"granite-{request.param}")
    if request.param == "hub":
        return hub
    if request.param == "tf5":
        return make_granite(path, naming="tf5")
    if request.param == "rope":
        return make_granite(path, position_embedding_type="rope", tie_word_embeddings=False)
    return make_granite(path, num_local_experts=0)


def test_logits_match_transformers(checkpoint):
    hf, path = checkpoint
    ids = np.random.default_rng(0).integers(0, ckpt.VOCAB_SIZE, size=(2, 37))
    close(ours(mlxc.load_model(path), ids, None), reference(hf, ids))


@pytest.mark.parametrize("size", CHUNK_SIZES)
def test_chunked_prefill_equals_one_pass(hub, size):
    hf, path = hub
    ids = np.random.default_rng(1).integers(0, ckpt.VOCAB_SIZE, size=(1, 29))
    check_chunked(mlxc.load_model(path), hf, ids, size)


def test_decode_equals_the_full_pass(hub):
    hf, path = hub
    ids = np.random.default_rng(2).integers(0, ckpt.VOCAB_SIZE, size=(1, 30))
    check_decode(mlxc.load_model(path), hf, ids, prefill=17)


def test_decode_after_trims_of_the_attention_layers(checkpoint):
    hf, path = checkpoint
    ids = np.random.default_rng(3).integers(0, ckpt.VOCAB_SIZE, size=(1, 34))
    check_decode_after_trims(mlxc.load_model(path), hf, ids)
