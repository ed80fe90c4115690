"""The HTTP edge every pdrt server shares: OpenAI-style error bodies, app lifespan, the request-body guard,
streamed responses that always clean up, and the instance id reported in ``/health``."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import traceback
import uuid
from typing import Any, AsyncIterator, Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdruntime.server.openai.schemas import ApiError, error_body
from pdruntime.util.aio import within
from pdruntime.util.sse import SSE_DONE

log = logging.getLogger("pdruntime.server")

PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def instance_id(env: Any = None) -> str:
    """This process's identity: ``PDRT_INSTANCE_ID`` when a supervisor set one, else pid + random."""
    given = getattr(env, "instance_id", None)
    return given or f"{os.getpid()}-{secrets.token_hex(4)}"


def install_error_handlers(app: FastAPI) -> None:
    """Every error leaves as an OpenAI-style JSON body; unexpected exceptions are logged and become 500.

    Unexpected errors are logged and answered by type and location only, never with the exception's
    message: messages of encoding, key and value errors quote the request's text, and prompt text never
    goes to a log or to another client's error body."""

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=error_headers(exc))

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
        return JSONResponse(internal_error(f"{request.method} {request.url.path}", exc).body(), status_code=500)


def error_headers(exc: ApiError) -> dict | None:
    """The headers of an ApiError's answer: its own, and ``Retry-After: 1`` on a 429 or 503 that names none (every
    refusal says when to come back)."""
    headers = exc.headers
    if exc.status in (429, 503) and not any(k.lower() == "retry-after" for k in headers or {}):
        headers = {**(headers or {}), "Retry-After": "1"}
    return headers


def internal_error(what: str, exc: BaseException) -> ApiError:
    """A 500 for an unexpected exception, logged (:func:`log_unexpected`) with a reference its body names."""
    ref = uuid.uuid4().hex[:12]
    log_unexpected(f"{what} ref={ref}", exc)
    return ApiError(500, f"internal error ({type(exc).__name__}); reference {ref} in the server log",
                    type="server_error", code="internal_error")


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


class GuardedStream(StreamingResponse):
    """A streaming response that always runs ``on_close(completed)``, also when the client goes away
    (the body iterator is cancelled then) — the place to abort whatever the stream was feeding from."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[bool], Awaitable[None]], **kw: Any) -> None:
        self._completed = False  # the body iterator ran to its end (stream_response records it)
        self._on_close = on_close
        super().__init__(content, media_type="text/event-stream", **kw)

    async def stream_response(self, send: Callable) -> None:
        """Starlette's, except that the chunk ending the SSE stream (``data: [DONE]``) is sent as the body's end:
        the last event and the chunked terminator go out in one write, one segment and one wake-up for the reader
        (the router's decode leg), where Starlette sends the terminator as a write of its own."""
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        ended = False
        async for chunk in self.body_iterator:
            if ended:
                continue  # nothing follows [DONE]; the iterator still runs to its end (then it counts as completed)
            if not isinstance(chunk, bytes):
                chunk = bytes(chunk) if isinstance(chunk, memoryview) else chunk.encode(self.charset)
            ended = chunk.endswith(SSE_DONE)
            await send({"type": "http.response.body", "body": chunk, "more_body": not ended})
        self._completed = True
        if not ended:
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope, receive, send) -> None:
        try:
            spec = scope.get("asgi", {}).get("spec_version", "2.0")
            if scope["type"] != "http" or tuple(map(int, spec.split("."))) >= (2, 4):
                await super().__call__(scope, receive, send)  # a send to a client that left raises there
            else:
                await self._stream_watched(receive, send)
        finally:
            await asyncio.shield(self._on_close(self._completed))

    async def _stream_watched(self, receive: Callable, send: Callable) -> None:
        """The body streamed in this task while one plain task waits for ``http.disconnect`` and cancels it. On an
        ASGI 2.3 server (uvicorn's) a send to a client that left is dropped silently, so someone must listen;
        Starlette does it in an anyio task group (a task, a cancel scope and the group's own bookkeeping per
        response, a fifth of a decode worker's CPU on 1-token answers). The stream ends as Starlette's does: on
        the client leaving it is cancelled and this returns; any other cancellation goes on."""
        streaming = asyncio.current_task()
        gone = False

        async def watch() -> None:
            nonlocal gone
            while (await receive())["type"] != "http.disconnect":
                pass
            gone = True
            streaming.cancel()

        watcher = asyncio.get_running_loop().create_task(watch())
        try:
            await self.stream_response(send)
        except asyncio.CancelledError:
            if not gone or streaming.uncancel() > 0:  # not (only) the client leaving: the server's own cancel
                raise
        finally:
            watcher.cancel()


# ---- request bodies: size and time limits enforced while the body streams in --------------------------

BODY_TIMEOUT_S = 30.0  # seconds to receive a whole request body (slow-drip "slowloris" bodies are cut here)


def body_too_large(max_bytes: int) -> ApiError:
    return ApiError(413, f"request body is larger than {max_bytes} bytes; accepted: up to {max_bytes} bytes",
                    code="request_too_large")


def body_too_slow(timeout_s: float, arrived: int) -> ApiError:
    return ApiError(408, f"request body not received within {timeout_s:g}s ({arrived} bytes arrived); accepted: a "
                    f"body sent within {timeout_s:g}s", code="body_timeout")


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

    async def _reject(self, scope: dict, send: Callable, error: ApiError) -> None:
        status = error.status
        if self.on_reject is not None:
            self.on_reject(scope, status)
        payload = json.dumps(error.body()).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": payload})

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        for k, v in scope.get("headers", ()):
            if k == b"content-length":
                try:
                    declared = int(v)
                except ValueError:
                    return await self._reject(scope, send, ApiError(400, "Content-Length is not an integer",
                                                                    code="invalid_header"))
                if declared > self.max_bytes:
                    return await self._reject(scope, send, body_too_large(self.max_bytes))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        chunks: list[bytes] = []
        total = 0
        while True:
            try:
                msg = await within(receive(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                return await self._reject(scope, send, body_too_slow(self.timeout_s, total))
            if msg["type"] != "http.request":  # http.disconnect: the client left while sending
                return
            body = msg.get("body", b"")
            total += len(body)
            if total > self.max_bytes:
                return await self._reject(scope, send, body_too_large(self.max_bytes))
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
