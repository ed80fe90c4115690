"""Pieces every pdrt server shares: error handlers, SSE helpers, prompt handling, test hooks."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
import traceback
import uuid
from typing import Any, AsyncIterator, Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdruntime.server.schemas import DEFAULT_MAX_TOKENS, ApiError, GenerateRequest, error_body

log = logging.getLogger("pdruntime.server")

PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def install_error_handlers(app: FastAPI) -> None:
    """Every error leaves as an OpenAI-style JSON body; unexpected exceptions are logged and become 500.

    Unexpected errors are logged and answered by type and location only, never with the exception's
    message: messages of encoding, key and value errors quote the request's text, and prompt text never
    goes to a log or to another client's error body."""

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        # keeps the exception's headers: 405 answers carry Allow
        return JSONResponse(error_body(exc.status_code, str(exc.detail), code="http_error"), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        err = exc.errors()[0] if exc.errors() else {}
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        return JSONResponse(error_body(400, f"{loc}: {err.get('msg', 'invalid request')}", param=loc or None,
                                       code="invalid_value"), status_code=400)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        ref = uuid.uuid4().hex[:12]
        log_unexpected(f"{request.method} {request.url.path} ref={ref}", exc)
        return JSONResponse(error_body(500, f"internal error ({type(exc).__name__}); reference {ref} in the server log",
                                       type="server_error", code="internal_error"), status_code=500)


def log_unexpected(what: str, exc: BaseException) -> None:
    """One ERROR line with the exception type and the frames that raised it, never the message (it can quote
    request text: ``UnicodeEncodeError``, ``KeyError``, ``ValueError`` do)."""
    frames = traceback.extract_tb(exc.__traceback__)[-4:]
    where = " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in reversed(frames))
    log.error("unexpected error in %s: %s at %s", what, type(exc).__name__, where or "?")


def lifespan_app(title: str, start: Callable[[], Awaitable[None]], stop: Callable[[], Awaitable[None]]) -> FastAPI:
    """A FastAPI app that runs ``start`` before serving and ``stop`` after, with pdrt's error bodies."""

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        await start()
        try:
            yield
        finally:
            await stop()

    app = FastAPI(title=title, lifespan=lifespan)
    install_error_handlers(app)
    return app


def metrics_response(payload: bytes) -> Response:
    return Response(payload, media_type=PROMETHEUS_CONTENT_TYPE)


def sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


class GuardedStream(StreamingResponse):
    """A streaming response that always runs ``on_close(completed)``, also when the client goes away
    (the body iterator is cancelled then) — the place to abort whatever the stream was feeding from."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[bool], Awaitable[None]], **kw: Any) -> None:
        self._completed = False
        self._on_close = on_close

        async def body() -> AsyncIterator[bytes]:
            async for chunk in content:
                yield chunk
            self._completed = True

        super().__init__(body(), media_type="text/event-stream", **kw)

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await asyncio.shield(self._on_close(self._completed))


def request_id(req: GenerateRequest) -> str:
    """The worker-side id: the body's ``rid``, else one derived from ``bootstrap_room`` so that both legs of a PD
    request agree on it (SGLang's router sends the same body to prefill and decode, with a room and no rid)."""
    if req.rid:
        return req.rid
    return f"room-{req.bootstrap_room}" if req.bootstrap_room is not None else uuid.uuid4().hex


def client_of(request: Request) -> str:
    return request.headers.get("x-client-id") or "anonymous"


async def read_generate(request: Request) -> GenerateRequest:
    from pdruntime.server.schemas import parse_body, validate_generate

    return validate_generate(parse_body(await request.body()))


class PromptBuilder:
    """Tokenizes a worker request the same way on prefill and decode, and derives SamplingParams."""

    def __init__(self, tokenizer: Any, max_model_len: int, vocab_size: int | None = None, *,
                 defaults: Any = None, tool_parser: str = "auto") -> None:
        from pdruntime.engine.defaults import GenerationDefaults
        from pdruntime.server.tools import detect_parser, parser_for

        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.defaults = defaults or GenerationDefaults()  # the model's sampling defaults (--generation-config)
        template = getattr(tokenizer, "chat_template", None) or ""
        self.tool_parser = detect_parser(template) if tool_parser == "auto" else parser_for(tool_parser).name
        self.template_has_tools = "tools" in template

    def prompt_ids(self, req: GenerateRequest) -> list[int]:
        if req.input_ids is not None:
            ids = list(req.input_ids)
            if self.vocab_size is not None and (bad := next((i for i in ids if i >= self.vocab_size), None)) is not None:
                raise ApiError(400, f"input_ids: token id {bad} is outside the vocabulary; accepted: token ids in "
                               f"[0, {self.vocab_size})", param="input_ids", code="invalid_value")
        elif req.messages is not None:
            from pdruntime.server.tools import render_messages

            tools = [t.model_dump(by_alias=True, exclude_none=True) for t in req.tools] if req.tools else None
            msgs = render_messages([m.model_dump(exclude_none=True) for m in req.messages], tools, self.tool_parser,
                                   self.template_has_tools)
            try:
                text = self.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, **(
                    {"tools": tools} if tools and self.template_has_tools else {}))
            except Exception as exc:  # the template's own message may quote the conversation: type only
                raise ApiError(400, f"messages could not be rendered with the chat template ({type(exc).__name__}); "
                               "accepted: messages {role: system|user|assistant, content: text}", param="messages",
                               code="invalid_value") from None
            ids = self.tokenizer.encode(text)
        else:
            ids = self.tokenizer.encode(req.text or "")
        if not ids:
            raise ApiError(400, "the prompt is empty; accepted: at least one token", param="prompt", code="invalid_value")
        if len(ids) >= self.max_model_len:
            raise ApiError(400, f"the prompt has {len(ids)} tokens; this model's context is {self.max_model_len} tokens, "
                           f"accepted: a prompt under {self.max_model_len} tokens plus max_tokens",
                           param="messages" if req.messages is not None else "prompt", code="context_length_exceeded")
        return ids

    def sampling(self, req: GenerateRequest, prompt_len: int) -> Any:
        from pdruntime.engine import InvalidRequest, SamplingParams

        sp = req.sampling_params
        room = self.max_model_len - prompt_len
        max_tokens = sp.max_new_tokens if sp.max_new_tokens is not None else min(DEFAULT_MAX_TOKENS, room)
        if max_tokens > room:
            raise ApiError(400, f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds the context of "
                           f"{self.max_model_len} tokens; accepted: max_tokens <= {room}", param="max_tokens",
                           code="context_length_exceeded")
        stop = () if sp.stop is None else ((sp.stop,) if isinstance(sp.stop, str) else tuple(s for s in sp.stop if s))
        d = self.defaults

        def pick(v, default):
            return default if v is None else v

        bias = {}
        for k, v in (sp.logit_bias or {}).items():
            if not k.lstrip("-").isdigit() or not 0 <= int(k) < (self.vocab_size or 1 << 31):
                raise ApiError(400, f"logit_bias: key {k!r} is not a token id of this model; accepted: token ids in "
                               f"[0, {self.vocab_size})", param="logit_bias", code="invalid_value")
            bias[int(k)] = v
        grammar = sp.grammar
        if grammar is None and (req.response_format is not None or req.tools):
            from pdruntime.server.structured import chat_grammar

            try:
                grammar = chat_grammar(req, self.tool_parser)
            except ValueError as exc:
                raise ApiError(400, f"response_format: {exc}", param="response_format", code="invalid_value") from None
        try:
            return SamplingParams(max_tokens=max_tokens, temperature=pick(sp.temperature, d.temperature),
                                  top_k=max(0, pick(sp.top_k, d.top_k)), top_p=pick(sp.top_p, d.top_p),
                                  min_p=pick(sp.min_p, d.min_p),
                                  repetition_penalty=pick(sp.repetition_penalty, d.repetition_penalty),
                                  frequency_penalty=sp.frequency_penalty, presence_penalty=sp.presence_penalty,
                                  logit_bias=bias, logprobs=sp.logprobs, prompt_logprobs=sp.prompt_logprobs,
                                  stop_token_ids=tuple(sp.stop_token_ids or ()),
                                  grammar=grammar, seed=sp.seed, stop=stop, ignore_eos=sp.ignore_eos)
        except InvalidRequest as exc:
            raise ApiError(400, str(exc), code="invalid_value") from None


class TestHooks:
    """Test-only knobs behind PDRT_TEST_HOOKS=1 (POST /debug/test). Never enabled in production."""

    def __init__(self) -> None:
        self.stall_transfers = 0  # decode: stop reading after the next N HEADERs (simulates a stuck transfer)
        self.stall_prefill = 0  # prefill: hold the next N attached requests before the engine
        self.corrupt_kv_chunk = 0  # prefill: flip one byte of the next N transfers' first chunk after its checksum

    def take(self, name: str) -> bool:
        n = getattr(self, name)
        if n > 0:
            setattr(self, name, n - 1)
            return True
        return False


def finish_reason_json(reason: str | None) -> dict | None:
    return None if reason is None else {"type": reason}


def now_s() -> float:
    return time.monotonic()


# ---- request bodies: size and time limits enforced while the body streams in --------------------------

BODY_TIMEOUT_S = 30.0  # seconds to receive a whole request body (slow-drip "slowloris" bodies are cut here)


class BodyGuard:
    """ASGI middleware: reads each HTTP request's body before the app runs, counting bytes as they arrive
    (chunked bodies included), and answers 413 as soon as the count passes ``max_bytes`` and 408 when the
    body has not fully arrived within ``timeout_s``. Memory per request is bounded by ``max_bytes``: the
    rest of an oversized body is never read (the connection is closed). The app then sees the body as one
    message; later ``receive()`` calls (disconnect watching) go to the server as before.

    ``on_reject(scope, status)`` is called for each rejection (metrics)."""

    def __init__(self, app: Any, max_bytes: int, timeout_s: float = BODY_TIMEOUT_S,
                 on_reject: Callable[[dict, int], None] | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        self.on_reject = on_reject

    async def _reject(self, scope: dict, send: Callable, status: int, message: str, code: str) -> None:
        if self.on_reject is not None:
            self.on_reject(scope, status)
        payload = json.dumps(error_body(status, message, code=code)).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": payload})

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        too_large = f"request body is larger than {self.max_bytes} bytes; accepted: up to {self.max_bytes} bytes"
        for k, v in scope.get("headers", ()):
            if k == b"content-length":
                try:
                    declared = int(v)
                except ValueError:
                    return await self._reject(scope, send, 400, "Content-Length is not an integer", "invalid_header")
                if declared > self.max_bytes:
                    return await self._reject(scope, send, 413, too_large, "request_too_large")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        chunks: list[bytes] = []
        total = 0
        while True:
            try:
                msg = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                return await self._reject(scope, send, 408, f"request body not received within {self.timeout_s:g}s "
                                          f"({total} bytes arrived); accepted: a body sent within {self.timeout_s:g}s",
                                          "body_timeout")
            if msg["type"] != "http.request":  # http.disconnect: the client left while sending
                return
            body = msg.get("body", b"")
            total += len(body)
            if total > self.max_bytes:
                return await self._reject(scope, send, 413, too_large, "request_too_large")
            if body:
                chunks.append(body)
            if not msg.get("more_body", False):
                break
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)
