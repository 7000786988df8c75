"""Recurrent state (the cache kind of a state-space layer) and the Mamba2 and Mamba (v1) mixers
that use it.

A Mamba2 layer caches no keys: its memory of everything before is a fixed-size state, the last
``conv_kernel - 1`` inputs of its depthwise causal convolution and the SSM state
``[B, heads, head_dim, state_size]``. Every prefill chunk and decode step advances it; nothing
ever trims it, since a token cannot be taken back out of a recurrence. A hybrid model
(nemotron_h) mixes these layers with attention layers whose ordinary KV caches ``--max-kv-size``
does trim; in the cache list each layer carries its own kind. A Mamba (v1) layer (jamba) holds
the same two arrays, its SSM state ``[B, channels, state_size]``.

How the state stays out of what is built for attention keys (the ``LayerCache`` protocol):

- ``holds_keys = False``: ``SequenceCache.windows()`` builds the masks from the caches that hold
  keys only, so no mask is ever sized from a recurrent cache.
- ``live_len`` is 0 (and ``row_live_len`` 0 per row, ``key_valid`` None): it holds no key
  columns. Anything that sized a mask or a K/V slice from it would get a zero-width one, which
  ``attend`` refuses, instead of a plausible wrong width.
- ``trimmable = False``: ``enforce_max_kv`` skips it. ``trim_front`` drops nothing and returns
  0: the protocol's rule (``n`` clamped to the tokens there are to drop) with no tokens held;
  the state itself is untouched, so a caller that ignores ``trimmable`` loses nothing and
  learns from the return that nothing was dropped.
- ``rewindable = False``: ``rewind`` raises, so speculative decoding refuses a model with
  recurrent layers (``cache.prepare_rewind``) rather than snapshot and re-run the state.
- ``offset`` counts every token seen (``monotonic-position``), like any cache's; ``nbytes``
  is the state's size, which does not grow with the tokens.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
from mlx import nn

from mlxc.runtime.model.cache import RewindError, check_trim

# --- the cache kind -----------------------------------------------------------------------------


class _RecurrentState:
    """What the two recurrent kinds share: the state arrays, and no keys (module docstring).

    ``conv``: ``[B, conv_kernel - 1, conv_dim]``, the convolution's last inputs (the input
    dtype); ``ssm``: ``[B, heads, head_dim, state_size]`` float32 (Mamba: ``[B, channels,
    state_size]``). Both None before the first
    chunk (the mixer starts from zeros, as a causal convolution and a fresh scan do).
    """

    trimmable = False  # recurrent state is never trimmed
    holds_keys = False  # no mask is built from it (SequenceCache.windows skips it)
    rewindable = False  # a token cannot be taken back out of a recurrence
    window = None
    live_len = 0  # no key columns

    def __init__(self) -> None:
        self.conv: mx.array | None = None
        self.ssm: mx.array | None = None

    def key_valid(self, n_new: int = 0) -> None:
        return None

    def rewind(self, n: int) -> None:
        raise RewindError("a recurrent state cannot rewind: a token cannot be taken back out")

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays())

    def arrays(self) -> list[mx.array]:
        return [a for a in (self.conv, self.ssm) if a is not None]


class RecurrentCache(_RecurrentState):
    """One Mamba2 layer's state of one sequence (or of a batch moving in lockstep)."""

    row_live_len = 0

    def __init__(self) -> None:
        super().__init__()
        self.offset = 0

    def update(self, conv: mx.array, ssm: mx.array, n_new: int) -> None:
        """The state after ``n_new`` more tokens (what the mixer computed from this one)."""
        self.conv, self.ssm = conv, ssm
        self.offset += n_new

    def trim_front(self, n: int, keep: int = 0) -> int:
        """Drops nothing (no tokens held; see the module docstring): 0."""
        check_trim(n, keep)
        return 0

    def prefix_block(self, start: int) -> list[mx.array] | None:
        """Copies of the state at ``offset``: the exact-prefix snapshot a resume needs (nothing
        of the tokens before it can be added or taken back)."""
        if self.ssm is None:
            return None
        return [mx.contiguous(a) for a in (self.conv, self.ssm)]

    def resume(self, blocks: list[list[mx.array]], offset: int) -> None:
        """The state at ``offset``: the newest block (the state at each boundary is whole)."""
        self.conv, self.ssm = blocks[-1]
        self.offset = offset

    def batch_layer(self) -> BatchRecurrentCache:
        return BatchRecurrentCache()


class BatchRecurrentCache(_RecurrentState):
    """The recurrent state of a decode batch's rows, stacked on the batch axis.

    The state has no time axis, so rows of different lengths need no padding: ``extend``
    concatenates single-sequence states, ``keep_rows`` gathers rows, and ``offset`` is per row
    (``[B]``) like ``BatchKVCache``'s.
    """

    def __init__(self) -> None:
        super().__init__()
        self.offsets = np.zeros(0, np.int64)  # [B] tokens seen, per row

    @property
    def offset(self) -> mx.array:
        return mx.array(self.offsets, mx.int32)

    def update(self, conv: mx.array, ssm: mx.array, n_new: int) -> None:
        self.conv, self.ssm = conv, ssm
        self.offsets = self.offsets + n_new

    @property
    def row_live_len(self) -> np.ndarray:
        return np.zeros(len(self.offsets), np.int64)

    def trim_front(self, n: np.ndarray, keep: int = 0) -> np.ndarray:
        """Drops nothing in any row: zeros."""
        check_trim(n, keep)
        return self.row_live_len

    def batch_layer(self) -> None:
        return None  # already a batch

    def extend(self, caches: list[RecurrentCache]) -> None:
        """Add one row per cache (single sequences whose prompt has run)."""
        for cache in caches:
            if cache.ssm is None or cache.ssm.shape[0] != 1:
                raise ValueError("only a single sequence's filled cache joins a decode batch")
        rows = ([] if self.ssm is None else [self]) + caches
        self.conv = mx.concatenate([r.conv for r in rows])
        self.ssm = mx.concatenate([r.ssm for r in rows])
        self.offsets = np.concatenate([self.offsets, [c.offset for c in caches]])

    def fits(self, other: BatchRecurrentCache) -> bool:
        """Whether ``place`` can take ``other``'s rows: both hold state (no time axis to fit)."""
        return type(other) is type(self) and self.ssm is not None and other.ssm is not None

    def place(self, slots: list[int], other: BatchRecurrentCache) -> None:
        """Write ``other``'s rows over rows ``slots`` (rows whose sequences have left)."""
        index = mx.array(slots)
        self.conv[index] = other.conv
        self.ssm[index] = other.ssm
        self.offsets[slots] = other.offsets

    def keep_rows(self, rows: list[int]) -> None:
        """Keep only ``rows`` (in that order)."""
        if not rows:
            self.__init__()  # empty, as new
            return
        index = mx.array(rows)
        self.conv, self.ssm = self.conv[index], self.ssm[index]
        self.offsets = self.offsets[rows]


# --- weights ------------------------------------------------------------------------------------


def convert_conv_weights(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """Depthwise ``*.conv1d.weight`` from torch's ``[C, 1, K]`` (out channels, in channels per
    group, kernel) to MLX's ``[C, K, 1]`` (out channels, kernel, in channels per group).

    Weights already in MLX's layout (an mlx-lm conversion) pass unchanged: their middle axis is
    the kernel. With ``K == 1`` the two layouts are the same array.
    """
    return {
        name: (
            w.swapaxes(1, 2)
            if name.endswith("conv1d.weight") and w.ndim == 3 and w.shape[1] == 1
            else w
        )
        for name, w in weights.items()
    }


# --- the mixer ----------------------------------------------------------------------------------


def time_step_limit(limit: list | tuple | None) -> tuple[float, float]:
    """A config's ``time_step_limit`` as the clamp's (min, max); None: (0, inf), no clamp.

    transformers 5 writes an infinite bound to config.json as ``{"__float__": "Infinity"}``.
    """

    def bound(value) -> float:
        return float(value["__float__"] if isinstance(value, dict) else value)

    if limit is None:
        return (0.0, math.inf)
    if len(limit) != 2:
        raise ValueError(f"time_step_limit must be [min, max], got {limit!r}")
    return (bound(limit[0]), bound(limit[1]))


class GatedRMSNorm(nn.Module):
    """``rms_norm(x * silu(gate))`` over each of ``n_groups`` equal channel groups, times
    ``weight`` (transformers' ``NemotronHRMSNormGated``: the gate before the norm), in float32."""

    def __init__(self, dims: int, n_groups: int, eps: float) -> None:
        super().__init__()
        self.weight = mx.ones((dims,))
        self.n_groups = n_groups
        self.eps = eps

    def __call__(self, x: mx.array, gate: mx.array) -> mx.array:
        x = x.astype(mx.float32) * nn.silu(gate.astype(mx.float32))
        grouped = x.reshape(*x.shape[:-1], self.n_groups, -1)
        return self.weight * mx.fast.rms_norm(grouped, None, self.eps).reshape(x.shape)


class Mamba2Mixer(nn.Module):
    """The Mamba2 token mixer of a hybrid layer, named as transformers' ``NemotronHMamba2Mixer``
    (``in_proj``, ``conv1d``, ``dt_bias``, ``A_log``, ``D``, ``norm``, ``out_proj``).

    ``in_proj`` gives the gate ``z``, the convolution's input ``xBC`` and ``dt``; the depthwise
    causal convolution (then SiLU) mixes ``xBC`` over the last ``conv_kernel`` tokens, which
    splits into the heads' input ``x`` and the grouped ``B``, ``C`` (head ``h`` reads group
    ``h // (heads / n_groups)``). Per head, with ``dt = clip(softplus(dt + dt_bias),
    *time_step_limit)`` and ``A = -exp(A_log)``:

        state_t = exp(dt_t A) state_{t-1} + dt_t x_t B_t^T      y_t = state_t C_t + D x_t

    A prefill chunk runs that as the chunked SSD scan (``ssd_scan``), a decode step (one token)
    as the recurrence itself; both continue from the cache's state and leave theirs in it.
    ``y`` goes through the gated group RMSNorm and ``out_proj``. The scan and the state are
    float32 whatever the weights' dtype.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        head_dim: int,
        state_size: int,
        n_groups: int,
        conv_kernel: int,
        chunk_size: int,
        time_step_limit: tuple[float, float] = (0.0, math.inf),
        rms_norm_eps: float = 1e-5,
        bias: bool = False,
        conv_bias: bool = True,
    ) -> None:
        super().__init__()
        if num_heads % n_groups:
            raise ValueError(f"mamba heads ({num_heads}) must split into n_groups ({n_groups})")
        self.num_heads, self.head_dim = num_heads, head_dim
        self.state_size, self.n_groups = state_size, n_groups
        self.conv_kernel, self.chunk_size = conv_kernel, chunk_size
        self.time_step_limit = tuple(time_step_limit)
        self.intermediate = num_heads * head_dim
        self.conv_dim = self.intermediate + 2 * n_groups * state_size
        self.in_proj = nn.Linear(hidden_size, self.intermediate + self.conv_dim + num_heads, bias)
        # Depthwise: weight [conv_dim, conv_kernel, 1] (convert_conv_weights turns torch's).
        self.conv1d = nn.Conv1d(
            self.conv_dim, self.conv_dim, conv_kernel, groups=self.conv_dim, bias=conv_bias
        )
        self.dt_bias = mx.ones((num_heads,))
        self.A_log = mx.log(mx.arange(1, num_heads + 1, dtype=mx.float32))
        self.D = mx.ones((num_heads,))
        self.norm = GatedRMSNorm(self.intermediate, n_groups, rms_norm_eps)
        self.out_proj = nn.Linear(self.intermediate, hidden_size, bias)

    def new_cache(self) -> RecurrentCache:
        return RecurrentCache()

    def __call__(
        self, x: mx.array, cache: RecurrentCache | BatchRecurrentCache | None = None
    ) -> mx.array:
        """``x`` ``[B, L, hidden]`` -> ``[B, L, hidden]``, advancing ``cache`` by ``L`` tokens
        (None: a whole sequence from zero state, nothing kept)."""
        B, L, _ = x.shape
        z, xBC, dt = mx.split(
            self.in_proj(x), [self.intermediate, self.intermediate + self.conv_dim], axis=-1
        )
        xBC, new_conv = causal_conv(self.conv1d, xBC, cache)

        groups = self.n_groups * self.state_size
        xs, Bm, Cm = mx.split(xBC, [self.intermediate, self.intermediate + groups], axis=-1)
        xs = xs.reshape(B, L, self.num_heads, self.head_dim).astype(mx.float32)
        Bm = Bm.reshape(B, L, self.n_groups, self.state_size).astype(mx.float32)
        Cm = Cm.reshape(B, L, self.n_groups, self.state_size).astype(mx.float32)
        dt = nn.softplus(dt.astype(mx.float32) + self.dt_bias.astype(mx.float32))
        dt = mx.clip(dt, *self.time_step_limit)  # [B, L, heads]
        A = -mx.exp(self.A_log.astype(mx.float32))
        state = None if cache is None else cache.ssm
        if state is None:
            state = mx.zeros((B, self.num_heads, self.head_dim, self.state_size), mx.float32)
        if L == 1:
            y, state = ssm_step(xs, dt, A, Bm, Cm, state)
        else:
            y, state = ssd_scan(xs, dt, A, Bm, Cm, state, self.chunk_size)
        y = y + xs * self.D.astype(mx.float32)[:, None]
        if cache is not None:
            cache.update(new_conv, state, L)
        y = self.norm(y.reshape(B, L, self.intermediate), z)
        return self.out_proj(y.astype(x.dtype))


def causal_conv(conv1d: nn.Conv1d, x: mx.array, cache) -> tuple[mx.array, mx.array]:
    """SiLU of the depthwise causal convolution of ``x`` ``[B, L, C]``, continuing from the
    cache's last ``K - 1`` inputs (zeros for a fresh sequence: the convolution's causal padding);
    returns the output and the last ``K - 1`` inputs, the cache's next conv state."""
    K = conv1d.weight.shape[1]
    state = None if cache is None else cache.conv
    if state is None:
        state = mx.zeros((x.shape[0], K - 1, x.shape[-1]), x.dtype)
    window = mx.concatenate([state, x], axis=1)  # [B, K - 1 + L, C]
    return nn.silu(conv1d(window)), window[:, window.shape[1] - (K - 1) :]  # valid: L outputs


def _per_head(m: mx.array, num_heads: int, axis: int = -2) -> mx.array:
    """Grouped (``groups`` on ``axis``) -> per head: head ``h`` reads group
    ``h // (heads / groups)`` (consecutive heads share a group)."""
    return mx.repeat(m, num_heads // m.shape[axis], axis=axis)


@mx.compile  # one fused kernel per decode step where the backend fuses (GPU)
def ssm_step(x, dt, A, B, C, state):
    """One token of the recurrence (decode). ``x`` ``[b, 1, h, p]``, ``dt`` ``[b, 1, h]``, ``B``
    and ``C`` ``[b, 1, g, n]``, ``state`` ``[b, h, p, n]``; returns ``y`` without the ``D``
    term, ``[b, 1, h, p]``, and the new state."""
    h = x.shape[2]
    dt, x = dt[:, 0], x[:, 0]
    B, C = _per_head(B[:, 0], h), _per_head(C[:, 0], h)  # [b, h, n]
    decay = mx.exp(dt * A)[..., None, None]  # [b, h, 1, 1]
    state = decay * state + (dt[..., None] * x)[..., None] * B[:, :, None, :]
    y = (state @ C[..., None])[..., 0]  # [b, h, p]
    return y[:, None], state


def ssd_scan(x, dt, A, B, C, state, chunk_size: int):
    """The recurrence over ``L`` tokens as the chunked SSD algorithm, from ``state``.

    Within a chunk of ``Q`` tokens the outputs are a masked, decayed ``C B^T`` product (an
    attention-like ``[Q, Q]`` matrix per head); across chunks only the states at chunk ends
    carry over, combined in one product over chunks. Shapes as in ``ssm_step`` with ``L``
    tokens; returns ``y`` (no ``D`` term) ``[b, L, h, p]`` and the state after the last token.
    A tail shorter than a chunk is zero-padded: a padded step has ``dt = 0``, so it neither
    decays the state nor adds to it.
    """
    b, L, h, p = x.shape
    g = B.shape[2]
    Q = min(chunk_size, L)
    pad = -L % Q
    if pad:
        x, dt, B, C = (
            mx.pad(t, [(0, 0), (0, pad)] + [(0, 0)] * (t.ndim - 2)) for t in (x, dt, B, C)
        )
    c = (L + pad) // Q

    def chunked(t: mx.array) -> mx.array:
        """``[b, L, k, ...]`` -> ``[b, k, c, Q, ...]`` (heads or groups, then chunks)."""
        return mx.moveaxis(t.reshape(b, c, Q, *t.shape[2:]), 3, 1)

    xdt = chunked(x * dt[..., None])  # [b, h, c, Q, p]
    cum = mx.cumsum(chunked(dt * A), axis=-1)  # [b, h, c, Q]: log-decay since the chunk began
    B, C = chunked(B), chunked(C)  # [b, g, c, Q, n]

    # Within each chunk: y[l] = sum_{s <= l} exp(cum[l] - cum[s]) (C[l] . B[s]) xdt[s]. The
    # scores C B^T are per group (its heads share them), the decays per head.
    causal = mx.tril(mx.ones((Q, Q), mx.bool_))
    decay = mx.exp(mx.where(causal, cum[..., :, None] - cum[..., None, :], -mx.inf))
    scores = (C @ B.swapaxes(-1, -2))[:, :, None]  # [b, g, 1, c, Q, Q]
    weights = (decay.reshape(b, g, h // g, c, Q, Q) * scores).reshape(b, h, c, Q, Q)
    y = weights @ xdt  # [b, h, c, Q, p]

    # Each chunk's own contribution to the state at its end (as if it started from zero).
    B, C = _per_head(B, h, axis=1), _per_head(C, h, axis=1)  # [b, h, c, Q, n]
    to_end = mx.exp(cum[..., -1:] - cum)  # [b, h, c, Q]
    chunk_states = (xdt * to_end[..., None]).swapaxes(-1, -2) @ B  # [b, h, c, p, n]

    # Across chunks: the state entering chunk k is the initial state and every earlier chunk's
    # own state, each decayed through the chunks in between (one [c + 1, c + 1] product).
    totals = mx.pad(cum[..., -1], [(0, 0), (0, 0), (1, 0)])  # [b, h, c + 1]
    run = mx.cumsum(totals, axis=-1)
    later = mx.tril(mx.ones((c + 1, c + 1), mx.bool_))
    across = mx.exp(mx.where(later, run[..., :, None] - run[..., None, :], -mx.inf))
    states = mx.concatenate([state[:, :, None], chunk_states], axis=2)  # [b, h, c + 1, p, n]
    entering = (across @ states.reshape(b, h, c + 1, -1)).reshape(states.shape)

    # What each chunk's entering state gives its tokens: exp(cum[l]) state C[l].
    from_state = (C @ entering[:, :, :-1].swapaxes(-1, -2)) * mx.exp(cum)[..., None]
    y = mx.moveaxis(y + from_state, 1, 3).reshape(b, c * Q, h, p)  # [b, L + pad, h, p]
    return y[:, :L], entering[:, :, -1]


# --- Mamba (v1) ---------------------------------------------------------------------------------


class MambaMixer(nn.Module):
    """The Mamba (selective scan) token mixer of a hybrid layer, named as transformers'
    ``JambaMambaMixer`` (``in_proj``, ``conv1d``, ``x_proj``, ``dt_proj``, ``A_log``, ``D``,
    ``out_proj``; with ``bc_norm_eps``, Jamba's ``dt_layernorm``, ``b_layernorm`` and
    ``c_layernorm``).

    ``in_proj`` gives the channels ``x`` and the gate ``z``; ``x`` goes through the depthwise
    causal convolution (then SiLU); ``x_proj(x)`` gives the time step's low-rank input (``dt_rank``)
    and ``B``, ``C`` (``state_size`` each, shared by every channel). Per channel ``i`` and state
    element ``n``, with ``dt = softplus(dt_proj(dt))`` and ``A = -exp(A_log)`` ``[channels, n]``:

        state_t = exp(dt_t A) state_{t-1} + dt_t x_t B_t      y_t = state_t C_t + D x_t

    then ``y * silu(z)`` and ``out_proj``. A prefill chunk runs the recurrence as a parallel
    scan on a GPU, token by token on the CPU (``selective_scan``), a decode step as one step;
    both continue from the cache's state (float32, ``[B, channels, state_size]``) and leave
    theirs in it.
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        state_size: int,
        conv_kernel: int,
        dt_rank: int,
        bias: bool = False,
        conv_bias: bool = True,
        bc_norm_eps: float | None = None,
    ) -> None:
        super().__init__()
        self.intermediate, self.state_size, self.dt_rank = intermediate_size, state_size, dt_rank
        I = intermediate_size
        self.in_proj = nn.Linear(hidden_size, 2 * I, bias)
        self.conv1d = nn.Conv1d(I, I, conv_kernel, groups=I, bias=conv_bias)
        self.x_proj = nn.Linear(I, dt_rank + 2 * state_size, bias=False)
        self.dt_proj = nn.Linear(dt_rank, I, bias=True)
        self.A_log = mx.log(
            mx.broadcast_to(mx.arange(1, state_size + 1, dtype=mx.float32), (I, state_size))
        )
        self.D = mx.ones((I,))
        self.out_proj = nn.Linear(I, hidden_size, bias)
        if bc_norm_eps is not None:
            self.dt_layernorm = nn.RMSNorm(dt_rank, eps=bc_norm_eps)
            self.b_layernorm = nn.RMSNorm(state_size, eps=bc_norm_eps)
            self.c_layernorm = nn.RMSNorm(state_size, eps=bc_norm_eps)

    def new_cache(self) -> RecurrentCache:
        return RecurrentCache()

    def __call__(
        self, x: mx.array, cache: RecurrentCache | BatchRecurrentCache | None = None
    ) -> mx.array:
        """``x`` ``[B, L, hidden]`` -> ``[B, L, hidden]``, advancing ``cache`` by ``L`` tokens
        (None: a whole sequence from zero state, nothing kept)."""
        B, L, _ = x.shape
        xs, z = mx.split(self.in_proj(x), 2, axis=-1)
        xs, new_conv = causal_conv(self.conv1d, xs, cache)
        dt, Bm, Cm = mx.split(self.x_proj(xs), [self.dt_rank, self.dt_rank + self.state_size], -1)
        if "dt_layernorm" in self:
            dt, Bm, Cm = self.dt_layernorm(dt), self.b_layernorm(Bm), self.c_layernorm(Cm)
        dt = nn.softplus(self.dt_proj(dt).astype(mx.float32))  # [B, L, channels]
        A = -mx.exp(self.A_log.astype(mx.float32))
        state = None if cache is None else cache.ssm
        if state is None:
            state = mx.zeros((B, self.intermediate, self.state_size), mx.float32)
        xf, Bm, Cm = xs.astype(mx.float32), Bm.astype(mx.float32), Cm.astype(mx.float32)
        if L == 1:
            y, state = _selective_step(xf, dt, A, Bm, Cm, state)
        else:
            y, state = selective_scan(xf, dt, A, Bm, Cm, state)
        if cache is not None:
            cache.update(new_conv, state, L)
        y = (y + xf * self.D.astype(mx.float32)) * nn.silu(z.astype(mx.float32))
        return self.out_proj(y.astype(x.dtype))


@mx.compile  # one fused kernel per decode step where the backend fuses (GPU)
def _selective_step(x, dt, A, B, C, state):
    """One token (decode), one fused kernel: ``x``, ``dt`` ``[b, 1, I]``, ``B``, ``C``
    ``[b, 1, n]``, ``state`` ``[b, I, n]``; ``y`` (no ``D`` term) ``[b, 1, I]``, the new state."""
    state = mx.exp(dt[:, 0, :, None] * A) * state + (dt * x)[:, 0, :, None] * B[:, 0, None, :]
    y = (state @ C[:, 0, :, None])[..., 0]
    return y[:, None], state


SCAN_CHUNK = 128  # tokens per parallel scan: bounds its [b, tokens, channels, state] arrays


def selective_scan(x, dt, A, B, C, state, chunk: int | None = None):
    """The recurrence over ``L`` tokens from ``state``, as a parallel prefix scan: each token's
    step is the affine map ``h -> a_t h + u_t`` (``a_t = exp(dt_t A)``, ``u_t = dt_t x_t B_t``),
    and log2(Q) rounds of composing each map with the one ``d`` tokens before it (d = 1, 2,
    4, ...) leave every token's map from the start of its chunk of ``Q = chunk`` tokens, all
    tokens at once; chunks follow each other from the state the last one left. The factors are
    decays in (0, 1], so no round overflows. Shapes as in ``_selective_step`` with ``L`` tokens;
    returns ``y`` (no ``D`` term) ``[b, L, I]`` and the state after the last token.

    ``chunk`` (default ``SCAN_CHUNK``; on the CPU 1, token by token): a CPU costs each pass over
    the ``[b, Q, I, n]`` arrays, and the log2(Q) rounds cost more passes than the tokens one at
    a time (a 256-token prefill at 2,048 channels: 225 -> 123 ms a layer); a GPU costs each
    launch, and takes every token of a chunk at once."""
    if chunk is None:
        chunk = 1 if mx.default_device() == mx.cpu else SCAN_CHUNK
    ys = []
    for start in range(0, x.shape[1], chunk):
        part = slice(start, start + chunk)
        y, state = _scan_chunk(x[:, part], dt[:, part], A, B[:, part], C[:, part], state)
        ys.append(y)
    return mx.concatenate(ys, axis=1), state


def _scan_chunk(x, dt, A, B, C, state):
    L = x.shape[1]
    a = mx.exp(dt[..., None] * A)  # [b, L, I, n]
    u = (dt * x)[..., None] * B[:, :, None, :]  # [b, L, I, n]
    d = 1
    while d < L:
        # token t composes with token t - d (tokens before the chunk: the identity map)
        a_before = mx.concatenate([mx.ones_like(a[:, :d]), a[:, :-d]], axis=1)
        u_before = mx.concatenate([mx.zeros_like(u[:, :d]), u[:, :-d]], axis=1)
        a, u = a * a_before, a * u_before + u
        d *= 2
    h = a * state[:, None] + u  # [b, L, I, n]: the state after each token
    y = (h @ C[..., None])[..., 0]  # [b, L, I]
    return y, h[:, -1]
