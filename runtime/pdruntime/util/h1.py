"""A small pooled HTTP/1.1 client for the router's calls to its workers: the part of ``httpx.AsyncClient`` the
router uses (``get``, ``post``, ``build_request`` + ``send(stream=True)``, ``aclose``), at a fraction of its CPU.

Why not httpx: profiled on 1-token completions through the router (bench/router.py, no-op workers), half of the
router's CPU was httpx and httpcore: per call, the pool's scan of every idle connection (``has_expired`` asks
anyio for socket details of each), the transport layers, and the request and response models. Here a call is a
write of one buffer and a parse of one head on a kept-alive ``asyncio`` stream.

What it does and does not do:
- keep-alive per (host, port); an idle connection is reused newest first and closed after ``keepalive_s``
  (below the workers' own 75 s, so a worker never closes one the router is about to use); a reused connection
  that fails before any byte of the answer (the peer closed it meanwhile) is retried once on a new connection;
- bodies by ``Content-Length``, ``Transfer-Encoding: chunked`` or, with neither, until the peer closes;
- timeouts: ``connect`` for the TCP handshake, ``read`` for each read (a float sets both), as httpx's;
- errors are httpx's own exception types (``ConnectError``, ``ConnectTimeout``, ``ReadTimeout``,
  ``RemoteProtocolError``, ``ReadError``), so callers keep catching ``httpx.HTTPError``;
- no TLS, no proxies, no redirects, no cookies, no HTTP/2: workers are plain HTTP on the cluster network.
"""

from __future__ import annotations

import asyncio
import json as _json
import time
from collections import deque
from typing import Any, AsyncIterator, Mapping
from urllib.parse import urlsplit

import httpx

HEAD_LIMIT = 64 * 1024  # bytes of status line + headers
KEEPALIVE_S = 30.0
MAX_IDLE_PER_HOST = 256
DEFAULT_TIMEOUT = 30.0
DRAIN_S = 0.01  # seconds aclose waits for the rest of an unread body before closing the connection instead


def _timeouts(timeout: Any, default: tuple[float | None, float | None]) -> tuple[float | None, float | None]:
    """(connect, read) seconds of a float, an ``httpx.Timeout`` or None (the client's default)."""
    if timeout is None:
        return default
    if isinstance(timeout, httpx.Timeout):
        return timeout.connect, timeout.read
    return float(timeout), float(timeout)


class Headers:
    """Response headers, names case-insensitive (``get`` as httpx's); the last value of a repeated name wins."""

    __slots__ = ("_h",)

    def __init__(self, pairs: list[tuple[str, str]]) -> None:
        self._h = {k.lower(): v for k, v in pairs}

    def get(self, name: str, default: str | None = None) -> str | None:
        return self._h.get(name.lower(), default)

    def __getitem__(self, name: str) -> str:
        return self._h[name.lower()]

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name.lower() in self._h

    def items(self):
        return self._h.items()


class _Conn:
    __slots__ = ("reader", "writer", "key", "idle_since", "reused")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, key: tuple[str, int]) -> None:
        self.reader, self.writer, self.key = reader, writer, key
        self.idle_since = 0.0
        self.reused = False

    def close(self) -> None:
        try:
            self.writer.close()
        except (OSError, RuntimeError):
            pass


class Request:
    __slots__ = ("method", "url", "host", "port", "target", "body", "headers", "timeout")

    def __init__(self, method: str, url: str, body: bytes, headers: Mapping[str, str] | None, timeout: Any) -> None:
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise httpx.UnsupportedProtocol(f"h1: only http:// URLs are supported, got {url!r}")
        self.method, self.url, self.body, self.timeout = method, url, body, timeout
        self.host, self.port = parts.hostname, parts.port or 80
        self.target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        self.headers = headers or {}

    def encode(self) -> bytes:
        lines = [f"{self.method} {self.target} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"]
        if self.body or self.method in ("POST", "PUT", "PATCH"):
            lines.append(f"Content-Length: {len(self.body)}\r\n")
        lines.extend(f"{k}: {v}\r\n" for k, v in self.headers.items())
        lines.append("\r\n")
        return "".join(lines).encode("latin-1") + self.body


class Response:
    """An answer: ``status_code``, ``headers``; the body by ``aread``/``content``/``json``/``text`` or, for a
    ``send(stream=True)``, by ``aiter_bytes``/``aiter_lines``, then ``aclose``."""

    def __init__(self, client: "Client", conn: _Conn, req: Request, status: int, headers: Headers,
                 read_s: float | None, keep: bool) -> None:
        self._client, self._conn, self.request = client, conn, req
        self.status_code, self.headers = status, headers
        self._read_s, self._keep = read_s, keep
        self._content: bytes | None = None
        te = (headers.get("transfer-encoding") or "").lower()
        self._chunked = "chunked" in te
        cl = headers.get("content-length")
        self._length = int(cl) if cl is not None and not self._chunked else None
        if req.method == "HEAD" or status in (204, 304) or 100 <= status < 200:
            self._length = 0
        if self._length is None and not self._chunked:
            self._keep = False  # delimited by the peer closing

    # ---- body ----
    async def _read(self, coro):
        try:
            async with asyncio.timeout(self._read_s):
                return await coro
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, OSError) as exc:
            self._fail()
            raise _io_error(exc, self.request.url, self._read_s, "mid-body", "a chunk-size line") from None

    def _fail(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _done(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            if self._keep:
                self._client._release(conn)
            else:
                conn.close()

    async def _next_piece(self) -> bytes | None:
        """The next piece of the body, None at its end (the connection then goes back to the pool). The state
        lives here, not in a generator, so a body abandoned mid-way can still be drained by :meth:`aclose`."""
        if self._conn is None:
            return None
        r = self._conn.reader
        if self._length is not None:
            if not self._length:
                self._done()
                return None
            data = await self._read(r.read(min(self._length, 65536)))
            if not data:
                self._fail()
                raise httpx.RemoteProtocolError(f"{self.request.url}: the peer closed the connection mid-body")
            self._length -= len(data)
            if not self._length:
                self._done()
            return data
        if self._chunked:
            line = await self._read(r.readuntil(b"\r\n"))
            try:
                size = int(line.split(b";", 1)[0].strip(), 16)
            except ValueError:
                self._fail()
                raise httpx.RemoteProtocolError(f"{self.request.url}: bad chunk size {line[:40]!r}") from None
            if size == 0:
                while (await self._read(r.readuntil(b"\r\n"))) != b"\r\n":  # trailers
                    pass
                self._done()
                return None
            return (await self._read(r.readexactly(size + 2)))[:-2]
        data = await self._read(r.read(65536))
        if not data:
            self._done()
            return None
        return data

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        if self._content is not None:
            if self._content:
                yield self._content
            return
        while (data := await self._next_piece()) is not None:
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
            self._content = b"".join([d async for d in self.aiter_bytes()])
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
        return _json.loads(self.content)

    async def aclose(self) -> None:
        """Done with it. A body not read to its end is drained if the rest arrives within :data:`DRAIN_S` (an SSE
        stream whose reader stopped at ``[DONE]`` has only its last chunk left), so the connection is reused;
        otherwise the connection is closed."""
        if self._conn is None:
            return
        if self._keep:
            try:
                async with asyncio.timeout(DRAIN_S):
                    while await self._next_piece() is not None:
                        pass
                return
            except (TimeoutError, httpx.HTTPError):
                pass
        self._fail()


class Client:
    """The pool: ``Client(timeout=30.0, keepalive_s=30.0)``."""

    def __init__(self, timeout: Any = DEFAULT_TIMEOUT, keepalive_s: float = KEEPALIVE_S,
                 max_idle_per_host: int = MAX_IDLE_PER_HOST) -> None:
        self._default = _timeouts(timeout, (DEFAULT_TIMEOUT, DEFAULT_TIMEOUT))
        self.keepalive_s, self.max_idle = keepalive_s, max_idle_per_host
        self._idle: dict[tuple[str, int], deque[_Conn]] = {}
        self._closed = False

    # ---- pool ----
    def _take_idle(self, key: tuple[str, int]) -> _Conn | None:
        idle = self._idle.get(key)
        now = time.monotonic()
        while idle:
            conn = idle.pop()  # newest first: the likeliest still open
            if now - conn.idle_since < self.keepalive_s and not conn.reader.at_eof() \
                    and not conn.writer.is_closing():
                conn.reused = True
                return conn
            conn.close()
        return None

    def _release(self, conn: _Conn) -> None:
        if self._closed or conn.reader.at_eof() or conn.writer.is_closing():
            conn.close()
            return
        idle = self._idle.setdefault(conn.key, deque())
        if len(idle) >= self.max_idle:
            idle.popleft().close()
        conn.idle_since = time.monotonic()
        idle.append(conn)

    async def _connect(self, req: Request, connect_s: float | None) -> _Conn:
        try:
            async with asyncio.timeout(connect_s):
                reader, writer = await asyncio.open_connection(req.host, req.port, limit=HEAD_LIMIT)
        except TimeoutError:
            raise httpx.ConnectTimeout(f"connecting to {req.host}:{req.port} took over {connect_s}s") from None
        except OSError as exc:
            raise httpx.ConnectError(f"{req.host}:{req.port}: {exc.strerror or exc}") from None
        return _Conn(reader, writer, (req.host, req.port))

    # ---- API ----
    def build_request(self, method: str, url: str, *, json: Any = None, content: bytes | None = None,
                      headers: Mapping[str, str] | None = None, timeout: Any = None) -> Request:
        hdrs = dict(headers or {})
        if json is not None:
            content = _json.dumps(json, separators=(",", ":")).encode()
            hdrs.setdefault("Content-Type", "application/json")
        return Request(method, url, content or b"", hdrs, timeout)

    async def send(self, req: Request, *, stream: bool = False) -> Response:
        if self._closed:
            raise RuntimeError("h1.Client is closed")
        connect_s, read_s = _timeouts(req.timeout, self._default)
        wire = req.encode()
        for attempt in (0, 1):
            conn = self._take_idle((req.host, req.port)) if attempt == 0 else None
            if conn is None:
                conn = await self._connect(req, connect_s)
            try:
                resp = await self._exchange(conn, req, wire, read_s)
            except _Stale:
                continue  # a kept-alive connection the peer had closed: once more on a new one
            if not stream:
                await resp.aread()
            return resp
        raise httpx.RemoteProtocolError(f"{req.url}: the connection closed before an answer")  # pragma: no cover

    async def _exchange(self, conn: _Conn, req: Request, wire: bytes, read_s: float | None) -> Response:
        try:
            conn.writer.write(wire)
            async with asyncio.timeout(read_s):
                await conn.writer.drain()
                head = await conn.reader.readuntil(b"\r\n\r\n")
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, OSError) as exc:
            conn.close()
            nothing_read = isinstance(exc, OSError) or (isinstance(exc, asyncio.IncompleteReadError) and not exc.partial)
            if conn.reused and nothing_read and not isinstance(exc, TimeoutError):
                raise _Stale() from None
            raise _io_error(exc, req.url, read_s, "without an answer", "the answer's head") from None
        status, headers, keep = _parse_head(head, req.url)
        return Response(self, conn, req, status, headers, read_s, keep)

    async def request(self, method: str, url: str, **kw: Any) -> Response:
        return await self.send(self.build_request(method, url, **kw))

    async def get(self, url: str, **kw: Any) -> Response:
        return await self.request("GET", url, **kw)

    async def post(self, url: str, **kw: Any) -> Response:
        return await self.request("POST", url, **kw)

    async def aclose(self) -> None:
        self._closed = True
        for idle in self._idle.values():
            while idle:
                idle.pop().close()
        self._idle.clear()


class _Stale(Exception):
    """A reused connection failed before any byte of the answer."""


def _io_error(exc: BaseException, url: str, read_s: float | None, closed: str, too_long: str) -> httpx.HTTPError:
    """httpx's exception for a failed read of an answer from ``url``: ``closed`` says where the peer closed
    (``mid-body``, ``without an answer``), ``too_long`` what overran :data:`HEAD_LIMIT`."""
    if isinstance(exc, TimeoutError):
        return httpx.ReadTimeout(f"no data from {url} within {read_s}s")
    if isinstance(exc, asyncio.IncompleteReadError):
        return httpx.RemoteProtocolError(f"{url}: the peer closed the connection {closed}")
    if isinstance(exc, asyncio.LimitOverrunError):
        return httpx.RemoteProtocolError(f"{url}: {too_long} exceeds {HEAD_LIMIT} bytes")
    return httpx.ReadError(f"{url}: {type(exc).__name__} {exc}")


def _parse_head(head: bytes, url: str) -> tuple[int, Headers, bool]:
    try:
        lines = head[:-4].decode("latin-1").split("\r\n")
        version, code, *_ = lines[0].split(" ", 2)
        status = int(code)
        pairs = []
        for line in lines[1:]:
            name, _, value = line.partition(":")
            pairs.append((name.strip(), value.strip()))
    except (ValueError, IndexError):
        raise httpx.RemoteProtocolError(f"{url}: not an HTTP/1.x answer: {head[:80]!r}") from None
    if not version.startswith("HTTP/1."):
        raise httpx.RemoteProtocolError(f"{url}: not an HTTP/1.x answer: {head[:80]!r}")
    headers = Headers(pairs)
    conn_hdr = (headers.get("connection") or "").lower()
    keep = "close" not in conn_hdr and (version != "HTTP/1.0" or "keep-alive" in conn_hdr)
    return status, headers, keep
