"""YaRN RoPE and the attention-scale terms of DeepSeek-V2-style MLA (deepseek_v2/v3, mistral4).

Three separate multipliers, all as transformers 5 computes them:

* ``YarnRoPE``: the YaRN frequency table (``factor``, ``beta_fast``, ``beta_slow``,
  ``original_max_position_embeddings``, ``truncate``) and its ``attention_factor``, which
  transformers multiplies into cos and sin, so the rotated q and k parts each carry it once
  (``_compute_yarn_parameters`` in ``transformers.modeling_rope_utils``).
* ``mla_softmax_scale``: ``qk_head_dim ** -0.5`` times ``yarn_get_mscale(factor, mscale_all_dim)``
  squared when the rope type is not ``default`` and ``mscale_all_dim`` is set
  (``yarn_apply_mscale`` in the deepseek_v2 / mistral4 modeling files).
* ``llama4_attn_scale``: mistral4's per-position query multiplier
  ``1 + beta * log(1 + floor(pos / original_max_position_embeddings))`` from ABSOLUTE positions
  (``monotonic-position``: ``cache.offset + arange(L)``), so it keeps growing after a trim;
  ``cache.offset`` may be an int or a per-row ``[B]`` array.

Positions for RoPE are absolute too: ``YarnRoPE(x, offset=cache.offset)``. Attention builds
its rope through ``rope.make_rope``, which picks ``YarnRoPE`` for a yarn config.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import mlx.core as mx
from mlx import nn

if TYPE_CHECKING:  # rope.make_rope builds a YarnRoPE: rope.py imports this module
    from mlxc.runtime.model.rope import RopeConfig


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN magnitude correction ``0.1 * mscale * ln(scale) + 1`` (1 when not extending)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def yarn_attention_factor(
    factor: float,
    mscale: float | None = None,
    mscale_all_dim: float | None = None,
    attention_factor: float | None = None,
) -> float:
    """The cos/sin multiplier; an explicit ``attention_factor`` wins, as in transformers."""
    if attention_factor is not None:
        return float(attention_factor)
    if mscale and mscale_all_dim:
        return yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim)
    return yarn_get_mscale(factor)


def yarn_inv_freq(
    dims: int,
    base: float,
    factor: float,
    original_max_position_embeddings: int,
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
    truncate: bool = True,
) -> mx.array:
    """Inverse frequencies ``[dims // 2]``: interpolated (/factor) for long wavelengths,
    extrapolated (kept) for short ones, linearly ramped between the beta_fast/beta_slow dims."""

    def correction_dim(rotations: float) -> float:
        # the dimension whose wavelength fits `rotations` turns into the original context
        return (dims * math.log(original_max_position_embeddings / (rotations * 2 * math.pi))) / (
            2 * math.log(base)
        )

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dims - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = mx.clip((mx.arange(dims // 2, dtype=mx.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp  # 1: keep the original frequency
    pos_freqs = base ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims)
    return (1 / (factor * pos_freqs)) * (1 - extrapolation) + (1 / pos_freqs) * extrapolation


class YarnRoPE(nn.Module):
    """``mx.fast.rope`` with the YaRN table over the first ``dims`` features of ``x``.

    ``traditional=True`` rotates interleaved pairs (x0, x1), (x2, x3)...: DeepSeek's complex
    form exactly, and transformers' ``rope_interleave=True`` up to a permutation of the output
    features that q and k share (transformers writes the even results then the odd ones), so
    q.k, hence attention, is identical. ``traditional=False`` is rotate-half.
    """

    def __init__(
        self,
        dims: int,
        *,
        base: float,
        factor: float,
        original_max_position_embeddings: int,
        beta_fast: float = 32.0,
        beta_slow: float = 1.0,
        mscale: float | None = None,
        mscale_all_dim: float | None = None,
        attention_factor: float | None = None,
        truncate: bool = True,
        traditional: bool = True,
    ) -> None:
        super().__init__()
        self.dims, self.traditional = dims, traditional
        inv_freq = yarn_inv_freq(
            dims, base, factor, original_max_position_embeddings, beta_fast, beta_slow, truncate
        )
        self._periods = 1.0 / inv_freq  # mx.fast.rope wants periods: angle = position / period
        mx.eval(self._periods)  # a lazy array cannot be evaluated on another thread
        self.mscale = yarn_attention_factor(factor, mscale, mscale_all_dim, attention_factor)

    @classmethod
    def from_config(cls, dims: int, cfg: RopeConfig, traditional: bool = True) -> YarnRoPE:
        """From a ``RopeConfig`` of kind yarn (``rope_scaling`` or ``rope_parameters``)."""
        p = cfg.params
        if "original_max_position_embeddings" not in p:
            raise ValueError("yarn rope needs original_max_position_embeddings")
        return cls(
            dims,
            base=cfg.theta,
            factor=cfg.factor,
            original_max_position_embeddings=p["original_max_position_embeddings"],
            beta_fast=p.get("beta_fast") or 32.0,  # `or`: transformers treats None/0 as unset
            beta_slow=p.get("beta_slow") or 1.0,
            mscale=p.get("mscale"),
            mscale_all_dim=p.get("mscale_all_dim"),
            attention_factor=p.get("attention_factor"),
            truncate=p.get("truncate", True),
            traditional=traditional,
        )

    def __call__(self, x: mx.array, offset: int | mx.array) -> mx.array:
        """``x [B, H, L, D]`` at absolute positions ``offset + arange(L)``."""
        if self.mscale != 1.0:
            # rope is linear, so scaling before equals transformers' scaled cos/sin
            if x.shape[-1] == self.dims:
                x = x * self.mscale
            else:
                x = mx.concatenate([x[..., : self.dims] * self.mscale, x[..., self.dims :]], -1)
        return mx.fast.rope(
            x,
            self.dims,
            traditional=self.traditional,
            base=None,
            scale=1.0,
            offset=offset,
            freqs=self._periods,
        )


def yarn_softmax_scale(qk_head_dim: int, factor: float, mscale_all_dim: float | None) -> float:
    """``qk_head_dim ** -0.5``, times ``yarn_get_mscale(factor, mscale_all_dim) ** 2`` if set."""
    scale = qk_head_dim**-0.5
    if mscale_all_dim:
        scale *= yarn_get_mscale(factor, mscale_all_dim) ** 2
    return scale


def mla_softmax_scale(qk_head_dim: int, cfg: RopeConfig) -> float:
    """transformers' ``yarn_apply_mscale``: any non-default rope type with ``mscale_all_dim``."""
    if cfg.kind == "default":
        return qk_head_dim**-0.5
    return yarn_softmax_scale(qk_head_dim, cfg.factor, cfg.params.get("mscale_all_dim"))


def llama4_attn_scale(
    offset: int | mx.array,
    L: int,
    beta: float | None,
    original_max_position_embeddings: int,
    dtype: mx.Dtype = mx.float32,
) -> mx.array | None:
    """Query multiplier for the ``L`` positions after ``offset``, or None when ``beta`` is
    None or 0 (no scaling: the caller skips the multiply).

    ``offset`` is the ABSOLUTE position of the first query (``cache.offset``): an int, or an
    ``mx.array`` ``[B]`` of per-row offsets (batched decode). The result broadcasts against
    queries ``[B, H, L, D]``: shape ``[1, 1, L, 1]`` for an int offset, ``[B, 1, L, 1]`` for an
    array. Computed in float32 and returned as ``dtype`` (pass the hidden states' dtype, which the
    queries share: a float32 scale would promote bf16 queries, and all after them, to float32).
    """
    if not beta:
        return None
    positions = mx.arange(L, dtype=mx.float32)
    if isinstance(offset, mx.array):
        positions = offset.astype(mx.float32).reshape(-1, 1) + positions  # [B, L]
    else:
        positions = (positions + offset)[None]  # [1, L]
    scale = 1 + beta * mx.log(1 + mx.floor(positions / original_max_position_embeddings))
    return scale[:, None, :, None].astype(dtype)
