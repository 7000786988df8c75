"""Requests, the events they receive, and the admission queue in front of the scheduler.

This is the part of ``runtime.serving.scheduler`` that other threads touch. A server thread builds a
:class:`SamplingParams`, calls ``Scheduler.submit`` (which queues a :class:`Request` here or
raises :class:`QueueFull` / :class:`SchedulerStopped`), receives :class:`Delta`, then one
:class:`Finished` or :class:`Failed` through its ``emit`` callback, may ``cancel()`` the request
at any time, and reads ``stats()``. :class:`AdmissionQueue` holds everything those threads
share with the scheduler thread behind one condition variable: the waiting requests, the
count of slots taken, the stop flag, the request counters and the stats snapshot the scheduler
thread publishes after each tick. It holds no MLX state; the step (``runtime.serving.scheduler``) and
per-sequence output (``runtime.serving.output``) live apart. ``runtime.serving.scheduler`` re-exports the
public names, which is where callers import them from.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("mlxc.serve")


class QueueFull(Exception):
    """``max_queue`` requests already wait for a slot: answer 429, do not queue."""


class SchedulerStopped(Exception):
    """The scheduler is shut down (or its thread died) and takes no more requests."""


# --- requests and the events they receive ----------------------------------------------------


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False  # vLLM's extension: generate exactly max_tokens (benchmarks, tests)
    # The rest of runtime.serving.sample.SamplingOptions (its defaults change nothing).
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0
    keep_special: frozenset[int] = frozenset()  # special tokens detokenized all the same
    constraint: Any = None  # a runtime.serving.structured.Constraint: the grammar output follows
    # False: the scheduler sends tokens without their text (Delta.text and Finished.text stay
    # empty) and the reader detokenizes (output.EventText): `mlxc serve`'s HTTP process does,
    # so the scheduler thread's step does not. Stop strings are matched on the scheduler's
    # text, so they need True.
    detokenize: bool = True

    def __post_init__(self) -> None:
        if self.stop and not self.detokenize:
            raise ValueError("stop strings are matched on the scheduler's text: detokenize=True")


# A request receives any number of Delta events, then exactly one Finished or Failed.


@dataclass
class TokenLogprob:
    """A token's log-probability, with the most likely alternatives (when asked)."""

    token: int
    text: str  # the token decoded alone (runtime.serving.output.token_piece)
    bytes: list[int]  # its UTF-8 bytes
    logprob: float
    # (text, bytes, logprob) of the most likely tokens, most likely first
    top: list[tuple[str, list[int], float]]


@dataclass
class Delta:
    text: str  # may be "" (a token that ends mid-character, or text held back by `stop`)
    token: int
    logprob: TokenLogprob | None = None  # when the request asked for logprobs


@dataclass
class Finished:
    reason: str  # "stop" (EOS or a stop string) or "length" (max_tokens)
    text: str  # the text held back until the end
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens resumed from the prefix cache (not prefilled)


@dataclass
class Failed:
    message: str
    shutdown: bool = False  # the server is shutting down (the request itself was fine)


Event = Delta | Finished | Failed


class Request:
    """A submitted generation. ``cancel()`` may be called from any thread, any time."""

    def __init__(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        emit: Callable[[Event], None],
        wake: Callable[[], None],
        model_inputs: dict[str, Any] | None = None,
    ) -> None:
        self.id = request_id
        self.prompt_ids = prompt_ids
        self.params = params
        self.emit = emit
        # Extra keyword inputs of the first prefill chunk's forward: a VL model's pixel_values
        # and grids (the model keeps the image features on its SequenceCache for later chunks).
        self.model_inputs = model_inputs or {}
        self._wake = wake
        self._cancelled = threading.Event()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def cancel(self) -> None:
        """Stop generating and free the slot (a no-op once the request has finished)."""
        self._cancelled.set()
        self._wake()

    def send(self, event: Event) -> None:
        """Hand ``event`` to ``emit`` (scheduler thread); a failing listener cancels the request."""
        try:
            self.emit(event)
        except Exception as e:  # noqa: BLE001 - the listener is gone (closed loop): stop
            log.debug("request %s: emit failed (%s); cancelling", self.id, e)
            self._cancelled.set()


# --- the admission queue -----------------------------------------------------------------------


class AdmissionQueue:
    """Waiting requests, slots taken, the stop flag, counters and the published stats snapshot.

    Every method takes the one lock. ``submit``, ``request_stop``, ``wake`` and ``read_stats``
    are for any thread; ``admit``, ``release_slot``, ``count``, ``publish`` and ``drain`` for the
    scheduler thread. A request holds a slot from ``admit`` until ``release_slot``; at most
    ``max_concurrency`` slots are taken, and at most ``max_queue`` requests wait beyond the free
    slots (a cancelled waiting request gives its place back at once).
    """

    def __init__(self, max_concurrency: int, max_queue: int) -> None:
        self.max_concurrency = max_concurrency
        self.max_queue = max_queue
        self._cond = threading.Condition()
        self._waiting: deque[Request] = deque()  # guarded by _cond
        self._stopping = False  # guarded by _cond
        self._slots_taken = 0  # guarded by _cond: admitted requests not yet released
        # guarded by _cond: a request was cancelled since the waiting ones were last looked at
        # (so a tick does not ask every waiting request, O(waiting) under a long queue)
        self._any_cancelled = False
        self._ids = itertools.count(1)
        self._counts = dict.fromkeys(("completed", "failed", "cancelled", "rejected"), 0)
        self._snapshot = {"pool_sequences": 0, "pool_batched": 0, "pool_bytes": 0}

    # --- any thread ---------------------------------------------------------------------------

    def submit(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        emit: Callable[[Event], None],
        model_inputs: dict[str, Any] | None,
        ended: Callable[[], bool],
    ) -> Request:
        """Queue a request (see ``Scheduler.submit``); ``ended`` says the scheduler thread has
        ended (asked under the lock)."""
        if not prompt_ids:
            raise ValueError("the prompt is empty: generation needs at least one token")
        if params.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {params.max_tokens}")
        with self._cond:
            if self._stopping or ended():
                raise SchedulerStopped("the scheduler is not running")
            self._purge_cancelled()
            free_slots = max(self.max_concurrency - self._slots_taken, 0)
            if len(self._waiting) >= self.max_queue + free_slots:
                self._counts["rejected"] += 1
                raise QueueFull(
                    f"{len(self._waiting)} requests are already waiting (--max-queue "
                    f"{self.max_queue}); retry later"
                )
            request = Request(
                f"req-{next(self._ids)}",
                list(prompt_ids),
                params,
                emit,
                self._cancelled_one,
                model_inputs,
            )
            self._waiting.append(request)
            self._cond.notify_all()
        return request

    def request_stop(self) -> None:
        """Refuse new requests and wake the scheduler thread (a lock and a notify)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()

    def wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def _cancelled_one(self) -> None:
        """``Request.cancel``'s wake-up: the next purge looks at the waiting requests."""
        with self._cond:
            self._any_cancelled = True
            self._cond.notify_all()

    def read_stats(self) -> tuple[dict[str, int], int, int, dict[str, int]]:
        """(the last published snapshot, requests waiting and not cancelled, requests admitted
        and not released, the counters). The last three are exact at this instant: a request
        leaves the queue and takes its slot under one lock, so between submit and release it is
        always counted in one of them (the snapshot is published once per tick, after it)."""
        with self._cond:
            waiting = sum(not r.cancelled for r in self._waiting)
            return self._snapshot, waiting, self._slots_taken, dict(self._counts)

    def _purge_cancelled(self) -> None:
        # Caller holds _cond. A cancelled waiting request gives its queue place back at once.
        if not self._any_cancelled:
            return
        self._any_cancelled = False
        kept = [r for r in self._waiting if not r.cancelled]
        self._counts["cancelled"] += len(self._waiting) - len(kept)
        self._waiting = deque(kept)

    # --- scheduler thread -----------------------------------------------------------------------

    def admit(self, busy: bool) -> list[Request] | None:
        """Wait until there is work (``busy``: sequences run) or a stop; None on a stop, else
        the waiting requests that fit in the free slots (maybe none), each now holding one."""
        with self._cond:
            self._purge_cancelled()
            while not self._stopping and not self._waiting and not busy:
                self._cond.wait()
                self._purge_cancelled()
            if self._stopping:
                return None
            admitted = []
            while self._waiting and self._slots_taken < self.max_concurrency:
                admitted.append(self._waiting.popleft())
                self._slots_taken += 1
        return admitted

    def release_slot(self) -> None:
        with self._cond:
            self._slots_taken -= 1

    def count(self, what: str) -> None:
        with self._cond:
            self._counts[what] += 1

    def publish(self, snapshot: dict[str, int]) -> None:
        with self._cond:
            self._snapshot = snapshot

    def drain(self) -> list[Request]:
        """Take every waiting request out of the queue (shutdown)."""
        with self._cond:
            waiting, self._waiting = list(self._waiting), deque()
        return waiting
