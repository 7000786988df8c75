"""nemotron_h (Mamba2 + attention + MLP + MoE layers by hybrid_override_pattern) against
transformers' NemotronHForCausalLM: tiny re-randomised checkpoints, float32, atol 1e-4.

transformers 5.24's mixer clamps the time step with (time_step_min, inf) in prefill, ignoring
the config's time_step_limit, and not at all in decode; the published model reads the config's
(0, inf). The reference here sets the config's limit on its mixers, and mlxc's decode is
compared with transformers' full forward pass, never with its decode.

The checks themselves (chunked, decode, decode after trims) are tests/_hybrid.py's.
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

PATTERN = "M-M*-ME*M"
# nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B's config.json keys, sizes shrunk (every key kept).
HUB_CONFIG = {
    "architectures": ["NemotronHForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": ckpt.BOS_ID,
    "chunk_size": 8,
    "conv_kernel": 4,
    "eos_token_id": ckpt.EOS_ID,
    "expand": 2,
    "head_dim": 16,
    "hidden_dropout": 0.0,
    "hidden_size": 64,
    "hybrid_override_pattern": PATTERN,
    "initializer_range": 0.02,
    "intermediate_size": 96,
    "layer_norm_epsilon": 1e-05,
    "mamba_head_dim": 8,
    "mamba_hidden_act": "silu",
    "mamba_num_heads": 8,
    "mamba_proj_bias": False,
    "mamba_ssm_cache_dtype": "float32",
    "max_position_embeddings": 512,
    "mlp_bias": False,
    "mlp_hidden_act": "relu2",
    "model_type": "nemotron_h",
    "moe_intermediate_size": 32,
    "moe_shared_expert_intermediate_size": 48,
    "n_group": 1,
    "n_groups": 2,
    "n_routed_experts": 6,
    "n_shared_experts": 1,
    "norm_eps": 1e-05,
    "norm_topk_prob": True,
    "num_attention_heads": 4,
    "num_experts_per_tok": 2,
    "num_hidden_layers": len(PATTERN),
    "num_key_value_heads": 2,
    "num_logits_to_keep": 1,
    "pad_token_id": ckpt.PAD_ID,
    "partial_rotary_factor": 1.0,
    "rescale_prenorm_residual": True,
    "residual_in_fp32": False,
    "rope_theta": 10000,
    "routed_scaling_factor": 2.5,
    "sliding_window": None,
    "ssm_state_size": 16,
    "tie_word_embeddings": False,
    "time_step_floor": 0.0001,
    "time_step_max": 0.1,
    "time_step_min": 0.001,
    "topk_group": 1,
    "torch_dtype": "float32",
    "use_bias": False,
    "use_cache": True,
    "use_conv_bias": True,
    "use_mamba_kernels": True,  # as released; transformers 5 ignores it (torch path on a CPU)
    "vocab_size": ckpt.VOCAB_SIZE,
}


def rerandomise(model: torch.nn.Module, seed: int) -> None:
    """Every parameter with real variance; the Mamba2 ones as Mamba2 draws them (A in
    -[1, 16], dt in [time_step_min, time_step_max] (softplus-inverted), D around 1)."""
    g = ckpt.rerandomise(model, seed)
    config = model.config
    with torch.no_grad():
        for layer in model.model.layers:
            mixer = layer.mixer
            if hasattr(mixer, "A_log"):
                H = mixer.num_heads
                mixer.A_log.copy_(torch.log(1 + 15 * torch.rand(H, generator=g)))
                lo, hi = math.log(config.time_step_min), math.log(config.time_step_max)
                dt = torch.exp(lo + (hi - lo) * torch.rand(H, generator=g))
                mixer.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
                mixer.D.copy_(1 + 0.5 * torch.randn(H, generator=g))
                mixer.time_step_limit = (0.0, math.inf)  # the config's (see the docstring)
            if hasattr(mixer, "gate"):
                bias = mixer.gate.e_score_correction_bias
                bias.copy_(0.1 * torch.randn(bias.shape, generator=g))


def make_model(config: dict, seed: int = 0):
    from transformers import NemotronHConfig, NemotronHForCausalLM

    torch.manual_seed(seed)
    hf = NemotronHForCausalLM(NemotronHConfig(**config)).to(torch.float32).eval()
    hf.config._attn_implementation = "eager"  # takes the float masks the trim test builds
    rerandomise(hf, seed)
    return hf


def make_nemotron_h(path, seed: int = 0, pattern: str = PATTERN, naming: str = "hub", **overrides):
    """A tiny re-randomised NemotronHForCausalLM at ``path`` with the factory tokenizer.

    ``naming`` "hub": the hub's config (hybrid_override_pattern) and tensor names (backbone.,
    what save_pretrained writes); "tf5": transformers 5's config (layers_block_type) and the
    names its model holds in memory (model.)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = HUB_CONFIG | {"hybrid_override_pattern": pattern, "num_hidden_layers": len(pattern)}
    hf = make_model(config | overrides, seed)
    if naming == "hub":
        hf.save_pretrained(path)
        saved = json.loads((path / "config.json").read_text())
        saved.pop("layers_block_type")
        (path / "config.json").write_text(
            json.dumps(config | overrides | saved | {"hybrid_override_pattern": pattern})
        )
    else:
        hf.config.save_pretrained(path)
        state = {k: v.contiguous() for k, v in hf.state_dict().items()}
        save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    ckpt.write_tokenizer(path)
    return hf, path


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    return make_nemotron_h(tmp_path_factory.mktemp("nemotron_h"))


@pytest.fixture(scope="module", params=["hub", "tf5"])
def checkpoint(request, hub, tmp_path_factory):
    """Both namings load (the checks past the logits run on the hub one)."""
    if request.param == "hub":
        return hub
    return make_nemotron_h(tmp_path_factory.mktemp("nemotron_h-tf5"), naming="tf5")


def test_logits_match_transformers(checkpoint):
    hf, path = checkpoint
    ids = np.random.default_rng(0).integers(0, ckpt.VOCAB_SIZE, size=(2, 37))
    model = mlxc.load_model(path)
    close(ours(model, ids, None), reference(hf, ids))


def test_each_layer_type_has_its_cache_kind(checkpoint):
    _, path = checkpoint
    model = mlxc.load_model(path)
    cache = model.make_cache()
    kinds = [type(c).__name__ for c in cache]  # one per M and * layer, in order
    assert kinds == ["RecurrentCache" if t == "M" else "KVCache" for t in PATTERN if t in "M*"]


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


@pytest.mark.parametrize("naming", ["hub", "tf5"])
def test_experts_in_a_latent_width_with_group_limited_routing(tmp_path, naming):
    """moe_latent_size (routed experts between fc1/fc2_latent_proj, the shared expert on the
    input) and n_group 3 / topk_group 1 (each token's experts from its best group only)."""
    hf, path = make_nemotron_h(
        tmp_path, pattern="ME*E", naming=naming, moe_latent_size=24, n_group=3, topk_group=1
    )
    model = mlxc.load_model(path)
    assert model.model.layers[1].mlp.fc1_latent_proj.weight.shape == (24, 64)
    ids = np.random.default_rng(5).integers(0, ckpt.VOCAB_SIZE, size=(2, 23))
    close(ours(model, ids, None), reference(hf, ids))
