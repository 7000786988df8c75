"""nemotron_h (Mamba2 + attention + MLP + MoE layers by hybrid_override_pattern) against
transformers' NemotronHForCausalLM: tiny re-randomised checkpoints, float32, atol 1e-4.

transformers 5.24's mixer clamps the time step with (time_step_min, inf) in prefill, ignoring
the config's time_step_limit, and not at all in decode; the published model reads the config's
(0, inf). The reference here sets the config's limit on its mixers, and mlxc's decode is
compared with transformers' full forward pass, never with its decode.

Under a bounded cache the attention layers are trimmed (with sinks) and the Mamba2 state is
not: the reference for that is transformers' forward with each attention layer's mask hiding
exactly the keys the trims dropped (attention here has no positional encoding, so that is the
same computation), replayed from the trim rule itself.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import mlxc
from mlxc.runtime.model.cache import enforce_max_kv
from mlxc.runtime.model.ssm import RecurrentCache

sys.path.insert(0, str(Path(__file__).parent))
import checkpoints as ckpt

ATOL = 1e-4
PATTERN = "M-M*-M-*M"
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
    "use_mamba_kernels": False,
    "vocab_size": ckpt.VOCAB_SIZE,
}


def rerandomise(model: torch.nn.Module, seed: int) -> None:
    """Every parameter with real variance; the Mamba2 ones as Mamba2 draws them (A in
    -[1, 16], dt in [time_step_min, time_step_max] (softplus-inverted), D around 1)."""
    g = torch.Generator().manual_seed(seed)
    config = model.config
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim > 1:
                p.copy_(torch.randn(p.shape, generator=g) * 1.2 / p.shape[-1] ** 0.5)
            else:
                p.copy_((1.0 if "norm" in name else 0.0) + 0.2 * torch.randn(p.shape, generator=g))
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


def reference(hf, ids: np.ndarray, attention_mask=None) -> np.ndarray:
    with torch.no_grad():
        return hf(input_ids=torch.from_numpy(ids), attention_mask=attention_mask).logits.numpy()


def ours(model, ids: np.ndarray, cache) -> np.ndarray:
    return np.array(model(mx.array(ids), cache=cache))


@pytest.fixture(scope="module", params=["hub", "tf5"])
def checkpoint(request, tmp_path_factory):
    return make_nemotron_h(tmp_path_factory.mktemp("nemotron_h"), naming=request.param)


def test_logits_match_transformers(checkpoint):
    hf, path = checkpoint
    ids = np.random.default_rng(0).integers(0, ckpt.VOCAB_SIZE, size=(2, 37))
    model = mlxc.load_model(path)
    np.testing.assert_allclose(ours(model, ids, None), reference(hf, ids), atol=ATOL, rtol=0)


def test_each_layer_type_has_its_cache_kind(checkpoint):
    _, path = checkpoint
    model = mlxc.load_model(path)
    cache = model.make_cache()
    kinds = [type(c).__name__ for c in cache]  # one per M and * layer, in order
    assert kinds == ["RecurrentCache" if t == "M" else "KVCache" for t in PATTERN if t in "M*"]


@pytest.mark.parametrize("size", [1, 2, 3, 7, 64])  # 2 < conv_kernel - 1: splits the kernel
def test_chunked_prefill_equals_one_pass(checkpoint, size):
    hf, path = checkpoint
    ids = np.random.default_rng(1).integers(0, ckpt.VOCAB_SIZE, size=(1, 29))
    model = mlxc.load_model(path)
    cache = model.make_cache()
    parts = [ours(model, ids[:, i : i + size], cache) for i in range(0, ids.shape[1], size)]
    np.testing.assert_allclose(np.concatenate(parts, axis=1), reference(hf, ids), atol=ATOL)
    assert all(c.offset == ids.shape[1] for c in cache)


def test_decode_equals_the_full_pass(checkpoint):
    hf, path = checkpoint
    ids = np.random.default_rng(2).integers(0, ckpt.VOCAB_SIZE, size=(1, 30))
    model = mlxc.load_model(path)
    cache = model.make_cache()
    parts = [ours(model, ids[:, :17], cache)]
    parts += [ours(model, ids[:, t : t + 1], cache) for t in range(17, ids.shape[1])]
    np.testing.assert_allclose(np.concatenate(parts, axis=1), reference(hf, ids), atol=ATOL)


def trimmed_mask(pieces: list[tuple[int, int]], max_kv: int, keep: int) -> torch.Tensor:
    """The additive mask [1, 1, L, L] of what each query still sees after the trims: the trim
    rule replayed on key positions (after each piece, the oldest past max_kv go, after the
    first ``keep`` sinks)."""
    total = pieces[-1][1]
    mask = torch.full((1, 1, total, total), -math.inf)
    live: list[int] = []
    for a, b in pieces:
        for p in range(a, b):
            mask[0, 0, p, live + list(range(a, p + 1))] = 0.0
        live += list(range(a, b))
        if len(live) > max_kv:
            live = live[:keep] + live[keep + len(live) - max_kv :]
    return mask


def test_decode_after_trims_of_the_attention_layers(checkpoint):
    """--max-kv-size 12 with 2 sinks, prefill in chunks of 5 then decode: the attention layers
    are trimmed after every chunk and step, the Mamba2 state never is; every logit equals
    transformers' with the trimmed keys masked out of its attention layers."""
    hf, path = checkpoint
    ids = np.random.default_rng(3).integers(0, ckpt.VOCAB_SIZE, size=(1, 34))
    pieces = [(a, min(a + 5, 20)) for a in range(0, 20, 5)]
    pieces += [(t, t + 1) for t in range(20, ids.shape[1])]
    model = mlxc.load_model(path)
    cache, parts, dropped = model.make_cache(), [], 0
    for a, b in pieces:
        parts.append(ours(model, ids[:, a:b], cache))
        dropped += enforce_max_kv(cache, 12, keep=2)
    assert dropped > 0
    for c in cache:
        assert c.offset == ids.shape[1]
        if isinstance(c, RecurrentCache):
            assert c.live_len == 0 and c.ssm is not None  # state, not keys: never trimmed
        else:
            assert c.live_len == 12
    mask = {"full_attention": trimmed_mask(pieces, 12, 2), "linear_attention": None}
    want = reference(hf, ids, attention_mask=mask)
    np.testing.assert_allclose(np.concatenate(parts, axis=1), want, atol=ATOL, rtol=0)
    # The guard: the trims change the output (the masked reference is not the plain one).
    assert np.abs(want - reference(hf, ids))[:, 20:].max() > 1e-2


def test_state_stays_constant_in_size(checkpoint):
    _, path = checkpoint
    model = mlxc.load_model(path)
    cache = model.make_cache()
    ours(model, np.array([[5, 6, 7, 8]]), cache)
    sizes = [c.nbytes for c in cache if isinstance(c, RecurrentCache)]
    for t in range(20):
        ours(model, np.array([[t + 3]]), cache)
    assert [c.nbytes for c in cache if isinstance(c, RecurrentCache)] == sizes
