"""Building blocks that generated models share (the model-specific parts are generated)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from mlxc.runtime import masks

ACTIVATIONS = {"silu": nn.silu, "gelu": nn.gelu, "gelu_approx": nn.gelu_approx, "relu": nn.relu}


def attend(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    *,
    scale: float,
    mask: mx.array | str | None,
) -> mx.array:
    """Scaled dot-product attention (GQA-aware) that refuses a mask not sized to the keys."""
    masks.check(mask, queries.shape[-2], keys.shape[-2])
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)


class SwiGLU(nn.Module):
    """``down(act(gate(x)) * up(x))`` with Hugging Face parameter names."""

    def __init__(self, dim: int, hidden: int, bias: bool = False, act: str = "silu") -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=bias)
        self.up_proj = nn.Linear(dim, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, dim, bias=bias)
        self.act = ACTIVATIONS[act]

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class LinearAttention(nn.Module):
    """An attention sublayer replaced by one linear map (nemotron_nas); keeps no cache."""

    def __init__(self, dim: int, bias: bool = False) -> None:
        super().__init__()
        self.linear_attn = nn.Linear(dim, dim, bias=bias)

    def __call__(self, x: mx.array, cache: None = None) -> mx.array:
        # Same call shape as attention so decoder layers need no special case; no keys kept.
        return self.linear_attn(x)


class LinearMLP(nn.Module):
    """An MLP sublayer replaced by one linear map (nemotron_nas)."""

    def __init__(self, dim: int, bias: bool = False) -> None:
        super().__init__()
        self.linear_mlp = nn.Linear(dim, dim, bias=bias)

    def __call__(self, x: mx.array) -> mx.array:
        return self.linear_mlp(x)
