"""HTTP edge types: ONE request model with bounds for every field, shared by the router and the workers.

Every rejection is a 4xx with an OpenAI-style body
``{"error": {"message", "type", "param", "code"}}`` saying what was wrong and what is accepted.

The bounds live here once (:data:`ACCEPTED` and the annotated field types below). The router's OpenAI
models, the workers' SGLang ``/generate`` model and the workers' own ``/v1`` routes all use these types,
so a value the router accepts is one the worker and its engine accept, and a value that would make an
engine step raise (a subnormal temperature, a seed past 64 bits, a token id past the vocabulary) is a
400 naming the parameter at whichever edge sees it first.

:func:`parse_body` is the byte-level edge: valid UTF-8, valid JSON (no NaN/Infinity), an object, nested at
most :data:`MAX_JSON_DEPTH` deep, and no lone surrogates in any string (``"\\ud800"`` is valid JSON but
not Unicode text).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator

DEFAULT_MAX_TOKENS = 256  # when the client does not say; clipped to the remaining context by the worker
MAX_BODY_BYTES = 8 << 20  # request bodies above this are rejected with 413 (enforced while streaming in)
MAX_JSON_DEPTH = 32  # nesting of arrays/objects; the deepest valid request is ~5
MAX_TOKENS_CAP = 1 << 20  # max_tokens upper bound before the per-model context check
MIN_TEMPERATURE = 1e-5  # below this (but > 0) logits / T overflows fp32 and sampling raises; 0 = greedy
MIN_TOP_P = 1e-5  # a top_p that rounds to 0 in fp32 keeps no token and sampling raises
MAX_TOP_K = 1 << 20
MAX_SEED = (1 << 63) - 1  # torch.Generator.manual_seed takes a signed 64-bit value
MAX_STOP = 4  # stop strings per request (OpenAI's limit)
MAX_STOP_CHARS = 256
MAX_MESSAGES = 4096
MAX_TOKEN_ID = (1 << 31) - 1  # input_ids are further checked against the model's vocabulary
MAX_ID_CHARS = 256  # user, name, model, rid

# What each parameter accepts, in words: every 400 about a parameter ends with "accepted: <this>".
ACCEPTED = {
    "model": "a model id from GET /v1/models",
    "max_tokens": f"an integer in [1, {MAX_TOKENS_CAP}] (and prompt + max_tokens within the model's context)",
    "max_completion_tokens": f"an integer in [1, {MAX_TOKENS_CAP}]",
    "max_new_tokens": f"an integer in [1, {MAX_TOKENS_CAP}]",
    "temperature": f"0 (greedy) or a number in [{MIN_TEMPERATURE:g}, 2]",
    "top_p": f"a number in [{MIN_TOP_P:g}, 1]",
    "top_k": f"an integer in [-1, {MAX_TOP_K}] (-1 and 0 = off)",
    "seed": f"an integer in [0, {MAX_SEED}]",
    "stop": f"a string or a list of at most {MAX_STOP} strings, each 1..{MAX_STOP_CHARS} characters",
    "n": "1",
    "presence_penalty": "0",
    "frequency_penalty": "0",
    "user": f"a string of at most {MAX_ID_CHARS} characters",
    "messages": f"a list of 1..{MAX_MESSAGES} messages {{role: system|user|assistant, content: text}}",
    "prompt": "a string, or a list of exactly one string",
    "input_ids": "a non-empty list of token ids in [0, vocabulary size)",
    "stream": "true or false",
    "stream_options": "{\"include_usage\": true|false}",
    "bootstrap_port": "an integer in [1, 65535]",
    "bootstrap_room": f"an integer in [0, {(1 << 64) - 1}]",
}

# OpenAI parameters pdrt knows but does not implement: rejected by name instead of silently ignored.
UNSUPPORTED = ("logprobs", "top_logprobs", "tools", "tool_choice", "functions", "function_call", "response_format",
               "logit_bias", "parallel_tool_calls", "best_of", "echo", "suffix", "audio", "modalities", "prediction",
               "service_tier", "store", "metadata", "reasoning_effort", "web_search_options")

# SGLang's chat/completion extensions, which SGLang's router writes into every body it forwards (with these
# defaults). pdrt behaves as these defaults say; a different value is rejected by name.
SGLANG_DEFAULTS = {"no_stop_trim": False, "continue_final_message": False, "skip_special_tokens": True,
                   "separate_reasoning": True, "stream_reasoning": True, "return_hidden_states": False}


class ApiError(Exception):
    """An error to return to the client as an OpenAI-style body."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def error_body(status: int, message: str, **kw: Any) -> dict:
    return ApiError(status, message, **kw).body()


# ---- bounded field types (the one place the bounds are written) ------------------------------------

def _temperature(v: float) -> float:
    if 0 < v < MIN_TEMPERATURE:
        raise ValueError(f"{v!r} is too small to sample with (0 means greedy)")
    return v


def _stop_strings(v: str | list[str] | None):
    items = [v] if isinstance(v, str) else (v or [])
    if len(items) > MAX_STOP:
        raise ValueError(f"{len(items)} stop strings given")
    for s in items:
        if len(s) > MAX_STOP_CHARS:
            raise ValueError(f"a stop string of {len(s)} characters")
    return v


MaxTokens = Annotated[int, Field(ge=1, le=MAX_TOKENS_CAP)]
Temperature = Annotated[float, Field(ge=0.0, le=2.0, allow_inf_nan=False), AfterValidator(_temperature)]
TopP = Annotated[float, Field(ge=MIN_TOP_P, le=1.0, allow_inf_nan=False)]
TopK = Annotated[int, Field(ge=-1, le=MAX_TOP_K)]
Seed = Annotated[int, Field(ge=0, le=MAX_SEED)]
Stop = Annotated[str | list[str] | None, AfterValidator(_stop_strings)]
ShortText = Annotated[str, Field(max_length=MAX_ID_CHARS)]
Port = Annotated[int, Field(ge=1, le=65535)]
Room = Annotated[int, Field(ge=0, le=(1 << 64) - 1)]
TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]


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
    name: ShortText | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class _SamplingFields(_Strict):
    model: str = Field(min_length=1, max_length=MAX_ID_CHARS)
    max_tokens: MaxTokens | None = None
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: TopK = 0  # pdrt/SGLang extension; -1 and 0 = off
    seed: Seed | None = None
    stop: Stop = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: ShortText | None = None
    n: Literal[1] = 1
    presence_penalty: Annotated[float, Field(ge=0.0, le=0.0)] = 0.0  # not implemented: only 0
    frequency_penalty: Annotated[float, Field(ge=0.0, le=0.0)] = 0.0
    ignore_eos: bool = False  # SGLang extension

    def stop_tuple(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def sampling_params(self) -> dict:
        """SGLang-shaped sampling_params for the worker legs (validated again there by :class:`WorkerSampling`)."""
        return {"max_new_tokens": self.max_tokens, "temperature": self.temperature, "top_p": self.top_p,
                "top_k": self.top_k, "seed": self.seed, "stop": list(self.stop_tuple()), "ignore_eos": self.ignore_eos}


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: MaxTokens | None = None

    @model_validator(mode="after")
    def _max(self):
        if self.max_tokens is None and self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return self

    def worker_input(self) -> dict:
        return {"messages": [{"role": m.role, "content": m.text()} for m in self.messages]}


class CompletionRequest(_SamplingFields):
    prompt: str | Annotated[list[str], Field(min_length=1, max_length=1)]

    @model_validator(mode="after")
    def _prompt(self):
        if self.max_tokens is None:
            self.max_tokens = 16  # OpenAI's default for /v1/completions
        return self

    def prompt_text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]

    def worker_input(self) -> dict:
        return {"text": self.prompt_text()}


class _PDFields(BaseModel):
    """What a PD router (pdrt's or SGLang's) adds to each leg's body."""
    rid: ShortText | None = None
    bootstrap_host: ShortText | None = None
    bootstrap_port: Port | None = None
    bootstrap_room: Room | None = None


class WorkerChatRequest(ChatCompletionRequest, _PDFields):
    """``/v1/chat/completions`` on a worker: the router's model plus the PD bootstrap fields."""


class WorkerCompletionRequest(CompletionRequest, _PDFields):
    """``/v1/completions`` on a worker: the router's model plus the PD bootstrap fields."""


def _find_bad_text(obj: Any, path: tuple, depth: int) -> tuple[str, str] | None:
    """(param path, problem) for the first string with a lone surrogate or a nesting past MAX_JSON_DEPTH."""
    if depth > MAX_JSON_DEPTH:
        return (str(path[0]) if path else "body"), f"nested more than {MAX_JSON_DEPTH} levels deep"
    if isinstance(obj, str):
        try:
            obj.encode("utf-8")
        except UnicodeEncodeError as exc:
            return ".".join(map(str, path)) or "body", \
                f"contains a lone surrogate (U+{ord(obj[exc.start]):04X} at character {exc.start}), which is not Unicode text"
        return None
    if isinstance(obj, dict):
        items = obj.items()
    elif isinstance(obj, list):
        items = enumerate(obj)
    else:
        return None
    for k, v in items:
        if isinstance(k, str) and (bad := _find_bad_text(k, path, depth + 1)) is not None:
            return bad
        if (bad := _find_bad_text(v, path + (k,), depth + 1)) is not None:
            return bad
    return None


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def parse_body(raw: bytes) -> dict:
    """Bytes -> a JSON object, or ApiError(400/413) saying what is wrong and what is accepted."""
    if len(raw) > MAX_BODY_BYTES:
        raise ApiError(413, f"request body of {len(raw)} bytes is too large; accepted: up to {MAX_BODY_BYTES} bytes",
                       code="request_too_large")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ApiError(400, f"request body is not valid UTF-8 (byte {exc.start}); accepted: a UTF-8 JSON object",
                       code="invalid_json") from None
    try:
        body = json.loads(text, parse_constant=_no_constants)
    except RecursionError:
        raise ApiError(400, f"request body is nested too deeply; accepted: JSON nested at most {MAX_JSON_DEPTH} "
                       "levels deep", code="invalid_json") from None
    except ValueError as exc:
        raise ApiError(400, f"request body is not valid JSON ({exc}); accepted: a JSON object", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"request body is a JSON {type(body).__name__}; accepted: a JSON object", code="invalid_json")
    bad = _find_bad_text(body, (), 1)
    if bad is not None:
        param, problem = bad
        accepted = f"JSON nested at most {MAX_JSON_DEPTH} levels deep" if problem.startswith("nested") else \
            "valid Unicode text (escape a character as a \\uXXXX pair only when it is a proper surrogate pair)"
        raise ApiError(400, f"{param}: {problem}; accepted: {accepted}", param=param if param != "body" else None,
                       code="invalid_json" if problem.startswith("nested") else "invalid_unicode")
    return body


def _accepted(loc: str | None) -> str:
    if not loc:
        return ""
    parts = [p for p in loc.split(".") if not p.isdigit()]
    for name in reversed(parts):
        if name in ACCEPTED:
            return f"; accepted: {ACCEPTED[name]}"
    return ""


def validate(model: type[BaseModel], body: dict) -> Any:
    """Validate ``body`` into ``model``; unsupported and unknown parameters and bad values become ApiError(400)
    naming the parameter, what was given, and what is accepted."""
    body = dict(body)
    for name in UNSUPPORTED:
        if name in body:
            if body[name] not in (None, False):
                raise ApiError(400, f"parameter {name!r} is not supported by pdrt; accepted parameters: "
                               f"{', '.join(sorted(model.model_fields))}", param=name, code="unsupported_parameter")
            del body[name]  # "logprobs": false and the like ask for nothing
    for name, default in SGLANG_DEFAULTS.items():
        if name in body:
            if body[name] != default:
                raise ApiError(400, f"parameter {name!r}={json.dumps(body[name])[:40]} is not supported by pdrt; "
                               f"accepted: {json.dumps(default)} (the default)", param=name,
                               code="unsupported_parameter")
            del body[name]
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise _to_api_error(exc, model) from None


def _to_api_error(exc: ValidationError, model: type[BaseModel]) -> ApiError:
    err = exc.errors()[0]
    loc = ".".join(str(x) for x in err.get("loc", ()) if not _is_tag(x)) or None
    if err.get("type") == "extra_forbidden":
        return ApiError(400, f"unknown parameter {loc!r}; accepted parameters: {', '.join(sorted(model.model_fields))}",
                        param=loc, code="unsupported_parameter")
    got = err.get("input")
    got_s = json.dumps(got)[:80] if isinstance(got, (int, float, str, bool, type(None))) else type(got).__name__
    msg = err.get("msg", "invalid value").removeprefix("Value error, ")
    return ApiError(400, f"{loc + ': ' if loc else ''}{msg} (got {got_s}){_accepted(loc)}", param=loc,
                    code="invalid_value")


def _is_tag(x: Any) -> bool:
    """pydantic's union/validator tags in error locations (``str``, ``list[str]``, ``function-after[...]``)."""
    return isinstance(x, str) and (x.startswith("function-") or x in ("str", "list[str]", "int", "float", "bool")
                                   or x.startswith("list[") or x.startswith("constrained-"))


# ---- worker (SGLang /generate) ------------------------------------------------------------

class WorkerSampling(BaseModel):
    """SGLang ``sampling_params``, with the same bounds as the router's OpenAI fields (unknown SGLang keys
    are ignored: SGLang clients send many this engine does not use)."""
    model_config = ConfigDict(extra="ignore")
    max_new_tokens: MaxTokens | None = None
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: TopK = 0  # SGLang uses -1 for "off"; <= 0 means off here
    seed: Seed | None = None
    stop: Stop = None
    ignore_eos: bool = False


class WorkerMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant"]
    content: str


class GenerateRequest(_PDFields):
    """SGLang ``/generate`` body, plus ``messages`` (a pdrt extension: the worker applies the chat template)."""
    model_config = ConfigDict(extra="ignore")
    text: str | None = None
    input_ids: Annotated[list[TokenId], Field(min_length=1)] | None = None
    messages: Annotated[list[WorkerMessage], Field(min_length=1, max_length=MAX_MESSAGES)] | None = None
    sampling_params: WorkerSampling = Field(default_factory=WorkerSampling)
    stream: bool = False

    @model_validator(mode="after")
    def _one_input(self):
        given = [x is not None for x in (self.text, self.input_ids, self.messages)]
        if sum(given) != 1:
            raise ValueError("exactly one of text, input_ids or messages is accepted")
        return self


def validate_generate(body: dict) -> GenerateRequest:
    try:
        return GenerateRequest.model_validate(body)
    except ValidationError as exc:
        raise _to_api_error(exc, GenerateRequest) from None


def generate_from_openai(req: ChatCompletionRequest | CompletionRequest, pd: _PDFields) -> GenerateRequest:
    """A worker's ``/v1`` request as the SGLang ``/generate`` request it runs (same bounds, already checked)."""
    return GenerateRequest.model_validate({**req.worker_input(), "sampling_params": req.sampling_params(),
                                           "stream": req.stream, "rid": pd.rid, "bootstrap_host": pd.bootstrap_host,
                                           "bootstrap_port": pd.bootstrap_port, "bootstrap_room": pd.bootstrap_room})


def openapi_components() -> dict:
    """JSON schemas of the router's request bodies (and what they reference), for the OpenAPI document."""
    out: dict = {}
    for model in (ChatCompletionRequest, CompletionRequest):
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        out.update(schema.pop("$defs", {}))
        out[model.__name__] = schema
    return out
