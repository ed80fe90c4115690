"""Pieces every pdrt server shares: error handlers, SSE helpers, prompt handling, test hooks."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
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
    """Every error leaves as an OpenAI-style JSON body; unexpected exceptions are logged and become 500."""

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body(exc.status_code, str(exc.detail), code="http_error"), status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        err = exc.errors()[0] if exc.errors() else {}
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        return JSONResponse(error_body(400, f"{loc}: {err.get('msg', 'invalid request')}", param=loc or None,
                                       code="invalid_value"), status_code=400)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error")
        return JSONResponse(error_body(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error",
                                       code="internal_error"), status_code=500)


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
    from pdruntime.server.schemas import parse_body
    from pydantic import ValidationError

    body = parse_body(await request.body())
    try:
        return GenerateRequest.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(x) for x in err.get("loc", ()))
        raise ApiError(400, f"{loc + ': ' if loc else ''}{err.get('msg')}", param=loc or None, code="invalid_value") from None


class PromptBuilder:
    """Tokenizes a worker request the same way on prefill and decode, and derives SamplingParams."""

    def __init__(self, tokenizer: Any, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len

    def prompt_ids(self, req: GenerateRequest) -> list[int]:
        if req.input_ids is not None:
            ids = list(req.input_ids)
        elif req.messages is not None:
            try:
                text = self.tokenizer.apply_chat_template(req.messages, add_generation_prompt=True)
            except Exception as exc:
                raise ApiError(400, f"messages could not be rendered with the chat template: {exc}", param="messages",
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
        try:
            return SamplingParams(max_tokens=max_tokens, temperature=sp.temperature, top_k=max(0, sp.top_k),
                                  top_p=sp.top_p, seed=sp.seed, stop=stop, ignore_eos=sp.ignore_eos)
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
