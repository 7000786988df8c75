"""gpt_oss's MoE in runtime/model/moe.py against transformers' GptOssMLP, and MXFP4 experts.

The block: re-randomised float32 weights, atol 1e-4, from the dense fused layout (the bf16 hub
checkpoints and what transformers 5 ``save_pretrained`` writes: the same names and shapes) and
from MXFP4 blocks/scales (the hub's openai/gpt-oss-* checkpoints). ``swiglu_limit`` is shrunk
so that both clamps bind on these inputs (asserted), and H == I as in gpt-oss, where no shape
can tell a fused tensor's orientation.

MXFP4: ``pack_mxfp4`` below quantises float weights into the hub's blocks and scales; it is
checked against transformers' dequantiser (``convert_moe_packed_tensors``). MLX's mxfp4
experts built from those bytes must equal dense experts built from the dequantised weights to
float32 rounding (atol 1e-5: the same fp4 values, only the order of the float32 sums differs),
directly and through the runtime's loader on a checkpoint directory.
"""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from checkpoints import make_gpt_oss, reference_logits
from mlx import nn
from mlx.utils import tree_flatten

import mlxc
from mlxc.runtime.checkpoint import loading
from mlxc.runtime.model.moe import MoE, QuantizedExpertLinear, convert_expert_weights

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from transformers.integrations.mxfp4 import FP4_VALUES, convert_moe_packed_tensors
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

ATOL = 1e-4
SAME_FP4 = 1e-5  # MLX mxfp4 vs dense float32 experts holding the same fp4 values
E, K = 4, 2
LIMIT = 1.5  # swiglu_limit, shrunk from 7.0 so that both clamps act on these inputs

# openai/gpt-oss-20b config.json, every key kept, sizes shrunk (H == I as in the real model).
HUB_CONFIG = {
    "architectures": ["GptOssForCausalLM"],
    "attention_bias": True,
    "attention_dropout": 0.0,
    "eos_token_id": 127,
    "experts_per_token": K,
    "head_dim": 16,
    "hidden_act": "silu",
    "hidden_size": 64,
    "initial_context_length": 16,
    "initializer_range": 0.02,
    "intermediate_size": 64,
    "layer_types": ["sliding_attention", "full_attention"],
    "max_position_embeddings": 64,
    "model_type": "gpt_oss",
    "num_attention_heads": 4,
    "num_experts_per_tok": K,
    "num_hidden_layers": 2,
    "num_key_value_heads": 2,
    "num_local_experts": E,
    "output_router_logits": False,
    "pad_token_id": 126,
    "quantization_config": {
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
        "quant_method": "mxfp4",
    },
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "factor": 4.0,
        "original_max_position_embeddings": 16,
        "rope_type": "yarn",
        "truncate": False,
    },
    "rope_theta": 150000,
    "router_aux_loss_coef": 0.9,
    "sliding_window": 8,
    "swiglu_limit": LIMIT,
    "tie_word_embeddings": False,
    "transformers_version": "4.55.0.dev0",
    "use_cache": True,
    "vocab_size": 128,
}
MOE_SETTINGS = {  # what specs/gpt_oss.yaml says of its moe block, as moe.MoE takes it
    "norm_topk_prob": True,
    "router_bias": True,
    "expert_bias": True,
    "act": "clamped_swiglu",
}
LAYOUT = {"gate_up": "interleaved", "fused": "in_out"}


# --- MXFP4 packing (the hub's format) ---------------------------------------------------------

FP4 = np.array(FP4_VALUES[:8], dtype=np.float32)  # E2M1 magnitudes; code | 8 is the negative


def pack_mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Float ``w [..., out, in]`` -> (blocks uint8 ``[..., out, in/32, 16]``, scales uint8
    ``[..., out, in/32]``) as gpt-oss stores experts: per group of 32 inputs the smallest
    power-of-two scale ``2**(s - 127)`` that puts the group's largest magnitude within 6, each
    value rounded to the nearest E2M1 code, two codes a byte, the even element in the low
    nibble."""
    g = w.reshape(*w.shape[:-1], -1, 32).astype(np.float32)
    amax = np.abs(g).max(axis=-1)
    exp = np.ceil(np.log2(np.maximum(amax, 1e-30) / 6.0)).astype(np.int32)
    exp = np.clip(exp, -127, 127)
    scaled = g / np.exp2(exp)[..., None].astype(np.float32)
    codes = np.abs(np.abs(scaled)[..., None] - FP4).argmin(axis=-1).astype(np.uint8)
    codes |= np.where(scaled < 0, 8, 0).astype(np.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.astype(np.uint8), (exp + 127).astype(np.uint8)


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """transformers' dequantiser: ``[E, out, in/32, 16]`` blocks -> ``[E, in, out]`` floats
    (the dense hub layout of ``gate_up_proj`` / ``down_proj``)."""
    t = convert_moe_packed_tensors(
        torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32
    )
    return t.numpy()


def test_pack_mxfp4_is_what_transformers_dequantises():
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((3, 8, 64)) * np.exp2(rng.integers(-4, 4, (3, 8, 1)))).astype(
        np.float32
    )
    blocks, scales = pack_mxfp4(w)
    assert blocks.shape == (3, 8, 2, 16) and scales.shape == (3, 8, 2)
    # Decoded here nibble by nibble: the low nibble is the even element.
    lut = np.concatenate([FP4, -FP4])
    mine = np.stack([lut[blocks & 15], lut[blocks >> 4]], axis=-1).reshape(3, 8, 2, 32)
    mine = (mine * np.exp2(scales.astype(np.int32) - 127)[..., None]).reshape(3, 8, 64)
    np.testing.assert_array_equal(dequantize_mxfp4(blocks, scales), mine.swapaxes(1, 2))
    # A quantiser: every value within half a step of the largest (2 * scale) of the original.
    step = np.repeat(np.exp2(scales.astype(np.int32) - 127), 32, axis=-1)
    assert (np.abs(mine - w) <= step).all()
    assert len(np.unique(blocks)) > 100  # nibbles of both signs and many magnitudes


# --- the block against transformers -----------------------------------------------------------


def reference_mlp(hidden: int, intermediate: int, seed: int = 0, **config) -> GptOssMLP:
    fields = {k: v for k, v in HUB_CONFIG.items() if k != "quantization_config"}
    fields |= {"hidden_size": hidden, "intermediate_size": intermediate} | config
    mlp = GptOssMLP(transformers.GptOssConfig(**fields)).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in mlp.named_parameters():
            if p.ndim <= 2 and p.shape[-1] != hidden:  # router bias [E], expert biases [E, out]
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            else:  # fused [E, in, out] experts and the router [E, H]: scaled by the input width
                fan_in = p.shape[-1] if p.ndim == 2 else p.shape[1]
                p.copy_(torch.randn(p.shape, generator=g) * 1.5 / fan_in**0.5)
    return mlp


def hub_weights(mlp: GptOssMLP, prefix: str = "mlp.") -> dict[str, mx.array]:
    """The MLP's tensors as a checkpoint names them (hub bf16 and transformers 5 alike)."""
    return {prefix + k: mx.array(v.detach().numpy()) for k, v in mlp.state_dict().items()}


def mlx_block(mlp: GptOssMLP, weights: dict[str, mx.array], **kw) -> MoE:
    """moe.MoE loaded as a generated gpt_oss model loads it: the spec's rename of the router
    (``mlp.router.`` -> ``mlp.gate.``), then the expert conversion, then (for MXFP4) the
    loader's quantisation of the modules that have scales."""
    cfg = mlp.experts
    moe = MoE(cfg.hidden_size, cfg.intermediate_size, E, K, swiglu_limit=cfg.limit, **kw)
    weights = {k.replace("mlp.router.", "mlp.gate."): v for k, v in weights.items()}
    conv = convert_expert_weights(
        weights, hidden=cfg.hidden_size, intermediate=cfg.intermediate_size, num_experts=E, **LAYOUT
    )
    conv = {k.removeprefix("mlp."): v for k, v in conv.items()}
    if "experts.gate_proj.scales" in conv:
        loading._quantize(moe, loading.MXFP4, conv, "config.json")
    moe.load_weights(list(conv.items()), strict=True)
    return moe


def run_both(mlp: GptOssMLP, moe: MoE, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    with torch.no_grad():
        want = mlp(torch.from_numpy(x))[0].numpy()
    return np.array(moe(mx.array(x))), want


def assert_clamps_bind(mlp: GptOssMLP, x: np.ndarray) -> None:
    """Some gate values above the limit and some up values beyond it either way."""
    e = mlp.experts
    with torch.no_grad():
        gu = (
            torch.from_numpy(x.reshape(-1, x.shape[-1])) @ e.gate_up_proj
            + e.gate_up_proj_bias[:, None]
        )
    gate, up = gu[..., ::2], gu[..., 1::2]
    assert (gate > e.limit).any() and (gate < -e.limit).any()
    assert (up > e.limit).any() and (up < -e.limit).any()


def _input(hidden: int, seed: int = 1, shape=(2, 9)) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((*shape, hidden)).astype(np.float32)


@pytest.mark.parametrize("sort_threshold", [1, 10**6], ids=["sorted", "unsorted"])
@pytest.mark.parametrize("hidden,intermediate", [(64, 64), (32, 48)])
def test_dense_fused_layout_matches_transformers(hidden, intermediate, sort_threshold):
    mlp = reference_mlp(hidden, intermediate, swiglu_alpha=1.3)  # tf5 key, not the default
    x = _input(hidden)
    assert_clamps_bind(mlp, x)
    moe = mlx_block(
        mlp, hub_weights(mlp), sort_threshold=sort_threshold, swiglu_alpha=1.3, **MOE_SETTINGS
    )
    got, want = run_both(mlp, moe, x)
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)
    # Not an accident of these sizes: halves instead of interleaved gate/up is far off.
    wrong = MoE(hidden, intermediate, E, K, swiglu_limit=LIMIT, swiglu_alpha=1.3, **MOE_SETTINGS)
    renamed = {k.replace("mlp.router.", "mlp.gate."): v for k, v in hub_weights(mlp).items()}
    conv = convert_expert_weights(
        renamed, hidden=hidden, intermediate=intermediate, num_experts=E, fused="in_out"
    )
    wrong.load_weights([(k.removeprefix("mlp."), v) for k, v in conv.items()], strict=True)
    assert np.abs(np.array(wrong(mx.array(x))) - want).max() > 0.1


def test_the_fused_orientation_is_not_guessed_when_hidden_equals_intermediate():
    # by_shape keeps an [E, I, H] down_proj as [E, H, I] when H == I: gpt_oss must say in_out.
    mlp = reference_mlp(64, 64)
    renamed = {k.replace("mlp.router.", "mlp.gate."): v for k, v in hub_weights(mlp).items()}
    by_shape = convert_expert_weights(
        renamed, hidden=64, intermediate=64, num_experts=E, gate_up="interleaved"
    )
    in_out = convert_expert_weights(renamed, hidden=64, intermediate=64, num_experts=E, **LAYOUT)
    down = mlp.experts.down_proj.detach().numpy()
    np.testing.assert_array_equal(
        np.array(in_out["mlp.experts.down_proj.weight"]), down.swapaxes(1, 2)
    )
    np.testing.assert_array_equal(np.array(by_shape["mlp.experts.down_proj.weight"]), down)
    with pytest.raises(ValueError, match=r"expected \[E, in, out\]"):
        convert_expert_weights(
            {"experts.down_proj": mx.zeros((E, 64, 32))},
            hidden=64,
            intermediate=64,
            num_experts=E,
            **LAYOUT,
        )


def mxfp4_weights(mlp: GptOssMLP, prefix: str = "mlp.") -> tuple[dict, dict]:
    """(the hub MXFP4 tensors of ``mlp``'s experts, the dense tensors they dequantise to)."""
    e = mlp.experts
    packed, dense = {}, {}
    for proj in ("gate_up_proj", "down_proj"):
        w = getattr(e, proj).detach().numpy().swapaxes(1, 2)  # [E, out, in], as blocks are
        blocks, scales = pack_mxfp4(w)
        packed[f"{prefix}experts.{proj}_blocks"] = mx.array(blocks)
        packed[f"{prefix}experts.{proj}_scales"] = mx.array(scales)
        dense[f"{prefix}experts.{proj}"] = mx.array(dequantize_mxfp4(blocks, scales))
    rest = {k: v for k, v in hub_weights(mlp, prefix).items() if not k.endswith("_proj")}
    return packed | rest, dense | rest


@pytest.mark.parametrize("sort_threshold", [1, 10**6], ids=["sorted", "unsorted"])
@pytest.mark.parametrize("hidden,intermediate", [(64, 64), (32, 64)])
def test_mxfp4_experts_equal_dense_experts_of_the_dequantised_weights(
    hidden, intermediate, sort_threshold
):
    mlp = reference_mlp(hidden, intermediate)
    packed, dense = mxfp4_weights(mlp)
    kw = {"sort_threshold": sort_threshold, **MOE_SETTINGS}
    quantised = mlx_block(mlp, packed, **kw)
    for proj in ("gate_proj", "up_proj", "down_proj"):
        layer = quantised.experts[proj]
        assert isinstance(layer, QuantizedExpertLinear) and layer.mode == "mxfp4"
        assert (layer.group_size, layer.bits, layer.weight.dtype) == (32, 4, mx.uint32)
    # The bytes are the checkpoint's, reinterpreted: gate at the even rows of gate_up.
    blocks = np.array(packed["mlp.experts.gate_up_proj_blocks"])
    as_bytes = np.array(quantised.experts.gate_proj.weight).view(np.uint8)
    np.testing.assert_array_equal(as_bytes, blocks[:, 0::2].reshape(E, intermediate, -1))
    assert isinstance(quantised.gate, nn.Linear)  # the router stays as stored
    x = _input(hidden)
    reference = mlx_block(mlp, dense, **kw)
    np.testing.assert_allclose(
        np.array(quantised(mx.array(x))), np.array(reference(mx.array(x))), atol=SAME_FP4, rtol=0
    )
    # ... and that dense block is transformers' with the dequantised weights loaded.
    with torch.no_grad():
        for proj in ("gate_up_proj", "down_proj"):
            getattr(mlp.experts, proj).copy_(
                torch.from_numpy(np.array(dense[f"mlp.experts.{proj}"]))
            )
    got, want = run_both(mlp, quantised, x)
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)


def test_mxfp4_shapes_are_checked():
    blocks = mx.zeros((E, 2 * 64, 2, 16), dtype=mx.uint8)
    with pytest.raises(ValueError, match="gate_up_proj_blocks: shape"):
        convert_expert_weights(
            {"experts.gate_up_proj_blocks": blocks}, hidden=64, intermediate=32, num_experts=E
        )
    with pytest.raises(ValueError, match="uint8, not"):
        convert_expert_weights(
            {"experts.down_proj_scales": mx.zeros((E, 64, 1))},
            hidden=64,
            intermediate=32,
            num_experts=E,
        )
    with pytest.raises(ValueError, match="divisible by 32"):
        convert_expert_weights(
            {"experts.down_proj_scales": mx.zeros((E, 64, 1), dtype=mx.uint8)},
            hidden=64,
            intermediate=48,
            num_experts=E,
        )


def test_quantization_read_from_the_config():
    assert loading.quantization(HUB_CONFIG) == loading.MXFP4
    assert loading.quantization({"quantization_config": {"quant_method": "fp8"}}) is None
    mlx_q = {"group_size": 64, "bits": 4}
    assert loading.quantization({"quantization": mlx_q, "quantization_config": mlx_q}) == mlx_q


# --- through the loader -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def hub_mxfp4(tmp_path_factory):
    """(an MXFP4 gpt_oss checkpoint as the hub writes one, the dense checkpoint of its
    dequantised experts): make_gpt_oss's tiny model, its experts packed by ``pack_mxfp4``."""
    root = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    source = make_gpt_oss(root / "source", tokenizer=False, legacy_config=True)
    weights = mx.load(str(source / "model.safetensors"))
    config = json.loads((source / "config.json").read_text())
    packed, dense = {}, {}
    for name, w in weights.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = pack_mxfp4(np.array(w).swapaxes(1, 2))  # [E, in, out] -> rows out
            packed[f"{name}_blocks"], packed[f"{name}_scales"] = mx.array(blocks), mx.array(scales)
            dense[name] = mx.array(dequantize_mxfp4(blocks, scales))
        else:
            packed[name] = dense[name] = w
    dirs = []
    for kind, tensors, cfg in (
        ("mxfp4", packed, config | {"quantization_config": HUB_CONFIG["quantization_config"]}),
        ("dense", dense, config),
    ):
        d = root / kind
        d.mkdir()
        mx.save_safetensors(str(d / "model.safetensors"), tensors, metadata={"format": "pt"})
        (d / "config.json").write_text(json.dumps(cfg))
        dirs.append(d)
    return tuple(dirs)


def test_the_loader_builds_mxfp4_experts_from_blocks_and_scales(hub_mxfp4):
    mxfp4_dir, dense_dir = hub_mxfp4
    model = mlxc.load_model(mxfp4_dir, fuse=False)  # the checkpoint's layout
    quantised = []
    for name, m in model.named_modules():
        if isinstance(m, QuantizedExpertLinear):
            assert (m.mode, m.group_size, m.bits) == ("mxfp4", 32, 4), name
            quantised.append(name)
        elif isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            pytest.fail(f"{name} is quantised, but only the experts are MXFP4")
    assert len(quantised) == 2 * 3  # gate, up and down of both layers
    params = dict(tree_flatten(model.parameters()))
    assert params["model.layers.0.mlp.experts.up_proj.weight"].dtype == mx.uint32
    assert params["model.layers.0.mlp.gate.bias"].dtype == mx.float32  # the router as stored
    ids = np.random.default_rng(5).integers(0, 384, size=(1, 20))
    got = np.array(mlxc.load_model(mxfp4_dir)(mx.array(ids)))  # gate|up fused, as served
    # The same fp4 values as dense float32 experts, to float32 rounding ...
    dense = np.array(mlxc.load_model(dense_dir)(mx.array(ids)))
    np.testing.assert_allclose(got, dense, atol=SAME_FP4, rtol=0)
    # ... and transformers' model holding the dequantised weights.
    np.testing.assert_allclose(got, reference_logits(dense_dir, ids), atol=ATOL, rtol=0)


def test_convert_refuses_an_mxfp4_checkpoint(hub_mxfp4, tmp_path):
    # Its experts would be written quantised under a config.json that no longer says so.
    from mlxc.runtime.checkpoint.convert import ConvertError, convert

    mxfp4_dir, _ = hub_mxfp4
    with pytest.raises(ConvertError, match="already quantised"):
        convert(mxfp4_dir, tmp_path / "out")
    assert not (tmp_path / "out").exists()
