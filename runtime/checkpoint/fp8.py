"""FP8 (E4M3) block-scaled checkpoints, dequantised on load.

Hugging Face FP8 checkpoints (DeepSeek-V3, Mistral-Small-4, ...) store a weight ``W`` as FP8
bytes plus ``W_scale_inv``: one scale per ``[block_m, block_n]`` tile (``weight_block_size``
in ``quantization_config``, 128 x 128 by default), or a per-tensor / per-expert scale that
broadcasts. The real weight is ``fp8(W) * scale`` tile by tile. MLX reads FP8 tensors as uint8.
"""

from __future__ import annotations

import math

import mlx.core as mx

SCALE_SUFFIX = "_scale_inv"
_UNUSED = ("activation_scale", "input_scale")
BLOCK = (128, 128)  # static activation scales: not needed to run


def _broadcasts(scale: tuple[int, ...], weight: tuple[int, ...]) -> bool:
    if len(scale) > len(weight):
        return False
    return all(s in (1, w) for s, w in zip(scale[::-1], weight[::-1]))


def dequantize_tensor(
    weight: mx.array, scale_inv: mx.array, block: tuple[int, int] = BLOCK, dtype=mx.bfloat16
) -> mx.array:
    """``fp8(weight) * scale_inv`` with ``block``-sized tile scales expanded to the weight."""
    w = mx.from_fp8(weight, dtype=mx.float32)
    if _broadcasts(tuple(scale_inv.shape), tuple(w.shape)):
        return (w * scale_inv).astype(dtype)
    m, n = w.shape[-2:]
    bm, bn = block
    if scale_inv.shape[-2:] != (math.ceil(m / bm), math.ceil(n / bn)):
        raise ValueError(
            f"scale {tuple(scale_inv.shape)} does not tile a {tuple(w.shape)} weight in "
            f"{bm}x{bn} blocks (quantization_config.weight_block_size)"
        )
    scale = mx.repeat(mx.repeat(scale_inv, bm, axis=-2), bn, axis=-1)[..., :m, :n]
    return (w * scale.astype(mx.float32)).astype(dtype)


def dequantize(
    weights: dict[str, mx.array], block: tuple[int, int] = BLOCK, dtype=mx.bfloat16
) -> dict[str, mx.array]:
    """Every ``X`` with an ``X_scale_inv`` companion dequantised; scale tensors removed."""
    scales = [k for k in weights if k.endswith(SCALE_SUFFIX)]
    if not scales:
        return weights
    out = {k: v for k, v in weights.items() if not k.endswith((SCALE_SUFFIX, *_UNUSED))}
    for key in scales:
        base = key[: -len(SCALE_SUFFIX)]
        if base not in weights:
            raise ValueError(f"{key} has no weight {base} to scale")
        if weights[base].dtype != mx.uint8:
            raise ValueError(f"{base} has a scale but is {weights[base].dtype}, not FP8 bytes")
        try:
            out[base] = dequantize_tensor(weights[base], weights[key], block, dtype)
        except ValueError as e:
            raise ValueError(f"{base}: {e}") from None
    return out
