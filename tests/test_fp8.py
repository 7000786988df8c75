"""FP8 block-scaled checkpoints dequantise on load (mistral4 with FP8 linears and experts)."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from test_mistral4 import make_checkpoint, reference

import mlxc
from mlxc.runtime.checkpoint import fp8

BLOCK = 8


def to_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-scaled E4M3 as FP8 checkpoints store it: bytes and per-tile ``scale_inv``."""
    *lead, m, n = w.shape
    tm, tn = -(-m // BLOCK), -(-n // BLOCK)
    padded = torch.zeros(*lead, tm * BLOCK, tn * BLOCK)
    padded[..., :m, :n] = w
    tiles = padded.reshape(*lead, tm, BLOCK, tn, BLOCK)
    scale = tiles.abs().amax(dim=(-3, -1)) / 448.0 + 1e-12
    q = (tiles / scale[..., :, None, :, None]).reshape(*lead, tm * BLOCK, tn * BLOCK)
    return q[..., :m, :n].to(torch.float8_e4m3fn), scale


def from_fp8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    s = scale.repeat_interleave(BLOCK, -2).repeat_interleave(BLOCK, -1)
    return q.float() * s[..., : q.shape[-2], : q.shape[-1]]


def test_dequantize_tensor_tiles_and_broadcast_scales():
    w = torch.randn(2, 20, 12)
    q, scale = to_fp8(w)
    q_bytes = mx.array(q.view(torch.uint8).numpy())
    got = fp8.dequantize_tensor(q_bytes, mx.array(scale.numpy()), (BLOCK, BLOCK), mx.float32)
    np.testing.assert_allclose(np.array(got), from_fp8(q, scale).numpy(), rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match="does not tile"):
        fp8.dequantize_tensor(q_bytes, mx.array(scale.numpy()), (4, 4))
    per_expert = fp8.dequantize_tensor(
        q_bytes, mx.array([[[2.0]], [[3.0]]]), (BLOCK, BLOCK), dtype=mx.float32
    )
    np.testing.assert_allclose(np.array(per_expert[1]), q[1].float().numpy() * 3.0)
    with pytest.raises(ValueError, match="no weight"):
        fp8.dequantize({"a_scale_inv": mx.ones((1,))})


def test_fp8_checkpoint_matches_transformers_on_the_dequantised_weights(tmp_path):
    hf = make_checkpoint(tmp_path / "src", q_lora_rank=32, seed=5)
    weights = load_file(str(tmp_path / "src" / "model.safetensors"))
    stored, dequantised = {}, {}
    for name, w in weights.items():
        is_linear = w.ndim >= 2 and "norm" not in name and "embed" not in name
        if is_linear and "lm_head" not in name and "mlp.gate." not in name:
            q, scale = to_fp8(w)
            stored[name], stored[name + "_scale_inv"] = q, scale
            dequantised[name] = from_fp8(q, scale)
        else:
            stored[name] = w
    out = tmp_path / "fp8"
    out.mkdir()
    save_file(stored, str(out / "model.safetensors"))
    config = json.loads((tmp_path / "src" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [BLOCK, BLOCK]}
    (out / "config.json").write_text(json.dumps(config))

    # Only the linears are replaced: the rest of hf's weights (norms, embeddings) stay.
    _, unexpected = hf.load_state_dict(dequantised, strict=False)
    assert not unexpected and len(dequantised) > 10
    ids = np.random.default_rng(0).integers(0, 128, size=(1, 24))
    model = mlxc.load_model(out, dtype="float32")  # dequantised straight to float32
    got = np.array(model(mx.array(ids)))
    np.testing.assert_allclose(got, reference(hf, ids), atol=1e-4, rtol=0)
