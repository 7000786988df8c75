"""What ``mlxc serve`` serves: :class:`Engine`, one model with its tokenizers, its image
processor (a VL model), its scheduler and the prompt workers.

The scheduler thread owns MLX and the model, and detokenizes with the tokenizer it was given.
Prompts are encoded in ``Engine.workers`` (threads of the server's side, never the event loop) on
a copy of that tokenizer, so no stream waits on another request's preprocessing. The HTTP app
over it is ``runtime.serving.server``; it reaches the scheduler only through ``Engine.submit``,
``status``, ``metrics_text`` and ``request_stop``, which ``runtime.serving.frontend``'s
``FrontEngine`` implements for an HTTP process of its own.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mlxc.runtime.serving import metrics
from mlxc.runtime.serving.scheduler import Scheduler

if TYPE_CHECKING:
    from mlxc.runtime.checkpoint.processor import Prompt

PROMPT_WORKERS = 2  # threads that turn request bodies into prompts
# The warm-up's image, in pixels a side: small, so the tower runs quickly (MLX's CUDA backend
# compiles a kernel at first use per kind and layout of kernel, not per image size).
WARM_IMAGE_SIDE = 224


class PromptError(ValueError):
    """A request that cannot be turned into prompt ids (answered 400)."""


class Engine:
    """What the server serves: one model, its tokenizer and chat template, its scheduler."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        model_id: str,
        aliases: tuple[str, ...] = (),
        eos_token_ids: set[int] | frozenset[int] = frozenset(),
        context_length: int | None = None,
        vocab_size: int | None = None,
        chat_template: str | None = None,
        description: str | None = None,
        processor: Any = None,
        prompt_tokenizer: Any = None,
        **scheduler_options: Any,
    ) -> None:
        self._prompt_side(
            model_id=model_id,
            aliases=aliases,
            eos_token_ids=eos_token_ids,
            context_length=context_length,
            vocab_size=vocab_size,
            chat_template=chat_template,
            description=description,
            processor=processor,
            prompt_tokenizer=prompt_tokenizer or copy.deepcopy(tokenizer),
        )
        if processor is not None:  # the warm-up runs the vision tower too
            scheduler_options.setdefault("warm_image", self._warm_image_prompt)
        self.scheduler = Scheduler(
            model, tokenizer, eos_token_ids=eos_token_ids, **scheduler_options
        )

    def _prompt_side(
        self,
        *,
        model_id: str,
        aliases: tuple[str, ...],
        eos_token_ids,
        context_length: int | None,
        vocab_size: int | None,
        chat_template: str | None,
        description: str | None,
        processor: Any,
        prompt_tokenizer: Any,
        created: int | None = None,
    ) -> None:
        """What the HTTP side reads: names, limits, the prompt tokenizer and processor."""
        self.model_id = model_id
        self.names = {model_id, *aliases}
        self.aliases = tuple(aliases)
        self.eos_token_ids = frozenset(eos_token_ids)
        self.context_length = context_length
        self.vocab_size = vocab_size
        self.chat_template = chat_template  # overrides the tokenizer's (--chat-template)
        self.description = description
        # Image processor of a VL model (None: text only); it encodes with prompt_tokenizer.
        self.processor = processor
        self.created = int(time.time()) if created is None else created
        # Prompts are encoded in worker threads, on a copy of the tokenizer: Hugging Face
        # tokenizers are not safe under concurrent use, and sharing the scheduler's would make
        # every stream's detokenizing wait while a long prompt is encoded.
        self.prompt_tokenizer = prompt_tokenizer
        self._prompt_lock = threading.Lock()  # the workers take turns on prompt_tokenizer
        self.workers: ThreadPoolExecutor | None = None  # made by start(), by the HTTP app
        self.preparing = 0  # requests in the workers now (event loop only; /health shows it)
        self.relay: EventRelay | None = None  # hands events to the server's event loop
        # Ends the HTTP server (set by ``server.run``; a FrontEngine calls it when its engine
        # process has gone).
        self.stop_serving: Callable[[], None] | None = None

    def prompt_side_settings(self) -> dict[str, Any]:
        """``_prompt_side``'s arguments: an ``Engine`` of the HTTP process is made of them."""
        return {
            "model_id": self.model_id,
            "aliases": self.aliases,
            "eos_token_ids": self.eos_token_ids,
            "context_length": self.context_length,
            "vocab_size": self.vocab_size,
            "chat_template": self.chat_template,
            "description": self.description,
            "processor": self.processor,
            "prompt_tokenizer": self.prompt_tokenizer,
            "created": self.created,
        }

    @classmethod
    def from_path(
        cls,
        path: str | Path,
        *,
        model_id: str | None = None,
        chat_template: str | None = None,
        description: str | None = None,
        specs: str | Path | None = None,
        group: Any = None,
        draft_model: str | Path | None = None,
        **scheduler_options: Any,
    ) -> Engine:
        """Load the checkpoint at ``path`` and start the scheduler; CheckpointError when it
        cannot be served. The model is built on the scheduler thread, which owns MLX.
        ``specs``: a directory of your own specs, as in ``loading.load_model``. ``group``: the
        ranks of ``mlx.launch`` the model is sharded over (with a ``lockstep`` for the
        scheduler: ``runtime.serving.distributed``). ``draft_model``: the checkpoint that
        drafts for ``scheduler_options["speculation"]`` (loaded here, its tokenizer checked
        against the model's)."""
        import dataclasses
        import functools

        from mlxc.runtime.checkpoint.loading import (
            CheckpointError,
            ProcessorFilesError,
            load_checkpoint,
        )

        path = Path(path)
        try:
            checkpoint = load_checkpoint(
                path,
                specs=specs,
                chat_template=chat_template,
                tokenizer_hint="the server needs one to read prompts",
                copy_tokenizer=True,
            )
        except ProcessorFilesError as e:
            raise CheckpointError(f"{path}: cannot read its image processor: {e}") from e
        if draft_model is not None:
            from mlxc.runtime.serving.speculative import load_draft

            try:
                draft = load_draft(draft_model, checkpoint.tokenizer, specs=specs)
            except CheckpointError as e:  # say which of the two checkpoints it is
                raise CheckpointError(f"the draft model: {e}") from e
            speculation = scheduler_options["speculation"]
            scheduler_options["speculation"] = dataclasses.replace(speculation, draft_model=draft)

        name = model_id or path.resolve().name
        engine = cls(
            None,
            checkpoint.tokenizer,
            load=functools.partial(checkpoint.load_model, group=group),
            model_id=name,
            aliases=(str(path),),
            eos_token_ids=checkpoint.eos_token_ids,
            context_length=checkpoint.context_length,
            vocab_size=checkpoint.vocab_size,
            chat_template=chat_template,
            description=description,
            processor=checkpoint.processor,
            prompt_tokenizer=checkpoint.prompt_tokenizer,
            **scheduler_options,
        )
        # Loads the model: a CheckpointError is raised here, not at the first request. The
        # prompt workers start with the app (``start``), in whichever process serves HTTP.
        engine.scheduler.start()
        return engine

    @property
    def max_kv_size(self) -> int | None:
        return self.scheduler.pool.max_kv_size

    def start(self) -> None:
        self._start_workers()
        self.scheduler.start()

    def stop(self) -> None:
        self.scheduler.stop()
        self._stop_workers()

    def _start_workers(self) -> None:
        if self.workers is None:
            self.workers = ThreadPoolExecutor(PROMPT_WORKERS, thread_name_prefix="mlxc-prompt")

    def _stop_workers(self) -> None:
        if self.workers is not None:
            self.workers.shutdown(wait=False, cancel_futures=True)
            self.workers = None

    # What the HTTP app asks of the scheduler (on its event loop).

    async def submit(
        self,
        prompt_ids: list[int],
        params: Any,
        events: asyncio.Queue,
        model_inputs: dict[str, Any] | None = None,
    ) -> Any:
        """Queue a generation whose events arrive in ``events`` (a queue of the running event
        loop); a handle whose ``cancel()`` ends it. Raises what ``Scheduler.submit`` raises
        (QueueFull, SchedulerStopped, ValueError)."""
        loop = asyncio.get_running_loop()
        if self.relay is None or self.relay.loop is not loop:  # one per loop (tests run several)
            self.relay = EventRelay(loop)
        relay = self.relay

        def emit(event) -> None:  # scheduler thread -> event loop
            relay.send(events, event)

        return self.scheduler.submit(prompt_ids, params, emit, model_inputs=model_inputs)

    async def status(self) -> tuple[bool, dict[str, Any]]:
        """Whether the scheduler runs, and its stats (``Scheduler.stats``)."""
        return self.scheduler.alive, self.scheduler.stats()

    async def metrics_text(self) -> bytes:
        """``GET /metrics``: Prometheus' text format."""
        return metrics.render(self.scheduler.stats())

    def request_stop(self) -> None:
        """Begin shutting down (safe in a signal handler): every request ends at once."""
        self.scheduler.request_stop()

    # Prompt building: called in the worker threads (never on the event loop).

    def encode_chat_with_images(
        self, messages: list[dict], images: list, template_kwargs: dict | None = None
    ) -> Prompt:
        """Through the processor: prompt ids with the image placeholders expanded, and the
        vision inputs (numpy; None without images). ``template_kwargs``: the chat template's
        extra variables."""
        try:
            with self._prompt_lock:
                return self.processor.encode(messages, images, template_kwargs=template_kwargs)
        except ValueError as e:  # the template (named), or placeholder/image count problems
            raise PromptError(str(e)) from e

    def _warm_image_prompt(self) -> tuple[list[int], dict]:
        """A one-image chat for the scheduler's warm-up (``Scheduler(warm_image=)``): prompt
        ids and vision inputs, as a request with an image makes them."""
        from PIL import Image

        image = Image.new("RGB", (WARM_IMAGE_SIDE, WARM_IMAGE_SIDE), (128, 96, 64))
        content = [{"type": "image"}, {"type": "text", "text": "What is in the picture?"}]
        prompt = self.encode_chat_with_images([{"role": "user", "content": content}], [image])
        return prompt.ids, prompt.vision

    @functools.cached_property
    def tool_format(self):
        """The tool-call format of this model's chat template (``runtime.serving.tool_calls``)."""
        from mlxc.runtime.serving.tool_calls import format_for_template

        template = self.chat_template or getattr(self.prompt_tokenizer, "chat_template", None)
        return format_for_template(template)

    @functools.cached_property
    def tool_markers(self) -> dict[str, int]:
        """The tool-call format's markers that are tokens of this tokenizer, and their ids
        (kept when detokenizing; forced calls sample the token itself)."""
        with self._prompt_lock:
            added = self.prompt_tokenizer.get_added_vocab()
        return {t: added[t] for t in self.tool_format.special if t in added}

    @functools.cached_property
    def grammars(self):
        """Makes the constraints of structured output (``runtime.serving.structured``)."""
        from mlxc.runtime.serving.structured import Grammars

        with self._prompt_lock:
            tokenizer = copy.deepcopy(self.prompt_tokenizer)
        return Grammars(tokenizer, self.vocab_size, self.eos_token_ids)

    def encode_chat(
        self, messages: list[dict[str, str]], template_kwargs: dict | None = None
    ) -> list[int]:
        from mlxc.runtime.checkpoint.tokenizer import OVERRIDE_SOURCE, render_chat_template

        tok = self.prompt_tokenizer
        if not (self.chat_template or getattr(tok, "chat_template", None)):
            raise PromptError(
                "this model has no chat template: start the server with --chat-template FILE, "
                "or send a raw prompt to /v1/completions"
            )
        source = OVERRIDE_SOURCE if self.chat_template else None  # None: the tokenizer's
        try:
            with self._prompt_lock:
                rendered = render_chat_template(
                    tok,
                    messages,
                    chat_template=self.chat_template,
                    source=source,
                    template_kwargs=template_kwargs,
                )
                # The template writes BOS and the other special tokens itself (as `mlxc
                # generate` does): do not add them twice.
                return list(tok.encode(rendered, add_special_tokens=False))
        except ValueError as e:  # ChatTemplateError names the template
            raise PromptError(str(e)) from e

    def prompt_tail(self, ids: list[int], tokens: int = 8) -> str:
        """The text of the prompt's last ``tokens`` tokens (what the template left open)."""
        with self._prompt_lock:
            return self.prompt_tokenizer.decode(ids[-tokens:])

    def encode_text(self, text: str) -> list[int]:
        from mlxc.runtime.checkpoint.tokenizer import encode_prompt

        with self._prompt_lock:
            return encode_prompt(self.prompt_tokenizer, text, chat_template=False)


class EventRelay:
    """Hands events from the scheduler thread to one event loop's queues, a burst at a time.

    One scheduler step makes an event for every running stream. A ``call_soon_threadsafe`` per
    event would wake the loop (a write to its self-pipe) and take the GIL from the scheduler
    thread once per token per stream; here the first event of a burst schedules one flush, and
    the events that follow before it runs join the same flush, in order.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._lock = threading.Lock()
        self._pending: list[tuple[asyncio.Queue, Any]] = []

    def send(self, queue: asyncio.Queue, event: Any) -> None:
        """Scheduler thread: queue ``event`` for ``queue``; raises once the loop is closed."""
        with self._lock:
            self._pending.append((queue, event))
            if len(self._pending) > 1:
                return  # a flush is already scheduled and will take this one too
        try:
            self.loop.call_soon_threadsafe(self._flush)
        except RuntimeError:  # the loop is closed: nobody reads these any more
            with self._lock:
                self._pending.clear()
            raise

    def _flush(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for queue, event in pending:
            queue.put_nowait(event)
