"""Qwen VL vision towers (runtime/model/vision/qwen.py) against transformers on tiny random weights.

Pixel values come from transformers' PIL-backend image processor (no torchvision), on random
PIL images of different sizes; a video-shaped grid (t = 2) checks per-frame attention.
"""

from __future__ import annotations

import itertools

import mlx.core as mx
import numpy as np
import pytest
import torch
import transformers

from mlxc.runtime.model.vision import qwen

PATCH, MERGE, TEMPORAL = 8, 2, 2
ATOL = 1e-4

TEXT = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 128,
}
VISION_COMMON = {
    "depth": 3,
    "num_heads": 2,
    "patch_size": PATCH,
    "spatial_merge_size": MERGE,
    "temporal_patch_size": TEMPORAL,
}
CONFIGS = {
    "qwen2_vl": (
        "Qwen2VLConfig",
        "Qwen2VLForConditionalGeneration",
        {**VISION_COMMON, "embed_dim": 32, "hidden_size": 64, "mlp_ratio": 2},
        {"rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3]}},
    ),
    "qwen2_5_vl": (
        "Qwen2_5_VLConfig",
        "Qwen2_5_VLForConditionalGeneration",
        # window 32 px = 2x2 merged tokens: a 6x8-patch image has 4 windows, two of them partial
        {
            **VISION_COMMON,
            "hidden_size": 32,
            "intermediate_size": 48,
            "out_hidden_size": 64,
            "window_size": 32,
            "fullatt_block_indexes": [1],
        },
        {"rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3]}},
    ),
    "qwen3_vl": (
        "Qwen3VLConfig",
        "Qwen3VLForConditionalGeneration",
        # 6x6 learned position table: grids of 4, 6, 8 and 12 patches resample it down and up
        {
            **VISION_COMMON,
            "hidden_size": 32,
            "intermediate_size": 48,
            "out_hidden_size": 64,
            "num_position_embeddings": 36,
            "deepstack_visual_indexes": [0, 2],
        },
        {
            "head_dim": 16,
            "rope_parameters": {
                "rope_type": "default",
                "mrope_section": [2, 3, 3],
                "mrope_interleaved": True,
            },
        },
    ),
}


def randomise(model, seed: int) -> None:
    """Every parameter redrawn with real variance (transformers' init is near zero)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ("norm" in name or "ln_q" in name) and name.endswith(".weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith(".bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name or "pos_embed" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:  # Linear [out, in] and the patch Conv3d [out, in, t, p, p]
                fan_in = int(np.prod(p.shape[1:]))
                p.copy_(torch.randn(p.shape, generator=g) * (1.5 / fan_in**0.5))


def build(model_type: str, seed: int = 0):
    """A tiny float32 transformers model, re-randomised, in eval mode."""
    config_cls, model_cls, vision, text = CONFIGS[model_type]
    config = getattr(transformers, config_cls)(
        vision_config=dict(vision),
        text_config={**TEXT, **text},
        image_token_id=120,
        video_token_id=121,
        vision_start_token_id=122,
        vision_end_token_id=123,
    )
    config._attn_implementation = "eager"
    model = getattr(transformers, model_cls)(config).float().eval()
    randomise(model, seed)
    return model


def tower_from(model, model_type: str):
    """Our tower, built from the saved vision_config dict and loaded strictly from the
    checkpoint tensors under ``model.visual.``."""
    tower = qwen.TOWERS[model_type](model.config.vision_config.to_dict())
    prefix = "model.visual."
    weights = {
        k[len(prefix) :]: mx.array(v.detach().numpy())
        for k, v in model.state_dict().items()
        if k.startswith(prefix)
    }
    tower.load_weights(list(tower.sanitize(weights).items()), strict=True)
    return tower


def pixels(sizes, seed: int = 0):
    """pixel_values, image_grid_thw from transformers' PIL image processor."""
    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    processor = Qwen2VLImageProcessorPil(
        patch_size=PATCH,
        merge_size=MERGE,
        temporal_patch_size=TEMPORAL,
        min_pixels=16 * 16,
        max_pixels=64 * 64 * 4,
    )
    rng = np.random.default_rng(seed)
    images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in sizes]
    out = processor(images=images, return_tensors="np")
    return out["pixel_values"].astype(np.float32), out["image_grid_thw"]


def video_like(seed: int = 1):
    """Random patches for a 2-frame grid after one processed image: per-frame attention."""
    pv, grid = pixels([(50, 70)], seed)
    rng = np.random.default_rng(seed)
    frames = rng.standard_normal((2 * 4 * 6, pv.shape[1])).astype(np.float32)
    return np.concatenate([pv, frames]), np.concatenate([grid, [[2, 4, 6]]])


INPUTS = {
    "one_image": lambda: pixels([(50, 70)]),
    "two_images": lambda: pixels([(50, 70), (90, 40)]),
    "image_and_video_grid": video_like,
}


@pytest.mark.parametrize("inputs", list(INPUTS))
@pytest.mark.parametrize("model_type", list(CONFIGS))
def test_tower_matches_transformers(model_type, inputs):
    model = build(model_type)
    tower = tower_from(model, model_type)
    pv, grid = INPUTS[inputs]()
    with torch.no_grad():
        ref = model.model.visual(torch.from_numpy(pv), grid_thw=torch.from_numpy(grid))

    out = tower(mx.array(pv), mx.array(grid))
    if model_type == "qwen3_vl":
        out, deepstack = out
        assert len(deepstack) == len(ref.deepstack_features) == 2
        for ours, theirs in zip(deepstack, ref.deepstack_features):
            np.testing.assert_allclose(np.array(ours), theirs.numpy(), atol=ATOL, rtol=0)
    expected = ref.pooler_output.numpy()
    assert out.shape == expected.shape == (int(np.prod(grid, axis=1).sum()) // MERGE**2, 64)
    assert np.abs(expected).std() > 0.3  # real variance, not near-zero init
    np.testing.assert_allclose(np.array(out), expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("model_type", list(CONFIGS))
def test_parameter_names_are_the_checkpoint_names(model_type):
    model = build(model_type)
    tower = qwen.TOWERS[model_type](model.config.vision_config.to_dict())
    from mlx.utils import tree_flatten

    ours = {k: v.shape for k, v in tree_flatten(tower.parameters())}
    theirs = {
        k[len("model.visual.") :]: tuple(v.shape)
        for k, v in model.state_dict().items()
        if k.startswith("model.visual.")
    }
    assert {k: tuple(v) for k, v in ours.items()} == theirs


# Tower prefix in the safetensors that transformers 5 writes: qwen2/2.5 are saved under the hub
# names (save_pretrained reverses its load-time renames), qwen3 needs no rename at all.
SAVED_PREFIX = {"qwen2_vl": "visual.", "qwen2_5_vl": "visual.", "qwen3_vl": "model.visual."}


@pytest.mark.parametrize("model_type", list(CONFIGS))
def test_loads_strictly_from_saved_checkpoint(model_type, tmp_path):
    model = build(model_type)
    model.save_pretrained(tmp_path)
    saved = mx.load(str(tmp_path / "model.safetensors"))
    prefix = SAVED_PREFIX[model_type]
    weights = {k[len(prefix) :]: v for k, v in saved.items() if k.startswith(prefix)}
    other = "model.visual." if prefix == "visual." else "visual."
    assert weights and not any(k.startswith(other) for k in saved)
    tower = qwen.TOWERS[model_type](model.config.vision_config.to_dict())
    tower.load_weights(list(tower.sanitize(weights).items()), strict=True)
    ref = model.model.visual.state_dict()
    from mlx.utils import tree_flatten

    for name, value in tree_flatten(tower.parameters()):
        np.testing.assert_array_equal(np.array(value), ref[name].numpy())


def test_sanitize_accepts_mlx_conv_layout():
    model = build("qwen3_vl")
    tower = qwen.TOWERS["qwen3_vl"](model.config.vision_config.to_dict())
    w = mx.array(np.random.default_rng(0).standard_normal((32, 3, 2, 8, 8)).astype(np.float32))
    assert mx.array_equal(
        tower.sanitize({"patch_embed.proj.weight": w})["patch_embed.proj.weight"], w
    )
    channels_last = w.transpose(0, 2, 3, 4, 1)
    back = tower.sanitize({"patch_embed.proj.weight": channels_last})["patch_embed.proj.weight"]
    assert mx.array_equal(back, w)
    with pytest.raises(ValueError):
        tower.sanitize({"patch_embed.proj.weight": w.reshape(32, -1)})


def test_hub_style_config_keys():
    """Hub configs: qwen2_vl writes in_chans and no rope_parameters; the tower takes defaults."""
    hub = {
        "depth": 2,
        "embed_dim": 32,
        "hidden_size": 64,
        "mlp_ratio": 2,
        "num_heads": 2,
        "in_chans": 3,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "spatial_patch_size": 14,
        "temporal_patch_size": 2,
        "model_type": "qwen2_vl",
    }
    tower = qwen.Qwen2VisionTower(hub)
    assert tower.patch_embed.proj.weight.shape == (32, 3, 2, 14, 14)
    assert tower.rope_theta == 10000.0 and tower.head_dim == 16


def test_segment_attention_equals_one_call_per_segment():
    rng = np.random.default_rng(0)
    bounds = [0, 4, 8, 10, 16, 20, 21]  # lengths 4, 4, 2, 6, 4, 1: grouped by length
    q, k, v = (mx.array(rng.standard_normal((2, 21, 8)).astype(np.float32)) for _ in range(3))
    ours = qwen.segment_attention(q, k, v, bounds, 0.3)
    naive = mx.concatenate(
        [
            mx.fast.scaled_dot_product_attention(
                q[None, :, s:e], k[None, :, s:e], v[None, :, s:e], scale=0.3
            )[0]
            for s, e in itertools.pairwise(bounds)
        ],
        axis=1,
    )
    np.testing.assert_allclose(np.array(ours), np.array(naive), atol=1e-6)
