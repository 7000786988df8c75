"""Rotary position embeddings. Positions come from ``cache.offset`` (``monotonic-position``).

``RopeConfig.from_config`` reads both config forms: transformers-4 ``rope_theta`` +
``rope_scaling`` and transformers-5 ``rope_parameters``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx import nn

from mlxc.runtime.model.config import ConfigError, lookup
from mlxc.runtime.model.yarn import YarnRoPE


@dataclass(frozen=True)
class RopeConfig:
    kind: str = "default"  # default | linear | llama3 | yarn | longrope | mrope
    theta: float = 10000.0
    factor: float = 1.0
    params: dict[str, Any] = field(default_factory=dict)  # the rest of the scaling dict
    max_position_embeddings: int | None = None

    @classmethod
    def from_config(
        cls,
        config: dict,
        path: str | tuple[str, ...] = "",
        layer_type: str | None = None,
        theta_from: str | None = None,
        default_theta: float = 10000.0,
    ) -> RopeConfig:
        """Read RoPE settings from the (sub-)config at dotted ``path``, or from the first of
        several paths whose sub-config holds RoPE keys ("" is the top level).

        Models whose layer types rotate differently (gemma3) name ``layer_type``, the entry of
        a transformers-5 ``rope_parameters`` keyed by layer type, and ``theta_from``, the key
        that the older form keeps that rope's theta under (it then takes no ``rope_scaling``).
        ``default_theta``: the theta of a config that names none (the model's config class
        default: Gemma 3's hub configs leave its 1e6 out).
        """
        paths = path if isinstance(path, tuple) else (path,)
        subs = [config if not p else lookup(config, p, {}) for p in paths]
        keys = ("rope_parameters", "rope_scaling", "rope_theta")
        if theta_from is not None:
            keys += (theta_from,)
        sub = next((s for s in subs if any(s.get(k) is not None for k in keys)), subs[0])
        per_type = sub.get("rope_parameters")
        if layer_type is not None and isinstance((per_type or {}).get(layer_type), dict):
            scaling = per_type[layer_type]
            theta = scaling.get("rope_theta", default_theta)
        elif theta_from is not None:
            scaling, theta = {}, sub.get(theta_from, default_theta)
        else:
            scaling = sub.get("rope_parameters") or sub.get("rope_scaling") or {}
            theta = scaling.get("rope_theta", sub.get("rope_theta", default_theta))
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind == "default" and "mrope_section" in scaling:
            kind = "mrope"
        if kind not in ("default", "linear", "llama3", "yarn", "longrope", "mrope"):
            raise ConfigError(f"unsupported rope_type '{kind}'")
        rest = {k: v for k, v in scaling.items() if k not in ("rope_theta", "rope_type", "type")}
        if kind == "longrope":
            # transformers: the original context may sit at the top level (Phi-3), and a missing
            # factor is the ratio of the two context lengths.
            original = rest.get("original_max_position_embeddings")
            original = original or sub.get("original_max_position_embeddings")
            if not original:
                raise ConfigError("longrope needs original_max_position_embeddings")
            rest["original_max_position_embeddings"] = original
            if not rest.get("factor") and sub.get("max_position_embeddings"):
                rest["factor"] = sub["max_position_embeddings"] / original
        return cls(
            kind=kind,
            theta=float(theta),
            factor=float(rest.pop("factor", 1.0) or 1.0),
            params=rest,
            max_position_embeddings=sub.get("max_position_embeddings"),
        )


def llama3_periods(dims: int, cfg: RopeConfig) -> mx.array:
    """Llama-3.1 frequency smoothing: long wavelengths divided by ``factor``, short kept."""
    p = cfg.params
    low, high = p.get("low_freq_factor", 1.0), p.get("high_freq_factor", 4.0)
    old_len = p.get("original_max_position_embeddings", 8192)
    inv_freq = 1.0 / cfg.theta ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims)
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * inv_freq / cfg.factor + smooth * inv_freq
    scaled = mx.where(wavelen > old_len / low, inv_freq / cfg.factor, inv_freq)
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return 1.0 / mx.where(medium, smoothed, scaled)


class RoPE(nn.Module):
    """``mx.fast.rope`` over the first ``dims`` features, at absolute position ``offset``."""

    def __init__(self, dims: int, cfg: RopeConfig, traditional: bool = False) -> None:
        super().__init__()
        self.dims, self.traditional = dims, traditional
        self.base: float | None = cfg.theta
        self.scale = 1.0
        self._periods = None
        if cfg.kind == "linear":
            self.scale = 1.0 / cfg.factor
        elif cfg.kind == "llama3":
            self.base, self._periods = None, llama3_periods(dims, cfg)
            # Evaluated now: a lazy array cannot be evaluated on another thread (the server's).
            mx.eval(self._periods)
        elif cfg.kind != "default":
            raise ConfigError(f"rope kind '{cfg.kind}' is not supported for this attention")

    def __call__(self, x: mx.array, offset: int) -> mx.array:
        return mx.fast.rope(
            x,
            self.dims,
            traditional=self.traditional,
            base=self.base,
            scale=self.scale,
            offset=offset,
            freqs=self._periods,
        )


class LongRoPE(nn.Module):
    """LongRoPE (``longrope``: MiniCPM3, Phi-3): each frequency divided by its factor, from
    ``short_factor`` while the forward's positions fit ``original_max_position_embeddings`` and
    from ``long_factor`` once its last position passes it (transformers' rule: the whole chunk
    switches; each row of a decode batch by its own position). cos and sin carry
    ``attention_factor``, by default ``sqrt(1 + ln(factor) / ln(original))``."""

    def __init__(self, dims: int, cfg: RopeConfig, traditional: bool = False) -> None:
        super().__init__()
        self.dims, self.traditional = dims, traditional
        p = cfg.params
        self.original = p["original_max_position_embeddings"]
        scale = p.get("attention_factor")
        if scale is None:
            f = cfg.factor
            scale = 1.0 if f <= 1 else math.sqrt(1 + math.log(f) / math.log(self.original))
        self.mscale = float(scale)
        base = cfg.theta ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims)
        for name in ("short_factor", "long_factor"):
            if len(p.get(name) or ()) != dims // 2:
                raise ConfigError(f"longrope {name} needs {dims // 2} values (rope dims / 2)")
        # mx.fast.rope takes periods (1 / frequency): the factor times the default period.
        self._short = mx.array(p["short_factor"], mx.float32) * base
        self._long = mx.array(p["long_factor"], mx.float32) * base
        mx.eval(self._short, self._long)  # a lazy array cannot be evaluated on another thread

    def _rope(self, x: mx.array, offset: int | mx.array, periods: mx.array) -> mx.array:
        return mx.fast.rope(
            x, self.dims, traditional=self.traditional, base=None, scale=1.0, offset=offset,
            freqs=periods,
        )  # fmt: skip

    def __call__(self, x: mx.array, offset: int | mx.array) -> mx.array:
        """``x [B, H, L, D]`` at absolute positions ``offset + arange(L)``."""
        if self.mscale != 1.0:  # rope is linear: scaling before equals transformers' cos/sin
            if x.shape[-1] == self.dims:
                x = x * self.mscale
            else:
                x = mx.concatenate([x[..., : self.dims] * self.mscale, x[..., self.dims :]], -1)
        L = x.shape[-2]
        if not isinstance(offset, mx.array):  # one sequence's offset, known on the host
            return self._rope(x, offset, self._long if offset + L > self.original else self._short)
        long = offset + L > self.original
        if offset.size == 1:  # one sequence's offset as an array (a compiled step): one table
            return self._rope(x, offset, mx.where(long, self._long, self._short))
        # a decode batch: [B] offsets, each row its own table
        long = long.reshape(-1, 1, 1, 1)
        return mx.where(long, self._rope(x, offset, self._long), self._rope(x, offset, self._short))


def make_rope(dims: int, cfg: RopeConfig, traditional: bool = False) -> RoPE | YarnRoPE | LongRoPE:
    """The rope of one attention layer, any kind: ``YarnRoPE`` for yarn, ``LongRoPE`` for
    longrope, else ``RoPE``."""
    if cfg.kind == "yarn":
        return YarnRoPE.from_config(dims, cfg, traditional)
    if cfg.kind == "longrope":
        return LongRoPE(dims, cfg, traditional=traditional)
    return RoPE(dims, cfg, traditional=traditional)
