"""jamba (Mamba selective-scan and attention layers by period/offset, SwiGLU or routed-expert
MLPs by period/offset) against transformers' JambaForCausalLM: tiny re-randomised checkpoints,
float32, atol 1e-4. transformers' torch path runs the selective scan as a per-token loop (no
mamba kernels on CPU): an independent reading of the recurrence our parallel scan computes.

The checks (chunked, decode, decode after trims of the attention layers) are tests/_hybrid.py's.
"""

from __future__ import annotations

import json
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
    check_state_size_is_constant,
    close,
    ours,
    reference,
)

# ai21labs/AI21-Jamba-1.5-Mini's config.json keys, sizes shrunk: 6 layers, attention at 1 and 4
# (period 3, offset 1), experts at 0, 2, 4 (period 2, offset 0).
HUB_CONFIG = {
    "architectures": ["JambaForCausalLM"],
    "attention_dropout": 0.0,
    "attn_layer_offset": 1,
    "attn_layer_period": 3,
    "bos_token_id": ckpt.BOS_ID,
    "eos_token_id": ckpt.EOS_ID,
    "expert_layer_offset": 0,
    "expert_layer_period": 2,
    "hidden_act": "silu",
    "hidden_size": 64,
    "initializer_range": 0.02,
    "intermediate_size": 96,
    "mamba_conv_bias": True,
    "mamba_d_conv": 4,
    "mamba_d_state": 8,
    "mamba_dt_rank": 8,
    "mamba_expand": 2,
    "mamba_proj_bias": False,
    "max_position_embeddings": 512,
    "model_type": "jamba",
    "num_attention_heads": 4,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 6,
    "num_key_value_heads": 2,
    "num_logits_to_keep": 1,
    "output_router_logits": False,
    "pad_token_id": ckpt.PAD_ID,
    "rms_norm_eps": 1e-06,
    "router_aux_loss_coef": 0.001,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "use_cache": True,
    "use_mamba_kernels": True,  # as released; transformers 5 ignores it (torch path on a CPU)
    "vocab_size": ckpt.VOCAB_SIZE,
}


def rerandomise(model: torch.nn.Module, seed: int) -> None:
    """Every parameter with real variance; the Mamba ones as Mamba draws them (A in -[1, 16]
    per channel and state element, dt in [0.001, 0.1] through dt_proj's bias, D around 1)."""
    g = ckpt.rerandomise(model, seed)
    with torch.no_grad():
        for layer in model.model.layers:
            mixer = getattr(layer, "mamba", None)
            if mixer is None:
                continue
            mixer.A_log.copy_(torch.log(1 + 15 * torch.rand(mixer.A_log.shape, generator=g)))
            I = mixer.D.shape[0]
            dt = torch.exp(
                math.log(1e-3) + (math.log(0.1) - math.log(1e-3)) * torch.rand(I, generator=g)
            )
            mixer.dt_proj.bias.copy_(dt + torch.log(-torch.expm1(-dt)))
            mixer.D.copy_(1 + 0.5 * torch.randn(I, generator=g))


def make_jamba(path, seed: int = 0, naming: str = "hub", **overrides):
    """A tiny re-randomised JambaForCausalLM at ``path`` with the factory tokenizer.

    ``naming`` "hub": what save_pretrained writes (per-expert tensors, as the hub's); "tf5":
    the names and fused expert tensors transformers 5 holds in memory."""
    from transformers import JambaConfig, JambaForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    hf = JambaForCausalLM(JambaConfig(**(HUB_CONFIG | overrides))).to(torch.float32).eval()
    hf.config._attn_implementation = "eager"  # takes the float masks of the trim check
    rerandomise(hf, seed)
    if naming == "hub":
        hf.save_pretrained(path)
    else:
        hf.config.save_pretrained(path)
        state = {k: v.contiguous() for k, v in hf.state_dict().items()}
        save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    ckpt.write_tokenizer(path)
    return hf, path


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    return make_jamba(tmp_path_factory.mktemp("jamba"))


@pytest.fixture(scope="module", params=["hub", "tf5"])
def checkpoint(request, hub, tmp_path_factory):
    """Both namings load (the checks past the logits run on the hub one)."""
    if request.param == "hub":
        return hub
    return make_jamba(tmp_path_factory.mktemp("jamba-tf5"), naming="tf5")


def test_logits_match_transformers(checkpoint):
    hf, path = checkpoint
    ids = np.random.default_rng(0).integers(0, ckpt.VOCAB_SIZE, size=(2, 37))
    close(ours(mlxc.load_model(path), ids, None), reference(hf, ids))


def test_layers_by_period_and_offset(checkpoint):
    _, path = checkpoint
    model = mlxc.load_model(path)
    layers = model.model.layers
    assert [type(layer.self_attn).__name__ for layer in layers] == [
        "Mamba", "Attention", "Mamba", "Mamba", "Attention", "Mamba",
    ]  # fmt: skip
    assert [type(layer.mlp).__name__ for layer in layers] == ["MoE", "SwiGLU"] * 3
    kinds = [type(c).__name__ for c in model.make_cache()]
    assert kinds == ["RecurrentCache", "KVCache", "RecurrentCache"] * 2


@pytest.mark.parametrize("size", CHUNK_SIZES)
def test_chunked_prefill_equals_one_pass(hub, size):
    hf, path = hub
    ids = np.random.default_rng(1).integers(0, ckpt.VOCAB_SIZE, size=(1, 29))
    check_chunked(mlxc.load_model(path), hf, ids, size)


def test_decode_equals_the_full_pass(hub):
    hf, path = hub
    ids = np.random.default_rng(2).integers(0, ckpt.VOCAB_SIZE, size=(1, 30))
    check_decode(mlxc.load_model(path), hf, ids, prefill=17)


def test_decode_after_trims_of_the_attention_layers(hub):
    hf, path = hub
    ids = np.random.default_rng(3).integers(0, ckpt.VOCAB_SIZE, size=(1, 34))
    check_decode_after_trims(mlxc.load_model(path), hf, ids)


def test_state_stays_constant_in_size(hub):
    check_state_size_is_constant(mlxc.load_model(hub[1]))


def test_dt_rank_auto_is_ceil_hidden_over_16(tmp_path):
    hf, path = make_jamba(tmp_path, mamba_dt_rank="auto", num_hidden_layers=2)
    config = json.loads((path / "config.json").read_text())
    assert config["mamba_dt_rank"] == 4  # what transformers resolved and saved: write "auto"
    (path / "config.json").write_text(json.dumps(config | {"mamba_dt_rank": "auto"}))
    model = mlxc.load_model(path)
    assert model.model.layers[0].self_attn.dt_rank == math.ceil(64 / 16)
    ids = np.random.default_rng(4).integers(0, ckpt.VOCAB_SIZE, size=(1, 9))
    close(ours(model, ids, None), reference(hf, ids))
