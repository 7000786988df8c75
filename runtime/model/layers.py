"""Building blocks that generated models share (the model-specific parts are generated)."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
from mlx import nn

from mlxc.runtime.model import masks
from mlxc.runtime.model.cache import QuantizedKV


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
    if isinstance(keys, QuantizedKV):
        if queries.shape[-2] <= QUANTIZED_MATMUL_QUERIES and packed_attention():
            return quantized_attention(queries, keys, values, scale=scale, mask=mask, sinks=sinks)
        # A prefill chunk: its L x T scores would be materialised; dequantising the live keys
        # once lets it take the fused kernel (same values: dequantize is what the matmul reads).
        keys, values = keys.dequantize(), values.dequantize()
    return mx.fast.scaled_dot_product_attention(
        queries, keys, values, scale=scale, mask=mask, sinks=sinks
    )


# Up to this many queries (decode steps, short continuations) attention reads the quantised
# keys and values directly; longer chunks dequantise them for the fused kernel (``attend``).
QUANTIZED_MATMUL_QUERIES = 8


def packed_attention() -> bool:
    """Whether ``attend`` reads quantised keys packed (``quantized_attention``) on this device:
    on the CPU and Metal. MLX 0.32.4's CUDA ``quantized_matmul`` gave wrong scores for batched
    64-wide quantised keys (max error ~30 on N(0, 1) inputs, or NaN; H200, 2026-12-01), and
    one stream's packed step was slower than the fused kernel on float keys there (172 against
    92 us at 2048 keys), so CUDA dequantises: the resident KV stays quantised."""
    return mx.default_device() == mx.cpu or mx.metal.is_available()


def quantized_attention(
    queries: mx.array,
    keys: QuantizedKV,
    values: QuantizedKV,
    *,
    scale: float,
    mask: mx.array | str | None,
    sinks: mx.array | None = None,
) -> mx.array:
    """``attend`` on quantised keys and values (``--kv-bits``): ``softmax(q k^T) v`` with both
    products through ``mx.quantized_matmul``, so the keys are read packed, never expanded.

    GQA: the ``n_heads / n_kv_heads`` query heads of one KV head attend as ``rep * L`` rows of
    that head (as MLA's decode does), so each product is one plain batched matmul per KV head,
    nothing broadcast; the masks see the scores as ``[B, kv, rep, L, T]``.
    """
    B, n_heads, L, _ = queries.shape
    n_kv = keys.shape[1]
    rep = n_heads // n_kv
    q = keys.quant
    kw = {"group_size": q.group_size, "bits": q.bits}
    rows = (queries * scale).reshape(B, n_kv, rep * L, -1)
    scores = mx.quantized_matmul(rows, *keys.parts, transpose=True, **kw)
    scores = scores.reshape(B, n_kv, rep, L, -1)
    if isinstance(mask, str):
        mask = masks.causal_array(L, scores.shape[-1])
    if mask is not None:
        if mask.ndim == 4:  # [B | 1, 1, L, T]: one mask for every head
            mask = mx.expand_dims(mask, 2)
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.finfo(scores.dtype).min)
        else:
            scores = scores + mask
    if sinks is not None:  # a virtual key per head that takes softmax mass and adds nothing
        sink = mx.broadcast_to(
            sinks.astype(scores.dtype).reshape(n_kv, rep, 1, 1), (*scores.shape[:-1], 1)
        )
        scores = mx.concatenate([sink, scores], axis=-1)
    probs = mx.softmax(scores, axis=-1, precise=True)
    if sinks is not None:
        probs = probs[..., 1:]
    probs = probs.reshape(B, n_kv, rep * L, -1)
    out = mx.quantized_matmul(probs, *values.parts, transpose=False, **kw)  # [B, kv, rep*L, Dv]
    return out.reshape(B, n_heads, L, -1)


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
