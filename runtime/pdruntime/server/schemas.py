"""HTTP edge types: OpenAI request validation and error bodies, SGLang-shaped worker requests.

Every rejection is a 4xx with an OpenAI-style body
``{"error": {"message", "type", "param", "code"}}`` saying what was wrong and what is accepted.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

DEFAULT_MAX_TOKENS = 256  # when the client does not say; clipped to the remaining context by the worker
MAX_BODY_BYTES = 8 << 20  # request bodies above this are rejected with 413

# OpenAI parameters pdrt knows but does not implement: rejected by name instead of silently ignored.
UNSUPPORTED = ("logprobs", "top_logprobs", "tools", "tool_choice", "functions", "function_call", "response_format",
               "logit_bias", "parallel_tool_calls", "best_of", "echo", "suffix", "audio", "modalities", "prediction",
               "service_tier", "store", "metadata", "reasoning_effort", "web_search_options")


class ApiError(Exception):
    """An error to return to the client as an OpenAI-style body."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def error_body(status: int, message: str, **kw: Any) -> dict:
    return ApiError(status, message, **kw).body()


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class _SamplingFields(_Strict):
    model: str = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)  # pdrt/SGLang extension; 0 = off
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(default=None, max_length=256)
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    ignore_eos: bool = False  # SGLang extension

    @model_validator(mode="after")
    def _supported_values(self):
        if self.n != 1:
            raise ValueError("n: only n=1 is supported")
        if self.presence_penalty != 0.0 or self.frequency_penalty != 0.0:
            raise ValueError("presence_penalty/frequency_penalty: only 0 is supported")
        if isinstance(self.stop, list) and len(self.stop) > 4:
            raise ValueError("stop: at most 4 stop strings are accepted")
        return self

    def stop_tuple(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def sampling_params(self) -> dict:
        """SGLang-shaped sampling_params for the worker legs."""
        return {"max_new_tokens": self.max_tokens, "temperature": self.temperature, "top_p": self.top_p,
                "top_k": self.top_k, "seed": self.seed, "stop": list(self.stop_tuple()), "ignore_eos": self.ignore_eos}


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)

    @model_validator(mode="after")
    def _max(self):
        if self.max_tokens is None and self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return self


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] = Field()

    @model_validator(mode="after")
    def _prompt(self):
        if isinstance(self.prompt, list) and len(self.prompt) != 1:
            raise ValueError("prompt: a string (or a list of exactly one string) is accepted")
        if self.max_tokens is None:
            self.max_tokens = 16  # OpenAI's default for /v1/completions
        return self

    def prompt_text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]


def parse_body(raw: bytes) -> dict:
    if len(raw) > MAX_BODY_BYTES:
        raise ApiError(413, f"request body of {len(raw)} bytes is too large; accepted: up to {MAX_BODY_BYTES} bytes",
                       code="request_too_large")
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as exc:
        raise ApiError(400, f"request body is not valid JSON ({exc}); accepted: a JSON object", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"request body is a JSON {type(body).__name__}; accepted: a JSON object", code="invalid_json")
    return body


def validate(model: type[BaseModel], body: dict) -> Any:
    """Validate ``body`` into ``model``; unsupported and unknown parameters and bad values become ApiError(400)."""
    for name in UNSUPPORTED:
        if name in body and body[name] not in (None, False):
            raise ApiError(400, f"parameter {name!r} is not supported by pdrt; accepted parameters: "
                           f"{', '.join(sorted(model.model_fields))}", param=name, code="unsupported_parameter")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "function-after") or None
        if err.get("type") == "extra_forbidden":
            raise ApiError(400, f"unknown parameter {loc!r}; accepted parameters: {', '.join(sorted(model.model_fields))}",
                           param=loc, code="unsupported_parameter") from None
        got = err.get("input")
        got_s = json.dumps(got)[:80] if isinstance(got, (int, float, str, bool, type(None))) else type(got).__name__
        msg = err.get("msg", "invalid value").removeprefix("Value error, ")
        raise ApiError(400, f"{loc + ': ' if loc else ''}{msg} (got {got_s})", param=loc,
                       code="invalid_value") from None


# ---- worker (SGLang /generate) ------------------------------------------------------------

class WorkerSampling(BaseModel):
    model_config = ConfigDict(extra="ignore")
    max_new_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = 0  # SGLang uses -1 for "off"; <= 0 means off here
    seed: int | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool = False


class GenerateRequest(BaseModel):
    """SGLang ``/generate`` body, plus ``messages`` (a pdrt extension: the worker applies the chat template)."""
    model_config = ConfigDict(extra="ignore")
    text: str | None = None
    input_ids: list[int] | None = None
    messages: list[dict] | None = None
    sampling_params: WorkerSampling = Field(default_factory=WorkerSampling)
    stream: bool = False
    rid: str | None = None
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: int | None = None

    @model_validator(mode="after")
    def _one_input(self):
        given = [x is not None for x in (self.text, self.input_ids, self.messages)]
        if sum(given) != 1:
            raise ValueError("exactly one of text, input_ids or messages is accepted")
        return self
