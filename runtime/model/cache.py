"""The layer-cache protocol and its attention kinds: full KV (a monotonic offset and a trimmable
live window) and windowed KV (keeps what a sliding window can see).

``LayerCache`` is what the runtime (generation, the scheduler's pool, the decode batch and
``mlxc verify``) asks of any layer's cache; a new cache kind plugs in by satisfying it. Two
quantities that a bounded cache separates, and that generated code reads by label:

- ``offset``   (``monotonic-position``): tokens ever written. RoPE, MRoPE and the Llama-4
  attention scale read it. It never decreases, ``trim_front`` included.
- ``live_len`` (``live-window``): keys physically present, ``offset - live_start``. The causal
  mask's key width and any slice of the returned K/V are sized from it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, runtime_checkable

import mlx.core as mx
import numpy as np

from mlxc.runtime.model import cuda_attention


@runtime_checkable
class LayerCache(Protocol):
    """One layer's cache of one sequence (or of a decode batch's rows), of any kind.

    The runtime reads capabilities, never concrete types: ``trimmable`` says whether
    ``enforce_max_kv`` may trim it (full KV: yes; a window bounds itself; recurrent state never),
    ``holds_keys`` whether masks are built for it (``SequenceCache.windows``; recurrent state
    holds none), ``batch_layer`` whether and how its rows join a decode batch. The README's
    cache contract lists these members (tests/test_cache.py checks it).

    Optional, for the server's prefix cache (``runtime.serving.prefix_cache``), which snapshots a
    sequence at its prefill chunk boundaries: ``prefix_block(start)``, copies of what resuming at
    ``offset`` needs beyond the blocks taken at the earlier boundaries (``start`` the previous
    one), or None when this cache no longer holds its prefix (a trim dropped tokens); and
    ``resume(blocks, offset)``, which makes a fresh cache of the kind what it was at ``offset``
    from its path's blocks, oldest first. A model with a cache lacking them is not cached.
    """

    trimmable: ClassVar[bool]
    holds_keys: ClassVar[bool]  # attention keys, which masks are built for; False: recurrent state
    rewindable: ClassVar[bool]  # whether ``rewind`` takes back tokens (speculative decoding)
    window: int | None  # the sliding window its keys serve; None: full attention

    @property
    def offset(self) -> Any:
        """``monotonic-position``: tokens ever written (``[B]`` in a decode batch)."""

    @property
    def live_len(self) -> int:
        """``live-window``: key columns present, what a mask is sized from."""

    @property
    def row_live_len(self) -> Any:
        """Tokens present per row, what ``max_kv_size`` bounds (``live_len`` for one sequence)."""

    def key_valid(self, n_new: int) -> Any:
        """``[B, 1, 1, live_len + n_new]``: the key columns each row may attend to once ``n_new``
        more are appended; None when every row may attend to every column."""

    def trim_front(self, n: Any, keep: int = 0) -> Any:
        """Drop the oldest ``n`` tokens after ``keep`` sinks (per row); ``offset`` unchanged."""

    def rewind(self, n: int) -> None:
        """Take back the last ``n`` tokens written (rejected draft tokens): ``offset`` and
        ``live_len`` move back by ``n``, nothing else changes. Never undoes a ``trim_front``
        (RewindError: trims run only after acceptance); a kind that cannot rewind raises."""

    @property
    def nbytes(self) -> int:
        """Bytes of the state it holds for its live tokens."""

    def arrays(self) -> list[mx.array]:
        """Every array it holds (what to evaluate after a prefill chunk)."""

    def batch_layer(self) -> LayerCache | None:
        """An empty decode-batch layer whose ``extend`` takes caches of this kind as rows (and
        ``keep_rows`` lets them leave); None: this kind decodes alone."""


class RewindError(ValueError):
    """A rewind a cache cannot do: past a trim, past what it holds, or a kind that never can."""


def check_trim(n: Any, keep: int) -> None:
    """ValueError unless ``trim_front``'s ``n`` (an int, or one per row) and ``keep`` are >= 0."""
    if (np.asarray(n) < 0).any() or keep < 0:
        raise ValueError(f"trim_front needs n >= 0 and keep >= 0, got n={n}, keep={keep}")


class KVCache:
    """Per-layer key/value store for one sequence (or a batch moving in lockstep).

    Keys and values live in a buffer ``[B, H, capacity, D]`` that grows in steps of ``step``
    tokens; the live window occupies ``[0, live_len)`` of it, oldest first, so a prefix of the
    buffer is always exactly the keys a query may attend to.

    ``rewind(n)`` moves ``offset`` back over the last ``n`` tokens: the buffer past ``held`` is
    dead space the next append overwrites. ``decode_bound`` = ``(max_kv_size, keep)`` while a
    speculative verification forward runs: its queries must see what one-token decode steps,
    each followed by a trim, would have seen (``key_valid``).
    """

    step = 256
    trimmable = True  # full KV: --max-kv-size trims it
    holds_keys = True
    rewindable = True
    window = None

    def __init__(self) -> None:
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.offset = 0
        self.live_start = 0
        self.sink = 0  # the `keep` of the trims so far: these front tokens are never dropped
        self.trimmed_at = 0  # offset at the last trim_front: a rewind never goes below it
        self.decode_bound: tuple[int, int] | None = None

    @property
    def held(self) -> int:
        """Tokens in the buffer, ``[0, held)``: ``offset - live_start``."""
        return self.offset - self.live_start

    @property
    def live_len(self) -> int:
        return self.held  # attention reads every token held

    @property
    def row_live_len(self) -> int:
        """Tokens present in each row (rows move in lockstep here; see ``BatchKVCache``)."""
        return self.live_len

    def key_valid(self, n_new: int) -> mx.array | None:
        # The rows move in lockstep: every live key is valid for each, unless a verification
        # forward must hide what the trims between one-token steps would have dropped.
        if self.decode_bound is None or self.live_len + n_new <= self.decode_bound[0] + 1:
            return None  # no step's trim would have dropped anything yet
        return decode_steps_valid(self.live_len, n_new, *self.decode_bound)

    def update_and_fetch(
        self, keys: mx.array, values: mx.array | None = None
    ) -> tuple[mx.array, mx.array | None]:
        """Append ``keys``/``values`` ``[B, H, L, D]``; return the live window after the append.

        ``values`` None keeps keys only.
        """
        n_new = keys.shape[2]
        start = self.held
        end = start + n_new
        if self.keys is None or end > self.keys.shape[2]:
            self.keys = self._grown(self.keys, keys, end)
            if values is not None:
                self.values = self._grown(self.values, values, end)
        # Indexed [:, :, a:b], not [..., a:b, :]: the same slices of [B, H, T, D], and a
        # third cheaper for Python to parse (a decode step makes four a layer, twelve quantised).
        self.keys[:, :, start:end] = keys
        if values is not None:
            self.values[:, :, start:end] = values
        self.offset += n_new
        if type(self) is KVCache and self._hands_buffers(keys, values):
            # Kinds built on this one take slices of what it fetches: only it hands buffers.
            return BufferKV(self.keys, end), BufferKV(self.values, end)
        live_values = None if values is None else self.values[:, :, :end]
        return self.keys[:, :, :end], live_values

    @staticmethod
    def _hands_buffers(keys: mx.array, values: mx.array | None) -> bool:
        """Whether a fetch after these new tokens hands the whole buffers (``BufferKV``): where
        mlxc's CUDA kernel reads them, a verification's few queries (one query's step too
        with ``cuda_attention.BUFFER_DECODE``; else MLX's decode kernel reads the slices). Never
        for MLA's latent and rope key, whose widths differ (``reads_buffers``)."""
        n_new = keys.shape[2]
        if not (n_new > 1 or cuda_attention.BUFFER_DECODE):
            return False
        return n_new <= cuda_attention.MAX_QUERIES and reads_buffers(keys, values)

    def _grown(self, buffer: mx.array | None, new: mx.array, needed: int) -> mx.array:
        """A buffer with room for ``needed`` tokens holding the live window of ``buffer``."""
        capacity = buffer_tokens(needed, self.step)
        B, H, _, D = new.shape
        grown = mx.zeros((B, H, capacity, D), new.dtype)
        if buffer is not None:
            n = self.held
            grown[..., :n, :] = buffer[..., :n, :]
        return grown

    def trim_front(self, n: int, keep: int = 0) -> int:
        """Drop the oldest ``n`` live tokens that follow the first ``keep`` (attention sinks).

        ``offset`` is unchanged; ``live_len`` shrinks by the number dropped, which is returned
        (``n`` clamped to what is there to drop).
        """
        n = int(n)
        check_trim(n, keep)
        live = self.held
        n = min(n, max(live - keep, 0))
        if n == 0:
            return 0
        if self.live_start and keep != self.sink:
            raise ValueError(f"trim_front keep={keep} differs from the earlier keep={self.sink}")
        self.sink = keep
        self.trimmed_at = self.offset
        # Slide the survivors down; assignment reads the old buffer, so overlap is safe.
        for buffer in (self.keys, self.values):
            if buffer is not None:
                buffer[..., keep : live - n, :] = buffer[..., keep + n : live, :]
        self.live_start += n
        return n

    def rewind(self, n: int) -> None:
        n = int(n)
        if n < 0 or n > self.offset - self.trimmed_at:
            raise RewindError(
                f"cannot rewind {n} tokens: {self.offset - self.trimmed_at} were written since "
                "the last trim (a trim only follows acceptance)"
            )
        self.offset -= n

    @property
    def nbytes(self) -> int:
        """Bytes of the tokens held (not the spare capacity)."""
        if self.keys is None:
            return 0
        held = self.keys.nbytes + (0 if self.values is None else self.values.nbytes)
        return held // self.keys.shape[2] * self.held

    def arrays(self) -> list[mx.array]:
        return [a for a in (self.keys, self.values) if a is not None]

    def prefix_block(self, start: int) -> list[mx.array] | None:
        """Copies of the keys (and values) of tokens ``[start, offset)``; None once a trim has
        dropped any token: a prefix is reusable only while held whole from its start."""
        if self.keys is None or self.live_start:
            return None
        return _copies(self.arrays(), start, self.offset)

    def resume(self, blocks: list[list[mx.array]], offset: int) -> None:
        """Hold tokens ``[0, offset)`` from ``blocks`` (each a ``prefix_block``, oldest first)."""
        parts = [mx.concatenate(p, axis=2) for p in zip(*blocks)]
        self.keys, self.values = self._buffers(parts)
        self.offset, self.live_start, self.sink = offset, offset - parts[0].shape[2], 0

    def _buffers(self, parts: list[mx.array]) -> tuple[Any, Any]:
        """Keys and values from the arrays ``arrays()`` lists (the prefix blocks' layout)."""
        return parts[0], parts[1] if len(parts) > 1 else None

    def live(self) -> tuple[mx.array, mx.array | None]:
        """The live keys and values ``[B, H, live_len, D]`` (what a decode batch's row takes)."""
        start = self.held - self.live_len
        live_values = None if self.values is None else self.values[..., start : self.held, :]
        return self.keys[..., start : self.held, :], live_values

    def batch_layer(self) -> LayerCache:
        from mlxc.runtime.model.batch import BatchKVCache  # batch builds on this module

        return BatchKVCache()


class WindowedKVCache(KVCache):
    """The keys of a sliding-window layer: only what the window can still see is live.

    A query at position ``p`` attends to keys ``p - window + 1 .. p``, so once a chunk is
    written the next chunk needs only the last ``window - 1`` keys: that is ``live_len``, and
    ``update_and_fetch`` returns those plus the chunk's, so a decode step attends to exactly
    ``window`` keys with no mask. The buffer drops older tokens in runs of
    ``slack = min(step, window)`` (dropping one per decode step would slide the whole window
    down every token): between forwards it holds (``held``) fewer than ``window - 1 + slack``.
    Positions are untouched: ``offset`` keeps counting every token (no ring buffer whose index
    could stand for it). ``--max-kv-size`` does not trim it: it bounds itself.

    ``rewind_reserve``: tokens past the window it keeps for a rewind (speculative decoding sets
    it to the draft length): after a rewind of up to that many it still holds what the window
    sees. Its own drops are not trims of the contract: a rewind may cross them while the keys
    it needs are held.
    """

    trimmable = False
    # Grows and drops in runs of 64 (a full KV cache grows by 256): each drop copies the window
    # down, once per 64 decode steps (~1.5% of attention's reads at window 512), and the buffer
    # stays within window + 128 tokens (+ a prefill chunk).
    step = 64

    def __init__(self, window: int) -> None:
        super().__init__()
        if window < 1:
            raise ValueError(f"a sliding window must be at least 1 token, got {window}")
        self.window = window
        self.slack = min(self.step, window)
        self.rewind_reserve = 0

    @property
    def live_len(self) -> int:
        return min(self.held, self.window - 1)

    def update_and_fetch(
        self, keys: mx.array, values: mx.array | None = None
    ) -> tuple[mx.array, mx.array | None]:
        n = self.live_len + keys.shape[2]  # what the chunk's queries may see
        held_keys, held_values = super().update_and_fetch(keys, values)
        live_keys = held_keys[..., -n:, :]
        live_values = None if held_values is None else held_values[..., -n:, :]
        self._drop_unseen()  # the returned arrays hold the old buffer: its slide leaves them
        return live_keys, live_values

    def _drop_unseen(self) -> None:
        """Drop the tokens no later query sees, once there are ``slack`` of them."""
        unseen = self.held - (self.window - 1) - self.rewind_reserve
        if unseen >= self.slack:
            self.trim_front(unseen)

    def rewind(self, n: int) -> None:
        n = int(n)
        # After the rewind the window must still see min(offset, window - 1) keys.
        if n < 0 or self.held - n < min(self.offset - n, self.window - 1):
            raise RewindError(
                f"cannot rewind {n} tokens: the window layer holds {self.held} and dropped the "
                f"keys a rewind needs (rewind_reserve {self.rewind_reserve} is too small)"
            )
        self.offset -= n

    def prefix_block(self, start: int) -> list[mx.array]:
        """Copies of the last keys of ``[start, offset)`` that a later query can see (at most
        ``window - 1``: what resuming at ``offset`` needs; the buffer holds at least those)."""
        n = min(self.offset - start, self.window - 1)
        return _copies(self.arrays(), self.held - n, self.held)

    def resume(self, blocks: list[list[mx.array]], offset: int) -> None:
        """Hold the last ``window - 1`` tokens before ``offset``, from the newest ``blocks``."""
        need, newest = min(offset, self.window - 1), []
        for block in reversed(blocks):
            newest.insert(0, block)
            if sum(b[0].shape[2] for b in newest) >= need:
                break
        super().resume(newest, offset)
        for name in ("keys", "values"):
            buffer = getattr(self, name)
            if buffer is not None:
                setattr(self, name, buffer[..., buffer.shape[2] - need :, :])
        self.live_start = offset - need

    def batch_layer(self) -> LayerCache:
        from mlxc.runtime.model.batch import BatchWindowedKVCache  # batch builds on this module

        return BatchWindowedKVCache(self.window)


# --- quantised KV (--kv-bits) ----------------------------------------------------------------


class KVQuantError(ValueError):
    """A KV quantisation the cache cannot apply (a group size that does not divide a head)."""


@dataclass(frozen=True)
class KVQuant:
    """How ``--kv-bits`` / ``--kv-group-size`` quantise keys and values: ``mx.quantize``'s affine
    scheme, each token's head vector in groups of ``group_size`` along the head dim."""

    bits: int
    group_size: int = 64

    def __post_init__(self) -> None:
        if self.bits not in KV_BITS or self.group_size not in KV_GROUP_SIZES:
            raise ValueError(
                f"KV quantisation takes bits in {KV_BITS} and group sizes in {KV_GROUP_SIZES}, "
                f"got {self.bits} bits, group {self.group_size}"
            )

    def quantize(self, x: mx.array) -> QuantizedKV:
        if x.shape[-1] % self.group_size:
            raise KVQuantError(
                f"--kv-group-size {self.group_size} does not divide this model's key/value head "
                f"dim {x.shape[-1]}: pick a group size that does, or leave --kv-bits off"
            )
        return QuantizedKV(mx.quantize(x, self.group_size, self.bits), self)


KV_BITS = (4, 8)
KV_GROUP_SIZES = (32, 64, 128)


class QuantizedKV:
    """Keys or values ``[B, H, T, D]`` as ``mx.quantize`` leaves them: ``parts`` = (packed
    ``uint32 [B, H, T, D * bits / 32]``, scales and biases ``[B, H, T, D / group_size]``).

    Each token is quantised on its own (the groups run along the head dim), so it indexes and
    assigns like the float array on every axis but the last (``x[..., a:b, :]``, ``x[rows]``):
    the caches' slides, trims and row gathers move tokens without requantising anything.
    ``shape`` is the float array's.
    """

    def __init__(self, parts: Sequence[mx.array], quant: KVQuant) -> None:
        self.parts = tuple(parts)
        self.quant = quant

    @property
    def shape(self) -> tuple[int, ...]:
        packed = self.parts[0]
        return (*packed.shape[:-1], packed.shape[-1] * 32 // self.quant.bits)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def __getitem__(self, index: Any) -> QuantizedKV:
        return QuantizedKV([p[index] for p in self.parts], self.quant)

    def __setitem__(self, index: Any, new: QuantizedKV) -> None:
        for part, value in zip(self.parts, new.parts):
            part[index] = value

    def map(self, fn: Callable[..., mx.array], *others: QuantizedKV) -> QuantizedKV:
        """``fn`` part by part (of this and ``others``, zipped), e.g. a concatenation."""
        parts = zip(self.parts, *(o.parts for o in others))
        return QuantizedKV([fn(*p) for p in parts], self.quant)

    def dequantize(self) -> mx.array:
        q = self.quant
        return mx.dequantize(*self.parts, group_size=q.group_size, bits=q.bits)

    def code_planes(self, dtype: mx.Dtype) -> list[mx.array]:
        """The codes (``0 .. 2**bits - 1``, before scale and bias; exact in any float dtype) as
        ``dtype`` arrays ``[B, H, T, D / p]``: plane ``j`` of the ``p`` holds head dims ``j, j +
        p, ...``. ``mx.quantize`` packs codes low bits first into little-endian words, so each
        byte is a code (8 bits: ``p = 1``) or two, its low nibble the even dim (4 bits)."""
        data = self.parts[0].view(mx.uint8)
        if self.quant.bits == 8:
            return [data.astype(dtype)]
        return list(_nibbles(dtype)(data))


@functools.cache
def _nibbles(dtype: mx.Dtype) -> Callable[[mx.array], tuple[mx.array, mx.array]]:
    """The low and high nibbles of ``uint8`` data as ``dtype``, compiled into one pass over each
    plane: as four ops, 2,048 cached tokens of 4 KV heads took 350 us a call on the CPU, 61
    compiled."""
    return mx.compile(
        lambda data: ((data & 15).astype(dtype), (data >> 4).astype(dtype)), shapeless=True
    )


class StagedKV:
    """A quantised cache's live keys or values while its newest tokens are staged in float
    (``QuantizedKVCache``): the first ``n_packed`` tokens of ``packed`` (``QuantizedKV``
    ``[B, H, P, D]``, the older tokens), then the first ``n_recent`` of ``recent`` (float
    ``[B, H, n, D]``), which every reader takes as quantising would store them: mlxc's CUDA
    kernel quantises them into shared memory (``cuda_attention``), ``dequantize`` through
    ``mx.quantize``. The counts default to the arrays' lengths; ``buffers``: the arrays are
    the cache's buffers themselves, whose shapes hold from step to step until they grow (so
    the kernel's call replays compiled). ``shape`` is the live window's."""

    def __init__(
        self,
        packed: QuantizedKV,
        recent: mx.array,
        n_packed: int | None = None,
        n_recent: int | None = None,
        buffers: bool = False,
    ) -> None:
        self.packed = packed
        self.recent = recent
        self.n_packed = packed.shape[2] if n_packed is None else n_packed
        self.n_recent = recent.shape[2] if n_recent is None else n_recent
        self.buffers = buffers

    @property
    def shape(self) -> tuple[int, ...]:
        B, H, _, D = self.recent.shape
        return (B, H, self.n_packed + self.n_recent, D)

    def dequantize(self) -> mx.array:
        packed = self.packed[:, :, : self.n_packed].dequantize()
        recent = self.packed.quant.quantize(self.recent[:, :, : self.n_recent])
        return mx.concatenate([packed, recent.dequantize()], axis=2)


class BufferKV:
    """A float cache's live keys or values as its whole buffer ``[B, H, capacity, D]`` and
    the count ``n`` of its first tokens that are live (``KVCache``, where mlxc's CUDA kernel
    reads them: ``reads_buffers``). The kernel takes the count as an input, so its call keeps
    its shapes from step to step until the buffer grows, and replays compiled
    (``cuda_attention``); every other reader takes ``live()``, the slice. ``shape`` is the
    live window's."""

    def __init__(self, buffer: mx.array, n: int) -> None:
        self.buffer = buffer
        self.n = n

    @property
    def shape(self) -> tuple[int, ...]:
        B, H, _, D = self.buffer.shape
        return (B, H, self.n, D)

    def live(self) -> mx.array:
        return self.buffer[:, :, : self.n]


def dense(kv: mx.array | QuantizedKV | StagedKV | BufferKV | None) -> mx.array | None:
    """``kv`` as a float array: what ``update_and_fetch`` returned, dequantised where the cache
    is quantised (an MLA latent feeds plain matmuls, not ``layers.attend``'s packed path)."""
    if isinstance(kv, BufferKV):
        return kv.live()
    return kv.dequantize() if isinstance(kv, QuantizedKV | StagedKV) else kv


class QuantizedKVMixin:
    """Quantises what a KV cache kind stores (``QuantizedKV`` buffers); the kind's own logic
    (growth, trims, sinks, the window) runs unchanged on them. ``update_and_fetch`` returns
    ``QuantizedKV`` keys and values, which ``layers.attend`` reads through
    ``mx.quantized_matmul`` (or mlxc's CUDA kernel), and ``dense`` expands for other readers."""

    quant: KVQuant

    def update_and_fetch(
        self, keys: mx.array, values: mx.array | None = None
    ) -> tuple[QuantizedKV, QuantizedKV | None]:
        q = self.quant
        return super().update_and_fetch(
            q.quantize(keys), None if values is None else q.quantize(values)
        )

    def _grown(self, buffer: QuantizedKV | None, new: QuantizedKV, needed: int) -> QuantizedKV:
        old = [None] * len(new.parts) if buffer is None else buffer.parts
        parts = [super(QuantizedKVMixin, self)._grown(b, n, needed) for b, n in zip(old, new.parts)]
        return QuantizedKV(parts, self.quant)

    def arrays(self) -> list[mx.array]:
        return [
            p for buffer in (self.keys, self.values) if buffer is not None for p in buffer.parts
        ]

    def _buffers(self, parts: list[mx.array]) -> tuple[QuantizedKV, QuantizedKV | None]:
        # Each buffer is three arrays (packed, scales, biases), keys' first.
        values = QuantizedKV(parts[3:], self.quant) if len(parts) > 3 else None
        return QuantizedKV(parts[:3], self.quant), values


class StagingMixin:
    """Stages a quantised cache's newest tokens in float where mlxc's CUDA kernel reads its keys
    (``staging``): a forward of a few tokens (a decode step, a verification) writes them into
    float buffers of STAGE tokens, quantised into the packed buffers a stage at a time
    (``flush``). The step then writes two float slices, as the float cache does, where
    quantising its tokens costs two quantise kernels and six slice writes a layer, launches
    that bound a small-batch GPU step (``docs/performance.md``). Attention reads the packed
    tokens, then the staged ones rounded as quantising stores them (``StagedKV``); tokens are
    quantised independently, so staging changes no result: what attention reads and what the
    packed buffers end up holding are exactly what quantising each token on arrival gives.

    A kind supplies ``_advance(n)`` (move its counters over ``n`` tokens, negative to take them
    back, writing nothing) and ``_packed_end`` (where the packed tokens end); a windowed kind
    also what a staged chunk's queries see (``_packed_window``) and its drops
    (``_after_staging``). Whatever else uses its buffers flushes first.
    """

    # Forwards of up to STAGE / 2 tokens stage (the kernel's most queries: a verification's)
    STAGE = cuda_attention.MAX_STAGED
    quant: KVQuant

    def _clear_staging(self) -> None:
        self.recent_keys: mx.array | None = None  # [B, H, STAGE, D], the staged tokens first
        self.recent_values: mx.array | None = None
        self.staged = 0  # the newest tokens held, in the recent buffers

    def update_and_fetch(
        self, keys: mx.array, values: mx.array | None = None
    ) -> tuple[QuantizedKV | StagedKV, QuantizedKV | StagedKV | None]:
        n_new = keys.shape[2]
        if not self._stages(keys, values):
            self.flush()
            return super().update_and_fetch(keys, values)
        if self.staged + n_new > self.STAGE:
            self.flush()
        if self.recent_keys is None or self.recent_keys.shape[:2] != keys.shape[:2]:
            B, H, _, D = keys.shape
            self.recent_keys = mx.zeros((B, H, self.STAGE, D), keys.dtype)
            self.recent_values = mx.zeros((B, H, self.STAGE, values.shape[3]), values.dtype)
        start, end = self.staged, self.staged + n_new
        self.recent_keys[:, :, start:end] = keys
        self.recent_values[:, :, start:end] = values
        self.staged = end
        self._advance(n_new)
        packed_keys, packed_values, n_packed = self._packed_window(n_new)
        # The whole buffers where the packed tokens are a prefix of them (no slices to build
        # a step; the kernel reads the live lengths).
        buffers = packed_keys is self.keys
        fetched = (
            StagedKV(packed_keys, self.recent_keys, n_packed, end, buffers),
            StagedKV(packed_values, self.recent_values, n_packed, end, buffers),
        )
        # The forward reads them before the cache writes again; a window's drops move only
        # packed tokens, of which it fetched slices.
        self._after_staging()
        return fetched

    def _packed_window(self, n_new: int) -> tuple[QuantizedKV, QuantizedKV, int]:
        """The packed keys and values a staged chunk of ``n_new`` attends to, and how many of
        their first tokens: every one, so the whole buffers and the packed end (full KV)."""
        return self.keys, self.values, self._packed_end

    def _after_staging(self) -> None:
        """What the kind does after an append besides writing it (a window's drops)."""

    def _stages(self, keys: mx.array, values: mx.array | None) -> bool:
        """Whether these new tokens are staged: a few, after packed ones, where it pays."""
        return (
            values is not None
            and keys.shape[2] <= self.STAGE // 2
            and self.keys is not None
            and self._packed_end > 0
            and staging(keys, values)
        )

    def flush(self) -> None:
        """Quantise the staged tokens into the packed buffers (the kind's own append)."""
        n = self.staged
        if n:
            self.staged = 0
            self._advance(-n)
            super().update_and_fetch(self.recent_keys[:, :, :n], self.recent_values[:, :, :n])

    def rewind(self, n: int) -> None:
        super().rewind(n)
        self.staged = max(self.staged - int(n), 0)

    def arrays(self) -> list[mx.array]:
        recent = [self.recent_keys, self.recent_values] if self.staged else []
        return super().arrays() + recent

    def _staged_bytes(self) -> int:
        """Bytes of one staged token of one row (keys and values)."""
        return (self.recent_keys.nbytes + self.recent_values.nbytes) // (
            self.recent_keys.shape[0] * self.STAGE
        )


class SequenceStaging(StagingMixin):
    """``StagingMixin`` for one sequence's caches (full and windowed KV): ``offset`` counts
    the staged tokens, ``held - staged`` are packed; a trim of the packed tokens leaves the
    staged ones be."""

    def _advance(self, n: int) -> None:
        self.offset += n

    @property
    def _packed_end(self) -> int:
        return self.held - self.staged

    def trim_front(self, n: int, keep: int = 0) -> int:
        n, staged = int(n), self.staged
        if staged and self._packed_end - keep < n:  # the trim reaches the staged tokens
            self.flush()
            staged = 0
        self.offset -= staged  # the kind's trim, on the packed tokens
        try:
            dropped = super().trim_front(n, keep)
        finally:
            self.offset += staged
        if dropped:
            self.trimmed_at = self.offset
        return dropped

    @property
    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        packed = self.keys.nbytes + (0 if self.values is None else self.values.nbytes)
        total = packed // self.keys.shape[2] * self._packed_end
        return total + (self._staged_bytes() * self.staged if self.staged else 0)

    def prefix_block(self, start: int) -> list[mx.array] | None:
        self.flush()
        return super().prefix_block(start)

    def resume(self, blocks: list[list[mx.array]], offset: int) -> None:
        super().resume(blocks, offset)
        self.staged = 0

    def live(self) -> tuple[QuantizedKV, QuantizedKV | None]:
        self.flush()
        return super().live()


class QuantizedKVCache(SequenceStaging, QuantizedKVMixin, KVCache):
    """Full KV (``KVCache``: trimmed by ``--max-kv-size``, sinks kept) stored quantised, its
    newest tokens staged in float where mlxc's CUDA kernel reads it (``StagingMixin``)."""

    def __init__(self, quant: KVQuant) -> None:
        super().__init__()
        self.quant = quant
        self._clear_staging()

    def batch_layer(self) -> LayerCache:
        from mlxc.runtime.model.batch import BatchQuantizedKVCache

        return BatchQuantizedKVCache(self.quant)


class QuantizedWindowedKVCache(SequenceStaging, QuantizedKVMixin, WindowedKVCache):
    """Windowed KV (``WindowedKVCache``: bounds itself to its window) stored quantised, its
    newest tokens staged in float where mlxc's CUDA kernel reads it and the window is wider
    than a stage (``StagingMixin``)."""

    def __init__(self, window: int, quant: KVQuant) -> None:
        super().__init__(window)
        self.quant = quant
        self._clear_staging()

    def _stages(self, keys: mx.array, values: mx.array | None) -> bool:
        return self.window > self.STAGE and super()._stages(keys, values)

    def _packed_window(self, n_new: int) -> tuple[QuantizedKV, QuantizedKV, int]:
        # WindowedKVCache's fetch: the live tokens before the chunk, then the chunk; with a
        # window wider than a stage, the staged ones are its newest and packed ones precede.
        seen = min(self.held - n_new, self.window - 1) + n_new - self.staged
        end = self._packed_end
        return self.keys[:, :, end - seen : end], self.values[:, :, end - seen : end], seen

    def _after_staging(self) -> None:
        self._drop_unseen()

    def batch_layer(self) -> LayerCache:
        from mlxc.runtime.model.batch import BatchQuantizedWindowedKVCache

        return BatchQuantizedWindowedKVCache(self.window, self.quant)


def staging(keys: mx.array, values: mx.array) -> bool:
    """Whether a quantised cache stages its newest tokens in float (``StagingMixin``): where
    attention reads its keys through mlxc's CUDA kernel, which reads packed and staged tokens
    in one pass (``reads_buffers``). Elsewhere each token is quantised on arrival."""
    return reads_buffers(keys, values)


def reads_buffers(keys: mx.array, values: mx.array | None) -> bool:
    """Whether attention on these keys and values (a forward's new ones) reads a cache's
    buffers through mlxc's CUDA kernel: a device with MLX's CUDA backend, float keys and
    values of a head dim it is built for (``BufferKV``, ``StagingMixin``)."""
    return (
        values is not None
        and keys.shape[-1] == values.shape[-1]
        and keys.shape[-1] in cuda_attention.HEAD_DIMS
        and keys.dtype in (mx.bfloat16, mx.float16, mx.float32)
        and cuda_attention.available()
    )


def quantized_caches(caches: list, quant: KVQuant | None) -> list:
    """``caches`` (fresh from ``make_cache``) with each full-KV and windowed-KV cache replaced,
    in place, by its quantised kind; None leaves them float. Other kinds stay as they are
    (recurrent state is never quantised). Exact types: a subclass (a latent cache) has its
    own layout and stays float until it names a quantised kind here."""
    if quant is None:
        return caches
    for i, cache in enumerate(caches):
        if type(cache) is KVCache:
            caches[i] = QuantizedKVCache(quant)
        elif type(cache) is WindowedKVCache:
            caches[i] = QuantizedWindowedKVCache(cache.window, quant)
    return caches


def make_caches(model: Any, quant: KVQuant | None = None) -> list:
    """A new sequence's caches: ``model.make_cache()``, quantised by ``quant`` (``--kv-bits``)
    unless the model owns its cache state (``cache_policy`` "model-owned": left float)."""
    caches = model.make_cache()
    if cache_policy(model) == "model-owned":
        return caches
    return quantized_caches(caches, quant)


def check_kv_quant(model: Any, quant: KVQuant | None) -> None:
    """Raise KVQuantError now, not at the first prompt, when ``quant`` cannot apply to the
    model's heads: one token's forward is built (never evaluated) on quantised caches."""
    if quant is not None:
        model(mx.array([[0]]), cache=make_caches(model, quant))


def buffer_tokens(needed: int, step: int) -> int:
    """Tokens a cache buffer holds to take ``needed``: whole ``step``s, plus one.

    The one keeps a buffer off multiples of 256 tokens: MLX 0.32's CUDA attention runs a
    one-query step whose keys are a slice of such a buffer through cuDNN, which builds (NVRTC
    compiles) a graph for each new buffer size, a stall each time the buffer grows (H200: decode
    344 tokens/s with the stalls, 484 without, ``docs/performance.md``); off those sizes the step
    takes MLX's vector kernel, built once per process.
    """
    return -(-needed // step) * step + 1


def decode_steps_valid(live: int, n_new: int, max_kv_size: int, keep: int) -> mx.array:
    """``[1, 1, n_new, live + n_new]``: the keys each of ``n_new`` queries appended to ``live``
    keys would see had they (and the untrimmed tokens before them) come one per decode step,
    each followed by ``enforce_max_kv``: before query ``j`` those trims have dropped
    ``live + j - max_kv_size`` columns after the ``keep`` sinks (causality is the mask's)."""
    dropped = mx.maximum(live + mx.arange(n_new)[:, None] - max_kv_size, 0)
    col = mx.arange(live + n_new)[None, :]
    return ((col < keep) | (col >= keep + dropped))[None, None]


def rewind_caches(caches: list, n: int) -> None:
    """Take the last ``n`` tokens back out of every layer's cache (rejected drafts)."""
    if n:
        for cache in caches:
            cache.rewind(n)


def prepare_rewind(model: Any, caches: list, reserve: int) -> None:
    """Ready a sequence's caches for rewinds of up to ``reserve`` tokens after each forward
    (windowed layers keep that many more keys), or raise RewindError naming what cannot."""
    if cache_policy(model) == "model-owned":
        raise RewindError("the model owns its cache state (cache: model-owned): it cannot rewind")
    kinds = sorted({type(c).__name__ for c in caches if not getattr(c, "rewindable", False)})
    if kinds:
        raise RewindError(
            f"speculative decoding needs caches that can take back rejected tokens; "
            f"{', '.join(kinds)} cannot (a recurrent state cannot un-absorb a token)"
        )
    for cache in caches:
        if hasattr(cache, "rewind_reserve"):
            cache.rewind_reserve = reserve


def _copies(buffers: list[mx.array], start: int, end: int) -> list[mx.array]:
    """Tokens ``[start, end)`` of each buffer in buffers of their own: a slice alone would keep
    the whole buffer alive (and a cache's buffers are rewritten by slice assignment)."""
    return [mx.contiguous(b[..., start:end, :]) for b in buffers]


def attention_cache(window: int | None) -> KVCache:
    """The cache of an attention layer: full KV, or windowed when ``window`` is set (a config's
    ``sliding_window`` may be null)."""
    return KVCache() if window is None else WindowedKVCache(window)


def check_kv_limits(max_kv_size: int | None, kv_sink: int) -> None:
    """ValueError unless ``kv_sink >= 0`` and ``max_kv_size`` (when set) leaves room past it."""
    if kv_sink < 0:
        raise ValueError(f"kv_sink must be >= 0, got {kv_sink}")
    if max_kv_size is not None and max_kv_size <= kv_sink:
        raise ValueError(f"max_kv_size ({max_kv_size}) must be larger than kv_sink ({kv_sink})")


_LAYER_CACHE_TYPES: dict[type, bool] = {}


def is_layer_cache(obj: Any) -> bool:
    """``isinstance(obj, LayerCache)``, checked once per type: a runtime protocol check looks up
    every member (~14 us), and admissions and prefill chunks ask it for every layer. The
    protocol's members are class attributes, methods and properties of each kind, the same for
    all of a type's instances."""
    known = _LAYER_CACHE_TYPES.get(type(obj))
    if known is None:
        known = _LAYER_CACHE_TYPES[type(obj)] = isinstance(obj, LayerCache)
    return known


def cache_arrays(caches: list) -> list[mx.array]:
    """Every array the caches hold: what to evaluate after a prefill chunk whose logits nobody
    reads (model-owned state outside the protocol: the arrays among its attributes)."""
    return [
        a
        for c in caches
        for a in (
            c.arrays()
            if is_layer_cache(c)
            else [v for v in vars(c).values() if isinstance(v, mx.array)]
        )
    ]


def cache_policy(model: Any) -> str:
    """The model's ``cache_policy`` (a class attribute of every generated ``Model``; "pooled-kv"
    for a model that declares none)."""
    return getattr(model, "cache_policy", "pooled-kv")


def trimmable(model: Any, caches: list) -> list:
    """The caches the runtime may trim: none of a model that owns its state (``cache_policy``
    "model-owned"), else every cache whose kind is ``trimmable``."""
    if cache_policy(model) == "model-owned":
        return []
    return [c for c in caches if getattr(c, "trimmable", False)]


def enforce_max_kv(caches: list[LayerCache], max_kv_size: int | None, keep: int = 0) -> int:
    """Trim every trimmable cache whose live length passed ``max_kv_size``; the most dropped.

    The one place the bounded-cache rule lives: generation, ``mlxc verify`` and the scheduler
    call it after every prefill chunk and every decode step (speculative decoding: after each
    verification step's rejected tokens are rewound, on the accepted state only).
    """
    if max_kv_size is None:
        return 0
    check_kv_limits(max_kv_size, keep)
    dropped = 0
    for cache in caches:
        if not cache.trimmable:
            continue  # a kind that bounds itself (window) or is never trimmed (recurrent state)
        # Per row: the rows of a decode batch (runtime.model.batch) have different lengths.
        excess = np.maximum(np.asarray(cache.row_live_len) - max_kv_size, 0)
        if excess.any():
            dropped = max(dropped, int(np.max(cache.trim_front(excess, keep=keep))))
    return dropped
