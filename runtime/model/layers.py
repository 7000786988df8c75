"""Building blocks that generated models share (the model-specific parts are generated)."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
from mlx import nn

from mlxc.runtime.model import masks


def relu2(x: mx.array) -> mx.array:
    """Squared ReLU (nemotron_h's MLP)."""
    return mx.square(nn.relu(x))


ACTIVATIONS = {
    "silu": nn.silu,
    "gelu": nn.gelu,
    "gelu_approx": nn.gelu_approx,
    "relu": nn.relu,
    "relu2": relu2,
}


@dataclass
class AttentionInputs:
    """What every attention layer of one forward reads, resolved once from the cache by the
    generated ``TextModel`` (as mlx-lm builds its mask once per forward); layers read no cache
    field for them.

    - ``masks`` (``live-window``): one mask per sliding window (key None: no window), sized to
      the live keys once the chunk is appended. ``attend`` checks it against the keys of each
      layer's cache.
    - ``offset`` (``monotonic-position``): absolute position of the chunk's first token, an int
      or a per-row ``[B]`` array (a decode batch). RoPE starts there.
    - ``rope``: MRoPE cos/sin tables; ``attn_scale``: the Llama-4 query multiplier. Both come
      from monotonic positions; None where the model has neither.
    """

    masks: dict[int | None, mx.array | str | None]
    offset: int | mx.array | None = None
    rope: tuple[mx.array, mx.array] | None = None
    attn_scale: mx.array | None = None


def attend(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    *,
    scale: float,
    mask: mx.array | str | None,
    sinks: mx.array | None = None,
) -> mx.array:
    """Scaled dot-product attention (GQA-aware) that refuses a mask not sized to the keys.

    ``sinks`` ``[n_heads]``: learned logits of a virtual key that takes softmax mass and adds
    nothing (gpt-oss).
    """
    masks.check(mask, queries.shape[-2], keys.shape[-2])
    return mx.fast.scaled_dot_product_attention(
        queries, keys, values, scale=scale, mask=mask, sinks=sinks
    )


def softcap(x: mx.array, cap: float | None) -> mx.array:
    """``cap * tanh(x / cap)``: logits bounded smoothly by ``cap`` (None: unchanged)."""
    return x if cap is None else mx.tanh(x / cap) * cap


class RMSNorm(nn.Module):
    """RMSNorm scaled by ``1 + weight``: Gemma stores its norm weights around zero."""

    def __init__(self, dims: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = mx.zeros((dims,))
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        return mx.fast.rms_norm(x, 1.0 + self.weight, self.eps)


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


class FusedSwiGLU(nn.Module):
    """``output_linear(act(gate) * up)``, gate and up the two halves of ``input_linear``'s
    outputs (granite's shared MLP, named as transformers names it)."""

    def __init__(self, dim: int, hidden: int, bias: bool = False, act: str = "silu") -> None:
        super().__init__()
        self.input_linear = nn.Linear(dim, 2 * hidden, bias=bias)
        self.output_linear = nn.Linear(hidden, dim, bias=bias)
        self.act = ACTIVATIONS[act]

    def __call__(self, x: mx.array) -> mx.array:
        gate, up = mx.split(self.input_linear(x), 2, axis=-1)
        return self.output_linear(self.act(gate) * up)


class MLP(nn.Module):
    """Non-gated ``down(act(up(x)))`` with Hugging Face parameter names."""

    def __init__(self, dim: int, hidden: int, bias: bool = False, act: str = "relu2") -> None:
        super().__init__()
        self.up_proj = nn.Linear(dim, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, dim, bias=bias)
        self.act = ACTIVATIONS[act]

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(self.act(self.up_proj(x)))


class LinearAttention(nn.Module):
    """An attention sublayer replaced by one linear map (nemotron_nas); keeps no cache."""

    def __init__(self, dim: int, bias: bool = False) -> None:
        super().__init__()
        self.linear_attn = nn.Linear(dim, dim, bias=bias)

    def __call__(
        self, x: mx.array, cache: None = None, inputs: AttentionInputs | None = None
    ) -> mx.array:
        # Same call shape as attention so decoder layers need no special case; no keys kept.
        return self.linear_attn(x)


class LinearMLP(nn.Module):
    """An MLP sublayer replaced by one linear map (nemotron_nas)."""

    def __init__(self, dim: int, bias: bool = False) -> None:
        super().__init__()
        self.linear_mlp = nn.Linear(dim, dim, bias=bias)

    def __call__(self, x: mx.array) -> mx.array:
        return self.linear_mlp(x)
