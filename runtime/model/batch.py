"""Batched decode: the decoding sequences of the server advance in one forward.

A decode step reads every weight once whatever the batch size, so one forward over all
decoding sequences costs about what one sequence costs. The sequences have different lengths
and are trimmed at different times, so their caches cannot simply be stacked. ``BatchKVCache``
holds them in one buffer per layer, rows right-aligned on a shared column index: a new token
of every row is written into the same column. Per row:

- ``offset`` (``monotonic-position``) is an ``mx.array [B]``: the tokens each row has ever
  written. RoPE (``mx.fast.rope`` takes an array offset), MRoPE and the Llama-4 scale read it.
- ``live_len`` (``live-window``) is the buffer's width: the keys returned to attention and the
  mask are that wide. ``key_valid`` says which of those columns each row may attend to.

Row ``b`` of the buffer, left to right: ``pad[b]`` empty columns (the row is shorter than the
batch's longest), its ``sink[b]`` attention-sink tokens, ``gap[b]`` columns of tokens trimmed
away, its most recent tokens, then ``tail[b]`` columns that are not its own (drafts it rejected
while other rows kept theirs, below). A trim widens the gap instead of moving keys; once more
than ``step`` columns are dead in every row, the rows are compacted (one gather), so resident
memory stays bounded by ``max_kv_size + 2 * step`` columns per row.

Prefill stays per sequence (``KVCache``) or per batch of prompts (``start_rows``); a sequence
joins the batch when its prompt is done and leaves it when it finishes. Adding rows at the end
(``extend``, ``append_batch``) and taking rows out (``keep_rows``) copy every row; ``place``
writes new rows over rows whose sequences have left (the server's dead rows,
``runtime.serving.scheduler.CachePool``), a write of those rows only.

A speculative verification (``mlxc serve --prompt-lookup``) writes ``k + 1`` columns to every
row, and each row keeps as many as it accepted (``rewind_rows``): the columns all rows rejected
go back (the width shrinks), and a row that rejected more gets them as its tail. The next
tokens of a row with a tail are written over it (a scatter of those rows after the slice
assignment of all), so its tokens stay contiguous and its tail keeps its length until a
compaction; while a row has a tail, a forward of several queries masks each query's later
columns per row (``key_valid``).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from mlxc.runtime.model import mrope
from mlxc.runtime.model.cache import (
    KVCache,
    KVQuant,
    LayerCache,
    QuantizedKV,
    QuantizedKVMixin,
    RewindError,
    StagingMixin,
    buffer_tokens,
    check_trim,
    is_layer_cache,
)
from mlxc.runtime.model.multimodal import SequenceCache


class BatchKVCache:
    """One layer's keys (and values) of several sequences; see the module docstring."""

    step = KVCache.step
    trimmable = True
    holds_keys = True
    rewindable = True  # the server's speculation (runtime.serving.speculative): rewind_rows
    window = None
    # (max_kv_size, keep) while a speculative verification runs (speculative.decode_bound):
    # each row's queries see what one-token steps, each followed by its trim, would have seen
    decode_bound: tuple[int, int] | None = None

    def __init__(self) -> None:
        self._clear()

    def _clear(self) -> None:
        self.keys: mx.array | None = None  # [B, H, capacity, D]
        self.values: mx.array | None = None
        self.width = 0  # columns in use, the same for every row
        self.offsets = np.zeros(0, np.int64)  # [B] tokens ever written, per row
        self.pad = np.zeros(0, np.int64)  # [B] empty columns at the front
        self.sink = np.zeros(0, np.int64)  # [B] sink tokens after the pad
        self.gap = np.zeros(0, np.int64)  # [B] trimmed columns after the sink
        self.trimmed = np.zeros(0, bool)  # [B] whether the row's sink is fixed by a trim
        self.tail = np.zeros(0, np.int64)  # [B] columns after the row's last token
        self.appended = 0  # columns written since rows last joined, left or were trimmed

    # --- the LayerCache protocol, per row ------------------------------------------------------

    @property
    def offset(self) -> mx.array:
        return mx.array(self.offsets, mx.int32)

    @property
    def live_len(self) -> int:
        return self.width

    @property
    def row_live_len(self) -> np.ndarray:
        """``[B]`` tokens present per row (what ``max_kv_size`` bounds)."""
        return self.width - self.pad - self.gap - self.tail

    def update_and_fetch(
        self, keys: mx.array, values: mx.array | None = None
    ) -> tuple[mx.array, mx.array | None]:
        """Append ``keys``/``values`` ``[B, H, L, D]`` to every row; return all the columns
        (``L`` more: a row with a tail writes over it and keeps it after its new tokens)."""
        n_new = keys.shape[2]
        end = self.width + n_new
        if self.keys is None:  # rows set up by start_rows: the first chunk makes the buffers
            self.keys = _right_aligned(keys, n_new, n_new, _capacity(end + 1))
            if values is not None:
                self.values = _right_aligned(values, n_new, n_new, _capacity(end + 1))
        else:
            if end > self.keys.shape[2]:
                self.keys = _with_capacity(self.keys, self.width, end)
                if values is not None:
                    self.values = _with_capacity(self.values, self.width, end)
            self.keys[:, :, self.width : end] = keys  # as KVCache's: [:, :, a:b] parses faster
            if values is not None:
                self.values[:, :, self.width : end] = values
            if self.tail.any():
                # A row with a tail writes its new columns after its own last token instead
                # (a scatter of those rows only: what the slice put there is in its tail).
                rows = np.flatnonzero(self.tail)
                column = (self.width - self.tail[rows])[:, None] + np.arange(n_new)[None, :]
                _write_rows(self.keys, rows, column, keys)
                if values is not None:
                    _write_rows(self.values, rows, column, values)
        self.width = end
        self.offsets = self.offsets + n_new
        self.appended += n_new
        live_values = None if values is None else self.values[:, :, :end]
        return self.keys[:, :, :end], live_values

    def key_valid(self, n_new: int = 0) -> mx.array | None:
        """``[B, 1, 1, width + n_new]``: the columns each row attends to once ``n_new`` more are
        appended (its sink and recent tokens); None when every row attends to every column (no
        mask: attention's fast path).

        ``[B, 1, n_new, width + n_new]``, each query's columns given whole (its own included,
        later ones not), for a forward of several queries where a row has a tail (its queries
        are not the last columns, so causality cannot be left to the mask's last columns) or,
        under ``decode_bound``, where one-token steps would have trimmed: query ``j`` of row
        ``b`` then misses the ``live + j - max_kv_size`` oldest tokens after the sinks, as
        ``KVCache.key_valid`` does for one sequence."""
        bounded = (
            n_new > 1
            and self.decode_bound is not None
            and bool((self.row_live_len + n_new > self.decode_bound[0] + 1).any())
        )
        if not (self.pad.any() or self.gap.any() or self.tail.any() or bounded):
            return None
        valid = self._valid(self.width + n_new)
        if n_new <= 1 or not (self.tail.any() or bounded):
            return mx.array(valid)[:, None, None, :]
        column = np.arange(valid.shape[1])[None, None, :]
        own = (self.width - self.tail)[:, None] + np.arange(n_new)[None, :]  # [B, n_new]
        valid = valid[:, None, :] & (column <= own[:, :, None])
        if bounded:
            max_kv_size, keep = self.decode_bound
            live = self.row_live_len[:, None] + np.arange(n_new)[None, :]
            dropped = np.maximum(live - max_kv_size, 0)[:, :, None]
            start = (self.pad + keep + self.gap)[:, None, None]  # the trims' next victim
            valid &= (column < start) | (column >= start + dropped)
        return mx.array(valid)[:, None]

    def _valid(self, columns: int | None = None) -> np.ndarray:
        """``[B, columns]`` (default: the width): the columns each row attends to. Columns past
        the width are new tokens (written after each row's last, over its tail): valid, except
        a prompt row's padding (``start_rows``)."""
        column = np.arange(self.width if columns is None else columns)[None, :]
        valid = column >= self.pad[:, None]
        if self.gap.any():  # trimmed rows: not the columns from the sink's end to the gap's end
            sink_end = (self.pad + self.sink)[:, None]
            valid &= (column < sink_end) | (column >= sink_end + self.gap[:, None])
        if self.tail.any():
            new = 0 if columns is None else columns - self.width
            valid &= column < (self.width - self.tail + new)[:, None]
        return valid

    def rewind(self, n: int) -> None:
        """Take the last ``n`` columns back from every row (the drafts a verification rejected):
        the rows share one column index, so they rewind together. Never past a trim, a join or
        a compaction (RewindError): speculation trims only after acceptance."""
        n = int(n)
        if n < 0 or n > self.appended:
            raise RewindError(
                f"cannot rewind {n} columns: {self.appended} were written since the rows last "
                "changed (a trim only follows acceptance)"
            )
        self.width -= n
        self.offsets = self.offsets - n
        self.appended -= n

    def rewind_rows(self, n: np.ndarray) -> None:
        """Take the last ``n[b]`` tokens back from row ``b`` (the drafts it rejected): the
        columns every row gives back leave the width (``rewind``); a row that gives back more
        keeps the rest as tail columns, written over by its next tokens."""
        n = np.asarray(n, np.int64)
        if len(n) != len(self.offsets):
            raise ValueError(f"{len(n)} counts for {len(self.offsets)} rows")
        if not len(n):
            return
        common = int(n.min())
        if n.max() > self.appended or common < 0:
            raise RewindError(
                f"cannot rewind {n.tolist()} columns: {self.appended} were written since the "
                "rows last changed (a trim only follows acceptance)"
            )
        self.rewind(common)
        self.tail = self.tail + n - common
        self.offsets = self.offsets - (n - common)
        self.appended -= int(n.max()) - common

    def trim_front(self, n: np.ndarray, keep: int = 0) -> np.ndarray:
        """Drop each row's oldest ``n[b]`` tokens after its first ``keep``; KVCache's rule per
        row. Returns the number dropped per row."""
        check_trim(n, keep)
        n = np.minimum(np.asarray(n, np.int64), np.maximum(self.row_live_len - keep, 0))
        trimming = n > 0
        if (trimming & self.trimmed & (self.sink != keep)).any():
            raise ValueError(f"trim_front keep={keep} differs from a row's earlier keep")
        self.sink = np.where(trimming, keep, self.sink)
        self.trimmed |= trimming
        self.gap = self.gap + n
        if trimming.any():
            self.appended = 0
        if len(self.pad) and self.waste.min() >= self.step:
            self._compact()
        return n

    @property
    def nbytes(self) -> int:
        """Bytes of the rows' live tokens (the buffer holds up to ``2 * step`` more columns)."""
        if self.keys is None:
            return 0
        per_column = (self.keys.nbytes + (0 if self.values is None else self.values.nbytes)) // (
            self.keys.shape[0] * self.keys.shape[2]
        )
        return int(self.row_live_len.sum()) * per_column

    def arrays(self) -> list[mx.array]:
        return [a for a in (self.keys, self.values) if a is not None]

    def row_prefix_block(self, b: int) -> list[mx.array] | None:
        """What row ``b``'s own cache would give as ``prefix_block(0)``: copies of its tokens
        (``[1, H, n, D]`` each); None once a trim has dropped any. For prompts prefilled
        together (``start_rows``), whose rows the prefix cache snapshots as single prompts'."""
        if self.keys is None or (self.window is None and self.gap[b]):
            return None
        # A full-KV row holds [pad | tokens]; a window row [pad | dropped (gap) | tokens].
        start, end = int(self.pad[b] + self.gap[b]), self.width - int(self.tail[b])
        return [mx.contiguous(a[b : b + 1, :, start:end, :]) for a in self.arrays()]

    def batch_layer(self) -> None:
        return None  # already a batch

    # --- rows joining and leaving -------------------------------------------------------------

    def start_rows(self, lengths: list[int]) -> None:
        """Make this empty cache the rows of prompts prefilled together: one forward of their
        tokens left-padded to the longest. Row ``b``'s first ``pad[b]`` columns are padding,
        never attended to, and its offset starts at ``-pad[b]`` so that its first real token is
        at position 0."""
        lengths = np.asarray(lengths, np.int64)
        self._clear()
        self.pad = lengths.max() - lengths
        self.offsets = -self.pad
        self.sink = np.zeros(len(lengths), np.int64)
        self.gap = np.zeros(len(lengths), np.int64)
        self.trimmed = np.zeros(len(lengths), bool)
        self.tail = np.zeros(len(lengths), np.int64)

    def extend(self, caches: list[KVCache]) -> None:
        """Add one row per cache (single-sequence caches, each ``[1, H, live_len, D]``)."""
        for cache in caches:
            if cache.keys is None or cache.keys.shape[0] != 1:
                raise ValueError("only a single sequence's filled cache joins a decode batch")
        lives = np.array([c.live_len for c in caches], np.int64)
        width = max(self.width, int(lives.max()))
        capacity = _capacity(width + 1)

        def joined(mine: mx.array | None, theirs: list[mx.array]) -> mx.array:
            # Existing rows shift right by the growth of the width; new rows end with them.
            parts = [] if mine is None else [_right_aligned(mine, self.width, width, capacity)]
            parts += [_right_aligned(t, t.shape[2], width, capacity) for t in theirs]
            return _per_part(lambda *rows: mx.concatenate(rows), *parts)

        live = [c.live() for c in caches]
        self.keys = joined(self.keys, [k for k, _ in live])
        if caches[0].values is not None:
            self.values = joined(self.values, [v for _, v in live])
        self.pad = np.concatenate([self.pad + (width - self.width), width - lives])
        self.width = width
        self.offsets = np.concatenate([self.offsets, [c.offset for c in caches]])
        self.sink = np.concatenate([self.sink, [c.sink for c in caches]])
        self.gap = np.concatenate([self.gap, np.zeros(len(caches), np.int64)])
        self.trimmed = np.concatenate([self.trimmed, [c.offset > c.live_len for c in caches]])
        self.tail = np.concatenate([self.tail, np.zeros(len(caches), np.int64)])
        self.appended = 0

    def append_batch(self, other: BatchKVCache) -> None:
        """Add ``other``'s rows after these (a batch of prompts prefilled together), both
        right-aligned on the wider of the two widths. Both hold rows (an empty batch is
        dropped by the pool, not kept)."""
        width = max(self.width, other.width)
        capacity = _capacity(width + 1)

        def joined(mine: mx.array | None, theirs: mx.array | None) -> mx.array | None:
            if mine is None:
                return None
            parts = [_right_aligned(mine, self.width, width, capacity)]
            parts.append(_right_aligned(theirs, other.width, width, capacity))
            return _per_part(lambda *rows: mx.concatenate(rows), *parts)

        self.keys, self.values = joined(self.keys, other.keys), joined(self.values, other.values)
        self.pad = np.concatenate([self.pad + width - self.width, other.pad + width - other.width])
        self.width = width
        for name in ("offsets", "sink", "gap", "trimmed", "tail"):
            setattr(self, name, np.concatenate([getattr(self, name), getattr(other, name)]))
        self.appended = 0

    def fits(self, other: BatchKVCache) -> bool:
        """Whether ``place`` can write ``other``'s rows into rows of this batch: both hold keys
        of one kind, and ``other`` is no wider (its rows end at this batch's column index)."""
        return (
            type(other) is type(self)
            and self.keys is not None
            and other.keys is not None
            and other.width <= self.width
        )

    def place(self, slots: list[int], other: BatchKVCache) -> None:
        """Write ``other``'s rows over rows ``slots`` of this batch (rows whose sequences have
        left: their keys are dropped), right-aligned on this batch's column index: a write of
        those rows only, where ``extend`` and ``keep_rows`` copy every row. See ``fits``."""
        start = self.width - other.width
        for i, b in enumerate(slots):
            self.keys[b, :, start : self.width] = other.keys[i, :, : other.width]
            if self.values is not None:
                self.values[b, :, start : self.width] = other.values[i, :, : other.width]
        self.pad[slots] = other.pad + start
        for name in ("offsets", "sink", "gap", "trimmed", "tail"):
            getattr(self, name)[slots] = getattr(other, name)
        self.appended = 0

    @property
    def waste(self) -> np.ndarray:
        """``[B]`` columns of each row that hold none of its keys (padding, trimmed gap, tail)."""
        return self.pad + self.gap + self.tail

    def keep_rows(self, rows: list[int]) -> None:
        """Keep only ``rows`` (in that order), then compact if every row wastes ``step``."""
        if not rows:
            self._clear()
            return
        index = mx.array(rows)
        self.keys = self.keys[index]
        if self.values is not None:
            self.values = self.values[index]
        for name in ("offsets", "pad", "sink", "gap", "trimmed", "tail"):
            setattr(self, name, getattr(self, name)[rows])
        if self.waste.min() >= self.step:
            self._compact()

    def _compact(self) -> None:
        """Gather each row's live columns, right-aligned, into a buffer as wide as the longest."""
        lives = self.row_live_len
        width = int(lives.max())
        valid = self._valid()
        index = np.zeros((len(lives), width), np.int32)
        for b, live in enumerate(lives):
            index[b, width - live :] = np.flatnonzero(valid[b])
        index = mx.array(index)[:, None, :, None]
        capacity = _capacity(width + 1)
        for name in ("keys", "values"):
            buffer = getattr(self, name)
            if buffer is not None:
                live = _per_part(
                    lambda b: mx.take_along_axis(b, index, axis=2), buffer[..., : self.width, :]
                )
                setattr(self, name, _right_aligned(live, width, width, capacity))
        self.width = width
        self.pad = width - lives
        self.gap = np.zeros_like(self.gap)
        self.tail = np.zeros_like(self.tail)
        self.appended = 0


class BatchWindowedKVCache(BatchKVCache):
    """The rows of sliding-window layers (``WindowedKVCache``): after every write each row keeps
    only its last ``window - 1`` tokens, dropped as gap columns (no copy; compacted as above), so
    every valid key is inside the window of the next query and the rows stay bounded by it."""

    trimmable = False  # bounds itself; --max-kv-size trims the full-KV layers only
    rewindable = False  # its drops follow every write; a rewind would need the keys dropped

    def __init__(self, window: int) -> None:
        super().__init__()
        self.window = window

    def rewind(self, n: int) -> None:
        raise RewindError("a decode batch's sliding-window rows cannot rewind")

    def rewind_rows(self, n: np.ndarray) -> None:
        self.rewind(int(np.max(n, initial=0)))

    def update_and_fetch(
        self, keys: mx.array, values: mx.array | None = None
    ) -> tuple[mx.array, mx.array | None]:
        live = super().update_and_fetch(keys, values)
        self._drop_unseen()
        return live

    def extend(self, caches: list[KVCache]) -> None:
        super().extend(caches)
        self._drop_unseen()

    def place(self, slots: list[int], other: BatchKVCache) -> None:
        super().place(slots, other)
        self._drop_unseen()

    def _drop_unseen(self) -> None:
        self.trim_front(np.maximum(self.row_live_len - (self.window - 1), 0))


class BatchStaging(StagingMixin):
    """``StagingMixin`` for a decode batch's quantised rows: the staged columns are the newest
    of every row, which it stages while no row has a tail (``rewind_rows``: that row's new
    tokens are scattered, not appended). Rows leaving take their staged columns along; whatever
    else moves columns or rows between buffers flushes first."""

    def _clear(self) -> None:
        super()._clear()
        self._clear_staging()

    def _advance(self, n: int) -> None:
        self.width += n
        self.offsets = self.offsets + n
        self.appended += n

    @property
    def _packed_end(self) -> int:
        return self.width - self.staged

    def _stages(self, keys: mx.array, values: mx.array | None) -> bool:
        return not self.tail.any() and super()._stages(keys, values)

    def flush(self) -> None:
        # The staged columns go where they are; a row's tail would scatter them again.
        tail, self.tail = self.tail, np.zeros_like(self.tail)
        try:
            super().flush()
        finally:
            self.tail = tail

    @property
    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        live = self.row_live_len
        staged = np.clip(self.staged - self.tail, 0, live)  # each row's staged tokens
        held = self.keys.nbytes + (0 if self.values is None else self.values.nbytes)
        per_column = held // (self.keys.shape[0] * self.keys.shape[2])
        total = int((live - staged).sum()) * per_column
        return total + (int(staged.sum()) * self._staged_bytes() if self.staged else 0)

    def keep_rows(self, rows: list[int]) -> None:
        if self.staged and rows:
            index = mx.array(rows)
            self.recent_keys = self.recent_keys[index]
            self.recent_values = self.recent_values[index]
        super().keep_rows(rows)

    def _compact(self) -> None:
        self.flush()
        super()._compact()

    def extend(self, caches: list[KVCache]) -> None:
        self.flush()
        super().extend(caches)

    def append_batch(self, other: BatchKVCache) -> None:
        self.flush()
        other.flush()
        super().append_batch(other)

    def place(self, slots: list[int], other: BatchKVCache) -> None:
        self.flush()
        other.flush()
        super().place(slots, other)

    def row_prefix_block(self, b: int) -> list[mx.array] | None:
        self.flush()
        return super().row_prefix_block(b)


class BatchQuantizedKVCache(BatchStaging, QuantizedKVMixin, BatchKVCache):
    """The rows of quantised full-KV layers (``QuantizedKVCache``): ``BatchKVCache``'s layout
    (pads, sinks, gaps, compaction) on ``QuantizedKV`` buffers; no token is requantised. Its
    newest columns are staged in float where mlxc's CUDA kernel reads it (``BatchStaging``)."""

    def __init__(self, quant: KVQuant) -> None:
        super().__init__()
        self.quant = quant


class BatchQuantizedWindowedKVCache(BatchStaging, QuantizedKVMixin, BatchWindowedKVCache):
    """The rows of quantised sliding-window layers (``QuantizedWindowedKVCache``), staged as
    ``BatchQuantizedKVCache``'s where the window is wider than a stage."""

    def __init__(self, window: int, quant: KVQuant) -> None:
        super().__init__(window)
        self.quant = quant

    def _stages(self, keys: mx.array, values: mx.array | None) -> bool:
        return self.window > self.STAGE and super()._stages(keys, values)

    def _after_staging(self) -> None:
        self._drop_unseen()


def _per_part(fn, *buffers):
    """``fn(*buffers)``, or part by part when the buffers are quantised (``QuantizedKV``)."""
    if isinstance(buffers[0], QuantizedKV):
        return buffers[0].map(fn, *buffers[1:])
    return fn(*buffers)


def _capacity(columns: int) -> int:
    return buffer_tokens(columns, KVCache.step)


def _right_aligned(buffer: mx.array, used: int, width: int, capacity: int) -> mx.array:
    """``buffer[..., :used, :]`` placed to end at column ``width`` of ``capacity`` columns."""
    if isinstance(buffer, QuantizedKV):
        return buffer.map(lambda part: _right_aligned(part, used, width, capacity))
    B, H, _, D = buffer.shape
    parts = [buffer[..., :used, :]]
    if width > used:
        parts.insert(0, mx.zeros((B, H, width - used, D), buffer.dtype))
    if capacity > width:
        parts.append(mx.zeros((B, H, capacity - width, D), buffer.dtype))
    return mx.concatenate(parts, axis=2)


def _write_rows(buffer: mx.array, rows: np.ndarray, columns: np.ndarray, new: mx.array) -> None:
    """Write ``new[rows]`` (``[R, H, L, D]`` of ``new [B, H, L, D]``) into ``buffer`` at row
    ``rows[i]``'s ``columns[i]`` (``[R, L]``): each row its own columns, a scatter."""
    r = mx.array(rows, mx.int32)
    # Rows x heads x columns, all indexed: the update is value[r] as it is, [R, H, L, ...].
    index = (r[:, None, None], mx.arange(new.shape[1])[None, :, None], mx.array(columns)[:, None])

    def write(part: mx.array, value: mx.array) -> mx.array:
        part[index] = value[r]
        return part

    _per_part(write, buffer, new)


def _with_capacity(buffer: mx.array, used: int, needed: int) -> mx.array:
    return _right_aligned(buffer, used, used, _capacity(needed))


class BatchPositions:
    """MRoPE positions of decoding rows: ``offset + i + rope_deltas`` on all three axes."""

    def __init__(self) -> None:
        self.deltas = np.zeros(0, np.int64)

    def __call__(self, input_ids: Any, offset: mx.array) -> mrope.TextPositions:
        return mrope.TextPositions(offset + mx.array(self.deltas, mx.int32), input_ids.shape[1])


class BatchCache(SequenceCache):
    """The caches of every decoding sequence: one batch layer per layer (what each layer's cache
    kind gives as its ``batch_layer``), row ``b`` being the ``b``-th sequence added. It goes
    where a model takes a ``SequenceCache``."""

    def __init__(self, layers: list[LayerCache], mrope: bool) -> None:
        super().__init__(layers)
        self.rope_state = BatchPositions() if mrope else None

    @classmethod
    def like(cls, caches: list[LayerCache]) -> BatchCache:
        """An empty batch for sequences whose caches are like ``caches`` (see ``accepts``)."""
        return cls(
            [c.batch_layer() for c in caches], getattr(caches, "rope_state", None) is not None
        )

    @staticmethod
    def accepts(caches: list) -> bool:
        """Whether a sequence's caches can join a batch: every layer's cache kind has a batch
        layer, and positions continue as plain offsets (every image token already seen)."""
        if not caches or not all(is_layer_cache(c) and c.batch_layer() is not None for c in caches):
            return False
        state = getattr(caches, "rope_state", None)
        return state is None or state.grids is None

    def extend(self, sequences: list[list[LayerCache]]) -> None:
        """Add each sequence's caches as a new row (see ``accepts``)."""
        for layer, batch in enumerate(self):
            batch.extend([caches[layer] for caches in sequences])
        if self.rope_state is not None:
            deltas = [int(np.asarray(s.rope_state.deltas).reshape(-1)[0]) for s in sequences]
            self.rope_state.deltas = np.concatenate([self.rope_state.deltas, deltas])

    @staticmethod
    def prefills_together(caches: list) -> bool:
        """Whether prompts with caches like ``caches`` can prefill as the rows of one batch
        (``start_rows``): every layer keeps keys (padding would run through recurrent state)
        and positions are plain offsets (no MRoPE state)."""
        return (
            BatchCache.accepts(caches)
            and getattr(caches, "rope_state", None) is None
            and all(isinstance(c.batch_layer(), BatchKVCache) for c in caches)
        )

    def start_rows(self, lengths: list[int]) -> None:
        """Make this empty batch the rows of prompts of these lengths (see ``prefills_together``
        and ``BatchKVCache.start_rows``)."""
        for batch in self:
            batch.start_rows(lengths)

    def row_prefix_blocks(self, b: int) -> list[list[mx.array] | None]:
        """Row ``b``'s ``prefix_block(0)`` of every layer (``BatchKVCache.row_prefix_block``)."""
        return [layer.row_prefix_block(b) for layer in self]

    def append_batch(self, other: BatchCache) -> None:
        """Add ``other``'s rows after these (``BatchKVCache.append_batch``)."""
        for mine, theirs in zip(self, other):
            mine.append_batch(theirs)

    @property
    def rewindable(self) -> bool:
        """Whether every layer can take tokens back (``rewind_rows``: speculation)."""
        return all(getattr(layer, "rewindable", False) for layer in self)

    def rewind_rows(self, n: np.ndarray) -> None:
        """Take the last ``n[b]`` tokens back from row ``b`` in every layer
        (``BatchKVCache.rewind_rows``; every layer must be rewindable)."""
        for batch in self:
            batch.rewind_rows(n)

    def keep_rows(self, rows: list[int]) -> None:
        for batch in self:
            batch.keep_rows(rows)
        if self.rope_state is not None:
            self.rope_state.deltas = self.rope_state.deltas[rows]

    def place(self, slots: list[int], other: BatchCache) -> bool:
        """Write ``other``'s rows over rows ``slots`` (rows whose sequences have left), layer
        by layer (``BatchKVCache.place``), if every layer can; False (nothing written) if one
        cannot: a layer kind without ``place``, or ``other`` wider than this batch."""
        if len(other) != len(self) or not all(
            hasattr(mine, "place") and mine.fits(theirs) for mine, theirs in zip(self, other)
        ):
            return False
        for mine, theirs in zip(self, other):
            mine.place(slots, theirs)
        if self.rope_state is not None:
            self.rope_state.deltas[slots] = other.rope_state.deltas
        return True

    def wasteful(self, rows: list[int]) -> bool:
        """Whether every one of ``rows`` wastes ``step`` or more columns in some layer, so that
        ``keep_rows(rows)`` would compact it."""
        return any(
            isinstance(batch, BatchKVCache) and batch.waste[rows].min() >= batch.step
            for batch in self
        )

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self)
