"""OpenAI-compatible HTTP API over the scheduler (FastAPI): ``create_app(engine)``.

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``
(and ``/v1/models/{id}``), ``GET /health``. Streaming answers are server-sent events that end
with ``data: [DONE]``. Every error is OpenAI-shaped: ``{"error": {"message", "type", "param",
"code"}}``; bad input is rejected before anything is queued, so it changes no state.

Request path: Host/Origin guard (``runtime.http_guard``) -> API key -> body (size-limited) ->
in a worker thread: JSON -> pydantic schema (strict types) -> prompt ids (chat template, or the
raw prompt) -> context and ``max_tokens`` checks -> ``Scheduler.submit`` -> events from the
scheduler thread, handed to the event loop with ``call_soon_threadsafe`` -> JSON or SSE.
``image_url`` parts (data URLs or bare base64; the server fetches nothing) go to a VL model's
``Engine.processor``, which expands the image placeholders; its vision inputs (numpy) travel with
the first prefill chunk through ``Scheduler.submit(model_inputs=...)``. A text model answers 400.

The event loop does no CPU-heavy work of a request: parsing, template rendering, tokenising and
image decoding run in ``Engine.workers``, on a tokenizer of their own (the scheduler thread
detokenizes with its own), so ``/health`` and running streams never wait on another request's
preprocessing. A request ends when its client goes, within one scheduler step: a stream through
its response's disconnect listener, anything else (queued, prefilling, a non-streaming answer)
through :func:`_unless_disconnected`.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import copy
import json
import logging
import re
import secrets
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Coroutine
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

if TYPE_CHECKING:
    from mlxc.runtime.processor import Prompt

from mlxc.runtime.scheduler import (
    Failed,
    Finished,
    QueueFull,
    SamplingParams,
    Scheduler,
    SchedulerStopped,
)

log = logging.getLogger("mlxc.serve")

DEFAULT_MAX_TOKENS = 512
# No request may hold a slot for ever: under --max-kv-size the context no longer bounds it.
DEFAULT_MAX_TOKENS_LIMIT = 32768
DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024  # room for base64 images; a text prompt needs far less
DEFAULT_MAX_IMAGES = 8
# Pixels of all of a request's images, read from their headers before any is decoded: 64 Mpx
# (8 images of 8 Mpx, 4K each) is 256 MiB decoded as RGBA.
DEFAULT_MAX_REQUEST_PIXELS = 64 * 2**20
MAX_STOP_STRINGS = 16
PROMPT_WORKERS = 2  # threads that turn request bodies into prompts
INT64 = (-(2**63), 2**63 - 1)


# --- the engine: model + tokenizer + scheduler ---------------------------------------------------


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
        self.model_id = model_id
        self.names = {model_id, *aliases}
        self.context_length = context_length
        self.vocab_size = vocab_size
        self.chat_template = chat_template  # overrides the tokenizer's (--chat-template)
        self.description = description
        # Image processor of a VL model (None: text only); it encodes with prompt_tokenizer.
        self.processor = processor
        self.created = int(time.time())
        # Prompts are encoded in worker threads, on a copy of the tokenizer: Hugging Face
        # tokenizers are not safe under concurrent use, and sharing the scheduler's would make
        # every stream's detokenizing wait while a long prompt is encoded.
        self.prompt_tokenizer = prompt_tokenizer or copy.deepcopy(tokenizer)
        self._prompt_lock = threading.Lock()  # the workers take turns on prompt_tokenizer
        self.workers: ThreadPoolExecutor | None = None  # made by start(), on the server's side
        self.preparing = 0  # requests in the workers now (event loop only; /health shows it)
        self.scheduler = Scheduler(
            model, tokenizer, eos_token_ids=eos_token_ids, **scheduler_options
        )

    @classmethod
    def from_path(
        cls,
        path: str | Path,
        *,
        model_id: str | None = None,
        chat_template: str | None = None,
        description: str | None = None,
        specs: str | Path | None = None,
        **scheduler_options: Any,
    ) -> Engine:
        """Load the checkpoint at ``path`` and start the scheduler; CheckpointError when it
        cannot be served. The model is built on the scheduler thread, which owns MLX.
        ``specs``: a directory of your own specs, as in ``loading.load_model``."""
        from mlxc.runtime.loading import CheckpointError, ProcessorFilesError, load_checkpoint

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

        name = model_id or path.resolve().name
        engine = cls(
            None,
            checkpoint.tokenizer,
            load=checkpoint.load_model,
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
        engine.start()  # loads the model; raises CheckpointError here, not at the first request
        return engine

    @property
    def max_kv_size(self) -> int | None:
        return self.scheduler.pool.max_kv_size

    def start(self) -> None:
        if self.workers is None:
            self.workers = ThreadPoolExecutor(PROMPT_WORKERS, thread_name_prefix="mlxc-prompt")
        self.scheduler.start()

    def stop(self) -> None:
        self.scheduler.stop()
        if self.workers is not None:
            self.workers.shutdown(wait=False, cancel_futures=True)
            self.workers = None

    # Prompt building: called in the worker threads (never on the event loop).

    def encode_chat_with_images(self, messages: list[dict], images: list) -> Prompt:
        """Through the processor: prompt ids with the image placeholders expanded, and the
        vision inputs (numpy; None without images)."""
        try:
            with self._prompt_lock:
                return self.processor.encode(messages, images)
        except ValueError as e:  # the template (named), or placeholder/image count problems
            raise PromptError(str(e)) from e

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        from mlxc.runtime.tokenizer import render_chat_template

        tok = self.prompt_tokenizer
        if not (self.chat_template or getattr(tok, "chat_template", None)):
            raise PromptError(
                "this model has no chat template: start the server with --chat-template FILE, "
                "or send a raw prompt to /v1/completions"
            )
        source = "--chat-template" if self.chat_template else None  # None: the tokenizer's
        try:
            with self._prompt_lock:
                rendered = render_chat_template(
                    tok, messages, chat_template=self.chat_template, source=source
                )
                # The template writes BOS and the other special tokens itself (as `mlxc
                # generate` does): do not add them twice.
                return list(tok.encode(rendered, add_special_tokens=False))
        except ValueError as e:  # ChatTemplateError names the template
            raise PromptError(str(e)) from e

    def encode_text(self, text: str) -> list[int]:
        from mlxc.runtime.tokenizer import encode_prompt

        with self._prompt_lock:
            return encode_prompt(self.prompt_tokenizer, text, chat_template=False)


# --- errors --------------------------------------------------------------------------------------


class APIError(Exception):
    """An OpenAI-shaped error response."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status,
            message,
            type,
            param,
            code,
        )

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def _validation_error(e: ValidationError | RequestValidationError) -> APIError:
    errors = e.errors()
    described = []
    for err in errors[:3]:
        loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
        described.append(f"{loc}: {err['msg']}" if loc else err["msg"])
    more = f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""
    first = [p for p in (errors[0].get("loc", ()) if errors else ()) if p != "body"]
    param = str(first[0]) if first else None
    return APIError(400, "invalid request: " + "; ".join(described) + more, param=param)


# --- request schemas ------------------------------------------------------------------------------


class _Schema(BaseModel):
    # Strict: "5" is not an int, 1.0 is not an int, "true" is not a bool. Unknown fields (the
    # many OpenAI options this server does not use) are ignored.
    model_config = ConfigDict(strict=True, extra="ignore")


class TextPart(_Schema):
    type: Literal["text"]
    text: str


class ImageURL(_Schema):
    url: str
    detail: str | None = None


class ImagePart(_Schema):
    type: Literal["image_url"]
    image_url: ImageURL


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class ChatMessage(_Schema):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None


class StreamOptions(_Schema):
    include_usage: bool = False


class _Sampling(_Schema):
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1)  # -1 (vLLM) or 0: no top-k filter
    seed: int | None = Field(default=None, ge=INT64[0], le=INT64[1])
    stop: str | list[str] | None = None
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # vLLM extension: generate exactly max_tokens tokens

    def params(self, max_tokens: int) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=0.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=max(self.top_k or 0, 0),
            seed=self.seed,
            stop=tuple(stop),
            ignore_eos=self.ignore_eos,
        )

    def check_supported(self) -> None:
        if self.n not in (None, 1):
            raise APIError(
                400, f"n={self.n} is not supported: this server returns one choice (n=1)", param="n"
            )
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise APIError(400, f"at most {MAX_STOP_STRINGS} stop strings", param="stop")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if not self.messages:
            raise APIError(400, "messages must hold at least one message", param="messages")
        if self.logprobs:
            raise APIError(400, "logprobs are not supported", param="logprobs")


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = False
    best_of: int | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.logprobs is not None:
            raise APIError(400, "logprobs are not supported", param="logprobs")
        if self.echo:
            raise APIError(400, "echo is not supported", param="echo")
        if self.best_of not in (None, 1):
            raise APIError(
                400, "best_of is not supported (one choice per request)", param="best_of"
            )


# --- prompt building (in the worker threads) ------------------------------------------------------


@dataclass(frozen=True)
class Limits:
    """What one request may ask of the server (the ``mlxc serve`` flags of the same names)."""

    default_max_tokens: int = DEFAULT_MAX_TOKENS  # --max-tokens
    max_tokens_limit: int = DEFAULT_MAX_TOKENS_LIMIT
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_images: int = DEFAULT_MAX_IMAGES  # --max-images-per-request
    max_request_pixels: int = DEFAULT_MAX_REQUEST_PIXELS

    def __post_init__(self) -> None:
        if not 1 <= self.default_max_tokens <= self.max_tokens_limit:
            raise ValueError(
                f"the default max_tokens ({self.default_max_tokens}) must be between 1 and "
                f"the max_tokens limit ({self.max_tokens_limit})"
            )


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _parse_body(body: bytes) -> dict[str, Any]:
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise APIError(400, f"the body is not valid JSON: {e}") from e
    except RecursionError:
        raise APIError(400, "the body is not valid here: its JSON is nested too deeply") from None
    if not isinstance(data, dict):
        raise APIError(400, f"the body must be a JSON object, got {type(data).__name__}")
    # JSON may spell a lone UTF-16 surrogate ("\ud800"), which is no text a tokenizer can
    # encode. Only a \uD8xx-\uDFxx escape can make one: check further only when one is there.
    if _SURROGATE_ESCAPE.search(body):
        try:
            json.dumps(data, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise APIError(
                400, "the body holds a lone UTF-16 surrogate escape (such as \\ud800): not text"
            ) from None
    return data


def _image_bytes(index: int, url: str) -> bytes:
    """The bytes of a data URL or bare base64 string (400 on anything else)."""
    if url.startswith(("http://", "https://", "file:")):
        raise APIError(
            400,
            "image URLs are not fetched: send the image inline as a data URL "
            "(data:image/png;base64,...)",
            param="messages",
        )
    payload = url.split(",", 1)[1] if url.startswith("data:") and "," in url else url
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise APIError(400, f"image {index} is not valid base64: {e}", param="messages") from e


def _decode_images(urls: list[str], limits: Limits) -> list:
    """The request's images as decoded PIL images. Their count and their pixels (read from the
    headers) are checked against the limits before any image is decoded."""
    from mlxc.runtime.processor import ImageInputError, image_size, load_image

    if len(urls) > limits.max_images:
        raise APIError(
            400,
            f"the request has {len(urls)} images; this server takes at most {limits.max_images} "
            "per request (--max-images-per-request)",
            param="messages",
        )
    data = [_image_bytes(i, url) for i, url in enumerate(urls)]
    try:
        sizes = [image_size(d) for d in data]
        pixels = sum(w * h for w, h in sizes)
        if pixels > limits.max_request_pixels:
            listed = ", ".join(f"{w}x{h}" for w, h in sizes)
            raise APIError(
                400,
                f"the request's images ({listed}) have {pixels} pixels; this server takes at "
                f"most {limits.max_request_pixels} per request (--max-request-pixels)",
                param="messages",
            )
        return [load_image(d) for d in data]  # each also bounded by the per-image limit
    except ImageInputError as e:
        raise APIError(400, f"an image cannot be used: {e}", param="messages") from e


def _chat_prompt(
    engine: Engine, req: ChatCompletionRequest, limits: Limits
) -> tuple[list[int], dict | None]:
    """Prompt ids, and the vision inputs (numpy) of its images (None without images)."""
    messages, images = [], []
    for message in req.messages:
        content = message.content
        if isinstance(content, list):
            parts = []
            for part in content:
                if isinstance(part, ImagePart):
                    images.append(part.image_url.url)
                    parts.append({"type": "image"})
                else:
                    parts.append({"type": "text", "text": part.text})
            content = parts if images else "".join(p["text"] for p in parts)
        messages.append({"role": message.role, "content": content or ""})
    if engine.processor is None:  # a text model
        if images:
            raise APIError(
                400,
                f"this model takes no images: {engine.model_id} is a text model; send text "
                "parts only",
                param="messages",
                code="image_input_not_supported",
            )
        try:
            return engine.encode_chat(messages), None
        except PromptError as e:
            raise APIError(400, str(e), param="messages") from e
    # A VL model renders every chat, with images or without, through its processor's template.
    decoded = _decode_images(images, limits) if images else []
    try:
        prompt = engine.encode_chat_with_images(messages, decoded)
    except PromptError as e:
        raise APIError(400, str(e), param="messages") from e
    return prompt.ids, prompt.vision


def _completion_prompt(engine: Engine, req: CompletionRequest) -> list[int]:
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise APIError(
                400,
                "send one prompt per request (batched prompts are not supported)",
                param="prompt",
            )
        prompt = prompt[0]
    if isinstance(prompt, str):
        return engine.encode_text(prompt)
    vocab = engine.vocab_size
    bad = [t for t in prompt if t < 0 or (vocab is not None and t >= vocab)]
    if bad:
        raise APIError(
            400, f"token id {bad[0]} is out of range (vocab size {vocab})", param="prompt"
        )
    return list(prompt)


def _max_tokens(
    engine: Engine, n_prompt: int, requested: int | None, limits: Limits, prompt_param: str
) -> int:
    """The completion budget; 400 when the prompt does not fit the context."""
    from mlxc.runtime.generate import ContextExceeded, completion_budget

    if n_prompt == 0:
        raise APIError(400, "the prompt encodes to no tokens", param=prompt_param)
    try:
        return completion_budget(
            n_prompt,
            requested,
            limits.default_max_tokens,
            engine.context_length,
            engine.max_kv_size,
        )
    except ContextExceeded as e:
        param = prompt_param if e.param == "prompt" else "max_tokens"
        raise APIError(400, str(e), param=param, code="context_length_exceeded") from e


def _check_model(engine: Engine, name: str | None) -> None:
    if name is not None and name not in engine.names:
        raise APIError(
            404,
            f"the model {name!r} does not exist: this server serves {engine.model_id!r}",
            param="model",
            code="model_not_found",
        )


@dataclass
class _Job:
    """A request made ready for the scheduler."""

    kind: str  # "chat" or "text"
    req: _Sampling
    prompt_ids: list[int]
    vision: dict | None
    max_tokens: int


def _prepare(engine: Engine, kind: str, body: bytes, limits: Limits) -> _Job:
    """Body -> a checked job (APIError otherwise). CPU-bound: runs in ``engine.workers``."""
    data = _parse_body(body)
    schema = ChatCompletionRequest if kind == "chat" else CompletionRequest
    try:
        req = schema.model_validate(data)
    except ValidationError as e:
        raise _validation_error(e) from None
    except RecursionError:
        raise APIError(400, "the body is not valid here: its JSON is nested too deeply") from None
    _check_model(engine, req.model)
    req.check_supported()
    requested = getattr(req, "max_completion_tokens", None) or req.max_tokens
    if requested is not None and requested > limits.max_tokens_limit:
        raise APIError(
            400,
            f"max_tokens ({requested}) is over this server's limit of "
            f"{limits.max_tokens_limit} tokens per request (--max-tokens-limit)",
            param="max_tokens",
        )
    if kind == "chat":
        prompt_ids, vision = _chat_prompt(engine, req, limits)
    else:
        prompt_ids, vision = _completion_prompt(engine, req), None
    prompt_param = "messages" if kind == "chat" else "prompt"
    max_tokens = _max_tokens(engine, len(prompt_ids), requested, limits, prompt_param)
    return _Job(kind, req, prompt_ids, vision, max_tokens)


# --- the app --------------------------------------------------------------------------------------


class _SSEResponse(StreamingResponse):
    """A stream whose request is cancelled however the response ends (client gone included)."""

    def __init__(self, content: AsyncIterator[str], handle: Any) -> None:
        super().__init__(
            content,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self.handle = handle

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.handle.cancel()  # a no-op when it finished


def _failure(event: Failed) -> APIError:
    if event.shutdown:
        return APIError(503, event.message, type="server_error", code="server_shutting_down")
    return APIError(500, event.message, type="server_error")


async def _client_gone(request: Request) -> None:
    """Returns when the client disconnects (the body must have been read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, work: Coroutine) -> Response:
    """``work``'s response, or, when the client disconnects first, ``work`` cancelled (its
    ``finally`` cancels the scheduler request: the slot is free within one step) and a 499.

    A streaming response is returned as soon as it starts; from then on its own disconnect
    listener (Starlette's) ends it, and the scheduler request with it.
    """
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_client_gone(request))
    try:
        await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
    if task.done() and not task.cancelled():
        return task.result()
    await asyncio.wait((task,))  # let it unwind
    return Response(status_code=499)  # nobody reads it


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _usage(done: Finished) -> dict[str, int]:
    return {
        "prompt_tokens": done.prompt_tokens,
        "completion_tokens": done.completion_tokens,
        "total_tokens": done.prompt_tokens + done.completion_tokens,
    }


class _Reply:
    """Response bodies of one completion: ``kind`` "chat" (chat.completion) or "text"."""

    def __init__(self, engine: Engine, kind: str) -> None:
        self.kind = kind
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        self.head = {
            "id": f"{prefix}-{uuid.uuid4().hex[:24]}",
            "object": "chat.completion" if kind == "chat" else "text_completion",
            "created": int(time.time()),
            "model": engine.model_id,
        }

    def _log(self, done: Finished) -> None:
        log.info(
            "%s: prompt %d tokens, completion %d tokens, finish %s",
            self.head["id"],
            done.prompt_tokens,
            done.completion_tokens,
            done.reason,
        )

    def whole(self, text: str, done: Finished) -> dict[str, Any]:
        self._log(done)
        choice: dict[str, Any] = {"index": 0, "finish_reason": done.reason, "logprobs": None}
        if self.kind == "chat":
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {**self.head, "choices": [choice], "usage": _usage(done)}

    async def stream(self, events: asyncio.Queue, include_usage: bool) -> AsyncIterator[str]:
        head = dict(self.head)
        if self.kind == "chat":
            head["object"] = "chat.completion.chunk"
        if include_usage:
            head["usage"] = None  # every chunk carries the key; the last one has the numbers

        def chunk(text: str | None, finish: str | None = None, role: bool = False) -> str:
            choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
            if self.kind == "chat":
                delta = {"role": "assistant"} if role else {}
                choice["delta"] = delta | ({"content": text} if text is not None else {})
            else:
                choice["text"] = text or ""
            return _sse({**head, "choices": [choice]})

        if self.kind == "chat":
            yield chunk("", role=True)
        while True:
            event = await events.get()
            if isinstance(event, Failed):
                yield _sse(_failure(event).body())
                break
            if event.text:
                yield chunk(event.text)
            if isinstance(event, Finished):
                self._log(event)
                yield chunk(None, finish=event.reason)
                if include_usage:
                    yield _sse({**head, "choices": [], "usage": _usage(event)})
                break
        yield "data: [DONE]\n\n"


def create_app(
    engine: Engine,
    *,
    api_key: str | None = None,
    default_max_tokens: int = DEFAULT_MAX_TOKENS,
    max_tokens_limit: int = DEFAULT_MAX_TOKENS_LIMIT,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_images: int = DEFAULT_MAX_IMAGES,
    max_request_pixels: int = DEFAULT_MAX_REQUEST_PIXELS,
    bind_host: str = "127.0.0.1",
    allowed_hosts: tuple[str, ...] = (),
    allowed_origins: tuple[str, ...] = (),
) -> FastAPI:
    """The FastAPI app serving ``engine``; its lifespan starts and stops the scheduler.

    ``bind_host``, ``allowed_hosts`` and ``allowed_origins`` configure the Host and Origin
    checks (:class:`mlxc.runtime.http_guard.HostOriginGuard`).
    """
    from mlxc.runtime.http_guard import HostOriginGuard

    limits = Limits(
        default_max_tokens=default_max_tokens,
        max_tokens_limit=max_tokens_limit,
        max_body_bytes=max_body_bytes,
        max_images=max_images,
        max_request_pixels=max_request_pixels,
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        try:
            yield
        finally:
            engine.stop()

    app = FastAPI(title="mlxc", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.engine = engine
    app.add_middleware(
        HostOriginGuard,
        bind_host=bind_host,
        allowed_hosts=allowed_hosts,
        allowed_origins=allowed_origins,
    )

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        return _validation_error(e).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return APIError(e.status_code, str(e.detail), type=kind).response()

    @app.exception_handler(Exception)
    async def _crash(request: Request, e: Exception) -> JSONResponse:
        log.exception("unhandled error in %s %s", request.method, request.url.path)
        return APIError(
            500, f"internal error: {type(e).__name__}: {e}", type="server_error"
        ).response()

    def check_auth(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(
            token.strip().encode(), api_key.encode()
        ):
            raise APIError(
                401,
                "missing or wrong API key: send the header 'Authorization: Bearer KEY' with "
                "the server's --api-key",
                code="invalid_api_key",
            )

    async def read_body(request: Request) -> bytes:
        declared = request.headers.get("content-length")
        too_big = APIError(
            413,
            f"request body over the {max_body_bytes} byte limit",
            code="request_too_large",
        )
        if declared is not None and declared.isdigit() and int(declared) > max_body_bytes:
            raise too_big
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > max_body_bytes:
                raise too_big
        return bytes(body)

    def submit(job: _Job):
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def emit(event) -> None:  # scheduler thread -> event loop
            loop.call_soon_threadsafe(events.put_nowait, event)

        params = job.req.params(job.max_tokens)
        try:
            handle = engine.scheduler.submit(job.prompt_ids, params, emit, model_inputs=job.vision)
        except QueueFull as e:
            raise APIError(429, str(e), type="rate_limit_error", code="queue_full") from e
        except SchedulerStopped as e:
            raise APIError(503, str(e), type="server_error") from e
        return handle, events

    async def complete(kind: str, body: bytes) -> Response:
        """Prepare the request in a worker, queue it; answer JSON, or SSE when it streams."""
        loop = asyncio.get_running_loop()
        engine.preparing += 1
        try:
            job = await loop.run_in_executor(engine.workers, _prepare, engine, kind, body, limits)
        finally:
            engine.preparing -= 1
        handle, events = submit(job)
        reply = _Reply(engine, kind)
        if job.req.stream:
            return _SSEResponse(reply.stream(events, job.req.include_usage), handle)
        try:
            parts = []
            while True:
                event = await events.get()
                if isinstance(event, Failed):
                    raise _failure(event)
                parts.append(event.text)
                if isinstance(event, Finished):
                    return JSONResponse(reply.whole("".join(parts), event))
        finally:
            handle.cancel()  # client gone or error: free the slot (a no-op once finished)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        check_auth(request)
        body = await read_body(request)
        return await _unless_disconnected(request, complete("chat", body))

    @app.post("/v1/completions")
    async def completions(request: Request):
        check_auth(request)
        body = await read_body(request)
        return await _unless_disconnected(request, complete("text", body))

    def model_card() -> dict[str, Any]:
        card = {
            "id": engine.model_id,
            "object": "model",
            "created": engine.created,
            "owned_by": "mlxc",
            "max_model_len": engine.context_length,
        }
        if engine.description:
            card["description"] = engine.description
        return card

    @app.get("/v1/models")
    async def models(request: Request):
        check_auth(request)
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str, request: Request):
        check_auth(request)
        _check_model(engine, name)
        return model_card()

    @app.get("/health")
    async def health():
        # Open without the API key: load balancers and the tests poll it.
        alive = engine.scheduler.alive
        body = {
            "status": "ok" if alive else "error",
            "model": engine.model_id,
            "preparing": engine.preparing,  # requests being parsed, rendered and tokenized
            **engine.scheduler.stats(),
        }
        return JSONResponse(body, status_code=200 if alive else 503)

    return app


# --- running it -----------------------------------------------------------------------------------


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port``: bound before the model loads, so a port in use is
    an error at once, not after minutes of loading. OSError when it cannot be bound."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        # As uvicorn does: rebinding over TIME_WAIT connections of a previous run is fine
        # (on Linux this never lets two servers listen on one port).
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    return sock


class _Server(uvicorn.Server):
    """uvicorn, ending every request at once on Ctrl-C / SIGTERM: each stream gets a final
    error event and ``[DONE]``, so the graceful shutdown has no stream to wait for, and the
    process exits 0 (uvicorn would re-raise the signal: a KeyboardInterrupt traceback)."""

    def __init__(self, config: uvicorn.Config, engine: Engine) -> None:
        super().__init__(config)
        self.engine = engine

    def handle_exit(self, sig, frame) -> None:
        self.engine.scheduler.request_stop()  # a lock and a notify: safe in a signal handler
        super().handle_exit(sig, frame)
        self._captured_signals.clear()  # a stop on request is a normal exit


def run(app: FastAPI, sock: socket.socket, *, log_level: str = "info") -> None:
    """Serve ``app`` (made by :func:`create_app`) on ``sock`` (from :func:`bind`) until a
    signal stops it."""
    config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=5)
    _Server(config, app.state.engine).run(sockets=[sock])
