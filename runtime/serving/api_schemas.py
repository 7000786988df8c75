"""The OpenAI-shaped side of ``mlxc serve``: request schemas (pydantic, strict types), the
errors (:class:`APIError`, ``{"error": {"message", "type", "param", "code"}}``) and the
per-request :class:`Limits` (the ``mlxc serve`` flags of the same names).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

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


class SamplingRequest(_Schema):
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


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # calls are parsed however many the model makes
    response_format: ResponseFormat | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if not self.messages:
            raise APIError(400, "messages must hold at least one message", param="messages")
        if self.logprobs:
            raise APIError(400, "logprobs are not supported", param="logprobs")


class CompletionRequest(SamplingRequest):
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
