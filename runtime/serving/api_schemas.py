"""The OpenAI-shaped side of ``mlxc serve``: request schemas (pydantic, strict types), the
errors (:class:`APIError`, ``{"error": {"message", "type", "param", "code"}}``) and the
per-request :class:`Limits` (the ``mlxc serve`` flags of the same names).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from mlxc.runtime.serving.sample import MAX_TOP_LOGPROBS
from mlxc.runtime.serving.scheduler import SamplingParams
from mlxc.runtime.serving.serve_defaults import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_IMAGES,
    DEFAULT_MAX_REQUEST_PIXELS,
    DEFAULT_MAX_TOKENS,
    DEFAULT_MAX_TOKENS_LIMIT,
)

MAX_STOP_STRINGS = 16
INT64 = (-(2**63), 2**63 - 1)


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


def validation_error(e: ValidationError | RequestValidationError) -> APIError:
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

# Request fields this server does not implement and that change what the model must produce:
# set to anything but the value that means "off", they get 400 naming them (nothing is dropped
# without a word). name -> (whether the value means "off", why it is refused). When a feature
# lands, its fields leave this table and become schema fields.
UNSUPPORTED_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "n": (lambda v: v in (None, 1), "this server returns one choice (n=1)"),
    "best_of": (lambda v: v in (None, 1), "this server returns one choice (best_of=1)"),
    "echo": (lambda v: v in (None, False), "the prompt is not echoed"),
    "suffix": (lambda v: v in (None, ""), "no insertion (suffix) completions"),
    # Chat requests declare these (tool calls, structured output); completions refuse them.
    "tools": (lambda v: not v, "tool calls are made by /v1/chat/completions"),
    "tool_choice": (lambda v: v in (None, "none", "auto"), "tool calls need /v1/chat/completions"),
    "functions": (lambda v: not v, "no function calls"),
    "function_call": (lambda v: v in (None, "none", "auto"), "no function calls"),
    "response_format": (
        lambda v: v is None or v == {"type": "text"},
        "structured output (json_object, json_schema) is made by /v1/chat/completions",
    ),
    "audio": (lambda v: v is None, "no audio output"),
    "modalities": (lambda v: v in (None, ["text"]), "text output only"),
    "prediction": (lambda v: v is None, "no predicted outputs"),
    "web_search_options": (lambda v: v is None, "no web search"),
    "verbosity": (lambda v: v is None, "no verbosity control"),
    # vLLM / llama.cpp extensions with the same effect
    "min_tokens": (lambda v: v in (None, 0), "no min_tokens"),
    "bad_words": (lambda v: not v, "no bad_words"),
    "allowed_token_ids": (lambda v: v is None, "no allowed_token_ids"),
    "guided_json": (lambda v: v is None, "no guided decoding"),
    "guided_regex": (lambda v: v is None, "no guided decoding"),
    "guided_choice": (lambda v: v is None, "no guided decoding"),
    "guided_grammar": (lambda v: v is None, "no guided decoding"),
    "structured_outputs": (lambda v: v is None, "no guided decoding"),
    "grammar": (lambda v: not v, "no grammars"),
    "json_schema": (lambda v: v is None, "no guided decoding"),
    "use_beam_search": (lambda v: v in (None, False), "no beam search"),
    "prompt_logprobs": (lambda v: v is None, "no prompt logprobs"),
}
# Fields that change nothing the model produces, accepted and ignored as OpenAI's server does.
# Any other field this server does not know is refused (400), as OpenAI refuses it.
IGNORED_FIELDS = frozenset(
    {
        "user",
        "metadata",
        "store",
        "service_tier",
        "parallel_tool_calls",  # chat: every call the model makes is returned
        "safety_identifier",
        "prompt_cache_key",
        "prompt_cache_retention",
    }
)


class _Schema(BaseModel):
    # Strict: "5" is not an int, 1.0 is not an int, "true" is not a bool. Unknown fields of
    # nested objects (messages, content parts) are ignored; a request's own unknown fields are
    # checked by SamplingRequest.check_supported.
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


class FunctionCall(_Schema):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallPart(_Schema):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Schema):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCallPart] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers
    name: str | None = None


# --- tools and structured output (runtime.serving.tool_calls, runtime.serving.structured) ---------


class FunctionSpec(_Schema):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema
    strict: bool | None = None


class ToolSpec(_Schema):
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(_Schema):
    name: str


class NamedToolChoice(_Schema):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaSpec(_Schema):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Schema):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None


class StreamOptions(_Schema):
    include_usage: bool = False


Penalty = Annotated[float, Field(ge=-2, le=2)]  # OpenAI's range


class SamplingRequest(_Schema):
    # Unknown fields are kept (model_extra) so that check_supported can name them.
    model_config = ConfigDict(strict=True, extra="allow")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1)  # -1 (vLLM) or 0: no top-k filter
    min_p: float | None = Field(default=None, ge=0, le=1)
    repetition_penalty: float | None = Field(default=None, gt=0, le=10)
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    seed: int | None = Field(default=None, ge=INT64[0], le=INT64[1])
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # vLLM extension: generate exactly max_tokens tokens

    def logprob_request(self) -> tuple[bool, int]:
        """(the sampled tokens' logprobs, how many alternatives): per endpoint."""
        return False, 0

    def params(self, max_tokens: int) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        logprobs, top_logprobs = self.logprob_request()
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=0.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=max(self.top_k or 0, 0),
            seed=self.seed,
            stop=tuple(stop),
            ignore_eos=self.ignore_eos,
            min_p=self.min_p or 0.0,
            repetition_penalty=self.repetition_penalty or 1.0,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            logit_bias=tuple((int(k), v) for k, v in (self.logit_bias or {}).items()),
            logprobs=logprobs,
            top_logprobs=top_logprobs,
        )

    def check_supported(self, vocab_size: int | None = None) -> None:
        for name, value in (self.model_extra or {}).items():
            if name in IGNORED_FIELDS:
                continue
            if name not in UNSUPPORTED_FIELDS:
                raise APIError(
                    400,
                    f"unknown field {name!r}: this server does not support it (it ignores only "
                    f"{', '.join(sorted(IGNORED_FIELDS))})",
                    param=name,
                )
            off, why = UNSUPPORTED_FIELDS[name]
            if not off(value):
                shown = json.dumps(value)
                shown = shown if len(shown) <= 40 else shown[:37] + "..."
                raise APIError(400, f"{name}={shown} is not supported: {why}", param=name)
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise APIError(400, f"at most {MAX_STOP_STRINGS} stop strings", param="stop")
        for key in self.logit_bias or {}:
            if not (key.isascii() and key.isdigit()) or (
                vocab_size is not None and int(key) >= vocab_size
            ):
                raise APIError(
                    400,
                    f"logit_bias key {key!r} is not a token id of this model"
                    + (f" (0..{vocab_size - 1})" if vocab_size else ""),
                    param="logit_bias",
                )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # calls are parsed however many the model makes
    response_format: ResponseFormat | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    # vLLM's name: extra variables of the chat template (enable_thinking, ...), over the
    # server's --chat-template-args.
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | None = None  # reaches the template as `reasoning_effort` (gpt-oss)

    def logprob_request(self) -> tuple[bool, int]:
        return bool(self.logprobs), self.top_logprobs or 0

    def check_supported(self, vocab_size: int | None = None) -> None:
        super().check_supported(vocab_size)
        if not self.messages:
            raise APIError(400, "messages must hold at least one message", param="messages")
        if self.top_logprobs and not self.logprobs:
            raise APIError(
                400, "top_logprobs needs logprobs: true (as OpenAI requires)", param="top_logprobs"
            )

    def template_kwargs(self, defaults: dict[str, Any]) -> dict[str, Any]:
        """The chat template's extra variables: the server's defaults, then this request's."""
        kwargs = {**defaults, **(self.chat_template_kwargs or {})}
        if self.reasoning_effort is not None:
            kwargs["reasoning_effort"] = self.reasoning_effort
        return kwargs


class CompletionRequest(SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    # Legacy shape: the N most likely alternatives of each token, besides the token itself.
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    def logprob_request(self) -> tuple[bool, int]:
        return self.logprobs is not None, self.logprobs or 0


# --- what one request may ask ---------------------------------------------------------------------


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
