"""MLA's decode attention over the latents, and its ``kv_b_proj`` from mlx-lm's split layout
(mlx-community DeepSeek-V3, Kimi-K2, GLM-4.7-Flash conversions).

mlx-lm stores kv_b_proj split per head: ``self_attn.embed_q.weight [H, kv_lora_rank, nope]``
(the key half, transposed) and ``self_attn.unembed_out.weight [H, v_head_dim, kv_lora_rank]``
(the value half), each quantised on its own (affine, along its last axis) in a quantised
checkpoint. :func:`join_kv_b` rebuilds the model's ``kv_b_proj.weight [H * (nope + v),
kv_lora_rank]``, dequantised: kv_b_proj stays float (the loader quantises only the layers whose
``.scales`` the weights hold), as decode reads it anyway (LatentAttention.kv_b_halves splits
and dequantises it once). :func:`split_kv_b` is that split: the two halves decode multiplies by,
and :func:`absorbed_attention` decode's attention with them.
"""

from __future__ import annotations

import functools
import re

import mlx.core as mx

from mlxc.runtime.model import cuda_attention, layers, masks
from mlxc.runtime.model.cache import dense
from mlxc.runtime.model.weights import packed_settings

_SPLIT = re.compile(r"^(.*\.self_attn)\.embed_q\.weight$")


def join_kv_b(
    weights: dict[str, mx.array], *, qk_nope_head_dim: int, kv_lora_rank: int
) -> dict[str, mx.array]:
    """``weights`` with every split ``embed_q`` / ``unembed_out`` pair joined into
    ``kv_b_proj.weight``; other tensors pass through. Pure: returns a new dict."""
    prefixes = [m[1] for name in weights if (m := _SPLIT.match(name))]
    if not prefixes:
        return weights
    out = dict(weights)
    for p in prefixes:
        w_k = _dense(out, f"{p}.embed_q", qk_nope_head_dim)  # [H, kv_lora_rank, nope]
        w_v = _dense(out, f"{p}.unembed_out", kv_lora_rank)  # [H, v_head_dim, kv_lora_rank]
        kv = mx.concatenate([w_k.swapaxes(-1, -2), w_v.astype(w_k.dtype)], axis=1)
        out[f"{p}.kv_b_proj.weight"] = kv.reshape(-1, kv.shape[-1])
    return out


def _dense(weights: dict[str, mx.array], prefix: str, in_dims: int) -> mx.array:
    """The float weight at ``prefix``, popped (with its scales and biases, dequantised)."""
    w = weights.pop(f"{prefix}.weight")
    scales = weights.pop(f"{prefix}.scales", None)
    if scales is None:
        return w
    biases = weights.pop(f"{prefix}.biases", None)
    if biases is None:
        raise ValueError(f"{prefix}: only an affine-quantised (scales and biases) split is read")
    bits, group_size, _ = packed_settings(w, scales, in_dims)
    f32 = mx.float32
    w = mx.dequantize(w, scales.astype(f32), biases.astype(f32), group_size=group_size, bits=bits)
    # Exact in float32. Kept so on the CPU, where the loader computes in float32 (its
    # _target_dtype): a bf16 copy would round every weight that mlx-lm's quantised product
    # reads exactly, and on random MoE weights that moved whole-model logits by 1-30% (routing
    # flips). Elsewhere in the checkpoint's float dtype, the one the model computes in.
    return w if mx.default_device() == mx.cpu else w.astype(scales.dtype)


def split_kv_b(
    weight: mx.array, *, n_heads: int, qk_nope_head_dim: int, kv_lora_rank: int
) -> tuple[mx.array, mx.array]:
    """``kv_b_proj.weight [H * (nope + v), kv_lora_rank]`` (float) as decode's two per-head
    products take it: ``q_nope @ w_k`` with ``w_k [H, nope, kv_lora_rank]`` and ``out @ w_v_t``
    with ``w_v_t [H, kv_lora_rank, v_head_dim]``, each one row per head.

    On CUDA both are transposed views of contiguous ``[H, out, in]`` arrays: MLX 0.32 runs a
    product of one row on its matrix-vector kernel only when the weight is such a view
    (``can_use_gemv``, ``mlx/backend/cuda/gemms/gemv.cu``) and hands any other layout to
    cuBLAS, slower for one row (mlx-lm's MLA stores its halves that way). Elsewhere both are
    contiguous as split (the CPU's OpenBLAS takes either layout, and neither was faster across
    the MLA models' shapes: 0.6-2x either way in float32)."""
    w_kv = weight.reshape(n_heads, -1, kv_lora_rank)
    w_k, w_v = mx.split(w_kv, [qk_nope_head_dim], axis=1)  # [H, nope, c], [H, v, c]
    if _transposed_weights():
        w_k_t = mx.contiguous(w_k.swapaxes(-1, -2))  # [H, c, nope]
        return w_k_t.swapaxes(-1, -2), mx.contiguous(w_v).swapaxes(-1, -2)
    return mx.contiguous(w_k), mx.contiguous(w_v.swapaxes(-1, -2))


def _transposed_weights() -> bool:
    """Whether decode's per-head weights are kept as transposed views (see split_kv_b)."""
    return cuda_attention.available()


def absorbed_attention(
    q_nope: mx.array,
    q_pe: mx.array,
    latents: mx.array,
    k_pe: mx.array,
    w_k: mx.array,
    w_v_t: mx.array,
    *,
    scale: float,
    mask: mx.array | None,
) -> mx.array:
    """Decode's attention ``[B, H, 1, v_head_dim]``, one query a head, over the live latents
    ``[B, 1, T, kv_lora_rank]`` (keys and values alike) and the rope keys ``[B, 1, T, rope]``:
    kv_b_proj's key half ``w_k`` moves onto the query, ``q . (W_k c) == (q W_k) . c``, a score is
    that plus ``q_pe . k_pe``, and only the output is expanded (``w_v_t``). ``mask``: None or
    ``[..., 1, T]``. Under ``--kv-bits`` the latents and rope keys come as the cache's
    ``QuantizedKV``: the kernel reads them packed, the other forms dequantise them first.

    On CUDA it is one kernel (``cuda_attention.latent_attention``, s41) for a step of little
    work (a single stream's, a small batch's: ``latent_applies``): MLX 0.32.4's fused attention
    has no kernel for a head of kv_lora_rank (512) and falls back to five ops, and even composed
    by hand (``composed_attention``, which larger steps take, and widths the kernel's loads do
    not divide) the scores are three cuBLAS products whose shapes move on with the key count
    every step, a sum and a softmax. Composed, the two halves of a score are added and scaled
    in one compiled kernel, with the query heads as the rows of the one latent head (an H100,
    16 layers of glm4_moe_lite's widths: 1.07 against 1.35 ms a step for MLX's fallback,
    ``docs/performance.md``). Elsewhere ``layers.attend`` takes them, the rope half as an
    additive mask (on the CPU its composed form, with the polynomial exp)."""
    masks.check(mask, 1, latents.shape[-2])
    q_lat = q_nope @ w_k  # [B, H, 1, kv_lora_rank]
    if cuda_attention.latent_applies(q_lat, q_pe, latents, k_pe):
        out = cuda_attention.latent_attention(q_lat, q_pe, latents, k_pe, scale=scale, mask=mask)
    elif composes_scores():  # --kv-bits: the latents expanded for the matmuls (dense)
        out = composed_attention(q_lat, q_pe, dense(latents), dense(k_pe), scale=scale, mask=mask)
    else:
        latents, k_pe = dense(latents), dense(k_pe)
        rope_scores = (q_pe * scale) @ k_pe.swapaxes(-1, -2)
        if isinstance(mask, mx.array):
            rope_scores = mx.where(mask, rope_scores, mx.finfo(rope_scores.dtype).min)
        out = layers.attend(q_lat, latents, latents, scale=scale, mask=rope_scores)
    return out @ w_v_t


def composed_attention(
    q_lat: mx.array,
    q_pe: mx.array,
    latents: mx.array,
    k_pe: mx.array,
    *,
    scale: float,
    mask: mx.array | None,
) -> mx.array:
    """``cuda_attention.latent_attention``'s result (``[B, H, 1, kv_lora_rank]``) from MLX's
    ops: the two halves' scores as products with the heads as the rows of the one latent
    head, added and scaled in one compiled kernel, a softmax, the weighted latents."""
    B, H = q_lat.shape[:2]
    rows = (B, 1, H, -1)  # the heads as rows of the one latent head: no broadcast of the latents
    latent_scores = q_lat.reshape(rows) @ latents.swapaxes(-1, -2)
    rope_scores = q_pe.reshape(rows) @ k_pe.swapaxes(-1, -2)
    if isinstance(mask, mx.array):
        scores = _masked_scores(latent_scores, rope_scores, mask, scale)
    else:
        scores = _scores(latent_scores, rope_scores, scale)
    weights = mx.softmax(scores, axis=-1, precise=True)
    return (weights @ latents).reshape(B, H, 1, -1)


def composes_scores() -> bool:
    """Whether ``absorbed_attention`` composes its scores where the kernel does not apply (see
    there): on CUDA."""
    return cuda_attention.available()


@functools.partial(mx.compile, shapeless=True)
def _scores(latent_scores: mx.array, rope_scores: mx.array, scale: float) -> mx.array:
    return (latent_scores + rope_scores) * scale


@functools.partial(mx.compile, shapeless=True)
def _masked_scores(
    latent_scores: mx.array, rope_scores: mx.array, mask: mx.array, scale: float
) -> mx.array:
    scores = _scores(latent_scores, rope_scores, scale)  # inlined into this kernel
    return mx.where(mask, scores, mx.finfo(scores.dtype).min)
