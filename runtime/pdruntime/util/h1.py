"""A small pooled HTTP/1.1 client for the router's calls to its workers: the part of ``httpx.AsyncClient`` the
router uses (``get``, ``post``, ``build_request`` + ``send(stream=True)``, ``aclose``), at a fraction of its CPU.

Why not httpx: profiled on 1-token completions through the router (bench/router.py, no-op workers), half of the
router's CPU was httpx and httpcore: per call, the pool's scan of every idle connection (``has_expired`` asks
anyio for socket details of each), the transport layers, and the request and response models. Here a call is one
write of one buffer on a kept-alive connection whose answers httptools (llhttp, C) parses as they arrive: each
connection is an ``asyncio.Protocol``, so reading an answer costs no stream, no task and no future per read.

What it does and does not do:
- requests are written once per pass of the event loop, all of a pass's together (:meth:`Client._flush`), not each
  as it is started: a worker woken by the first finds the others waiting, and serves them in one wake-up. Measured
  on bench/router.py's no-op workers with the router on two processes: the workers' and the router's CPU per
  request fell by 8% each, and requests/s rose by 9% (docs/benchmarks.md, "Eighth look"). The cost: a request
  leaves when the pass that started it ends (a few microseconds at one request at a time; in a busy pass, the
  rest of that pass's work);
- keep-alive per (host, port); an idle connection is reused newest first and closed after ``keepalive_s``
  (below the workers' own 75 s, so a worker never closes one the router is about to use); a reused connection
  that fails before any byte of the answer (the peer closed it meanwhile) is retried once on a new connection;
  a connection goes back to the pool as soon as its answer has fully arrived (the body waits in the response);
- bodies by ``Content-Length``, ``Transfer-Encoding: chunked`` or, with neither, until the peer closes;
- timeouts: ``connect`` for the TCP handshake, ``read`` for each wait on the answer (a float sets both), as httpx's;
  the wait for a call's answer is bounded through the client's :class:`~pdruntime.util.aio.Deadlines` (swept every
  50 ms, so it may run up to that much over; a loop timer per call cost the router 1.5% of its instructions);
- errors are httpx's own exception types (``ConnectError``, ``ConnectTimeout``, ``ReadTimeout``,
  ``RemoteProtocolError``, ``ReadError``), so callers keep catching ``httpx.HTTPError``;
- JSON bodies are written and read with orjson where it is installed (the stdlib's json otherwise);
- no TLS, no proxies, no redirects, no cookies, no HTTP/2, no HEAD: workers are plain HTTP on the cluster network.
"""

from __future__ import annotations

import asyncio
import functools
import json as _json
import time
from collections import deque
from typing import Any, AsyncIterator, Callable, Mapping
from urllib.parse import urlsplit

import httptools
import httpx

from pdruntime.util.aio import Deadlines

try:
    import orjson
except ImportError:  # pragma: no cover - orjson is in the runtime extra
    orjson = None

HEAD_LIMIT = 64 * 1024  # bytes of status line + headers
KEEPALIVE_S = 30.0
MAX_IDLE_PER_HOST = 256
DEFAULT_TIMEOUT = 30.0
DRAIN_S = 0.01  # seconds aclose waits for the rest of an unread body before closing the connection instead
NOTHING = object()  # Response.take: no piece has arrived yet


def dumps(obj: Any) -> bytes:
    """Compact JSON bytes (orjson; the stdlib for what orjson refuses, e.g. an integer past 64 bits)."""
    if orjson is not None:
        try:
            return orjson.dumps(obj)
        except TypeError:
            pass
    return _json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


def loads(data: bytes | str) -> Any:
    """JSON -> Python (orjson; the stdlib's parser decides, and words, what orjson rejects). ValueError if not JSON."""
    if orjson is not None:
        try:
            return orjson.loads(data)
        except orjson.JSONDecodeError:
            pass
    return _json.loads(data)


def _timeouts(timeout: Any, default: tuple[float | None, float | None]) -> tuple[float | None, float | None]:
    """(connect, read) seconds of a float, a ``(connect, read)`` tuple (None: no limit; the router's legs pass one
    per request, which costs less than an ``httpx.Timeout``), an ``httpx.Timeout`` or None (the client's default)."""
    if timeout is None:
        return default
    if type(timeout) is tuple:
        return timeout
    if isinstance(timeout, httpx.Timeout):
        return timeout.connect, timeout.read
    return float(timeout), float(timeout)


class Headers:
    """Response headers, names case-insensitive (``get`` as httpx's); the last value of a repeated name wins.
    Decoded on the first look: most answers are read without one."""

    __slots__ = ("_raw", "_h")

    def __init__(self, pairs: list[tuple[bytes, bytes]]) -> None:
        self._raw = pairs
        self._h: dict[str, str] | None = None

    @property
    def _map(self) -> dict[str, str]:
        if self._h is None:
            self._h = {k.decode("latin-1").lower(): v.decode("latin-1").strip() for k, v in self._raw}
        return self._h

    def get(self, name: str, default: str | None = None) -> str | None:
        return self._map.get(name.lower(), default)

    def __getitem__(self, name: str) -> str:
        return self._map[name.lower()]

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name.lower() in self._map

    def items(self):
        return self._map.items()


@functools.lru_cache(maxsize=4096)
def _split(method: str, url: str) -> tuple[tuple[str, int], str]:
    """((host, port), the head's first lines up to its Host line) of a call to an http:// URL (the router calls the
    same few URLs again and again)."""
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise httpx.UnsupportedProtocol(f"h1: only http:// URLs are supported, got {url!r}")
    host, port = parts.hostname, parts.port or 80
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return (host, port), f"{method} {target} HTTP/1.1\r\nHost: {host}:{port}\r\n"


_SIZED = ("POST", "PUT", "PATCH")  # methods whose head states a length even for an empty body


class Response:
    """An answer: ``status_code``, ``headers``; the body by ``aread``/``content``/``json``/``text`` or, for a
    ``send(stream=True)``, by :meth:`read_some` (or ``aiter_bytes``/``aiter_lines``), then ``aclose``.

    The connection fills the body in as it arrives (``_Conn.on_body`` appends each piece, then :meth:`_end` or
    :meth:`_fail`); a reader waits only when nothing is buffered."""

    # what most answers keep from start to end, as class defaults (not a store per answer)
    _ended = False
    _error: BaseException | None = None
    _waiter: asyncio.Future | None = None
    _content: bytes | None = None
    _released = False  # release(): the rest of the body is dropped as it arrives

    _headers: Headers | None = None

    def __init__(self, conn: "_Conn", req: Request, status: int, raw_headers: list[tuple[bytes, bytes]],
                 read_s: float | None) -> None:
        self._conn: _Conn | None = conn  # None once the answer is complete (the connection is back in the pool)
        self._loop = conn.loop
        self.url = req.url  # not the request: its future holds this answer (no reference cycle per call)
        self.status_code, self._raw_headers = status, raw_headers
        self._read_s = read_s
        self._pieces: deque[bytes] = deque()

    @property
    def headers(self) -> Headers:
        """Made on the first look: the router reads an answer's headers only when it is an error."""
        if self._headers is None:
            self._headers = Headers(self._raw_headers)
        return self._headers

    # ---- filled in by the connection ----
    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _end(self, whole: bool = False) -> None:
        """The body has arrived; ``whole``: read it into ``content`` now (a call that waited for all of it)."""
        self._ended = True
        self._conn = None
        if whole:
            pieces = self._pieces
            self._content = pieces.popleft() if len(pieces) == 1 else b"".join(pieces)
            pieces.clear()
        self._wake()

    def _fail(self, exc: BaseException) -> None:
        self._error = exc
        self._conn = None
        self._wake()

    # ---- body ----
    @property
    def complete(self) -> bool:
        """The whole body has arrived (it may still be unread)."""
        return self._ended

    def take(self) -> bytes | None | object:
        """The next piece of the body that has arrived, None at its end, :data:`NOTHING` while the next is still on its
        way (:meth:`arrival` says when). Raises httpx's errors, as :meth:`read_some`."""
        if self._pieces:
            return self._pieces.popleft()
        if self._error is not None:
            raise self._error
        if self._ended:
            return None
        if self._conn is None:  # closed by aclose
            raise httpx.StreamClosed()
        return NOTHING

    def arrival(self) -> asyncio.Future:
        """A future done once :meth:`take` has something (a piece, the end, an error); no read timeout of its own."""
        self._waiter = waiter = self._loop.create_future()
        if self._pieces or self._ended or self._error is not None or self._conn is None:
            waiter.set_result(None)
        return waiter

    async def read_some(self) -> bytes | None:
        """The next piece of the body as it arrived, None at its end. Raises httpx's errors (ReadTimeout when nothing
        arrives for the read timeout, RemoteProtocolError when the peer closes mid-body)."""
        while (piece := self.take()) is NOTHING:
            await self._wait()
        return piece  # type: ignore[return-value]

    async def _wait(self) -> None:
        loop = self._loop
        self._waiter = waiter = loop.create_future()
        timer = loop.call_later(self._read_s, self._timed_out, waiter) if self._read_s is not None else None
        try:
            await waiter
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()

    def _timed_out(self, waiter: asyncio.Future) -> None:
        if not waiter.done():
            conn = self._conn
            self._fail(httpx.ReadTimeout(f"no data from {self.url} within {self._read_s}s"))
            if conn is not None:
                conn.close()

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        if self._content is not None:
            if self._content:
                yield self._content
            return
        while (data := await self.read_some()) is not None:
            if data:
                yield data

    async def aiter_lines(self) -> AsyncIterator[str]:
        """Decoded lines without their ending (``\\n`` or ``\\r\\n``), as ``httpx.Response.aiter_lines``."""
        tail = b""
        async for data in self.aiter_bytes():
            tail += data
            *lines, tail = tail.split(b"\n")
            for line in lines:
                yield line.rstrip(b"\r").decode("utf-8", "replace")
        if tail:
            yield tail.rstrip(b"\r").decode("utf-8", "replace")

    async def aread(self) -> bytes:
        if self._content is None:
            parts = []
            while (data := await self.read_some()) is not None:
                parts.append(data)
            self._content = parts[0] if len(parts) == 1 else b"".join(parts)
        return self._content

    @property
    def content(self) -> bytes:
        if self._content is None:
            raise httpx.ResponseNotRead()
        return self._content

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", "replace")

    def json(self) -> Any:
        return loads(self.content)

    def release(self) -> None:
        """Done with it, without waiting: a body not yet complete may finish arriving within :data:`DRAIN_S` (the
        connection then goes back to the pool as it ends, e.g. an SSE stream whose reader stopped at its last
        event), else its connection is closed. What :meth:`aclose` does, off the caller's path."""
        conn = self._conn
        if conn is None or self._ended:
            return
        self._released = True
        self._pieces.clear()
        if conn.keep:
            self._loop.call_later(DRAIN_S, self._drain_over, conn)
        else:
            self._drain_over(conn)

    def _drain_over(self, conn: "_Conn") -> None:
        if not self._ended and self._conn is conn:
            self._conn = None
            conn.close()

    async def aclose(self) -> None:
        """Done with it. A body not yet complete is waited for :data:`DRAIN_S` (an SSE stream whose reader stopped
        at ``[DONE]`` has only its last chunk left), so the connection is reused; otherwise the connection is
        closed."""
        conn = self._conn
        if conn is None or self._ended:
            return
        if conn.keep:
            try:
                async with asyncio.timeout(DRAIN_S):
                    while not self._ended and self._error is None:
                        self._pieces.clear()
                        await self._wait()
            except TimeoutError:
                pass
            if self._ended:
                self._pieces.clear()
                return
        self._conn = None
        conn.close()


def _close_delimited(resp: Response) -> bool:
    """The answer's body ends when the peer closes (neither a length nor chunks)."""
    te = (resp.headers.get("transfer-encoding") or "").lower()
    return "chunked" not in te and resp.headers.get("content-length") is None and resp.status_code not in (204, 304)


class Request:
    """One call: what is sent (``method``, ``url``, ``body``, ``headers``; :meth:`encode`) and, once
    :meth:`Client.start` has sent it, its exchange: ``fut`` resolves to its Response once the head (``whole``
    False) or the whole answer (``whole`` True) has arrived, or to httpx's error; :meth:`cancel` gives it up and
    closes its connection (the peer sees the hang-up). One object for both: the router makes two per request.
    ``ctype``: a Content-Type sent unless ``headers`` has "Content-Type" (what ``build_request(json=...)`` sets).
    ``on_done``: called with ``fut`` as soon as it is settled, in the same step (a done callback of ``fut`` would run
    a loop iteration later, through a handle of its own)."""

    __slots__ = ("method", "url", "key", "start_lines", "body", "headers", "timeout", "ctype",
                 "client", "wire", "read_s", "connect_s", "fut", "whole", "conn", "timer", "on_done")

    def __init__(self, method: str, url: str, body: bytes, headers: Mapping[str, str] | None, timeout: Any,
                 ctype: str | None = None) -> None:
        self.key, self.start_lines = _split(method, url)  # (host, port); the request and Host lines
        self.method, self.url, self.body, self.timeout, self.ctype = method, url, body, timeout, ctype
        self.headers = headers or {}
        self.fut: asyncio.Future | None = None  # set by Client.start
        self.conn: _Conn | None = None
        self.timer: Deadlines | None = None  # where its read timeout waits, until its answer
        self.on_done: Callable[[asyncio.Future], None] | None = None

    @property
    def host(self) -> str:
        return self.key[0]

    @property
    def port(self) -> int:
        return self.key[1]

    def encode(self) -> bytes:
        head, body, headers = self.start_lines, self.body, self.headers
        if body or self.method in _SIZED:
            head += "Content-Length: %d\r\n" % len(body)
        if self.ctype is not None and "Content-Type" not in headers:
            head += "Content-Type: " + self.ctype + "\r\n"
        if headers:
            try:  # "name: value" lines joined in C (no bytecode per header)
                head += "\r\n".join(map(": ".join, headers.items())) + "\r\n"
            except TypeError:  # a value that is not a str
                head += "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        return (head + "\r\n").encode("latin-1") + body

    # ---- the exchange (Client.start) ----
    def cancel(self) -> None:
        """Give the call up: its future is cancelled and, unless its answer had fully arrived, its connection closed."""
        self._stop_timer()
        fut = self.fut
        if fut is not None and fut.cancel():
            self._done(fut)
        conn = self.conn
        if conn is not None and conn.call is self:
            conn.call = None
            conn.close()

    def resolve(self, resp: Response) -> None:
        self._stop_timer()
        fut = self.fut
        if not fut.done():
            fut.set_result(resp)
            if self.on_done is not None:  # most calls have none (a stream's head is awaited): no call then
                self._done(fut)

    def fail(self, exc: BaseException) -> None:
        self._stop_timer()
        fut = self.fut
        if not fut.done():
            fut.set_exception(exc)
            self._done(fut)

    def _stop_timer(self) -> None:
        if self.timer is not None:
            self.timer.discard(self)
            self.timer = None  # its entry's callback is this call's: no reference cycle left behind

    def _done(self, fut: asyncio.Future) -> None:
        """``on_done``, once: dropped as it is called, so that a callback bound to its owner (the router's legs,
        which hold this call) leaves no reference cycle for the garbage collector."""
        on_done, self.on_done = self.on_done, None
        if on_done is not None:
            on_done(fut)

    def timed_out(self) -> None:
        if not self.fut.done():
            self.fail(httpx.ReadTimeout(f"no data from {self.url} within {self.read_s}s"))
            if self.conn is not None and self.conn.call is self:
                self.conn.call = None
                self.conn.close()

    async def connect_and_send(self) -> None:
        """The call on a new connection (none idle, or the idle one turned out closed)."""
        try:
            conn = await self.client._connect(self, self.connect_s)
        except httpx.HTTPError as exc:
            self.fail(exc)
            return
        if self.fut.done():  # cancelled or timed out while connecting
            conn.close()
            return
        conn.begin(self)


class _Conn(asyncio.Protocol):
    """One kept-alive connection to a worker, one call at a time; httptools parses the answers as they arrive."""

    def __init__(self, client: "Client", key: tuple[str, int]) -> None:
        self.client, self.key = client, key
        self.loop = client.loop
        self.pool = client._pool(key)  # where it waits while idle
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.idle_since = 0.0
        self.reused = False
        self.closed = False
        self.keep = True
        self.call: Request | None = None  # the call whose answer this connection is reading
        self.resp: Response | None = None
        self.got_bytes = False
        self._headers: list[tuple[bytes, bytes]] = []
        self._head_bytes = 0  # bytes of the pending answer's head so far (counted per read, not per header)
        self._interim = False  # a 1xx answer before the real one

    def begin(self, call: Request) -> None:
        """Send ``call``'s request (written as this pass of the loop ends, :meth:`Client._flush`); its answer resolves
        ``call.fut``."""
        self.call, call.conn, self.got_bytes = call, self, False
        self._head_bytes = 0
        self.client._send_soon(self, call.wire)

    # ---- asyncio.Protocol ----
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        if self.call is None and self.resp is None:  # bytes nobody asked for on an idle connection: not one to reuse
            self.close()
            return
        try:
            self.parser.feed_data(data)
            if self.resp is None and self.call is not None:  # all of this read was head, and it is not complete
                self._head_bytes += len(data)
                if self._head_bytes > HEAD_LIMIT:
                    raise httptools.HttpParserError("head too long")
        except httptools.HttpParserError:
            url = self.call.url if self.call is not None else "?"
            self._broken(httpx.RemoteProtocolError(f"{url}: the answer's head exceeds {HEAD_LIMIT} bytes"
                                                   if self._head_bytes > HEAD_LIMIT else
                                                   f"{url}: not an HTTP/1.x answer: {data[:80]!r}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        call, resp = self.call, self.resp
        self.call = self.resp = None
        if call is not None and not call.fut.done():
            if resp is None and self.reused and not self.got_bytes:
                # a kept-alive connection the peer had closed: once more on a new one
                call.conn = None
                asyncio.get_running_loop().create_task(call.connect_and_send())
            elif resp is None:
                call.fail(httpx.RemoteProtocolError(f"{call.url}: the peer closed the connection without an answer"))
            elif _close_delimited(resp):
                resp._end(whole=True)
                call.resolve(resp)
            else:
                exc2 = httpx.RemoteProtocolError(f"{call.url}: the peer closed the connection mid-body")
                resp._fail(exc2)
                call.fail(exc2)
            return
        if resp is not None and not resp._ended and resp._error is None:
            if _close_delimited(resp):
                resp._end()
            else:
                url = resp.url
                resp._fail(httpx.RemoteProtocolError(f"{url}: the peer closed the connection mid-body"))

    # ---- httptools callbacks ----
    def on_message_begin(self) -> None:
        self._headers = []

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name, value))  # bounded: data_received stops a head past HEAD_LIMIT

    def on_headers_complete(self) -> None:
        call, parser = self.call, self.parser
        if call is None:
            raise httptools.HttpParserError("an answer nobody asked for")
        status = parser.get_status_code()
        if status < 200:
            self._interim, self._head_bytes = True, 0
            return
        self.keep = parser.should_keep_alive()
        self.resp = resp = Response(self, call, status, self._headers, call.read_s)
        if not call.whole:
            call.resolve(resp)

    def on_body(self, body: bytes) -> None:
        resp = self.resp
        if resp is not None and not resp._released:  # a released answer's rest only has to arrive (for reuse)
            resp._pieces.append(body)
            if resp._waiter is not None:
                resp._wake()

    def on_message_complete(self) -> None:
        if self._interim:
            self._interim = False
            return
        call, resp = self.call, self.resp
        self.call = self.resp = None
        if resp is not None:
            whole = call is not None and call.whole
            resp._end(whole)
            if whole:
                call.resolve(resp)  # type: ignore[union-attr]
        if self.keep:
            self.client._release(self)
        else:
            self.close()

    # ---- the client's side ----
    def _broken(self, exc: BaseException) -> None:
        """A protocol error: the pending answer or body fails with ``exc`` and the connection closes."""
        call, resp = self.call, self.resp
        self.call = self.resp = None
        if call is not None:
            call.fail(exc)
        if resp is not None and not resp._ended:
            resp._fail(exc)
        self.close()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class Client:
    """The pool: ``Client(timeout=30.0, keepalive_s=30.0)``."""

    def __init__(self, timeout: Any = DEFAULT_TIMEOUT, keepalive_s: float = KEEPALIVE_S,
                 max_idle_per_host: int = MAX_IDLE_PER_HOST) -> None:
        self._default = _timeouts(timeout, (DEFAULT_TIMEOUT, DEFAULT_TIMEOUT))
        self.keepalive_s, self.max_idle = keepalive_s, max_idle_per_host
        self._idle: dict[tuple[str, int], deque[_Conn]] = {}
        self._closed = False
        #: the calls' read timeouts (and the router's deadlines before a first token, legs.py): swept, not a loop
        #: timer each
        self.deadlines = Deadlines()
        self._outbox: list[tuple[_Conn, bytes]] = []  # requests this pass of the loop has started (_flush sends them)
        try:  # made on the loop it serves (the router's start): asked now, else on its first call
            self._loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            self._loop = None

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The event loop this client's connections live on (its first call's): asked once, because on Python 3.11
        every ``asyncio.get_running_loop()`` is a ``getpid()`` system call (a fork check)."""
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        return loop

    # ---- sending ----
    def _send_soon(self, conn: _Conn, wire: bytes) -> None:
        outbox = self._outbox
        outbox.append((conn, wire))
        if len(outbox) == 1:
            self.loop.call_soon(self._flush)

    def _flush(self) -> None:
        """Write every request started since the last flush. One whose connection was closed meanwhile (its call
        cancelled, or the peer gone: ``connection_lost`` has retried or failed it) is dropped."""
        out, self._outbox = self._outbox, []
        for conn, wire in out:
            transport = conn.transport
            if not conn.closed and transport is not None and not transport.is_closing():
                transport.write(wire)

    # ---- pool ----
    def _pool(self, key: tuple[str, int]) -> deque[_Conn]:
        """The idle connections to ``key``, newest last."""
        idle = self._idle.get(key)
        if idle is None:
            idle = self._idle[key] = deque()
        return idle

    def _take_idle(self, key: tuple[str, int]) -> _Conn | None:
        idle = self._idle.get(key)
        if not idle:
            return None
        now = time.monotonic()
        while idle:
            conn = idle.pop()  # newest first: the likeliest still open
            if now - conn.idle_since < self.keepalive_s and not conn.closed and not conn.transport.is_closing():
                conn.reused = True
                return conn
            conn.close()
        return None

    def _release(self, conn: _Conn) -> None:
        if self._closed or conn.closed:
            conn.close()
            return
        idle = conn.pool
        if len(idle) >= self.max_idle:
            idle.popleft().close()
        conn.idle_since = time.monotonic()
        idle.append(conn)

    async def _connect(self, req: Request, connect_s: float | None) -> _Conn:
        key = req.key
        host, port = key
        try:
            async with asyncio.timeout(connect_s):
                _, conn = await self.loop.create_connection(lambda: _Conn(self, key), host, port)
        except TimeoutError:
            raise httpx.ConnectTimeout(f"connecting to {host}:{port} took over {connect_s}s") from None
        except OSError as exc:
            raise httpx.ConnectError(f"{host}:{port}: {exc.strerror or exc}") from None
        return conn

    # ---- API ----
    def build_request(self, method: str, url: str, *, json: Any = None, content: bytes | None = None,
                      headers: Mapping[str, str] | None = None, timeout: Any = None) -> Request:
        if json is not None:
            return Request(method, url, dumps(json), headers, timeout, "application/json")
        return Request(method, url, content or b"", headers, timeout)

    def start(self, req: Request, *, stream: bool = False) -> Request:
        """Send ``req`` (on an idle connection, else connecting first; written when this pass of the loop ends, with
        the others it started) and return it: its ``fut`` is its Response, at its head with ``stream``, else once the
        whole answer has arrived. No task unless a connection is opened. The read timeout bounds the wait for that.
        A request is sent once."""
        if self._closed:
            raise RuntimeError("h1.Client is closed")
        if req.fut is not None:
            raise RuntimeError(f"h1: {req.method} {req.url} was sent already; build a new request")
        loop = self.loop
        req.client, req.whole = self, not stream
        req.connect_s, req.read_s = _timeouts(req.timeout, self._default)
        req.wire = req.encode()
        req.fut = loop.create_future()
        if req.read_s is not None:
            req.timer = deadlines = self.deadlines
            deadlines.add(req, time.monotonic() + req.read_s, req.timed_out)
        conn = self._take_idle(req.key)
        if conn is not None:
            conn.begin(req)
        else:
            loop.create_task(req.connect_and_send())
        return req

    async def send(self, req: Request, *, stream: bool = False) -> Response:
        call = self.start(req, stream=stream)
        try:
            return await call.fut
        except asyncio.CancelledError:
            call.cancel()
            raise

    async def request(self, method: str, url: str, **kw: Any) -> Response:
        return await self.send(self.build_request(method, url, **kw))

    async def get(self, url: str, **kw: Any) -> Response:
        return await self.request("GET", url, **kw)

    async def post(self, url: str, **kw: Any) -> Response:
        return await self.request("POST", url, **kw)

    async def aclose(self) -> None:
        self._closed = True
        self.deadlines.close()
        for idle in self._idle.values():
            while idle:
                idle.pop().close()
        self._idle.clear()
