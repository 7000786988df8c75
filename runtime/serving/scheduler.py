"""Continuous-batching scheduler and KV cache pool for ``mlxc serve``.

One background thread owns MLX and the model: MLX is not safe under concurrent forwards, so
every model call, sampler call and cache operation happens on it (given a ``load`` function, it
builds the model there too: MLX streams are per thread). Other threads only
``submit`` requests (through a lock-protected queue), ``cancel`` them (a flag) and read
``stats()`` (a snapshot the thread publishes).

Each tick of the loop:

1. admits waiting requests while fewer than ``max_concurrency`` run (continuous batching: new
   sequences join between steps, never mid-step);
2. drops cancelled sequences, which returns their caches to the pool;
3. advances every decoding sequence by one token, all in ONE forward (a decode batch), and ONE
   prefilling sequence (round-robin) by one chunk of at most ``prefill_chunk_size`` tokens, so
   a long prompt costs the others one chunk per token instead of its whole prefill; fresh
   prompts that fit in one chunk go together instead, as the rows of one forward, within the
   same budget of (padded) tokens (``_prompt_group``), waiting a few ticks for each other
   while the batch decodes (``_prompts_wait``);
4. hands each sampled token to its request. The batched step is read one tick later, after the
   next one is queued, so the device works while the host handles tokens.

With ``speculation`` (``mlxc serve --prompt-lookup`` or ``--draft-model``), a tick whose
decode batch is small and whose rows may speculate (``BatchSpeculation``) reads the step in
flight first, drafts each row's next tokens (from n-grams of its own prompt and output, or
from the draft model, one forward per draft token for all rows: ``speculative.BatchDrafter``)
and verifies them in one forward of the batch, while at least half of its rows have a draft
(a row without one takes its one token from that forward); each row accepts by its own rule
(greedy, or the accept/reject rule at its temperature) and keeps what it accepted where that
buys a token per row over cutting every row to the fewest (``speculative.rows_keep``), then
rewinds the rest (``BatchCache.rewind_rows``), and the rows are trimmed. Greedy output is the
plain greedy output; sampled output follows the same distribution.

A decode step reads every weight once whatever the batch size, which is what makes serving
many streams cheaper than serving them one by one. Prefill runs per sequence in its own
``KVCache`` (a prompt batch in a ``BatchCache`` of its own, which joins the decode batch whole
once evaluated); when its prompt is done, a sequence's caches move into the pool's
``BatchCache`` (``runtime.model.batch``), which keeps each row's offset, trims and sinks
apart. Caches that cannot join (model-owned state) decode one forward per sequence.

With a prefix cache (``runtime.serving.prefix_cache``, ``prefix_cache_bytes`` > 0), an
admitted sequence starts from the longest cached prefix of its prompt (its caches resumed, its
``prefilled`` past it) and each of its prefill chunks but the last is snapshotted into the
cache once evaluated; nothing else changes: a hit prefills the rest and joins the decode batch
like any other sequence.

After every prefill chunk and every decode step the pool calls ``enforce_max_kv`` on the caches
that ran (never on ``model-owned`` ones); in the decode batch each row is trimmed on its own. A
failure in one sequence's forward ends that request with a :class:`Failed` event and frees its
caches; the others carry on. A failure of the batched decode forward ends the requests in it.

This module holds the step: the cache pool, the tick and the forwards. Requests, their events
and the admission queue (everything other threads touch) are in ``runtime.serving.admission``; turning
a sampled token into a request's events (detokenizing, stop strings) is ``runtime.serving.output``.
Callers import the request and event names from here (re-exported, see ``__all__``).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any

import mlx.core as mx
import numpy as np
from mlx import nn

from mlxc.runtime.model import cuda_attention, cuda_matmul
from mlxc.runtime.model.batch import BatchCache, BatchKVCache
from mlxc.runtime.model.cache import (
    KVQuant,
    cache_arrays,
    cache_policy,
    check_kv_limits,
    check_kv_quant,
    enforce_max_kv,
    make_caches,
    trimmable,
)
from mlxc.runtime.serving import metrics
from mlxc.runtime.serving.admission import (
    AdmissionQueue,
    Delta,
    Event,
    Failed,
    Finished,
    QueueFull,
    Request,
    SamplingParams,
    SchedulerStopped,
    TokenLogprob,
)
from mlxc.runtime.serving.generate import (
    DEFAULT_KV_SINK,
    as_model_inputs,
    check_prompt,
    prefill_chunks,
    prefill_spans,
)
from mlxc.runtime.serving.output import SequenceOutput, StopMatcher, token_piece
from mlxc.runtime.serving.prefix_cache import (
    TEXT,
    PrefixCache,
    cacheable,
    chunk_key,
    image_digest,
)
from mlxc.runtime.serving.sample import RowSampler, Sampled, sample_rows
from mlxc.runtime.serving.serve_defaults import (
    DEFAULT_PREFILL_WAIT_STEPS,
    DEFAULT_PREFIX_CACHE_BYTES,
)
from mlxc.runtime.serving.speculative import (
    BatchDrafter,
    BatchSpeculation,
    PromptLookup,
    SpecStats,
    accept_drafts,
    decode_bound,
    greedy_accept,
    probs,
    rows_keep,
)
from mlxc.runtime.serving.structured import AnyToken, apply_masks

__all__ = [
    "CachePool",
    "Delta",
    "Event",
    "Failed",
    "Finished",
    "QueueFull",
    "Request",
    "SamplingParams",
    "Scheduler",
    "SchedulerStopped",
    "StopMatcher",
    "TokenLogprob",
]

log = logging.getLogger("mlxc.serve")

# Scheduler._warm_serving's requests, (prompt tokens, sampling), in four waves: the first
# decodes alone; the next four arrive together (two end first, leaving dead rows); two arrive
# together once they have ended (a prompt batch written over the dead rows); the next arrives
# alone once one of those has ended (a row written over a dead one). _WARM_CONSTRAINED's
# output is constrained (by AnyToken: the masked steps of structured output, no grammar).
# The last two arrive once every other has ended (_WARM_COMPACTION_WAVE): a prompt longer
# than a buffer step beside a short one, padded to it in their prompt batch, so that when the
# long one ends the short row wastes a step of columns and the batch compacts (a gather no
# other wave meets, which a loaded server meets once its first answers end).
_WARM_LONG_PROMPT = BatchKVCache.step + 4
_WARM_REQUESTS = (
    (5, SamplingParams(max_tokens=24, ignore_eos=True)),
    (3, SamplingParams(max_tokens=2, ignore_eos=True)),
    (4, SamplingParams(max_tokens=2, ignore_eos=True)),
    (
        7,
        SamplingParams(
            max_tokens=10, ignore_eos=True, temperature=0.7, top_p=0.9, top_k=20, seed=0
        ),
    ),
    (
        4,
        SamplingParams(
            max_tokens=12, ignore_eos=True, logprobs=True, top_logprobs=2, repetition_penalty=1.1
        ),
    ),
    (6, SamplingParams(max_tokens=2, ignore_eos=True)),
    (2, SamplingParams(max_tokens=6, ignore_eos=True, temperature=1.0, min_p=0.05, seed=1)),
    (3, SamplingParams(max_tokens=3, ignore_eos=True)),
    (_WARM_LONG_PROMPT, SamplingParams(max_tokens=2, ignore_eos=True)),
    (3, SamplingParams(max_tokens=6, ignore_eos=True)),
)
_WARM_CONSTRAINED = 3
_ENDED = -1
_ALL_ENDED = (-1, _ENDED)  # a wave that waits for every request before it to end
# (requests, when they arrive: None at once, else (request, tokens it has streamed or _ENDED))
_WARM_WAVES = (((0,), None), ((1, 2, 3, 4), (0, 2)), ((5, 6), (2, _ENDED)), ((7,), (5, _ENDED)))
_WARM_COMPACTION_WAVE = ((8, 9), _ALL_ENDED)
# A VL server's request with an image (``warm_image``): its vision tower runs, and its row
# decodes beside the last text request's (it arrives once that one has streamed a token).
_WARM_IMAGE = len(_WARM_REQUESTS)
_WARM_IMAGE_WAVE = ((_WARM_IMAGE,), (7, 1))
_WARM_MAX_TICKS = 500  # a scheduler that cannot finish them in this many ticks is broken


def _run_then_park(work: list[Callable[[], None]]) -> None:
    """The scheduler thread's body: run the one function in ``work``, then block forever (a
    daemon thread).

    The thread must not end while the process lives: MLX's thread-local state is torn down
    after a thread's Python part has finished, in C++ destructors that take the GIL, so a
    process exiting just then aborts ("terminate called without an active exception", exit
    134). A parked daemon thread has nothing left to tear down when the process exits. The
    function is popped from ``work`` (the Thread object keeps its arguments while it runs), so
    that the parked thread holds no reference to the scheduler or its model.
    """
    main = work.pop()
    try:
        main()
    finally:
        del main
        threading.Event().wait()


def _name_os_thread(name: str) -> None:
    """Give the calling thread ``name`` for the OS too (``top -H``, ``/proc/PID/task/TID/comm``,
    ``bench.serve_compare``'s CPU time per thread): Python names its threads for itself only.
    Linux only; elsewhere, or if libc will not, the thread keeps the process's name."""
    if sys.platform != "linux":
        return
    try:
        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # 15: PR_SET_NAME
    except (OSError, AttributeError):  # cosmetic: a thread without its own name still runs
        pass


# --- cache pool --------------------------------------------------------------------------------


def _cache_nbytes(cache: Any) -> int:
    if hasattr(cache, "nbytes"):
        return int(cache.nbytes)
    # Model-owned state without accounting of its own: count the arrays it holds.
    return sum(a.nbytes for a in cache_arrays([cache]))


class CachePool:
    """Each running sequence's caches, the decode batch, their memory, and the bounded-cache rule.

    Used from the scheduler thread only. A sequence's caches are its own while it prefills;
    ``join`` moves them into ``batch`` (row ``b`` belongs to ``batch_keys[b]``). ``enforce`` is
    the one call site of ``enforce_max_kv`` in the server; model-owned caches
    (the model's ``cache_policy`` is "model-owned") are never trimmed and never batched.

    Rows are slots: a sequence that leaves leaves its row behind, dead (``batch_keys[b]`` is
    None: the step still computes it, ``live_rows`` drops its output), and a sequence that
    joins is written over a dead row (``BatchCache.place``, a write of that row only). Taking
    a row out or adding one at the end copies every row of every layer, which on the H200 cost
    more than a decode step (``bench/batch_churn.py``), and a loaded server's requests end and
    arrive every few steps. The dead rows go (``drop_dead``, one copy) once they are as many as
    the live ones, once every live row wastes a compaction's worth of columns, or before a
    speculative verification.
    """

    def __init__(
        self,
        model: nn.Module | None,
        max_kv_size: int | None,
        kv_sink: int,
        kv_quant: KVQuant | None = None,
    ) -> None:
        self.model = model  # set by the scheduler once it has built the model
        self.max_kv_size = max_kv_size
        self.kv_sink = kv_sink
        self.kv_quant = kv_quant  # --kv-bits: each new sequence's keys and values quantised
        self._caches: dict[str, list] = {}
        self.batch: BatchCache | None = None
        self.batch_keys: list[str | None] = []  # None: a dead row (see the class docstring)
        # When some rows are dead: the live rows' indices, and each row's index into the live
        # rows' inputs (a dead row's: one past them); see slot_inputs and live_rows.
        self._live_index: mx.array | None = None
        self._slot_source: mx.array | None = None
        self.peak_bytes = 0
        self.peak_batched = 0  # the most rows the decode batch has held at once

    @property
    def trims(self) -> bool:
        if self.max_kv_size is None or self.model is None:
            return False
        return cache_policy(self.model) != "model-owned"

    def allocate(self, key: str) -> list:
        caches = make_caches(self.model, self.kv_quant)
        self._caches[key] = caches
        return caches

    def batchable(self, key: str) -> bool:
        caches = self._caches.get(key)
        owned = cache_policy(self.model) == "model-owned"
        return caches is not None and not owned and BatchCache.accepts(caches)

    @property
    def live_keys(self) -> list[str]:
        """The keys of the batch's live rows, in row order."""
        return [k for k in self.batch_keys if k is not None]

    @property
    def _live_slots(self) -> list[int]:
        """The indices of the batch's live rows."""
        return [b for b, k in enumerate(self.batch_keys) if k is not None]

    def join(self, keys: list[str]) -> None:
        """Move these sequences' caches into the decode batch (see ``batchable``)."""
        caches = [self._caches.pop(k) for k in keys]
        if self._has_dead_rows(len(keys)):
            rows = BatchCache.like(caches[0])
            rows.extend(caches)  # these rows alone, then written over dead ones
            if self._place(keys, rows):
                return
        self.drop_dead()
        if self.batch is None:
            self.batch = BatchCache.like(caches[0])
        self.batch.extend(caches)
        self._added(keys)

    def join_batch(self, keys: list[str], batch: BatchCache) -> None:
        """Move the rows of prompts prefilled together (``batch``, row ``b`` = ``keys[b]``)
        into the decode batch; their own caches were never used."""
        for key in keys:
            self._caches.pop(key)
        if self._has_dead_rows(len(keys)) and self._place(keys, batch):
            return
        self.drop_dead()
        if self.batch is None:
            self.batch = batch
        else:
            self.batch.append_batch(batch)
        self._added(keys)

    def release(self, key: str) -> None:
        self._caches.pop(key, None)
        if key in self.batch_keys:
            self.batch_keys[self.batch_keys.index(key)] = None
            live = len(self.live_keys)
            if 2 * live <= len(self.batch_keys):  # as many dead rows as live ones: drop them
                self.drop_dead()
            else:
                self._rows_changed()

    def drop_dead(self) -> None:
        """Take the dead rows out of the batch (one copy of the live ones)."""
        if None in self.batch_keys:
            self._keep_live()

    def _keep_live(self) -> None:
        """Keep the live rows only: one copy, which also compacts the rows that waste ``step``
        columns (``BatchKVCache.keep_rows``)."""
        live = self._live_slots
        if live:
            self.batch.keep_rows(live)
        else:
            self.batch = None
        self.batch_keys = [self.batch_keys[b] for b in live]
        self._rows_changed()

    def slot_inputs(self, ids: mx.array) -> mx.array:
        """``ids [live rows, ...]`` spread over the batch's rows, dead rows given token 0."""
        if self._live_index is None:
            return ids
        padded = mx.concatenate([ids, mx.zeros((1, *ids.shape[1:]), ids.dtype)])
        return padded[self._slot_source]

    def live_rows(self, out: mx.array) -> mx.array:
        """The live rows of ``out [batch rows, ...]``, in row order (dead rows' output dropped)."""
        return out if self._live_index is None else out[self._live_index]

    def _has_dead_rows(self, n: int) -> bool:
        return self.batch is not None and self.batch_keys.count(None) >= n

    def _place(self, keys: list[str], rows: BatchCache) -> bool:
        """Write ``rows`` over the first dead rows, if the batch can (``BatchCache.place``)."""
        slots = [b for b, k in enumerate(self.batch_keys) if k is None][: len(keys)]
        if not self.batch.place(slots, rows):
            return False
        for slot, key in zip(slots, keys):
            self.batch_keys[slot] = key
        if self.batch.wasteful(self._live_slots):  # placed at the column index: fronts unused
            self._keep_live()
        self._added([])
        return True

    def _added(self, keys: list[str]) -> None:
        self.batch_keys += keys
        self.peak_batched = max(self.peak_batched, len(self.live_keys))
        self._rows_changed()

    def _rows_changed(self) -> None:
        self._live_index = self._slot_source = None
        if None in self.batch_keys:
            live = self._live_slots
            source = np.full(len(self.batch_keys), len(live), np.int32)  # dead: the zero appended
            source[live] = np.arange(len(live))
            self._live_index, self._slot_source = mx.array(live), mx.array(source)

    def enforce(self, caches: list) -> int:
        """Trim ``caches`` back to ``max_kv_size`` live tokens (per row); the most dropped."""
        if self.max_kv_size is None:
            return 0
        return enforce_max_kv(trimmable(self.model, caches), self.max_kv_size, self.kv_sink)

    def __len__(self) -> int:
        return len(self._caches) + len(self.live_keys)

    def nbytes(self) -> int:
        total = sum(_cache_nbytes(c) for caches in self._caches.values() for c in caches)
        if self.batch is not None:
            total += self.batch.nbytes
        self.peak_bytes = max(self.peak_bytes, total)
        return total


# --- scheduler -------------------------------------------------------------------------------


def _logprobs(
    seqs: list[_Sequence],
    sampled: Sampled,
    tokens: list[int],
    piece: Callable[[int], tuple[str, list[int]]],
) -> list[TokenLogprob | None]:
    """Each row's TokenLogprob (None where its request did not ask): one host read.
    ``tokens``: ``sampled.tokens``, already read."""
    if sampled.logprobs is None:
        return [None] * len(seqs)
    chosen = sampled.logprobs.tolist()
    ids = values = None
    if sampled.top_ids is not None:
        ids, values = sampled.top_ids.tolist(), sampled.top_logprobs.tolist()
    out: list[TokenLogprob | None] = []
    for b, seq in enumerate(seqs):
        if not seq.sampler.logprobs:
            out.append(None)
            continue
        k = seq.sampler.top_logprobs
        top = [(*piece(t), v) for t, v in zip(ids[b][:k], values[b][:k])] if k else []
        out.append(TokenLogprob(tokens[b], *piece(tokens[b]), chosen[b], top))
    return out


class _Sequence:
    """A running request's generation state (scheduler thread only)."""

    def __init__(
        self,
        request: Request,
        caches: list,
        tokenizer: Any,
        eos_token_ids: frozenset[int],
        spec_seed: int | None = None,
    ) -> None:
        p = request.params
        self.request = request
        self.caches = caches
        # Its sampling options, random key and penalty state (runtime.serving.sample).
        self.sampler = RowSampler(p, request.prompt_ids)
        self.prefilled = 0  # prompt tokens already forwarded
        self.chunks: list[tuple[int, int]] = []  # its prefill chunks (set at admission)
        self.first_inputs = request.model_inputs  # for its first forward (vision inputs)
        # Prefix cache: the trie node at `prefilled` (None: it adds no more nodes), the digest
        # of its images, the marker of its chunks before any image token, whether the prefix
        # it resumed from held every image token, and the node its last chunk makes, added
        # once that chunk is evaluated.
        self.prefix_node = None
        self.image_digest: bytes | None = None
        self.text_marker: bytes | None = None
        self.images_done = False
        self.pending_node: tuple | None = None
        self.batched = False  # its caches are a row of the pool's decode batch
        # Its prompt can prefill as a row of a prompt batch while nothing of it is prefilled
        # (decided once, at admission: Scheduler._prefills_together).
        self.prompt_batchable = False
        self.admitted_tick = 0  # the scheduler's tick count when it was admitted
        self.last_token: int | None = None  # input of the next decode step
        # With speculation (a ``spec_seed``): prompt and generated tokens, where the drafts
        # start from, and the host generator of its accept/reject draws.
        speculates = spec_seed is not None
        self.history: list[int] | None = list(request.prompt_ids) if speculates else None
        self.spec_rng = np.random.default_rng(spec_seed) if speculates else None
        # Its grammar (runtime.serving.structured), None when its output is free.
        self.constraint = p.constraint
        # Its text and events: detokenizer, stop strings, completion tokens.
        self.output = SequenceOutput(tokenizer, p, len(request.prompt_ids), eos_token_ids)

    @property
    def prefilling(self) -> bool:
        return self.prefilled < len(self.request.prompt_ids)

    @property
    def may_speculate(self) -> bool:
        """Greedy, or sampled at a temperature alone (the accept/reject rule keeps that
        distribution; top-p/top-k/min-p are not combined with it), with nothing that adjusts
        or reports its logits."""
        s = self.sampler
        plain = not s.adjusts and not s.logprobs and self.constraint is None
        return plain and (s.greedy or (s.top_p == 1 and s.top_k == 0 and s.min_p == 0))


def _fresh(seq: _Sequence) -> bool:
    """Whether ``seq``'s prompt may still prefill as a row of a prompt batch."""
    return seq.prompt_batchable and seq.prefilled == 0


def _warm_tails(model: nn.Module, kv_quant: KVQuant | None, k: int) -> None:
    """Run, on two throwaway rows of ``model``, what a verification of ``k`` drafts whose rows
    keep different counts leaves to the steps after it (``BatchKVCache.rewind_rows``' tails:
    the scatter of a tailed row's new tokens, per-query masks), so MLX compiles those kernels
    before serving, not at the first such verification (``Scheduler._warm_serving``'s short
    prompts find no drafts: its requests never speculate). CUDA's warm-up, with speculation."""
    rows = []
    for n in (6, 9):
        caches = make_caches(model, kv_quant)
        model(mx.array([list(range(10, 10 + n))], dtype=mx.int32), cache=caches)
        mx.eval(cache_arrays(caches))
        rows.append(caches)
    batch = BatchCache.like(rows[0])
    batch.extend(rows)
    if not batch.rewindable:
        return
    for width, keep in ((k + 1, [1, k + 1]), (1, None), (k + 1, None)):
        # A verification (the first row keeps its input token alone: a tail of k columns),
        # a step writing over the tail, a verification around it.
        mx.eval(model(mx.full((2, width), 11, mx.int32), cache=batch))
        if keep is not None:
            batch.rewind_rows(width - np.array(keep))


class Scheduler:
    """Runs many generations on one model from one thread; see the module docstring."""

    def __init__(
        self,
        model: nn.Module | None,
        tokenizer: Any,
        *,
        load: Callable[[], nn.Module] | None = None,
        eos_token_ids: Iterable[int] = (),
        max_kv_size: int | None = None,
        kv_sink: int = DEFAULT_KV_SINK,
        kv_quant: KVQuant | None = None,
        prefill_chunk_size: int = 512,
        max_concurrency: int = 8,
        max_queue: int = 64,
        prefix_cache_bytes: int = DEFAULT_PREFIX_CACHE_BYTES,
        prefill_wait_steps: int = DEFAULT_PREFILL_WAIT_STEPS,
        lockstep: Any = None,
        speculation: BatchSpeculation | None = None,
        warm_up: bool = True,
        warm_image: Callable[[], tuple[list[int], dict[str, Any]]] | None = None,
    ) -> None:
        """``lockstep``: under ``mlx.launch``, the hook that makes every rank's ticks admit and
        drop the same requests (``runtime.serving.distributed.Lockstep``). ``speculation``:
        prompt-lookup drafts verified in the decode batch (see the module docstring).
        ``prefill_wait_steps``: the most decode steps a fresh prompt waits for others to
        prefill with (``_prompts_wait``); 0 prefills each tick's arrivals at once.
        ``warm_up``: on CUDA, serve throwaway requests before the real ones
        (``_warm_serving``). ``warm_image``: a VL model's image prompt for them (prompt ids and
        vision inputs, as ``submit`` takes them), made when the warm-up runs."""
        if prefill_chunk_size < 1:
            raise ValueError(f"prefill_chunk_size must be >= 1, got {prefill_chunk_size}")
        if prefill_wait_steps < 0:
            raise ValueError(f"prefill_wait_steps must be >= 0, got {prefill_wait_steps}")
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        check_kv_limits(max_kv_size, kv_sink)
        if (model is None) == (load is None):
            raise ValueError("pass either a model or a load function")
        self.model = model
        self._load = load
        # Used on the scheduler thread only (detokenizing). Hugging Face tokenizers are not
        # safe under concurrent use, so prompt encoding elsewhere needs a tokenizer of its own.
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.prefill_chunk_size = prefill_chunk_size
        self.prefill_wait_steps = prefill_wait_steps
        self.warm_up = warm_up
        self._warm_image = warm_image
        self.pool = CachePool(model, max_kv_size, kv_sink, kv_quant)
        # Snapshots of prompts at their chunk boundaries (runtime.serving.prefix_cache).
        self.prefix = PrefixCache(prefix_cache_bytes) if prefix_cache_bytes > 0 else None
        self.lockstep = lockstep
        self.speculation = speculation
        # The drafter: n-grams, or the draft model on a batch of its own (refused here, named,
        # when its caches cannot rewind).
        self._lookup = self._drafter = None
        if speculation is not None and speculation.draft_model is None:
            self._lookup = PromptLookup(speculation.ngram_size)
        elif speculation is not None:
            self._drafter = BatchDrafter(
                speculation.draft_model,
                max_kv_size=max_kv_size,
                kv_sink=kv_sink,
                kv_quant=kv_quant,
                prefill_chunk_size=prefill_chunk_size,
            )
        self.spec_stats = SpecStats()  # verification steps, drafts proposed and kept
        # The seeds of unseeded requests' accept/reject draws, from MLX's generator: under
        # mlx.launch the ranks agree on it (agree_on_seed runs first), so they accept alike.
        self._spec_seeds = None
        if speculation is not None:
            self._spec_seeds = np.random.default_rng(mx.random.randint(0, 2**31, ()).item())

        # Waiting requests, slots, counters, the stats snapshot: shared with other threads.
        self._queue = AdmissionQueue(max_concurrency, max_queue)
        self._running: dict[_Sequence, None] = {}  # admission order; scheduler thread only
        self._prefill_queue: deque[_Sequence] = deque()  # round-robin order of prefills
        self._ticks = 0  # ticks run: a fresh prompt's wait is counted in them (_prompts_wait)
        self._warming = False  # _warm_serving's requests are running (uncounted: _count)
        self._phases = {p: metrics.SCHEDULER_SECONDS.labels(p) for p in metrics.SCHEDULER_PHASES}
        # The batched decode step queued but not read yet: (its rows, their sampled tokens).
        self._inflight: tuple[list[_Sequence], Sampled] | None = None
        self._thread: threading.Thread | None = None
        self._done = threading.Event()  # the loop (or the failed load) is over
        # logprobs' token texts and bytes (scheduler thread)
        self._token_pieces: dict[int, tuple[str, list[int]]] = {}

    # --- any thread ---------------------------------------------------------------------------

    @property
    def max_concurrency(self) -> int:
        return self._queue.max_concurrency

    @property
    def max_queue(self) -> int:
        return self._queue.max_queue

    def start(self) -> None:
        """Start the scheduler thread (idempotent).

        With ``load``, the model is built on that thread first, and a failure to build it
        raises here: MLX streams belong to a thread, so arrays left lazy by one thread (a RoPE
        table computed in a constructor, say) cannot be evaluated on another.
        """
        if self._thread is not None:
            return
        ready = threading.Event()
        errors: list[BaseException] = []
        self._thread = threading.Thread(
            target=_run_then_park,
            args=([functools.partial(self._main, ready, errors)],),
            name="mlxc-scheduler",
            daemon=True,
        )
        self._thread.start()
        ready.wait()
        if errors:
            raise errors[0]

    def _main(self, ready: threading.Event, errors: list[BaseException]) -> None:
        try:
            try:
                if self._load is not None:
                    self.model = self._load()
                check_kv_quant(self.model, self.pool.kv_quant)
                # Before serving: the ragged decode batch's kernels (CUDA only), and those of
                # verifications of up to K drafts.
                queries = (1,)
                if self.speculation is not None:
                    queries = tuple(range(1, self.speculation.num_draft_tokens + 2))
                cuda_attention.warm(self.model, queries, self.pool.kv_quant)
                cuda_matmul.warm(self.model)  # a batch's products
                if self._drafter is not None:
                    cuda_attention.warm(self._drafter.model, queries, self.pool.kv_quant)
                    cuda_matmul.warm(self._drafter.model)
                self.pool.model = self.model
                if self.warm_up and cuda_attention.available():
                    log.info(
                        "warming up: %d throwaway requests (MLX compiles its CUDA kernels at "
                        "first use; about a minute on a machine that has not cached them; "
                        "--no-warmup skips this)",
                        len(_WARM_REQUESTS) + (self._warm_image is not None),
                    )
                    start = time.perf_counter()
                    self._warm_serving()
                    if self.speculation is not None:
                        self._warm_speculation()
                    log.info("warm-up done in %.1f s", time.perf_counter() - start)
            except BaseException as e:  # noqa: BLE001 - start() re-raises it
                errors.append(e)
                return
            finally:
                ready.set()
            # Named once the model has run here: threads MLX started for this thread's streams
            # took the name it had then, so the OS's name stands for this thread alone.
            _name_os_thread(threading.current_thread().name)
            self._loop()
        finally:
            self._done.set()

    def _warm_serving(self) -> None:
        """Serve a few throwaway requests (``_WARM_REQUESTS``) through the scheduler's own ticks
        before the real ones: a lone row decoding, prompts prefilled together and joining it,
        rows ending (dead rows decoded through) and arrivals written over them, sampled rows,
        one asking for logprobs and one whose output is constrained (the masked steps of
        structured output) beside greedy ones; on a VL model, one with an image; last, a
        compaction of the batch's rows (``BatchKVCache.keep_rows``), after a long prompt's row.

        MLX's CUDA backend compiles (NVRTC) a module the first time a kernel variant runs, a
        second or more each; met by real requests, every stream waits. On the H200 the first
        16-stream wave waited 2.5 s for its first tokens while MLX compiled a gather module for
        the batched decode step (``bench/results/warm-gpu-h200/``), after a warm-up whose steps
        were its own, not the scheduler's. So this one takes the scheduler's. A served
        64-stream run still fell to a sixth of its rate for 4-7 s once its first answers ended
        (``bench/results/serve-profile-gpu-h200-s20/``), most likely compiling the
        compaction's gather along the columns (``mx.take_along_axis``, a module of its own):
        the one batch path no wave took, hence the last wave (with it, s21's served run on an
        H100 compiled nothing and did not dip).

        The requests have a queue of their own and skip the prefix cache; no counter or metric
        sees them (``_count``). Called on CUDA only."""
        waves, image = list(_WARM_WAVES), None
        if self._warm_image is not None:
            try:
                image = self._warm_image()
            except Exception as e:  # noqa: BLE001 - real image requests will say what fails
                log.warning("warming up without an image: %s: %s", type(e).__name__, e)
            else:
                waves.append(_WARM_IMAGE_WAVE)
        waves.append(_WARM_COMPACTION_WAVE)
        queue, prefix = self._queue, self.prefix
        self._queue, self.prefix = AdmissionQueue(_WARM_IMAGE + 1, 0), None
        self._warming = True
        streamed: dict[int, int] = {}  # warm request -> tokens it has streamed, or _ENDED

        def submit(index: int) -> None:
            vision = None
            if index == _WARM_IMAGE:
                prompt, vision = image
                params = SamplingParams(max_tokens=2, ignore_eos=True)
            else:
                length, params = _WARM_REQUESTS[index]
                if index == _WARM_CONSTRAINED:
                    params = replace(params, constraint=AnyToken(len(self.tokenizer)))
                prompt = [10 + (7 * index + 3 * i) % 50 for i in range(length)]
            streamed[index] = 0

            def emit(event: Event) -> None:  # a failure is logged by _fail, after "warming up"
                streamed[index] = streamed[index] + 1 if isinstance(event, Delta) else _ENDED

            self._queue.submit(prompt, params, emit, vision, lambda: False)

        def arrives(when: tuple[int, int] | None) -> bool:
            if when is None:
                return True
            if when == _ALL_ENDED:
                return all(now == _ENDED for now in streamed.values())
            index, tokens = when
            now = streamed.get(index, 0)
            return now == _ENDED or tokens != _ENDED and now >= tokens

        try:
            for _ in range(_WARM_MAX_TICKS):
                while waves and arrives(waves[0][1]):
                    for index in waves.pop(0)[0]:
                        submit(index)
                for request in self._queue.admit(busy=True):
                    self._admit(request)
                self._tick()
                if not waves and not self._running:
                    break
            else:
                raise RuntimeError(f"warm-up requests unfinished after {_WARM_MAX_TICKS} ticks")
        finally:
            self._queue, self.prefix, self._warming = queue, prefix, False
            self.spec_stats = SpecStats()
            self.pool.peak_batched = self.pool.peak_bytes = 0

    def _warm_speculation(self) -> None:
        """``_warm_tails`` for the target and the draft model (its rows rewind per row too). A
        failure is logged, not raised: real verifications would meet the same and fail only
        the requests in them."""
        k = self.speculation.num_draft_tokens
        models = [(self.model, self.pool.kv_quant)]
        if self._drafter is not None:
            models.append((self._drafter.model, self._drafter.kv_quant))
        try:
            for model, kv_quant in models:
                _warm_tails(model, kv_quant, k)
        except Exception as e:  # noqa: BLE001 - see the docstring
            log.warning("warming up speculation failed: %s: %s", type(e).__name__, e)

    def request_stop(self) -> None:
        """Begin shutting down without waiting (signal handlers): the loop ends after its
        current step, and running and waiting requests end with a Failed(shutdown) event."""
        self._queue.request_stop()

    def stop(self, timeout: float | None = 10.0) -> None:
        """``request_stop``, then wait (up to ``timeout`` seconds) for the loop to end."""
        self.request_stop()
        if self._thread is not None:
            self._done.wait(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and not self._done.is_set()

    def submit(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        emit: Callable[[Event], None],
        model_inputs: dict[str, Any] | None = None,
    ) -> Request:
        """Queue a generation; ``emit`` receives its events on the scheduler thread.

        ``model_inputs`` go to the forward of the first prefill chunk (vision inputs; numpy
        arrays are converted on the scheduler thread).

        Raises ValueError for an empty prompt or a token id outside the model's (and the draft
        model's) vocabulary (``check_prompt``), QueueFull when ``max_queue`` requests already
        wait, SchedulerStopped after ``stop``. ``emit`` must not block; an exception from it
        cancels the request.
        """
        models = [self.model] + ([self.speculation.draft_model] if self._drafter else [])
        check_prompt(prompt_ids, *models)
        return self._queue.submit(prompt_ids, params, emit, model_inputs, self._ended)

    def stats(self) -> dict[str, Any]:
        snapshot, waiting, running, counts = self._queue.read_stats()
        return {
            "running": running,
            "waiting": waiting,
            "max_concurrency": self.max_concurrency,
            "max_queue": self.max_queue,
            "pool": {
                "sequences": snapshot["pool_sequences"],
                "batched": snapshot["pool_batched"],  # rows of the decode batch
                "peak_batched": self.pool.peak_batched,
                "bytes": snapshot["pool_bytes"],
                "peak_bytes": self.pool.peak_bytes,
                "max_kv_size": self.pool.max_kv_size,
                "kv_sink": self.pool.kv_sink,
                "kv_bits": None if self.pool.kv_quant is None else self.pool.kv_quant.bits,
                "trims": self.pool.trims,
            },
            "prefix_cache": snapshot.get("prefix_cache"),
            "speculation": snapshot.get("speculation"),
            "requests": counts,
        }

    def _ended(self) -> bool:
        """The scheduler thread was started and its loop (or its load) is over."""
        return self._thread is not None and self._done.is_set()

    # --- scheduler thread -----------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            admit = functools.partial(self._queue.admit, busy=bool(self._running))
            if self.lockstep is None:
                admitted = admit()
            else:  # the same admissions and cancellations on every rank
                admitted = self.lockstep.admit(admit, self._running)
            if admitted is None:  # request_stop
                break
            for request in admitted:
                self._admit(request)
            try:
                self._tick()
            except Exception as e:  # a bug outside any one sequence: fail them all, keep serving
                log.exception("scheduler tick failed")
                for seq in list(self._running):
                    self._fail(seq, e)
            self._publish()
        self._shutdown()

    def _admit(self, request: Request) -> None:
        try:
            caches = self.pool.allocate(request.id)
            spec_seed = None
            if self._spec_seeds is not None:  # the request's seed, else the next agreed one
                spec_seed = request.params.seed
                if spec_seed is None:
                    spec_seed = int(self._spec_seeds.integers(2**63))
                spec_seed %= 2**64  # numpy takes no negative seed; OpenAI's are any int64
            seq = _Sequence(request, caches, self.tokenizer, self.eos_token_ids, spec_seed)
            seq.admitted_tick = self._ticks
            prompt = request.prompt_ids
            seq.chunks = prefill_chunks(
                len(prompt), self.prefill_chunk_size, prefill_spans(self.model, prompt)
            )
            self._resume(seq)
            seq.prompt_batchable = self._prefills_together(seq)
        except Exception as e:  # noqa: BLE001 - a bad request must not stop the loop
            self.pool.release(request.id)
            request.send(Failed(f"cannot start generation: {e}"))
            self._queue.count("failed")
            self._queue.release_slot()
            return
        self._running[seq] = None
        self._prefill_queue.append(seq)

    def _resume(self, seq: _Sequence) -> None:
        """Start ``seq`` from the longest cached prefix of its prompt, if any."""
        if (
            self.prefix is None
            or cache_policy(self.model) == "model-owned"
            or not cacheable(seq.caches)
        ):
            return
        if seq.request.model_inputs:
            seq.image_digest = image_digest(seq.request.model_inputs)
            markers = (None, seq.image_digest)
        elif getattr(self.model, "vision_tower", None) is not None:
            seq.text_marker = TEXT  # its text may hold image placeholder ids (prefix_cache)
            markers = (None, TEXT)
        else:
            markers = (None,)
        seq.prefix_node = self.prefix.root
        hit = self.prefix.lookup(seq.request.prompt_ids, seq.chunks, markers)
        if hit is None:
            return
        self.prefix.restore(hit, seq.caches)
        seq.prefilled = seq.output.cached_tokens = hit.tokens
        self._count(metrics.PREFIX_CACHE_HITS)
        self._count(metrics.PREFIX_CACHE_HIT_TOKENS, hit.tokens)
        seq.prefix_node = hit.node
        if hit.images_done:  # every image token is in the prefix: no vision inputs to run
            seq.first_inputs, seq.images_done = None, True

    def _snapshot(
        self,
        seq: _Sequence,
        start: int,
        end: int,
        blocks_of: Callable[[], list[list[mx.array] | None]] | None = None,
    ) -> list[mx.array]:
        """Copies of what ``seq``'s caches need to resume at ``end``, the chunk ``[start, end)``
        just built (lazy: evaluated with it, added to the trie by ``_store``). ``blocks_of``
        gives each layer's copies; by default each of ``seq.caches``' ``prefix_block(start)``
        (a prompt prefilled as a row of a batch has its batch's instead)."""
        node = seq.prefix_node
        if node is None:
            return []
        phase = self._image_phase(seq)
        if node.evicted or node.end != start or phase is None:
            seq.prefix_node = None
            return []
        marker = seq.text_marker if phase == "text" else seq.image_digest
        key = chunk_key(seq.request.prompt_ids, start, end, marker)
        state = getattr(seq.caches, "rope_state", None) if phase == "done" else None
        if self.prefix.child(node, key) is not None:  # another request stored it already
            seq.pending_node = (node, key, end, [], phase, state)
            return []
        blocks = blocks_of() if blocks_of else [c.prefix_block(start) for c in seq.caches]
        if any(b is None for b in blocks):  # a trimmed cache: its prefix is no longer whole
            seq.prefix_node = None
            return []
        seq.pending_node = (node, key, end, blocks, phase, state)
        return [a for b in blocks for a in b]

    def _image_phase(self, seq: _Sequence) -> str | None:
        """Where the prefix stands against the request's image tokens: "text" (none seen: the
        caches depend on the tokens alone), "mid" (some), "done" (all); None: unknown."""
        if seq.image_digest is None:
            return "text"
        if seq.images_done:
            return "done"
        images = getattr(seq.caches, "images", None)
        if images is None:  # a model that keeps its image features elsewhere: do not guess
            return None
        if images.consumed == 0:
            return "text"
        return "mid" if images.consumed < images.embeds.shape[0] else "done"

    def _store(self, seq: _Sequence) -> None:
        """Add the node of ``seq``'s evaluated chunk to the trie (see ``_snapshot``)."""
        if seq.pending_node is None:
            return
        parent, key, end, blocks, phase, state = seq.pending_node
        seq.pending_node = None
        seq.prefix_node = self.prefix.insert(
            parent,
            key,
            end,
            blocks,
            resumable=phase != "mid",
            images_done=phase == "done",
            prompt_state=state,
        )

    def _tick(self) -> None:
        start = time.perf_counter()
        try:
            self._tick_work()
        finally:
            self._spent("tick", start)

    def _tick_work(self) -> None:
        self._ticks += 1
        for seq in [s for s in self._running if self._cancelled(s)]:
            self._release(seq)
            self._queue.count("cancelled")

        # A sequence whose prompt is done decodes in the batch from now on.
        joining = [s for s in self._running if not (s.prefilling or s.batched)]
        joining = [s for s in joining if self.pool.batchable(s.request.id)]
        if joining:
            self.pool.join([s.request.id for s in joining])
            for seq in joining:
                seq.batched, seq.caches = True, []

        work = [s for s in self._running if not (s.prefilling or s.batched)]
        together: list[_Sequence] = []  # fresh prompts prefilled as the rows of one batch
        first = self._next_prefill()
        if first is not None:
            together = self._prompt_group(first)
            if len(together) == 1:
                work.append(together.pop())

        # The batched decode step is queued first and read one tick later: its inputs are the
        # tokens of the step still in flight, so the device never waits for the host (as in
        # generate_tokens). A row that turns out finished when its token is read has had one
        # step too many; that step's token is dropped with its row.
        previous, self._inflight = self._inflight, None
        deferred: tuple[list[_Sequence], mx.array] | None = None
        rows = self._batch_rows()
        if rows and self._may_speculate(rows):
            if previous is not None:  # the drafts continue the tokens in flight: read them
                self._read_tokens(*previous)
                previous = None
            self.pool.drop_dead()  # a verification's rows are the batch's rows
            rows = self._batch_rows()
            start = time.perf_counter()
            if rows and self._speculate(rows):
                rows = []  # the verification was this tick's batched step
            self._spent("verify", start)
        if rows:
            try:
                start = time.perf_counter()
                sampled = self._decode_batch(rows, previous)
                start = self._spent("build", start)
                if isinstance(sampled, Sampled):
                    mx.async_eval(sampled.arrays())
                    self._inflight = (rows, sampled)
                else:  # constrained rows: sampled below, once their masks are known
                    mx.async_eval(sampled)
                    deferred = (rows, sampled)
                self._spent("dispatch", start)
            except Exception as e:  # noqa: BLE001 - ends the batched requests only
                for seq in rows:
                    self._fail(seq, e)
        if previous is not None:
            self._read_tokens(*previous)
        if deferred is not None:
            # The previous step's tokens are in the grammars now: the masks are computed on
            # the host while the device runs this step's forward, then the batch is sampled.
            rows, logits = deferred
            try:
                sampled = sample_rows(self._masked(rows, logits), [seq.sampler for seq in rows])
                mx.async_eval(sampled.arrays())
                self._inflight = (rows, sampled)
            except Exception as e:  # noqa: BLE001 - ends the batched requests only
                for seq in rows:
                    if seq in self._running:
                        self._fail(seq, e)

        # (sequences, arrays to evaluate, their sampled tokens or None, their prompt batch)
        built: list[tuple[list[_Sequence], list[mx.array], Sampled | None, BatchCache | None]]
        built = []
        start = time.perf_counter()
        if together:
            try:
                built.append((together, *self._prefill_together(together)))
            except Exception as e:  # noqa: BLE001 - MLX errors in the forward end these only
                for seq in together:
                    self._fail(seq, e)
        for seq in work:
            try:
                arrays, token = self._advance(seq)
            except Exception as e:  # noqa: BLE001 - MLX errors in a forward end that request only
                self._fail(seq, e)
                continue
            built.append(([seq], arrays, token, None))
            if seq.prefilling:
                self._prefill_queue.append(seq)  # back of the round-robin for its next chunk

        try:
            mx.eval([a for _, arrays, _, _ in built for a in arrays])
        except Exception as error:  # noqa: BLE001 - retried one by one just below
            # Find the sequence(s) whose graph fails; the others' results stand.
            ok = []
            for item in built:
                try:
                    mx.eval(item[1])
                    ok.append(item)
                except Exception as e:  # noqa: BLE001 - this graph fails
                    for seq in item[0]:
                        self._fail(seq, e)
            if len(ok) == len(built):
                # None failed again: the error came from evaluating a kernel, which MLX's CPU
                # stream reports once, to the next evaluation, leaving the array unfilled. Which
                # graph it was cannot be told, so none of them is trusted.
                for seqs, _, _, _ in ok:
                    for seq in seqs:
                        self._fail(seq, error)
                ok = []
            built = ok
        for seqs, _, token, batch in built:
            for seq in seqs:
                self._store(seq)  # the snapshots of chunks just evaluated, if any
            if batch is not None:  # evaluated: its rows join the decode batch
                self.pool.join_batch([s.request.id for s in seqs], batch)
                for seq in seqs:
                    seq.batched, seq.caches = True, []
            if token is not None:
                self._spent("prefill", start)
                self._read_tokens(seqs, token)
                start = time.perf_counter()
        if built:
            self._spent("prefill", start)

    def _batch_rows(self) -> list[_Sequence]:
        """The sequences of the decode batch's rows, in row order."""
        by_key = {s.request.id: s for s in self._running}
        return [by_key[k] for k in self.pool.live_keys]

    def _may_speculate(self, rows: list[_Sequence]) -> bool:
        """Whether this tick's batched step may be a verification (``BatchSpeculation``)."""
        spec = self.speculation
        if spec is None or len(rows) > spec.max_rows:
            return False

        if not all(seq.may_speculate for seq in rows):
            return False
        return self.pool.batch.rewindable

    def _speculate(self, rows: list[_Sequence]) -> bool:
        """Draft, verify and accept for every row of the decode batch, synchronously (the
        next drafts depend on what this step accepts). Each row keeps what it accepted, or all
        are cut to the fewest (``rows_keep``; ``BatchCache.rewind_rows``); a row without
        drafts takes its one token from the same forward. False when fewer than half the rows
        have a draft (or no room for one): nothing was run, the tick takes a plain step,
        unpipelined (the step in flight was read to draft; a batch often short of drafts pays
        that each tick)."""
        # A step emits up to k + 1 tokens per row, within each row's max_tokens.
        limits = [
            min(
                self.speculation.num_draft_tokens,
                s.request.params.max_tokens - s.output.generated - 1,
            )
            for s in rows
        ]
        batch = self.pool.batch
        k = max(limits)
        if 2 * sum(n > 0 for n in limits) < len(rows):
            return False
        try:
            if self._lookup is not None:
                drafted = [
                    (self._lookup.propose(seq.history, n, 0.0, None)[0] if n else [], None)
                    for seq, n in zip(rows, limits)
                ]
            else:  # the draft model decodes k tokens for all rows, one forward each
                drafted = self._drafter.propose(
                    [seq.request.id for seq in rows],
                    [seq.history for seq in rows],
                    k,
                    [0.0 if seq.sampler.greedy else seq.sampler.temperature for seq in rows],
                    [seq.spec_rng for seq in rows],
                )
        except Exception as e:  # noqa: BLE001 - a draft forward failed: these requests end
            for seq in rows:
                self._fail(seq, e)
            return True
        drafts = [d[: max(n, 0)] for (d, _), n in zip(drafted, limits)]
        if 2 * sum(bool(d) for d in drafts) < len(rows):
            if self._drafter is not None:
                self._drafter.accepted([0] * len(rows))
            return False
        width = 1 + max(len(d) for d in drafts)  # a row with fewer drafts repeats its last
        ids = [[seq.last_token, *d] for seq, d in zip(rows, drafts)]
        ids = mx.array([row + row[-1:] * (width - len(row)) for row in ids], dtype=mx.int32)
        try:
            # Under --max-kv-size each query sees what its one-token step, trimmed, would have.
            bound = self.pool.max_kv_size if self.pool.trims else None
            with decode_bound(trimmable(self.model, batch), bound, self.pool.kv_sink):
                logits = self.model(ids, cache=batch)
            self._count(metrics.VERIFY_FORWARDS)
            targets = mx.argmax(logits, axis=-1).tolist()
            emitted = [
                greedy_accept(targets[b], d)
                if seq.sampler.greedy
                else accept_drafts(probs(logits[b], seq.sampler.temperature), q, d, seq.spec_rng)
                for b, (seq, d, (_, q)) in enumerate(zip(rows, drafts, drafted))
            ]
        except Exception as e:  # noqa: BLE001 - ends the batched requests only
            for seq in rows:
                self._fail(seq, e)
            return True
        # Each row's caches keep its input token and the drafts it keeps.
        emitted = rows_keep(emitted)
        kept = np.array([len(tokens) for tokens in emitted])
        batch.rewind_rows(width - kept)
        self.pool.enforce(batch)
        if self._drafter is not None:  # the draft's rows keep the same drafts
            self._drafter.accepted((kept - 1).tolist())
        stats = self.spec_stats
        proposed, accepted = sum(len(d) for d in drafts), int((kept - 1).sum())
        stats.steps += 1
        stats.proposed += proposed
        stats.accepted += accepted
        self._count(metrics.SPEC_STEPS)
        self._count(metrics.SPEC_DRAFT_TOKENS, proposed)
        self._count(metrics.SPEC_ACCEPTED_TOKENS, accepted)
        for seq, tokens in zip(rows, emitted):
            for token in tokens:
                if seq not in self._running:
                    break  # finished on an earlier token: the rest is dropped with its row
                try:
                    self._accept(seq, token)
                except Exception as e:  # noqa: BLE001 - ends this request only
                    self._fail(seq, e)
        return True

    def _next_prefill(self) -> _Sequence | None:
        """The sequence whose prompt moves this tick (taken off the round-robin queue), or
        None: the front of the queue while fresh prompts need not wait, else the first prompt
        already under way (a fresh prompt's wait never holds up a chunked one)."""
        queue = self._prefill_queue
        if not queue:
            return None
        if not self._prompts_wait():
            return queue.popleft()
        seq = next((s for s in queue if not _fresh(s)), None)
        if seq is not None:
            queue.remove(seq)
        return seq

    def _prompts_wait(self) -> bool:
        """Whether fresh prompts wait this tick, to prefill later as the rows of one forward.

        On a GPU a short prompt's forward costs about a decode step's kernel launches, and the
        tick evaluates it before the next step is queued (the device idles while the host
        builds that step); prompts arriving one or two per tick would each pay it. So they
        wait while the decode batch runs, until a quarter of its rows' count wait (a group
        worth the forward) or the oldest has waited ``prefill_wait_steps`` ticks (its first
        token late by at most that many decode steps). Counted in ticks, so ranks under
        ``mlx.launch`` agree. (On the H200 the served load's prompts already came a few at a
        time: this halved its prefill forwards without moving its rate, ``docs/performance.md``.)
        """
        live = len(self.pool.live_keys)
        if self.prefill_wait_steps == 0 or not live:
            return False  # nothing decodes: a prompt would wait for nothing
        fresh = [s for s in self._prefill_queue if _fresh(s)]
        if not fresh or 4 * len(fresh) >= live:
            return False
        return self._ticks - min(s.admitted_tick for s in fresh) < self.prefill_wait_steps

    def _prompt_group(self, first: _Sequence) -> list[_Sequence]:
        """``first`` and the waiting prompts that prefill with it as the rows of one batch (one
        forward instead of one each: a short prompt's forward costs its kernel launches, not
        its tokens), within one chunk's budget of padded tokens; just ``[first]`` when it
        cannot (see ``_prefills_together``)."""
        if not _fresh(first):
            return [first]
        group, width = [first], first.chunks[0][1]
        for seq in list(self._prefill_queue):
            if not _fresh(seq) or len(seq.chunks) != len(first.chunks):
                continue
            wider = max(width, seq.chunks[0][1])
            if (len(group) + 1) * wider > self.prefill_chunk_size:
                break
            group.append(seq)
            width = wider
            self._prefill_queue.remove(seq)
        return group

    def _prefills_together(self, seq: _Sequence) -> bool:
        """Whether ``seq``'s prompt, just admitted, can be a row of a prompt batch: nothing
        prefilled yet (no prefix hit), no vision inputs, its caches kinds that take padding
        (``BatchCache.prefills_together``), and a prompt of one chunk, or of one chunk and its
        last token alone (the CPU's split, ``prefill_chunks``; the prefix cache snapshots each
        row's first chunk from the batch, ``_prefill_together``)."""
        chunks = seq.chunks
        return (
            seq.prefilled == 0
            and not seq.first_inputs
            and (len(chunks) == 1 or (len(chunks) == 2 and chunks[1][1] - chunks[1][0] == 1))
            and cache_policy(self.model) != "model-owned"
            and BatchCache.prefills_together(seq.caches)
        )

    def _prefill_together(
        self, group: list[_Sequence]
    ) -> tuple[list[mx.array], Sampled, BatchCache]:
        """Build (lazily) the prefill of ``group``'s prompts as the rows of one new batch,
        left-padded to the longest (``BatchCache.start_rows``), and their first tokens; the
        batch joins the decode batch once evaluated (``_tick``). The chunks are each prompt's
        own (``prefill_chunks``), so greedy output matches prefilling alone; so do the prefix
        cache's snapshots of a first chunk before the last token (``_snapshot``)."""
        prompts = [seq.request.prompt_ids for seq in group]
        heads = [prompt[: seq.chunks[0][1]] for prompt, seq in zip(prompts, group)]
        width = max(len(head) for head in heads)
        batch = BatchCache.like(group[0].caches)
        batch.start_rows([len(head) for head in heads])
        ids = mx.array([[0] * (width - len(head)) + head for head in heads], dtype=mx.int32)
        last_token_alone = len(group[0].chunks) == 2
        logits = self.model(ids, cache=batch, last_only=not last_token_alone)
        self.pool.enforce(batch)
        snapshots = []
        if last_token_alone:
            if self.prefix is not None:  # each row's first chunk, as its prompt alone stores it
                for b, (seq, head) in enumerate(zip(group, heads)):
                    blocks_of = functools.partial(batch.row_prefix_blocks, b)
                    snapshots += self._snapshot(seq, 0, len(head), blocks_of)
            tails = mx.array([prompt[-1:] for prompt in prompts], dtype=mx.int32)
            logits = self.model(tails, cache=batch, last_only=True)
            self.pool.enforce(batch)
        self._count(metrics.PREFILL_FORWARDS, 2 if last_token_alone else 1)
        for seq, prompt in zip(group, prompts):
            seq.prefilled = len(prompt)
        sampled = sample_rows(self._masked(group, logits[:, -1, :]), [s.sampler for s in group])
        return sampled.arrays() + snapshots, sampled, batch

    def _cancelled(self, seq: _Sequence) -> bool:
        if self.lockstep is not None:
            return seq.request.id in self.lockstep.cancelled  # decided once for every rank
        return seq.request.cancelled

    def _decode_batch(
        self, rows: list[_Sequence], previous: tuple[list[_Sequence], Sampled] | None
    ) -> Sampled | mx.array:
        """Build (lazily) one decode step of every batched sequence: their tokens ``[B]``, or,
        when a row's output follows a grammar, the logits ``[B, V]`` to sample once the step
        in flight is read (its token moves the grammar the mask comes from).

        A row's input is its token in ``previous`` (the step in flight, not read yet) or, for a
        row that joined since, its first token, read when its prefill ended.
        """
        carried, pending = ([], None) if previous is None else (previous[0], previous[1].tokens)
        if carried == rows:  # the usual step: the same rows in the same order, no new array
            ids = pending[:, None]
        else:
            where = {id(seq): i for i, seq in enumerate(carried)}  # row -> index into `inputs`
            joined = [seq for seq in rows if id(seq) not in where]
            where |= {id(seq): len(carried) + j for j, seq in enumerate(joined)}
            inputs = mx.array([seq.last_token for seq in joined], dtype=mx.int32)
            if pending is not None:
                inputs = mx.concatenate([pending, inputs])
            ids = inputs[mx.array([where[id(seq)] for seq in rows])][:, None]
        # The batch's dead rows (CachePool) take a token too; their outputs are dropped.
        logits = self.model(self.pool.slot_inputs(ids), cache=self.pool.batch)
        self._count(metrics.DECODE_FORWARDS)
        self.pool.enforce(self.pool.batch)
        logits = self.pool.live_rows(logits[:, -1, :])
        if any(seq.constraint is not None for seq in rows):
            return logits  # their masks need the step in flight: see _tick
        # Every row's own sampling, in one batched call (one argmax when all are greedy).
        return sample_rows(logits, [seq.sampler for seq in rows])

    def _masked(self, rows: list[_Sequence], logits: mx.array) -> mx.array:
        """``logits`` with each constrained row's grammar mask applied (rows that ended since
        are left alone: their token is dropped)."""
        which = [b for b, s in enumerate(rows) if s.constraint is not None and s in self._running]
        return apply_masks(logits, which, [rows[b].constraint.bitmask() for b in which])

    def _read_tokens(self, seqs: list[_Sequence], sampled: Sampled) -> None:
        """Hand each sequence its sampled token (one host read); skips ones already ended."""
        start = time.perf_counter()
        try:
            values = sampled.tokens.tolist()
            logprobs = _logprobs(seqs, sampled, values, self._token_piece)
        except Exception as e:  # noqa: BLE001 - the forward's graph failed: its requests end
            for seq in seqs:
                if seq in self._running:
                    self._fail(seq, e)
            return
        finally:
            start = self._spent("read", start)
        for seq, token, logprob in zip(seqs, values, logprobs):
            if seq not in self._running:
                continue  # finished, cancelled or failed while this step was in flight
            try:
                self._accept(seq, token, logprob)
            except Exception as e:  # noqa: BLE001 - ends this request only
                self._fail(seq, e)
        self._spent("hand_out", start)

    def _token_piece(self, token: int) -> tuple[str, list[int]]:
        """A token's text and bytes alone (logprobs), cached: the same few tokens recur."""
        piece = self._token_pieces.get(token)
        if piece is None:
            piece = self._token_pieces[token] = token_piece(self.tokenizer, token)
        return piece

    def _spent(self, phase: str, since: float) -> float:
        """Add the time since ``since`` (a ``perf_counter`` reading) to ``phase`` of
        ``mlxc_scheduler_seconds`` (not while warming up, as ``_count``); return now."""
        now = time.perf_counter()
        if not self._warming:
            self._phases[phase].inc(now - since)
        return now

    def _count(self, counter: Any, n: int = 1) -> None:
        """Add ``n`` to a Prometheus counter (``runtime.serving.metrics``), unless the
        warm-up's throwaway requests are running: the counters count what was served."""
        if not self._warming:
            counter.inc(n)

    def _forward(self, seq: _Sequence, ids: list[int], **kwargs) -> mx.array:
        self._count(metrics.PREFILL_FORWARDS if seq.prefilling else metrics.DECODE_FORWARDS)
        inputs = dict(kwargs)
        if seq.first_inputs is not None:  # numpy inputs become MLX arrays here, on this thread
            inputs |= as_model_inputs(seq.first_inputs)
            seq.first_inputs = None
        logits = self.model(mx.array([ids], dtype=mx.int32), cache=seq.caches, **inputs)
        self.pool.enforce(seq.caches)  # after every prefill chunk and every decode step
        return logits

    def _advance(self, seq: _Sequence) -> tuple[list[mx.array], Sampled | None]:
        """Build (lazily) one prefill chunk or one decode step: (arrays to evaluate, token).

        The chunking is ``generate_tokens``'s (``prefill_chunks``), the last chunk's last logits
        giving the first token; so greedy output matches ``mlxc generate`` token for token,
        trims included.
        """
        if seq.prefilling:
            prompt = seq.request.prompt_ids
            start, end = next((a, b) for a, b in seq.chunks if a == seq.prefilled)
            if end < len(prompt):
                self._forward(seq, prompt[start:end])
                seq.prefilled = end
                return cache_arrays(seq.caches) + self._snapshot(seq, start, end), None
            logits = self._forward(seq, prompt[start:end], last_only=True)
            seq.prefilled = end
        else:
            logits = self._forward(seq, [seq.last_token])
        sampled = sample_rows(self._masked([seq], logits[:, -1, :]), [seq.sampler])
        return sampled.arrays(), sampled

    def _accept(self, seq: _Sequence, token: int, logprob: TokenLogprob | None = None) -> None:
        if seq.constraint is not None:
            seq.constraint.accept(token)
        if seq.history is not None:
            seq.history.append(token)
        if seq.output.accept(token, seq.request.send, logprob):
            self._release(seq)  # it sent Finished
            self._queue.count("completed")
        else:
            seq.last_token = token

    def _fail(self, seq: _Sequence, error: BaseException) -> None:
        log.warning("request %s failed: %s: %s", seq.request.id, type(error).__name__, error)
        log.debug("traceback of request %s", seq.request.id, exc_info=error)
        seq.request.send(Failed(f"generation failed: {type(error).__name__}: {error}"))
        self._release(seq)
        self._queue.count("failed")

    def _release(self, seq: _Sequence) -> None:
        if seq in self._running:
            del self._running[seq]
            self._queue.release_slot()
        if seq in self._prefill_queue:
            self._prefill_queue.remove(seq)
        self.pool.release(seq.request.id)
        seq.caches = []
        if self._drafter is not None:
            self._drafter.drop(seq.request.id)

    def _publish(self) -> None:
        snapshot = {
            "pool_sequences": len(self.pool),
            "pool_batched": len(self.pool.live_keys),
            "pool_bytes": self.pool.nbytes(),
            "prefix_cache": None if self.prefix is None else self.prefix.stats(),
            "speculation": None if self.speculation is None else self._spec_snapshot(),
        }
        self._queue.publish(snapshot)

    def _spec_snapshot(self) -> dict[str, Any]:
        s = self.spec_stats
        return {
            "steps": s.steps,
            "proposed": s.proposed,
            "accepted": s.accepted,
            "acceptance": round(s.acceptance, 4),
            "num_draft_tokens": self.speculation.num_draft_tokens,
            "max_rows": self.speculation.max_rows,
            "drafter": "prompt-lookup" if self._lookup is not None else "draft-model",
        }

    def _shutdown(self) -> None:
        for request in self._queue.drain():
            request.send(Failed("the server is shutting down", shutdown=True))
        for seq in list(self._running):
            seq.request.send(Failed("the server is shutting down", shutdown=True))
            self._release(seq)
        self._publish()
