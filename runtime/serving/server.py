"""OpenAI-compatible HTTP API over the scheduler (FastAPI): ``create_app(engine)``.

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``
(and ``/v1/models/{id}``), ``GET /health``. Streaming answers are server-sent events that end
with ``data: [DONE]``. Every error is OpenAI-shaped: ``{"error": {"message", "type", "param",
"code"}}``; bad input is rejected before anything is queued, so it changes no state.

Layout: ``runtime.serving.engine`` holds the :class:`Engine` (model, tokenizers, processor,
scheduler, prompt workers; the app reaches the scheduler only through its ``submit``,
``status``, ``metrics_text`` and ``request_stop``, which ``runtime.serving.frontend``'s
``FrontEngine`` sends to another process when HTTP runs in one of its own),
``runtime.serving.api_schemas`` the request schemas, :class:`APIError` and :class:`Limits`;
this module the app: request preparation, the disconnect watcher, the JSON and SSE replies,
and binding and running it. The app's settings live on ``app.state`` (``engine``,
``settings``); the API key check and the size-limited body read are FastAPI dependencies
(:func:`check_auth` on every ``/v1`` route, :func:`read_body` on the completion routes).

Request path: Host/Origin guard (``runtime.serving.http_guard``) -> API key -> body (size-limited) ->
in a worker thread: JSON -> pydantic schema (strict types) -> prompt ids (chat template, or the
raw prompt) -> context and ``max_tokens`` checks -> ``Scheduler.submit`` -> events from the
scheduler thread, handed to the event loop by ``Engine.submit`` -> JSON or SSE.
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
import json
import logging
import re
import secrets
import socket
import time
import uuid
from collections.abc import AsyncIterator, Coroutine
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from typing import Annotated, Any

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from mlxc.runtime.serving import metrics
from mlxc.runtime.serving.api_schemas import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_IMAGES,
    DEFAULT_MAX_REQUEST_PIXELS,
    DEFAULT_MAX_TOKENS,
    DEFAULT_MAX_TOKENS_LIMIT,
    MAX_STOP_STRINGS,
    APIError,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    ImagePart,
    ImageURL,
    Limits,
    SamplingRequest,
    StreamOptions,
    TextPart,
    validation_error,
)
from mlxc.runtime.serving.engine import PROMPT_WORKERS, Engine, PromptError
from mlxc.runtime.serving.generate import out_of_range
from mlxc.runtime.serving.reasoning import ReasoningSplitter, starts_in_reasoning
from mlxc.runtime.serving.scheduler import (
    Delta,
    Failed,
    Finished,
    QueueFull,
    SchedulerStopped,
    TokenLogprob,
)
from mlxc.runtime.serving.structured import GrammarError
from mlxc.runtime.serving.tool_calls import ToolCallStream, ToolFormat, template_message

__all__ = [  # what mlxc.runtime.serving.server has always offered, wherever it now lives
    "DEFAULT_MAX_BODY_BYTES",
    "DEFAULT_MAX_IMAGES",
    "DEFAULT_MAX_REQUEST_PIXELS",
    "DEFAULT_MAX_TOKENS",
    "DEFAULT_MAX_TOKENS_LIMIT",
    "MAX_STOP_STRINGS",
    "PROMPT_WORKERS",
    "APIError",
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "Engine",
    "ImagePart",
    "ImageURL",
    "Limits",
    "PromptError",
    "StreamOptions",
    "TextPart",
    "bind",
    "create_app",
    "run",
]

log = logging.getLogger("mlxc.serve")


# --- request preparation (in the worker threads) --------------------------------------------------


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
    from mlxc.runtime.checkpoint.processor import ImageInputError, image_size, load_image

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
    engine: Engine, req: ChatCompletionRequest, settings: _Settings, tools: list[dict] | None
) -> tuple[list[int], dict | None]:
    """Prompt ids, and the vision inputs (numpy) of its images (None without images)."""
    limits = settings.limits
    template_kwargs = req.template_kwargs(settings.chat_template_args)
    if tools:
        template_kwargs["tools"] = tools  # as transformers' apply_chat_template(tools=) takes them
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
        try:
            extra = template_message(message)  # tool calls and tool results
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from None
        messages.append({"role": message.role, "content": content or "", **extra})
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
            return engine.encode_chat(messages, template_kwargs), None
        except PromptError as e:
            raise APIError(400, str(e), param="messages") from e
    # A VL model renders every chat, with images or without, through its processor's template.
    decoded = _decode_images(images, limits) if images else []
    try:
        prompt = engine.encode_chat_with_images(messages, decoded, template_kwargs)
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
    bad = out_of_range(prompt, vocab)
    if bad is not None:
        raise APIError(400, f"token id {bad} is out of range (vocab size {vocab})", param="prompt")
    return list(prompt)


def _max_tokens(
    engine: Engine, n_prompt: int, requested: int | None, limits: Limits, prompt_param: str
) -> int:
    """The completion budget; 400 when the prompt does not fit the context."""
    from mlxc.runtime.serving.generate import ContextExceeded, completion_budget

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
    req: SamplingRequest
    prompt_ids: list[int]
    vision: dict | None
    max_tokens: int
    # With --reasoning-parser (chat): whether the output starts inside the reasoning.
    in_reasoning: bool | None = None
    tools: ToolFormat | None = None  # tool calls are parsed from the reply in this format
    params: dict[str, Any] = field(default_factory=dict)  # SamplingParams fields set here


def _constraint(engine: Engine, req: ChatCompletionRequest, tools: list[dict] | None):
    """The grammar the reply must follow (``runtime.serving.structured``), or None. A forcing
    ``tool_choice`` (a named function, or "required"): one call. Else a ``response_format``
    (json_object, json_schema): that JSON, or a call of a tool when there are tools ("auto")."""
    from mlxc.runtime.serving.structured import call_items, grammar, response_item

    choice, param = req.tool_choice, "tool_choice"
    forced = bool(tools) and choice not in (None, "auto")
    if forced and not isinstance(choice, str):
        tools = [t for t in tools if t["function"]["name"] == choice.function.name]
    alternatives = call_items(engine.tool_format, tools, engine.tool_markers) if tools else []
    if not forced:
        fmt, param = req.response_format, "response_format"
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_schema" and fmt.json_schema is None:
            raise APIError(400, "response_format json_schema needs its json_schema", param=param)
        schema = fmt.json_schema.schema_ if fmt.json_schema else None
        alternatives.insert(0, response_item(fmt.type, schema))
    try:
        return engine.grammars.constraint(grammar(alternatives))
    except GrammarError as e:
        raise APIError(400, f"the schema cannot be used: {e}", param=param) from None


def _tool_request(req: ChatCompletionRequest) -> list[dict] | None:
    """The request's tool definitions for the chat template (None: no tools, or
    ``tool_choice`` "none"); 400 when ``tool_choice`` does not fit ``tools``."""
    choice = req.tool_choice
    names = [t.function.name for t in req.tools or []]
    if choice is not None and choice != "none" and not names:
        raise APIError(400, "tool_choice needs tools", param="tool_choice")
    if not isinstance(choice, str) and choice is not None and choice.function.name not in names:
        raise APIError(
            400,
            f"tool_choice names the function {choice.function.name!r}, which is not in tools",
            param="tool_choice",
        )
    if not names or choice == "none":
        return None
    return [t.model_dump(exclude_none=True) for t in req.tools]


def _prepare(engine: Engine, kind: str, body: bytes, settings: _Settings) -> _Job:
    """Body -> a checked job (APIError otherwise). CPU-bound: runs in ``engine.workers``."""
    limits = settings.limits
    data = _parse_body(body)
    schema = ChatCompletionRequest if kind == "chat" else CompletionRequest
    try:
        req = schema.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from None
    except RecursionError:
        raise APIError(400, "the body is not valid here: its JSON is nested too deeply") from None
    _check_model(engine, req.model)
    req.check_supported(engine.vocab_size)
    requested = getattr(req, "max_completion_tokens", None) or req.max_tokens
    if requested is not None and requested > limits.max_tokens_limit:
        raise APIError(
            400,
            f"max_tokens ({requested}) is over this server's limit of "
            f"{limits.max_tokens_limit} tokens per request (--max-tokens-limit)",
            param="max_tokens",
        )
    tools = None
    if kind == "chat":
        tools = _tool_request(req)
        prompt_ids, vision = _chat_prompt(engine, req, settings, tools)
    else:
        prompt_ids, vision = _completion_prompt(engine, req), None
    prompt_param = "messages" if kind == "chat" else "prompt"
    max_tokens = _max_tokens(engine, len(prompt_ids), requested, limits, prompt_param)
    job = _Job(kind, req, prompt_ids, vision, max_tokens)
    if tools:
        job.tools = engine.tool_format
        job.params["keep_special"] = frozenset(engine.tool_markers.values())
    if kind == "chat":
        constraint = _constraint(engine, req, tools)
        if constraint is not None:
            job.params["constraint"] = constraint
    if kind == "chat" and settings.reasoning_parser:
        tail = engine.prompt_tail(prompt_ids)
        job.in_reasoning = starts_in_reasoning(settings.reasoning_parser, tail)
    return job


# --- replies ---------------------------------------------------------------------------------------


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


def _usage(done: Finished) -> dict[str, Any]:
    return {
        "prompt_tokens": done.prompt_tokens,
        "completion_tokens": done.completion_tokens,
        "total_tokens": done.prompt_tokens + done.completion_tokens,
        # OpenAI's field: prompt tokens resumed from the prefix cache instead of prefilled
        "prompt_tokens_details": {"cached_tokens": done.cached_tokens},
    }


def _chat_logprob(lp: TokenLogprob) -> dict[str, Any]:
    """One token of ``choices[].logprobs.content`` (OpenAI's chat shape)."""
    return {
        "token": lp.text,
        "logprob": lp.logprob,
        "bytes": lp.bytes,
        "top_logprobs": [{"token": t, "logprob": v, "bytes": b} for t, b, v in lp.top],
    }


class _Reply:
    """Response bodies of one completion: ``kind`` "chat" (chat.completion) or "text"; with
    its logprobs when asked, the reasoning split off (chat, --reasoning-parser), and its token
    timing in the metrics."""

    def __init__(self, engine: Engine, job: _Job, arrival: float) -> None:
        self.kind = kind = job.kind
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        self.head = {
            "id": f"{prefix}-{uuid.uuid4().hex[:24]}",
            "object": "chat.completion" if kind == "chat" else "text_completion",
            "created": int(time.time()),
            "model": engine.model_id,
        }
        self.want_logprobs = job.req.logprob_request()[0]
        self.splitter = None if job.in_reasoning is None else ReasoningSplitter(job.in_reasoning)
        self.tools = job.tools  # parse tool calls out of the content in this format
        # parallel_tool_calls false: the first call only.
        self.max_calls = 1 if getattr(job.req, "parallel_tool_calls", None) is False else None
        self.tool_stream = None
        if job.tools is not None:
            self.tool_stream = ToolCallStream(job.tools, self.max_calls)
        self.clock = metrics.TokenClock(arrival)
        self.offset = 0  # characters of completion text so far (legacy text_offset)

    def event(self, event: Delta | Finished | Failed) -> None:
        """Count ``event`` in the metrics (every event passes here once)."""
        now = time.monotonic()
        if isinstance(event, Delta):
            self.clock.token(now)
        elif isinstance(event, Finished):
            self._log(event)
            self.clock.finished(now, event.reason, event.prompt_tokens, event.completion_tokens)
        else:
            metrics.FINISHED.labels(reason="failed").inc()

    def _log(self, done: Finished) -> None:
        log.info(
            "%s: prompt %d tokens, completion %d tokens, finish %s",
            self.head["id"],
            done.prompt_tokens,
            done.completion_tokens,
            done.reason,
        )

    def _logprobs(self, deltas: list[Delta]) -> dict[str, Any] | None:
        """``choices[].logprobs`` of these tokens (None when the request did not ask)."""
        if not self.want_logprobs:
            return None
        entries, offsets = [], []
        for d in deltas:
            if d.logprob is not None:
                entries.append(d.logprob)
                offsets.append(self.offset)
            self.offset += len(d.text)
        if self.kind == "chat":
            return {"content": [_chat_logprob(e) for e in entries], "refusal": None}
        return {  # the legacy completions shape
            "tokens": [e.text for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{t: v for t, _, v in e.top} for e in entries],
            "text_offset": offsets,
        }

    def whole(self, deltas: list[Delta], done: Finished) -> dict[str, Any]:
        text = "".join(d.text for d in deltas) + done.text
        choice: dict[str, Any] = {
            "index": 0,
            "finish_reason": done.reason,
            "logprobs": self._logprobs(deltas),
        }
        if self.kind == "chat":
            choice["message"] = {"role": "assistant", "content": text}
            if self.splitter is not None:
                reasoning, content = self.splitter.split(text)
                choice["message"] |= {"content": content, "reasoning_content": reasoning or None}
            if self.tools is not None:
                content, calls = self.tools.parse(choice["message"]["content"])
                calls = calls[: self.max_calls]
                if calls:
                    choice["message"] |= {
                        "content": content or None,
                        "tool_calls": [call.to_openai() for call in calls],
                    }
                    choice["finish_reason"] = _finish_with_calls(done.reason)
        else:
            choice["text"] = text
        return {**self.head, "choices": [choice], "usage": _usage(done)}

    def _pieces(self, text: str, final: bool = False) -> list[tuple[str, Any]]:
        """(field, value) of the chat deltas for this text: content, reasoning_content, or
        tool_calls (a list of the calls completed, with their indexes)."""
        if self.splitter is None:
            pieces = [("content", text)] if text else []
        else:
            pieces = self.splitter.feed(text) + (self.splitter.flush() if final else [])
            pieces = [("reasoning_content" if k == "reasoning" else k, t) for k, t in pieces]
        if self.tool_stream is None:
            return pieces
        out: list[tuple[str, Any]] = []

        def add(content: str, calls: list) -> None:
            if content:
                out.append(("content", content))
            if calls:
                first = self.tool_stream.sent - len(calls)
                out.append(("tool_calls", [c.to_openai(first + i) for i, c in enumerate(calls)]))

        for name, value in pieces:
            if name == "content":
                add(*self.tool_stream.feed(value))
            else:
                out.append((name, value))
        if final:
            add(*self.tool_stream.finish())
        return out

    async def stream(self, events: asyncio.Queue, include_usage: bool) -> AsyncIterator[str]:
        """SSE chunks. Each write carries every event queued for this stream so far: under
        load the event loop can fall behind the decode batch, and a write per token per stream
        (a send through the ASGI server each, holding the GIL the scheduler thread needs) then
        adds up; a stream that is behind catches up in one write."""
        head = dict(self.head)
        if self.kind == "chat":
            head["object"] = "chat.completion.chunk"
        if include_usage:
            head["usage"] = None  # every chunk carries the key; the last one has the numbers
        # The head's JSON once per stream; each chunk appends its choices to it.
        head_json = json.dumps(head, ensure_ascii=False, separators=(",", ":"))[:-1]
        text_key = "delta" if self.kind == "chat" else "text"

        def chunk(delta: dict | str, finish: str | None = None, logprobs=None) -> str:
            choice = {"index": 0, "finish_reason": finish, "logprobs": logprobs, text_key: delta}
            body = json.dumps(choice, ensure_ascii=False, separators=(",", ":"))
            return f'data: {head_json},"choices":[{body}]}}\n\n'

        if self.kind == "chat":
            yield chunk({"role": "assistant", "content": ""})
        done = False
        while not done:
            batch = [await events.get()]
            while not events.empty():
                batch.append(events.get_nowait())
            out: list[str] = []
            for event in batch:
                done = self._chunks(event, chunk, head, include_usage, out)
                if done:
                    break
            if out:  # nothing when the events' text is held back (a tool call, a think tag)
                yield "".join(out)
        yield "data: [DONE]\n\n"

    def _chunks(self, event, chunk, head: dict, include_usage: bool, out: list[str]) -> bool:
        """Append ``event``'s SSE chunks to ``out``; True when the stream ends with it."""
        self.event(event)
        if isinstance(event, Failed):
            out.append(_sse(_failure(event).body()))
            return True
        done = isinstance(event, Finished)
        logprobs = None
        if isinstance(event, Delta) and event.logprob is not None:
            logprobs = self._logprobs([event])
        if self.kind == "chat":
            pieces = self._pieces(event.text, final=done)
            if logprobs is not None and not pieces:
                pieces = [("content", "")]  # the token's text is held back: still report it
            for i, (field, text) in enumerate(pieces):
                out.append(chunk({field: text}, logprobs=logprobs if i == 0 else None))
        elif event.text or logprobs is not None:
            out.append(chunk(event.text, logprobs=logprobs))
        if done:
            reason = event.reason
            if self.tool_stream is not None and self.tool_stream.sent:
                reason = _finish_with_calls(reason)
            out.append(chunk({} if self.kind == "chat" else "", finish=reason))
            if include_usage:
                out.append(_sse({**head, "choices": [], "usage": _usage(event)}))
        return done


def _finish_with_calls(reason: str) -> str:
    """The finish reason of a reply that made tool calls: "tool_calls" when the model stopped
    by itself (a call cut short by max_tokens keeps "length")."""
    return "tool_calls" if reason == "stop" else reason


# --- the app --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Settings:
    """What :func:`create_app` was told beyond the engine (``app.state.settings``)."""

    api_key: str | None
    limits: Limits
    chat_template_args: dict[str, Any] = field(default_factory=dict)  # --chat-template-args
    reasoning_parser: str | None = None  # --reasoning-parser


async def _engine(request: Request) -> Engine:
    return request.app.state.engine


async def _settings(request: Request) -> _Settings:
    return request.app.state.settings


EngineDep = Annotated[Engine, Depends(_engine)]
SettingsDep = Annotated[_Settings, Depends(_settings)]


async def check_auth(request: Request, settings: SettingsDep) -> None:
    """The ``--api-key`` check (401 otherwise); a no-op without a key."""
    api_key = settings.api_key
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


async def read_body(request: Request, settings: SettingsDep) -> bytes:
    """The request body, 413 as soon as it is over ``--max-body-bytes`` (declared or read)."""
    max_body_bytes = settings.limits.max_body_bytes
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


Body = Annotated[bytes, Depends(read_body)]


async def _submit(engine: Engine, job: _Job):
    events: asyncio.Queue = asyncio.Queue()
    params = replace(job.req.params(job.max_tokens), **job.params)
    try:
        handle = await engine.submit(job.prompt_ids, params, events, model_inputs=job.vision)
    except QueueFull as e:
        raise APIError(429, str(e), type="rate_limit_error", code="queue_full") from e
    except SchedulerStopped as e:
        raise APIError(503, str(e), type="server_error") from e
    return handle, events


async def _complete(engine: Engine, settings: _Settings, kind: str, body: bytes) -> Response:
    """Prepare the request in a worker, queue it; answer JSON, or SSE when it streams."""
    arrival = time.monotonic()
    loop = asyncio.get_running_loop()
    engine.preparing += 1
    try:
        job = await loop.run_in_executor(engine.workers, _prepare, engine, kind, body, settings)
    finally:
        engine.preparing -= 1
    handle, events = await _submit(engine, job)
    reply = _Reply(engine, job, arrival)
    if job.req.stream:
        return _SSEResponse(reply.stream(events, job.req.include_usage), handle)
    try:
        deltas = []
        while True:
            event = await events.get()
            reply.event(event)
            if isinstance(event, Failed):
                raise _failure(event)
            if isinstance(event, Finished):
                return JSONResponse(reply.whole(deltas, event))
            deltas.append(event)
    finally:
        handle.cancel()  # client gone or error: free the slot (a no-op once finished)


def _model_card(engine: Engine) -> dict[str, Any]:
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


# Every /v1 route checks the API key first (before the body is read).
_v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_auth)])


_ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}


async def _counted(request: Request, work: Coroutine) -> Response:
    """``work``'s response, counted in the metrics (errors are counted by ``_api_error``)."""
    response = await _unless_disconnected(request, work)
    metrics.REQUESTS.labels(_ENDPOINTS[request.url.path], str(response.status_code)).inc()
    return response


@_v1.post("/chat/completions")
async def chat_completions(request: Request, body: Body, engine: EngineDep, settings: SettingsDep):
    return await _counted(request, _complete(engine, settings, "chat", body))


@_v1.post("/completions")
async def completions(request: Request, body: Body, engine: EngineDep, settings: SettingsDep):
    return await _counted(request, _complete(engine, settings, "text", body))


@_v1.get("/models")
async def models(engine: EngineDep):
    return {"object": "list", "data": [_model_card(engine)]}


@_v1.get("/models/{name:path}")
async def model(name: str, engine: EngineDep):
    _check_model(engine, name)
    return _model_card(engine)


_open = APIRouter()  # no API key: load balancers and the tests poll it


@_open.get("/health")
async def health(engine: EngineDep):
    alive, stats = await engine.status()
    body = {
        "status": "ok" if alive else "error",
        "model": engine.model_id,
        "preparing": engine.preparing,  # requests being parsed, rendered and tokenized
        **stats,
    }
    return JSONResponse(body, status_code=200 if alive else 503)


@_open.get("/metrics")
async def prometheus_metrics(engine: EngineDep):
    """Prometheus text format (``runtime.serving.metrics`` lists the names)."""
    return Response(await engine.metrics_text(), media_type=metrics.CONTENT_TYPE)


async def _api_error(request: Request, e: APIError) -> JSONResponse:
    endpoint = _ENDPOINTS.get(request.url.path)
    if endpoint is not None:
        metrics.REQUESTS.labels(endpoint, str(e.status)).inc()
    return e.response()


async def _invalid(request: Request, e: RequestValidationError) -> JSONResponse:
    return validation_error(e).response()


async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
    kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
    return APIError(e.status_code, str(e.detail), type=kind).response()


async def _crash(request: Request, e: Exception) -> JSONResponse:
    log.exception("unhandled error in %s %s", request.method, request.url.path)
    return APIError(500, f"internal error: {type(e).__name__}: {e}", type="server_error").response()


@asynccontextmanager
async def _lifespan(app: FastAPI):
    engine: Engine = app.state.engine
    engine.start()
    try:
        yield
    finally:
        engine.stop()


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
    chat_template_args: dict[str, Any] | None = None,
    reasoning_parser: str | None = None,
) -> FastAPI:
    """The FastAPI app serving ``engine``; its lifespan starts and stops the scheduler.

    ``bind_host``, ``allowed_hosts`` and ``allowed_origins`` configure the Host and Origin
    checks (:class:`mlxc.runtime.serving.http_guard.HostOriginGuard`). ``chat_template_args``:
    the chat template's extra variables for every request (a request's
    ``chat_template_kwargs`` override them); ``reasoning_parser``: one of
    ``runtime.serving.reasoning.PARSERS`` (chat replies then split off ``reasoning_content``).
    """
    from mlxc.runtime.serving.reasoning import PARSERS

    if reasoning_parser is not None and reasoning_parser not in PARSERS:
        raise ValueError(f"unknown reasoning parser {reasoning_parser!r}: one of {PARSERS}")
    from mlxc.runtime.serving.http_guard import HostOriginGuard

    limits = Limits(
        default_max_tokens=default_max_tokens,
        max_tokens_limit=max_tokens_limit,
        max_body_bytes=max_body_bytes,
        max_images=max_images,
        max_request_pixels=max_request_pixels,
    )
    app = FastAPI(title="mlxc", lifespan=_lifespan, docs_url=None, redoc_url=None)
    app.state.engine = engine
    app.state.settings = _Settings(
        api_key=api_key,
        limits=limits,
        chat_template_args=dict(chat_template_args or {}),
        reasoning_parser=reasoning_parser,
    )
    app.add_middleware(
        HostOriginGuard,
        bind_host=bind_host,
        allowed_hosts=allowed_hosts,
        allowed_origins=allowed_origins,
    )
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _crash)
    app.include_router(_v1)
    app.include_router(_open)
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
        self.engine.request_stop()  # safe in a signal handler
        super().handle_exit(sig, frame)
        self._captured_signals.clear()  # a stop on request is a normal exit


def run(app: FastAPI, sock: socket.socket, *, log_level: str = "info") -> None:
    """Serve ``app`` (made by :func:`create_app`) on ``sock`` (from :func:`bind`) until a
    signal stops it."""
    config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=5)
    server = _Server(config, app.state.engine)
    app.state.engine.stop_serving = lambda: setattr(server, "should_exit", True)
    server.run(sockets=[sock])
