"""``mlxc serve``'s HTTP side in a process of its own, so its Python never holds the GIL the
scheduler thread needs.

In one process the event loop (parsing, SSE chunks, one send per stream per step) and the
scheduler thread (building each step's graph, handing tokens out) take turns on one GIL, and
every turn the loop takes is a step the device waits for. Measured in-process on an H100 (s21,
``bench.gil_contention``: the medium llama, 64 rows): a second Python thread busy a fifth of
the time cut the scheduler's rate from 11.8-15.6k to 8.7k tokens/s, where the served rate of
the same scheduler was 4.2k. Two processes have two GILs: served, alternated on one H100, the
step's build fell from 3.2-3.6 to 1.7-1.9 ms and the rate rose 1.1-1.5x at 64 streams
(``bench/results/serve-http-process-gpu-h100-s21/``).

The process ``mlxc serve`` starts (the *engine process*) loads the model and runs the scheduler
as before, then starts the *HTTP process* (``multiprocessing``, spawned, never forked: MLX and
the scheduler thread are already running) with the bound socket and what the HTTP side reads of
the engine (:class:`FrontendSpec`: names, limits, the prompt tokenizer and image processor),
and answers it (:class:`EngineHost`) until it ends. The HTTP process runs the same app
(``runtime.serving.server``) over a :class:`FrontEngine`, an ``Engine`` without a scheduler
whose ``submit``, ``status``, ``metrics_text`` and ``request_stop`` are messages over two pipes:

- to the engine: ``("submit", rid, prompt_ids, params, grammar, model_inputs)``,
  ``("cancel", rid)`` (every request sends it once it ends), ``("status", token)``, ``("stop",)``;
- to the HTTP process: ``("event", rid, event)``, ``("submitted", rid, error)``,
  ``("status", token, alive, stats, the engine's metric families)``.

Each pipe carries lists of messages: whatever queued since the last write goes in one (one
scheduler step's events for every stream together). A request without stop strings is sent
with ``detokenize=False``: its events carry tokens alone and the HTTP process makes their text
(``output.EventText``), which took ~7 us a stream a step off the scheduler thread (0.4 ms of
an H100 step's 6 at 64 streams). Each side reads on one thread and writes
on another (the HTTP process reads on its event loop), so neither waits to write while the
other waits to write. A grammar travels as its Lark text (llguidance's matcher does not pickle);
the engine makes its own matcher from it, after the HTTP side has already checked it compiles.

Ending: a signal to the engine process (SIGINT, SIGTERM) is passed on to the HTTP process as
SIGTERM (a terminal's Ctrl-C reaches both). Either way the scheduler ends every request (their
final events still reach their streams), uvicorn shuts down, the HTTP process exits, its pipe closes, and the engine process
stops the scheduler and exits with the HTTP process's exit status. If the engine process dies,
the HTTP process fails its open requests and exits 1; if the HTTP process dies, the engine
process stops.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import itertools
import logging
import multiprocessing
import os
import queue
import signal
import socket
import sys
import threading
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection
from typing import Any

from mlxc.runtime.serving import metrics
from mlxc.runtime.serving.engine import Engine
from mlxc.runtime.serving.output import EventText
from mlxc.runtime.serving.scheduler import Failed, Finished, QueueFull, SchedulerStopped

log = logging.getLogger("mlxc.serve")

STATUS_TIMEOUT = 30.0  # seconds /health and /metrics wait for the engine before saying it is down
EXIT_TIMEOUT = 15.0  # seconds the engine process waits for the HTTP process once it is stopping
_REFUSALS = {"queue_full": QueueFull, "stopped": SchedulerStopped, "invalid": ValueError}


@dataclass(frozen=True)
class FrontendSpec:
    """What the HTTP process needs of the engine (pickled to it at start)."""

    prompt_side: dict[str, Any]  # ``Engine._prompt_side``'s arguments
    max_kv_size: int | None
    stats: dict[str, Any]  # the scheduler's stats at start (``/health`` until it answers)
    app: dict[str, Any] = field(default_factory=dict)  # ``create_app``'s settings
    log_level: str = "info"


def _writer(outbox: queue.SimpleQueue, conn: Connection) -> None:
    """Send what ``outbox`` gets, as lists of messages, until it gets None."""
    while True:
        message = outbox.get()
        batch = []
        while message is not None:
            batch.append(message)
            try:
                message = outbox.get_nowait()
            except queue.Empty:
                break
        if batch:
            try:
                conn.send(batch)
            except (OSError, ValueError):  # the other process has gone
                return
        if message is None:
            return


# --- the engine process ---------------------------------------------------------------------------


class EngineHost:
    """The engine process's end: requests from the HTTP process to the scheduler, and the
    scheduler's events back."""

    def __init__(self, engine: Engine, requests: Connection, replies: Connection) -> None:
        self.engine = engine
        self._requests = requests
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._handles: dict[int, Any] = {}  # reader thread only
        self._writer = threading.Thread(
            target=_writer, args=(self._outbox, replies), name="mlxc-replies", daemon=True
        )

    def serve(self) -> None:
        """Answer the HTTP process until it closes its end (it has exited)."""
        self._writer.start()
        try:
            while True:
                try:
                    batch = self._requests.recv()
                except (EOFError, OSError):
                    return
                for message in batch:
                    self._handle(message)
        finally:
            self._outbox.put(None)
            self._writer.join(timeout=5)

    def _handle(self, message: tuple) -> None:
        kind = message[0]
        if kind == "submit":
            _, rid, prompt_ids, params, grammar, model_inputs = message
            self._outbox.put(
                ("submitted", rid, self._submit(rid, prompt_ids, params, grammar, model_inputs))
            )
        elif kind == "cancel":
            handle = self._handles.pop(message[1], None)
            if handle is not None:
                handle.cancel()  # a no-op once it has finished
        elif kind == "status":
            scheduler = self.engine.scheduler
            reply = (
                "status",
                message[1],
                scheduler.alive,
                scheduler.stats(),
                metrics.render_engine(),
            )
            self._outbox.put(reply)
        elif kind == "stop":
            self.engine.request_stop()

    def _submit(self, rid, prompt_ids, params, grammar, model_inputs) -> tuple[str, str] | None:
        """Queue the request; None, or why it was refused (a ``_REFUSALS`` key and a message)."""
        outbox = self._outbox

        def emit(event) -> None:  # scheduler thread
            outbox.put(("event", rid, event))

        try:
            if grammar is not None:
                params = replace(params, constraint=self.engine.grammars.constraint(grammar))
            self._handles[rid] = self.engine.scheduler.submit(
                prompt_ids, params, emit, model_inputs=model_inputs
            )
        except QueueFull as e:
            return "queue_full", str(e)
        except SchedulerStopped as e:
            return "stopped", str(e)
        except ValueError as e:  # a prompt outside the vocabulary, a grammar (checked already)
            return "invalid", str(e)
        return None


def serve_http_process(
    engine: Engine, sock: socket.socket, app_settings: dict[str, Any], log_level: str
) -> int:
    """Serve ``engine`` over HTTP on ``sock`` from a process of its own; returns that
    process's exit status once it has ended and the scheduler has stopped (128 + N when
    signal N killed it, as a shell reports it)."""
    context = multiprocessing.get_context("spawn")
    requests_in, requests_out = context.Pipe(duplex=False)  # HTTP process -> engine
    replies_in, replies_out = context.Pipe(duplex=False)  # engine -> HTTP process
    spec = FrontendSpec(
        prompt_side=engine.prompt_side_settings(),
        max_kv_size=engine.max_kv_size,
        stats=engine.scheduler.stats(),
        app=app_settings,
        log_level=log_level,
    )
    process = context.Process(
        target=_http_main, args=(spec, sock, requests_out, replies_in), name="mlxc-http"
    )
    try:
        process.start()
    except BaseException:
        engine.stop()
        raise
    requests_out.close()
    replies_in.close()
    sock.close()  # the HTTP process holds its own copy

    def stop(signum, frame) -> None:
        engine.request_stop()  # a lock and a notify: safe in a signal handler
        # Passed on as SIGTERM: a terminal's Ctrl-C reached the HTTP process too, and uvicorn
        # takes a second SIGINT (not a SIGTERM) as "exit now, unfinished or not".
        if process.exitcode is None:
            os.kill(process.pid, signal.SIGTERM)

    previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        EngineHost(engine, requests_in, replies_out).serve()
        process.join(EXIT_TIMEOUT)
        if process.exitcode is None:
            log.warning("the HTTP process did not end within %.0f s: killing it", EXIT_TIMEOUT)
            process.kill()
            process.join()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        engine.stop()
    code = process.exitcode
    return 128 - code if code < 0 else code


# --- the HTTP process -----------------------------------------------------------------------------


class _Handle:
    """A request in the engine process: ``cancel()`` ends it there (once; a no-op after)."""

    def __init__(self, front: FrontEngine, rid: int) -> None:
        self._front, self._rid = front, rid

    def cancel(self) -> None:
        front, self._front = self._front, None
        if front is not None:
            front._forget(self._rid)
            front._outbox.put(("cancel", self._rid))


class FrontEngine(Engine):
    """The HTTP process's ``Engine``: the prompt side as in one process; the scheduler's side
    through :class:`EngineHost`."""

    def __init__(self, spec: FrontendSpec, requests: Connection, replies: Connection) -> None:
        self._prompt_side(**spec.prompt_side)
        self._max_kv_size = spec.max_kv_size
        self._stats = spec.stats  # the last stats the engine sent
        self._alive = True
        self._replies = replies
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._writer = threading.Thread(
            target=_writer, args=(self._outbox, requests), name="mlxc-requests", daemon=True
        )
        self._ids = itertools.count()
        self._queues: dict[int, asyncio.Queue] = {}  # rid -> its events (until it ends)
        self._texts: dict[int, EventText] = {}  # rid -> its text, made here (no stop strings)
        self._waiting: dict[int, asyncio.Future] = {}  # rid or status token -> its answer
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def max_kv_size(self) -> int | None:
        return self._max_kv_size

    def start(self) -> None:
        self._start_workers()
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._replies.fileno(), self._read)
        self._writer.start()

    def stop(self) -> None:
        self._stop_workers()
        if self._loop is not None and self._alive:
            self._loop.remove_reader(self._replies.fileno())
        self._outbox.put(None)

    def request_stop(self) -> None:
        self._outbox.put(("stop",))  # SimpleQueue.put is safe in a signal handler

    async def submit(self, prompt_ids, params, events, model_inputs=None):
        if not self._alive:
            raise SchedulerStopped("the engine process has ended")
        rid = next(self._ids)
        grammar = None
        if params.constraint is not None:  # the engine makes its own matcher
            grammar, params = params.constraint.grammar, replace(params, constraint=None)
        if not params.stop and params.detokenize:  # the text is made here, off the step
            params = replace(params, detokenize=False)
            self._texts[rid] = EventText(self._detokenizer_tokenizer, params.keep_special)
        answer = self._loop.create_future()
        self._waiting[rid] = answer
        self._queues[rid] = events
        self._outbox.put(("submit", rid, prompt_ids, params, grammar, model_inputs))
        try:
            refused = await answer
        except asyncio.CancelledError:  # the client went: the engine may have it queued
            _Handle(self, rid).cancel()
            raise
        finally:
            self._waiting.pop(rid, None)
        if refused is not None:
            self._forget(rid)
            kind, message = refused
            raise _REFUSALS[kind](message)
        return _Handle(self, rid)

    @functools.cached_property
    def _detokenizer_tokenizer(self) -> Any:
        """The tokenizer ``EventText`` decodes with, on the event loop: a copy of the prompt
        tokenizer, which the prompt workers use meanwhile."""
        with self._prompt_lock:
            return copy.deepcopy(self.prompt_tokenizer)

    def _forget(self, rid: int) -> None:
        self._queues.pop(rid, None)
        self._texts.pop(rid, None)

    async def status(self) -> tuple[bool, dict[str, Any]]:
        alive, stats, _ = await self._ask_status()
        return alive, stats

    async def metrics_text(self) -> bytes:
        _, stats, engine_text = await self._ask_status()
        return metrics.render(stats, engine_text)

    async def _ask_status(self) -> tuple[bool, dict[str, Any], bytes | None]:
        """The engine's liveness, stats and metric families; the last stats and no families
        when it has ended or does not answer in time."""
        if self._alive:
            token = next(self._ids)
            answer = self._waiting[token] = self._loop.create_future()
            self._outbox.put(("status", token))
            try:
                alive, self._stats, text = await asyncio.wait_for(answer, STATUS_TIMEOUT)
                return alive, self._stats, text
            except TimeoutError:
                log.error("the engine process did not answer in %.0f s", STATUS_TIMEOUT)
            finally:
                self._waiting.pop(token, None)
        return False, self._stats, None

    def _read(self) -> None:
        """Event loop: take what the engine sent."""
        try:
            while self._replies.poll():
                for message in self._replies.recv():
                    self._dispatch(message)
        except (EOFError, OSError):
            self._engine_gone()

    def _dispatch(self, message: tuple) -> None:
        kind, key = message[0], message[1]
        if kind == "event":
            events = self._queues.get(key)
            if events is not None:
                event = message[2]
                text = self._texts.get(key)
                events.put_nowait(event if text is None else text.fill(event))
                if isinstance(event, (Finished, Failed)):
                    self._forget(key)
            return
        answer = self._waiting.get(key)
        if answer is not None and not answer.done():
            answer.set_result(message[2] if kind == "submitted" else message[2:])

    def _engine_gone(self) -> None:
        """The engine process has ended: fail what is open, and end the HTTP server."""
        if not self._alive:
            return
        self._alive = False
        log.error("the engine process has ended: stopping")
        self._loop.remove_reader(self._replies.fileno())
        for events in self._queues.values():
            events.put_nowait(Failed("the engine process has ended"))
        self._queues.clear()
        self._texts.clear()
        for answer in self._waiting.values():
            if not answer.done():
                answer.set_exception(SchedulerStopped("the engine process has ended"))
        if self.stop_serving is not None:
            self.stop_serving()


def _http_main(spec: FrontendSpec, sock: socket.socket, requests: Connection, replies: Connection):
    """The HTTP process."""
    from mlxc.runtime.serving.server import create_app, run

    logging.basicConfig(
        level=spec.log_level.upper(), format="%(levelname)s:     %(name)s: %(message)s"
    )
    engine = FrontEngine(spec, requests, replies)
    run(create_app(engine, **spec.app), sock, log_level=spec.log_level)
    if not engine._alive:
        sys.exit(1)
