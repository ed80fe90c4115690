"""HTTP edge types: ONE request model with bounds for every field, shared by the router and the workers.

Every rejection is a 4xx with an OpenAI-style body
``{"error": {"message", "type", "param", "code"}}`` saying what was wrong and what is accepted.

The bounds live here once (:data:`ACCEPTED` and the annotated field types below). The router's OpenAI
models, the workers' SGLang ``/generate`` model and the workers' own ``/v1`` routes all use these types,
so a value the router accepts is one the worker and its engine accept, and a value that would make an
engine step raise (a subnormal temperature, a seed past 64 bits, a token id past the vocabulary) is a
400 naming the parameter at whichever edge sees it first.

Each process validates a request once, at its own HTTP edge: the router into :class:`ChatCompletionRequest` /
:class:`CompletionRequest` (then ``router.reply.EdgeRequest``), a worker into :class:`GenerateRequest`; the layers
below read those objects. What a client leaves out gets its default here (:data:`DEFAULT_MAX_TOKENS`,
:data:`COMPLETION_DEFAULT_MAX_TOKENS`; sampling defaults: the model's, ``engine.defaults``). The engine keeps its
own checks as the guard of its Python API.

:func:`parse_body` is the byte-level edge: valid UTF-8, valid JSON (no NaN/Infinity), an object, nested at
most :data:`MAX_JSON_DEPTH` deep, and no lone surrogates in any string (``"\\ud800"`` is valid JSON but
not Unicode text).
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

try:
    import orjson
except ImportError:  # pragma: no cover - orjson is in the runtime extra
    orjson = None
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator

# defaults for what a client leaves out: chosen here and nowhere else (the engine's SamplingParams has its own, for
# callers of the engine itself)
DEFAULT_MAX_TOKENS = 256  # chat and /generate: clipped to the context left after the prompt (default_max_tokens)
COMPLETION_DEFAULT_MAX_TOKENS = 16  # /v1/completions: OpenAI's default
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
MAX_N = 8  # choices per request (each is one decode sequence)
MAX_TOP_LOGPROBS = 20  # OpenAI's limit
MAX_TOOLS = 128
MAX_LOGIT_BIAS = 300

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
    "n": f"an integer in [1, {MAX_N}]",
    "presence_penalty": "a number in [-2, 2]",
    "frequency_penalty": "a number in [-2, 2]",
    "repetition_penalty": "a number in (0, 100] (1 = off)",
    "min_p": "a number in [0, 1] (0 = off)",
    "logit_bias": f"an object of at most {MAX_LOGIT_BIAS} token ids (as strings) -> a number in [-100, 100]",
    "logprobs": f"chat: true|false; completions: an integer in [0, {MAX_TOP_LOGPROBS}]",
    "top_logprobs": f"an integer in [0, {MAX_TOP_LOGPROBS}] (with logprobs: true)",
    "stop_token_ids": "a list of at most 16 token ids",
    "response_format": "{\"type\": \"text\"} | {\"type\": \"json_object\"} | {\"type\": \"json_schema\", \"json_schema\": {\"name\", \"schema\", \"strict\"}}",
    "tools": f"a list of at most {MAX_TOOLS} {{type: function, function: {{name, description, parameters}}}}",
    "tool_choice": "\"none\" | \"auto\" | \"required\" | {\"type\": \"function\", \"function\": {\"name\": ...}}",
    "parallel_tool_calls": "true or false",
    "echo": "true or false (completions; with logprobs: not streamed)",
    "user": f"a string of at most {MAX_ID_CHARS} characters",
    "messages": f"a list of 1..{MAX_MESSAGES} messages {{role: system|user|assistant|tool, content: text}} "
                "(assistant messages may carry tool_calls, tool messages a tool_call_id)",
    "prompt": "a string, or a list of exactly one string",
    "input_ids": "a non-empty list of token ids in [0, vocabulary size)",
    "stream": "true or false",
    "stream_options": "{\"include_usage\": true|false, \"continuous_usage_stats\": true|false}",
    "bootstrap_port": "an integer in [1, 65535]",
    "bootstrap_room": f"an integer in [0, {(1 << 64) - 1}]",
}

# OpenAI parameters pdrt knows but does not implement: rejected by name instead of silently ignored.
UNSUPPORTED = ("functions", "function_call", "best_of", "suffix", "audio", "modalities", "prediction",
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
MinP = Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)]
RepPenalty = Annotated[float, Field(gt=0.0, le=100.0, allow_inf_nan=False)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0, allow_inf_nan=False)]
Bias = Annotated[float, Field(ge=-100.0, le=100.0, allow_inf_nan=False)]
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
    continuous_usage_stats: bool = False  # SGLang/vLLM: usage on every chunk


class FunctionDef(_Strict):
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: str


class ToolChoiceNamed(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ToolCallFunction(_Strict):
    name: str
    arguments: str


class ToolCall(_Strict):
    id: ShortText
    type: Literal["function"] = "function"
    function: ToolCallFunction


class JsonSchemaFormat(_Strict):
    name: ShortText = "response"
    description: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type json_schema needs a json_schema object")
        return self


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: ShortText | None = None
    tool_calls: list[ToolCall] | None = None  # assistant turns that called tools
    tool_call_id: ShortText | None = None  # tool turns: which call this answers

    @model_validator(mode="after")
    def _content(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (only an assistant message with tool_calls may omit it)")
        return self

    def text(self) -> str:
        content = self.__dict__["content"]
        if content is None:
            return ""
        if isinstance(content, str):
            return content
        return "".join(p.text for p in content)

    def worker_dict(self) -> dict:
        """What a worker renders the message from (read from ``__dict__``: once per message of every request, and an
        agent's history is dozens of messages)."""
        f = self.__dict__
        d: dict = {"role": f["role"], "content": self.text()}
        if f["tool_calls"]:
            d["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.function.name,
                                                                          "arguments": c.function.arguments}}
                               for c in f["tool_calls"]]
        if f["tool_call_id"]:
            d["tool_call_id"] = f["tool_call_id"]
        if f["name"]:
            d["name"] = f["name"]
        return d


_OPTIONAL_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed")  # same name both sides


class _SamplingFields(_Strict):
    model: str = Field(min_length=1, max_length=MAX_ID_CHARS)
    max_tokens: MaxTokens | None = None
    temperature: Temperature | None = None  # None = the model's default (GET /v1/models)
    top_p: TopP | None = None
    top_k: TopK | None = None  # pdrt/SGLang extension; -1 and 0 = off
    min_p: MinP | None = None  # pdrt/SGLang/vLLM extension
    repetition_penalty: RepPenalty | None = None  # pdrt/SGLang/vLLM extension
    seed: Seed | None = None
    stop: Stop = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: ShortText | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    logit_bias: Annotated[dict[str, Bias], Field(max_length=MAX_LOGIT_BIAS)] | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=16)] | None = None
    ignore_eos: bool = False  # SGLang extension

    def stop_tuple(self) -> tuple[str, ...]:
        stop = self.__dict__["stop"]
        if stop is None:
            return ()
        return (stop,) if isinstance(stop, str) else tuple(stop)

    def logprobs_n(self) -> int | None:
        return None

    def grammar(self) -> str | None:
        return None

    def sampling_params(self) -> dict:
        """SGLang-shaped sampling_params for the worker legs (validated again there by :class:`WorkerSampling`).
        Fields the client left out are absent: the worker fills in the model's defaults.

        Read from the model's ``__dict__``: each attribute read of a pydantic model goes through the
        ``__getattr__`` hook BaseModel defines (several times a plain read), and this reads twenty per request."""
        f = self.__dict__
        out: dict = {}  # built key by key (one per request: no comprehension to drop the Nones afterwards)
        if f["max_tokens"] is not None:
            out["max_new_tokens"] = f["max_tokens"]
        for key in _OPTIONAL_SAMPLING:
            value = f[key]
            if value is not None:
                out[key] = value
        out["stop"] = list(self.stop_tuple())
        out["ignore_eos"] = f["ignore_eos"]
        out["frequency_penalty"] = f["frequency_penalty"]
        out["presence_penalty"] = f["presence_penalty"]
        if f["logit_bias"]:
            out["logit_bias"] = dict(f["logit_bias"])
        if f["stop_token_ids"] is not None:
            out["stop_token_ids"] = f["stop_token_ids"]
        logprobs = self.logprobs_n()
        if logprobs is not None:
            out["logprobs"] = logprobs
        if f["n"] > 1:
            out["n"] = f["n"]
        return out


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    response_format: ResponseFormat | None = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceNamed | None = None
    parallel_tool_calls: bool = True

    @model_validator(mode="after")
    def _max(self):
        if self.max_tokens is None and self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        from pdruntime.server.openai.structured import check_chat  # names the parameter of an unsupported combination
        check_chat(self)
        return self

    def logprobs_n(self) -> int | None:
        f = self.__dict__
        return (f["top_logprobs"] or 0) if f["logprobs"] else None

    def worker_input(self) -> dict:
        """What the workers need to render the prompt and build the grammar (they know the tool-call parser)."""
        f = self.__dict__
        out: dict = {"messages": [m.worker_dict() for m in f["messages"]]}
        if not f["tools"] and f["response_format"] is None:  # the usual request: nothing else to pass
            return out
        if self.tools and self.tool_choice != "none":
            out["tools"] = [t.model_dump(by_alias=True, exclude_none=True) for t in self.tools]
            out["tool_choice"] = self.tool_choice if isinstance(self.tool_choice, str) or self.tool_choice is None \
                else self.tool_choice.model_dump()
            out["parallel_tool_calls"] = self.parallel_tool_calls
        if self.response_format is not None:
            out["response_format"] = self.response_format.model_dump(by_alias=True, exclude_none=True)
        return {k: v for k, v in out.items() if v is not None}


class CompletionRequest(_SamplingFields):
    prompt: str | Annotated[list[str], Field(min_length=1, max_length=1)]
    logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    echo: bool = False

    @model_validator(mode="after")
    def _prompt(self):
        f = self.__dict__  # not self.x: reads through BaseModel's __getattr__ hook cost several times more
        if f["max_tokens"] is None:
            self.max_tokens = COMPLETION_DEFAULT_MAX_TOKENS
        if f["echo"] and f["logprobs"] is not None and f["stream"]:
            raise ValueError("echo with logprobs is not supported when streaming; accepted: stream: false, or echo "
                             "or logprobs alone")
        return self

    def logprobs_n(self) -> int | None:
        return self.__dict__["logprobs"]

    def sampling_params(self) -> dict:
        out = super().sampling_params()
        f = self.__dict__
        if f["echo"] and f["logprobs"] is not None:
            out["prompt_logprobs"] = f["logprobs"]  # echo: the prompt's logprobs precede the completion's
        return out

    def prompt_text(self) -> str:
        prompt = self.__dict__["prompt"]
        return prompt if isinstance(prompt, str) else prompt[0]

    def worker_input(self) -> dict:
        return {"text": self.prompt_text()}


class _PDFields(BaseModel):
    """What a PD router (pdrt's or SGLang's) adds to each leg's body."""
    rid: ShortText | None = None
    bootstrap_host: ShortText | None = None
    bootstrap_port: Port | None = None
    bootstrap_room: Room | None = None


class KVTransferParams(BaseModel):
    """vLLM's ``kv_transfer_params`` as its PD proxy and NixlConnector write them (other keys are ignored):
    ``do_remote_decode`` asks a prefill worker to compute the prompt and hold its KV for a decode; a decode worker
    gets ``do_remote_prefill`` with where that KV is held (server/worker/lease.py)."""
    model_config = ConfigDict(extra="ignore")
    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_engine_id: ShortText | None = None
    remote_request_id: ShortText | None = None
    remote_host: ShortText | None = None
    remote_port: Port | None = None
    remote_block_ids: Any = None
    tp_size: int | None = None


class _OpenAIPDFields(BaseModel):
    """What a PD router adds to a worker's /v1 body: SGLang's bootstrap fields (arrays of n, one room per choice,
    from sglang-router for chat with n > 1) or vLLM's kv_transfer_params."""
    rid: ShortText | None = None
    bootstrap_host: ShortText | Annotated[list[ShortText], Field(min_length=1, max_length=MAX_N)] | None = None
    bootstrap_port: Port | Annotated[list[Port], Field(min_length=1, max_length=MAX_N)] | None = None
    bootstrap_room: Room | Annotated[list[Room], Field(min_length=1, max_length=MAX_N)] | None = None
    kv_transfer_params: KVTransferParams | None = None

    def first_pd(self) -> _PDFields:
        """The bootstrap fields of the request's one KV transfer: an array's first entry (pdrt prefills once and
        decode forks the n choices off that one transfer; both legs read the same body, so they agree)."""
        def first(v):
            return v[0] if isinstance(v, list) else v
        return _PDFields(rid=self.rid, bootstrap_host=first(self.bootstrap_host), bootstrap_port=first(self.bootstrap_port),
                         bootstrap_room=first(self.bootstrap_room))


class WorkerChatRequest(ChatCompletionRequest, _OpenAIPDFields):
    """``/v1/chat/completions`` on a worker: the router's model plus the PD fields."""


class WorkerCompletionRequest(CompletionRequest, _OpenAIPDFields):
    """``/v1/completions`` on a worker: the router's model plus the PD fields."""


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


_DECODER = json.JSONDecoder(parse_constant=_no_constants)  # one, not one per call (json.loads with kwargs)


_LONG_NUMBER = re.compile(rb"[0-9]{19}")  # an integer orjson may read as a float (past 64 bits)
_DIGITS = b"0123456789"  # a body with fewer than 19 digits in all holds no such integer (no regex scan needed)


def _fast_parse(raw: bytes) -> dict | None:
    """``raw`` parsed by orjson when that is exactly what :func:`parse_body` would accept, else None (the stdlib
    path decides and words the error). orjson rejects invalid UTF-8, lone surrogates, NaN and Infinity itself;
    what is left to rule out: nesting past MAX_JSON_DEPTH (a body with fewer opening brackets cannot nest that
    deep) and integers orjson would turn into floats."""
    if orjson is None:
        return None
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    if (type(body) is dict and raw.count(b"{") + raw.count(b"[") <= MAX_JSON_DEPTH
            and (len(raw) - len(raw.translate(None, _DIGITS)) < 19 or _LONG_NUMBER.search(raw) is None)):
        return body
    return None


def parse_body(raw: bytes) -> dict:
    """Bytes -> a JSON object, or ApiError(400/413) saying what is wrong and what is accepted."""
    if len(raw) > MAX_BODY_BYTES:
        raise ApiError(413, f"request body of {len(raw)} bytes is too large; accepted: up to {MAX_BODY_BYTES} bytes",
                       code="request_too_large")
    body = _fast_parse(raw)
    if body is not None:
        return body
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ApiError(400, f"request body is not valid UTF-8 (byte {exc.start}); accepted: a UTF-8 JSON object",
                       code="invalid_json") from None
    try:
        body = _DECODER.decode(text)
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


_FALSY_DROPPED = ("echo", "logprobs", "top_logprobs", "tools", "tool_choice", "response_format", "suffix")
_SCREENED = frozenset(UNSUPPORTED) | frozenset(_FALSY_DROPPED) | frozenset(SGLANG_DEFAULTS)  # keys validate() looks at


def _accepted(loc: str | None) -> str:
    if not loc:
        return ""
    parts = [p for p in loc.split(".") if not p.isdigit()]
    for name in reversed(parts):
        if name in ACCEPTED:
            return f"; accepted: {ACCEPTED[name]}"
    return ""


_VALIDATORS: dict[type, Any] = {}  # model -> its pydantic-core validator (a class attribute of a pydantic model is a
#                                   lookup through its metaclass's __getattr__ hook: slow, and the router asks per request)


def _validator(model: type[BaseModel]) -> Any:
    got = _VALIDATORS.get(model)
    if got is None:
        got = _VALIDATORS[model] = model.__pydantic_validator__
    return got


def validate(model: type[BaseModel], body: dict) -> Any:
    """Validate ``body`` into ``model``; unsupported and unknown parameters and bad values become ApiError(400)
    naming the parameter, what was given, and what is accepted."""
    if not body.keys() & _SCREENED:  # the usual body: nothing to refuse or drop before pydantic
        try:
            return _validator(model).validate_python(body)  # model.model_validate(body), without its frame
        except ValidationError as exc:
            raise _to_api_error(exc, model) from None
    body = dict(body)
    for name in UNSUPPORTED:
        if name in body:
            if body[name] not in (None, False):
                raise ApiError(400, f"parameter {name!r} is not supported by pdrt; accepted parameters: "
                               f"{', '.join(sorted(model.model_fields))}", param=name, code="unsupported_parameter")
            del body[name]  # "logprobs": false and the like ask for nothing
    for name in _FALSY_DROPPED:
        if name in body and name not in model.model_fields and body[name] in (None, False):
            del body[name]  # e.g. "echo": false on chat asks for nothing
    for name, default in SGLANG_DEFAULTS.items():
        if name in body:
            if body[name] != default:
                raise ApiError(400, f"parameter {name!r}={json.dumps(body[name])[:40]} is not supported by pdrt; "
                               f"accepted: {json.dumps(default)} (the default)", param=name,
                               code="unsupported_parameter")
            del body[name]
    try:
        return _validator(model).validate_python(body)
    except ValidationError as exc:
        raise _to_api_error(exc, model) from None


def _to_api_error(exc: ValidationError, model: type[BaseModel]) -> ApiError:
    err = exc.errors()[0]
    cause = (err.get("ctx") or {}).get("error")
    if getattr(cause, "code", None) and getattr(cause, "param", None):  # structured.GrammarError: names its cause
        return ApiError(400, str(cause), param=cause.param, code=cause.code)
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
    temperature: Temperature | None = None  # None = the model's default
    top_p: TopP | None = None
    top_k: TopK | None = None  # SGLang uses -1 for "off"; <= 0 means off here
    min_p: MinP | None = None
    repetition_penalty: RepPenalty | None = None
    frequency_penalty: Penalty = 0.0
    presence_penalty: Penalty = 0.0
    logit_bias: Annotated[dict[str, Bias], Field(max_length=MAX_LOGIT_BIAS)] | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=16)] | None = None
    logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None  # pdrt: top-n per token
    prompt_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None  # vLLM's name: top-n per prompt token
    grammar: Annotated[str, Field(max_length=1 << 20)] | None = None  # pdrt: an llguidance grammar
    seed: Seed | None = None
    stop: Stop = None
    ignore_eos: bool = False
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1  # SGLang's: choices; a decode worker forks them off one prefill


class WorkerMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "tool"]
    content: str
    tool_calls: list[dict] | None = None
    tool_call_id: str | None = None


class GenerateRequest(_PDFields):
    """SGLang ``/generate`` body, plus ``messages`` (a pdrt extension: the worker applies the chat template)."""
    model_config = ConfigDict(extra="ignore")
    text: str | None = None
    input_ids: Annotated[list[TokenId], Field(min_length=1)] | None = None
    messages: Annotated[list[WorkerMessage], Field(min_length=1, max_length=MAX_MESSAGES)] | None = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None  # pdrt: rendered into the prompt
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceNamed | None = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None
    sampling_params: WorkerSampling = Field(default_factory=WorkerSampling)
    stream: bool = False

    @model_validator(mode="after")
    def _one_input(self):
        given = [x is not None for x in (self.text, self.input_ids, self.messages)]
        if sum(given) != 1:
            raise ValueError("exactly one of text, input_ids or messages is accepted")
        return self


def default_max_tokens(room: int) -> int:
    """max_tokens of a chat or /generate request that does not say: DEFAULT_MAX_TOKENS, clipped to ``room`` (the
    context left after the prompt)."""
    return min(DEFAULT_MAX_TOKENS, room)


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
