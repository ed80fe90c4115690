"""The router's HTTP/1.1 server: ``/v1/completions`` and ``/v1/chat/completions`` answered straight from an asyncio
protocol, every other route by the router's FastAPI app.

Why not uvicorn + FastAPI for every request: on 1-token completions (bench/router.py, no-op workers) the router spent
a fifth of its CPU in Starlette's middleware, routing and request and response objects, and more in uvicorn's
per-request cycle (a task, a scope, an event, a write for the head and another for the body). Here a completion is
parsed by httptools (llhttp, C) into one :class:`_Exchange`, handled by one task that calls
:meth:`Router.completion` directly, and answered with one write; a client that goes away cancels that task (its legs
are aborted by their own clean-up), so no task watches for the disconnect. Every other request (``/health``,
``/metrics``, ``/v1/models``, ``/config``, ``/debug/requests``, ``/admin/topology``, ``/openapi.json``, 404s and
405s) goes to the FastAPI app through a small ASGI bridge, unchanged.

What the server holds to, as uvicorn with pdrt's guards did: the connection guard (``connections.ConnectionGuard``:
header deadline, caps per client and per server), request bodies bounded in size (413 as soon as the count passes
``max_body_bytes``, the rest never read) and in time (408 after ``body_timeout_s``), keep-alive closed after
:data:`KEEPALIVE_S` idle, HTTP/1.0 and ``Connection: close``, pipelined requests answered in order, chunked request
bodies, ``Expect: 100-continue``, write flow control, and on SIGTERM/SIGINT: no new connections, idle ones closed,
requests in flight finished (a second signal stops at once), then the router's own shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import http
import logging
import signal
from collections import deque
from typing import Any, Callable
from urllib.parse import unquote

import httptools

from pdruntime.server.connections import ConnectionLimits, guarded
from pdruntime.server.edge import body_too_large, body_too_slow, error_headers, internal_error
from pdruntime.server.openai.schemas import ApiError
from pdruntime.server.router.reply import EdgeCall, Streamed
from pdruntime.util import h1
from pdruntime.util.sse import SSE_DONE

log = logging.getLogger("pdruntime.router")

KEEPALIVE_S = 75.0  # seconds an idle keep-alive connection stays open (above the clients' usual 30-60 s pools)
SWEEP_S = 1.0  # seconds between sweeps for idle keep-alive connections
MAX_PIPELINED = 16  # complete requests queued behind the one being answered before reading pauses
HOT_ROUTES = {"/v1/completions": False, "/v1/chat/completions": True}  # path -> chat
HOT_PATHS = {p.encode(): p for p in HOT_ROUTES}  # their request targets, as httptools hands them over
_METHODS = {m.encode(): m for m in ("GET", "POST", "HEAD", "PUT", "DELETE", "OPTIONS", "PATCH")}

_LAST_CHUNK = b"0\r\n\r\n"  # the chunked encoding's terminator
_STATUS = {s.value: f"HTTP/1.1 {s.value} {s.phrase}\r\n".encode() for s in http.HTTPStatus}


def _status_line(status: int) -> bytes:
    return _STATUS.get(status) or f"HTTP/1.1 {status} Unknown\r\n".encode()


@functools.lru_cache(maxsize=256)
def _sized_head(status: int, ctype: bytes) -> bytes:
    """A head's lines up to its content-length value, for an answer of known length on a kept-alive connection
    with no other header (most answers: the same few bytes every time)."""
    return _status_line(status) + b"content-type: " + ctype + b"\r\ncontent-length: "


class _Exchange:
    """One request on a connection, as it is parsed and then answered."""

    __slots__ = ("method", "url", "path", "raw_path", "query", "raw_headers", "headers", "body", "size", "keep_alive",
                 "version", "upgrade", "gone", "chat")

    def __init__(self) -> None:
        self.url = b""
        self.raw_headers: list[tuple[bytes, bytes]] = []
        self.headers: dict[str, str] = {}
        self.body: list[bytes] | bytes = []
        self.size = 0
        self.upgrade = False
        self.gone: asyncio.Future | None = None  # ASGI: resolves when the client leaves or the answer is complete
        self.chat: bool | None = None  # a hot route (chat or not); None: the FastAPI app answers it


class RouterConnection(asyncio.Protocol):
    """One client connection of the router's server (the guard is mixed in by :func:`protocol_class`)."""

    router: Any  # pdruntime.server.router.app.Router
    app: Any  # the router's ASGI app, for every route but the two hot ones
    connections: set  # every open connection of this server (sweeps, shutdown)
    max_body: int
    body_timeout_s: float

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.client: tuple[str, int] | None = None
        self.server_addr: tuple[str, int] | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.cur: _Exchange | None = None  # being parsed
        self.head_done = False  # cur's head is complete
        self.active: _Exchange | None = None  # being answered
        self.task: asyncio.Task | None = None
        self.queue: deque[_Exchange] = deque()  # complete, waiting behind active (pipelining)
        self.closing = False
        self.body_timer: asyncio.TimerHandle | None = None
        self.idle_since = self.loop.time()
        self.write_paused = False
        self.drained: asyncio.Future | None = None

    # ---- asyncio.Protocol ----
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        peer = transport.get_extra_info("peername")
        self.client = (str(peer[0]), int(peer[1])) if isinstance(peer, tuple) else None
        sock = transport.get_extra_info("sockname")
        self.server_addr = (str(sock[0]), int(sock[1])) if isinstance(sock, tuple) else None
        self.connections.add(self)

    @property
    def busy(self) -> bool:
        """A request whose head is complete and whose answer is not (the guard never closes a busy connection)."""
        return self.head_done or self.active is not None

    def data_received(self, data: bytes) -> None:
        if self.closing:
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._refuse(ApiError(400, "HTTP upgrades (Upgrade: h2c, websocket) are not served; accepted: HTTP/1.1 "
                                  "requests without an Upgrade header", code="invalid_request"))
        except httptools.HttpParserError as exc:
            self._refuse(ApiError(400, f"malformed HTTP request ({exc}); accepted: HTTP/1.1", code="invalid_request"))
        else:
            if self.head_done and self.body_timer is None and not self.closing:
                # a body still arriving: all of it within body_timeout_s of its head
                self.body_timer = self.loop.call_later(self.body_timeout_s, self._body_too_slow)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closing = True
        self.connections.discard(self)
        self._cancel_body_timer()
        for ex in (self.active, *self.queue):
            if ex is not None and ex.gone is not None and not ex.gone.done():
                ex.gone.set_result(None)
        self.queue.clear()
        if self.task is not None and not self.task.done() and self.active is not None and self.active.chat is not None:
            self.task.cancel()  # the client left: the handler's clean-up aborts both legs
        if self.drained is not None and not self.drained.done():
            self.drained.set_result(None)

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        if self.drained is not None and not self.drained.done():
            self.drained.set_result(None)

    def hang_up(self) -> None:
        """Close the connection from this side; nothing more is written or answered on it."""
        self.closing = True
        self.transport.close()  # type: ignore[union-attr]

    async def _drain(self) -> None:
        if self.write_paused and not self.closing:
            self.drained = self.loop.create_future()
            await self.drained

    # ---- httptools callbacks ----
    def on_message_begin(self) -> None:
        self.cur = _Exchange()

    def on_url(self, url: bytes) -> None:
        self.cur.url += url  # type: ignore[union-attr]

    def on_header(self, name: bytes, value: bytes) -> None:
        self.cur.raw_headers.append((name.lower(), value.rstrip(b" \t")))  # type: ignore[union-attr]

    def on_headers_complete(self) -> None:
        ex, parser = self.cur, self.parser
        assert ex is not None
        self.head_done = True
        method = parser.get_method()
        ex.method = _METHODS.get(method) or method.decode("ascii")
        ex.version = parser.get_http_version()
        ex.keep_alive = parser.should_keep_alive()
        ex.upgrade = parser.should_upgrade()
        raw = ex.url
        if raw in HOT_PATHS:  # the two hot routes, as clients send them: nothing to split or unquote
            ex.raw_path, ex.path, ex.query = raw, HOT_PATHS[raw], b""
        else:
            url = httptools.parse_url(raw)
            ex.raw_path = url.path
            path = url.path.decode("ascii")
            ex.path = unquote(path) if "%" in path else path
            ex.query = url.query or b""
        headers = ex.headers
        for k, v in ex.raw_headers:
            headers.setdefault(k.decode("latin-1"), v.decode("latin-1"))
        declared = headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body:
            self._refuse(body_too_large(self.max_body), headers)
        elif "expect" in headers and headers["expect"].lower() == "100-continue":
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")  # type: ignore[union-attr]

    def on_body(self, body: bytes) -> None:
        ex = self.cur
        if ex is None or self.closing:
            return
        ex.size += len(body)
        if ex.size > self.max_body:
            self._refuse(body_too_large(self.max_body), ex.headers)
            return
        ex.body.append(body)  # type: ignore[union-attr]

    def on_message_complete(self) -> None:
        ex, self.cur = self.cur, None
        self.head_done = False
        self._cancel_body_timer()
        if ex is None or self.closing or ex.upgrade:
            return
        ex.body = ex.body[0] if len(ex.body) == 1 else b"".join(ex.body)  # type: ignore[arg-type]
        if self.active is None:
            self._start(ex)
        else:
            self.queue.append(ex)
            if len(self.queue) >= MAX_PIPELINED:
                self.transport.pause_reading()  # type: ignore[union-attr]

    # ---- answering ----
    def _start(self, ex: _Exchange) -> None:
        self.active = ex
        ex.chat = HOT_ROUTES.get(ex.path) if ex.method == "POST" else None
        self.task = self.loop.create_task(self._completion(ex, ex.chat) if ex.chat is not None else self._asgi(ex))

    def _answered(self, ex: _Exchange) -> None:
        """``ex``'s answer is complete: the next pipelined request, or idle keep-alive, or close."""
        if ex.gone is not None and not ex.gone.done():
            ex.gone.set_result(None)
        self.active = self.task = None
        self.idle_since = self.loop.time()
        if self.closing:
            return
        if not ex.keep_alive:
            self.hang_up()
        elif self.queue:
            if len(self.queue) == MAX_PIPELINED:
                self.transport.resume_reading()  # type: ignore[union-attr]
            self._start(self.queue.popleft())

    def _head(self, ex: _Exchange, status: int, ctype: bytes, extra: dict | None, length: int | None) -> bytes:
        if length is not None and not extra and ex.keep_alive:
            return b"%b%d\r\n\r\n" % (_sized_head(status, ctype), length)
        parts = [_status_line(status), b"content-type: ", ctype, b"\r\n"]
        if length is not None:
            parts.append(b"content-length: %d\r\n" % length)
        elif ex.version == "1.1":
            parts.append(b"transfer-encoding: chunked\r\n")
        for k, v in (extra or {}).items():
            parts.append(f"{k}: {v}\r\n".encode("latin-1"))
        if not ex.keep_alive:
            parts.append(b"connection: close\r\n")
        parts.append(b"\r\n")
        return b"".join(parts)

    def _write_json(self, ex: _Exchange, status: int, body: Any, headers: dict | None = None) -> None:
        if self.closing:
            return
        payload = h1.dumps(body)
        self.transport.write(self._head(ex, status, b"application/json", headers, len(payload)) + payload)  # type: ignore[union-attr]

    def _refuse(self, error: ApiError, headers: dict | None = None) -> None:
        """Answer ``error`` and close: the rest of this connection's bytes are never read (413, 408, 400)."""
        if self.closing:
            return
        self.router.reject_headers(headers or {}, error.status)
        ex = _Exchange()
        ex.keep_alive, ex.version = False, "1.1"
        self._write_json(ex, error.status, error.body(), error_headers(error))
        self._cancel_body_timer()
        self.hang_up()

    def _body_too_slow(self) -> None:
        self.body_timer = None
        if self.cur is not None and self.head_done and not self.closing:
            self._refuse(body_too_slow(self.body_timeout_s, self.cur.size), self.cur.headers)

    def _cancel_body_timer(self) -> None:
        if self.body_timer is not None:
            self.body_timer.cancel()
            self.body_timer = None

    async def _completion(self, ex: _Exchange, chat: bool) -> None:
        """A hot route, answered without the FastAPI app: one JSON write, or an SSE stream in chunks."""
        try:
            out = await self.router.completion(EdgeCall(chat, ex.headers, ex.body, self.client))  # type: ignore[arg-type]
        except ApiError as exc:
            self._write_json(ex, exc.status, exc.body(), error_headers(exc))
        except asyncio.CancelledError:
            return  # the client left (connection_lost); the router counted it
        except Exception as exc:
            err = internal_error(f"{ex.method} {ex.path}", exc)
            self._write_json(ex, 500, err.body())
        else:
            if isinstance(out, Streamed):
                if not await self._stream(ex, out):
                    return
            else:
                self._write_json(ex, 200, out)
        self._answered(ex)

    async def _stream(self, ex: _Exchange, out: Streamed) -> bool:
        """SSE chunks as they come (the head goes out with the first, the chunked terminator with the chunk that ends
        in ``data: [DONE]``: one write, one segment and one wake-up for the client); ``out.finish`` runs once
        whatever happens. False when the answer could not be completed (the connection is closed)."""
        chunked = ex.version == "1.1"
        if not chunked:
            ex.keep_alive = False  # HTTP/1.0: the body ends when the connection closes
        head: bytes | None = self._head(ex, 200, b"text/event-stream; charset=utf-8", None, None)
        completed = ended = False
        try:
            async for chunk in out.chunks:
                if not chunk or ended:
                    continue  # nothing follows [DONE]; the iterator still runs to its end
                ended = chunk.endswith(SSE_DONE)
                data = (b"%x\r\n%b\r\n%b" % (len(chunk), chunk, _LAST_CHUNK if ended else b"")) if chunked else chunk
                if head is not None:
                    data, head = head + data, None
                self.transport.write(data)  # type: ignore[union-attr]
                if self.write_paused:
                    await self._drain()
            completed = True
        except asyncio.CancelledError:
            return False
        except Exception as exc:
            err = internal_error(f"{ex.method} {ex.path} (stream)", exc)
            if head is not None:
                self._write_json(ex, 500, err.body())
                return True
            self.hang_up()
            return False
        finally:
            await asyncio.shield(out.finish(completed))
        if not self.closing and not ended:
            self.transport.write((head or b"") + (_LAST_CHUNK if chunked else b""))  # type: ignore[union-attr]
        return True

    async def _asgi(self, ex: _Exchange) -> None:
        """Any other route: the router's FastAPI app, through ASGI (spec 2.3: a client that leaves is an
        ``http.disconnect`` from ``receive``, and what is sent after it is dropped)."""
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": ex.version,
                 "server": self.server_addr, "client": self.client, "scheme": "http", "method": ex.method,
                 "root_path": "", "path": ex.path, "raw_path": ex.raw_path, "query_string": ex.query,
                 "headers": ex.raw_headers, "state": {}}
        state = {"body_sent": False, "head": None, "chunked": False, "started": False, "complete": False}

        async def receive() -> dict:
            if not state["body_sent"]:
                state["body_sent"] = True
                return {"type": "http.request", "body": ex.body, "more_body": False}
            if not state["complete"] and not self.closing:
                if ex.gone is None:
                    ex.gone = self.loop.create_future()
                await ex.gone
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            if self.closing or state["complete"]:
                return
            if message["type"] == "http.response.start":
                state["started"] = True
                state["head"], state["chunked"] = self._asgi_head(ex, message)
                return
            if message["type"] != "http.response.body":
                return
            body = message.get("body", b"") if ex.method != "HEAD" else b""
            more = message.get("more_body", False)
            if state["chunked"]:
                data = (b"%x\r\n%b\r\n" % (len(body), body) if body else b"") + (b"" if more else _LAST_CHUNK)
            else:
                data = body
            if state["head"] is not None:
                data, state["head"] = state["head"] + data, None
            if data:
                self.transport.write(data)  # type: ignore[union-attr]
            if not more:
                state["complete"] = True
            elif self.write_paused:
                await self._drain()

        try:
            await self.app(scope, receive, send)
        except Exception as exc:
            err = internal_error(f"{ex.method} {ex.path}", exc)
            if not state["started"]:
                self._write_json(ex, 500, err.body())
                state["complete"] = True
        if not state["complete"] and not self.closing:  # the app ended without a whole answer: nothing else fits
            self.hang_up()
        self._answered(ex)

    def _asgi_head(self, ex: _Exchange, message: dict) -> tuple[bytes, bool]:
        status = message["status"]
        parts = [_status_line(status)]
        length = chunked = False
        for name, value in message.get("headers", ()):
            name = name.lower()
            if name == b"content-length":
                length = True
            elif name == b"transfer-encoding":
                continue  # framed here
            elif name == b"connection" and b"close" in value.lower():
                ex.keep_alive = False
                continue
            parts += [name, b": ", value, b"\r\n"]
        if not length and ex.method != "HEAD" and status not in (204, 304) and status >= 200:
            if ex.version == "1.1":
                chunked = True
                parts.append(b"transfer-encoding: chunked\r\n")
            else:
                ex.keep_alive = False
        if not ex.keep_alive:
            parts.append(b"connection: close\r\n")
        parts.append(b"\r\n")
        return b"".join(parts), chunked


def protocol_class(router: Any, app: Any, limits: ConnectionLimits, connections: set,
                   on_close: Callable[[str], None], on_count: Callable[[int], None]) -> type:
    """:class:`RouterConnection` for one server, with the connection guard."""
    cfg = router.cfg
    base = type("RouterConnection", (RouterConnection,), {
        "router": router, "app": app, "connections": connections, "max_body": cfg.max_body_bytes,
        "body_timeout_s": cfg.body_timeout_s})
    return guarded(base, limits, on_close, on_count)


async def _sweep(connections: set, keepalive_s: float) -> None:
    """Close keep-alive connections idle for ``keepalive_s`` (a request in flight is never cut)."""
    loop = asyncio.get_running_loop()
    while True:
        await asyncio.sleep(SWEEP_S)
        now = loop.time()
        for conn in list(connections):
            if not conn.busy and not conn.queue and now - conn.idle_since > keepalive_s and not conn.closing:
                conn.hang_up()


async def serve(router: Any, app: Any, host: str, port: int, limits: ConnectionLimits, *,
                keepalive_s: float = KEEPALIVE_S) -> None:
    """Run the router (its ``start``, then the server until SIGTERM or SIGINT, then its ``stop``)."""
    loop = asyncio.get_running_loop()
    m = router.metrics
    connections: set = set()
    proto = protocol_class(router, app, limits, connections, lambda why: m.connections_closed.labels(why).inc(),
                           m.connections_open.set)
    await router.start()
    stop = asyncio.Event()
    signals = 0

    def on_signal() -> None:
        nonlocal signals
        signals += 1
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    try:
        # sibling router processes (processes.py) listen on the same port: the kernel spreads connections over them
        server = await loop.create_server(proto, host, port, backlog=2048, reuse_port=router.peers is not None)
    except OSError as exc:
        await router.stop()
        log.error("cannot listen on %s:%d: %s", host, port, exc)
        raise SystemExit(1) from None
    await router.join_peers()
    sweeper = loop.create_task(_sweep(connections, keepalive_s))
    log.info("router serving on http://%s:%d", host, port)
    try:
        await stop.wait()
        server.close()
        for conn in list(connections):  # idle ones now; busy ones once their answer is complete
            if not conn.busy and not conn.queue:
                conn.hang_up()
            else:
                for ex in (conn.active, *conn.queue):
                    if ex is not None:
                        ex.keep_alive = False
        while any(c.busy for c in connections) and signals < 2:
            await asyncio.sleep(0.05)
    finally:
        sweeper.cancel()
        for conn in list(connections):
            conn.transport.close()
        with contextlib.suppress(Exception):
            await server.wait_closed()
        await router.stop()


def run(router: Any, app: Any, host: str, port: int, limits: ConnectionLimits) -> None:
    """``pdrt serve --role router``: :func:`serve` on uvloop's loop where uvloop is installed, else asyncio's."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(serve(router, app, host, port, limits))
        return
    uvloop.run(serve(router, app, host, port, limits))
