"""Connection hygiene for every pdrt HTTP server: a header deadline, and caps per client and per server.

uvicorn reaps a keep-alive connection only after a response; one that never sends a request, or sends its head
a byte at a time, stays open for ever, and file descriptors are the limit an attacker reaches first. Here:

* **header deadline**: from the connection's first moment (or the first byte of its next request) the whole
  request head must arrive within ``header_timeout_s``; a slow client is closed and counted, and never gets a
  request task (uvicorn starts one only for a complete head). Idle keep-alive between requests stays uvicorn's
  ``timeout_keep_alive``.
* **caps**: at most ``max_per_client`` connections from one address and ``max_connections`` in all. Beyond
  either, the oldest *idle* connection (no request in flight: a slow head or an idle keep-alive) of that client
  (of the largest holder, for the server cap) is closed to make room; a new connection for which none can be
  closed gets a ``503`` with ``Retry-After`` and is closed. A flood thus evicts itself, and a client whose
  requests are in flight is never cut.

:class:`ConnectionTable` is the pure decision; :class:`ConnectionGuard` wires it into an HTTP server protocol:
:func:`guarded_protocol` into uvicorn's (the workers), the router's own server (``router/server.py``) into its.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any, Callable

HEADER_TIMEOUT_S = 10.0  # seconds for a whole request head
MAX_CONNECTIONS = 4096  # per server
MAX_CONNECTIONS_PER_CLIENT = 512  # per client address: above a router's pool to one worker (its 256 keep-alive)
REFUSED_RETRY_AFTER_S = 1  # the Retry-After of a connection refused at a full table


@dataclass(frozen=True)
class ConnectionLimits:
    header_timeout_s: float = HEADER_TIMEOUT_S
    max_connections: int = MAX_CONNECTIONS
    max_per_client: int = MAX_CONNECTIONS_PER_CLIENT

    def __post_init__(self) -> None:
        if not self.header_timeout_s > 0:
            raise ValueError(f"header_timeout_s={self.header_timeout_s} is invalid; accepted: seconds > 0")
        if not 1 <= self.max_per_client <= self.max_connections:
            raise ValueError(f"max_per_client={self.max_per_client}, max_connections={self.max_connections} are "
                             "invalid; accepted: 1 <= max_per_client <= max_connections")


class ConnectionTable:
    """Open connections by client address, oldest first. ``admit(conn)`` -> (accepted, connections to close).

    A connection is any object with ``client_addr`` (str) and ``busy`` (bool: a request in flight). Pure."""

    def __init__(self, limits: ConnectionLimits) -> None:
        self.limits = limits
        self.by_client: dict[str, list[Any]] = {}
        self.count = 0

    def admit(self, conn: Any) -> tuple[bool, list[tuple[Any, str]]]:
        mine = self.by_client.setdefault(conn.client_addr, [])
        evict: list[tuple[Any, str]] = []
        if len(mine) >= self.limits.max_per_client:
            victim = _oldest_idle(mine)
            if victim is None:
                return False, []
            evict.append((victim, "client_cap"))
        elif self.count >= self.limits.max_connections:
            holder = max(self.by_client.values(), key=len)
            victim = _oldest_idle(holder) or _oldest_idle([c for cs in self.by_client.values() for c in cs])
            if victim is None:
                return False, []
            evict.append((victim, "server_cap"))
        for victim, _ in evict:
            self.remove(victim)
        mine.append(conn)
        self.count += 1
        return True, evict

    def remove(self, conn: Any) -> None:
        mine = self.by_client.get(conn.client_addr)
        if mine is not None and conn in mine:
            mine.remove(conn)
            self.count -= 1
            if not mine:
                del self.by_client[conn.client_addr]


def _oldest_idle(conns: list[Any]) -> Any | None:
    return next((c for c in conns if not c.busy), None)


def refused_response(retry_after_s: int = REFUSED_RETRY_AFTER_S) -> bytes:
    """A whole HTTP/1.1 503 in the OpenAI error shape, for a connection no room could be made for."""
    body = json.dumps({"error": {"message": "this server holds its maximum number of connections; retry after "
                                            f"{retry_after_s}s", "type": "server_overloaded", "param": None,
                                 "code": "too_many_connections"}}).encode()
    head = (f"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: {retry_after_s}\r\n"
            f"connection: close\r\ncontent-length: {len(body)}\r\n\r\n")
    return head.encode() + body


def http_protocol_class() -> type:
    """uvicorn's httptools protocol when httptools imports, else its h11 protocol."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
        return HttpToolsProtocol
    except ImportError:
        from uvicorn.protocols.http.h11_impl import H11Protocol
        return H11Protocol


class ConnectionGuard:
    """Mixin for an HTTP server protocol (put it first in the bases): the header deadline and the caps of one server's
    table, as :func:`guarded` sets them. The protocol provides ``client`` (the peer, set in ``connection_made``),
    ``transport``, ``loop`` and ``busy`` (a request whose head is complete and whose response is not)."""

    guard_table: ConnectionTable
    guard_limits: ConnectionLimits

    @staticmethod
    def guard_on_close(reason: str) -> None:  # replaced per server by guarded()
        pass

    @staticmethod
    def guard_on_count(n: int) -> None:  # replaced per server by guarded()
        pass

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)  # type: ignore[misc]
        peer = self.client  # type: ignore[attr-defined]
        self.client_addr = str(peer[0]) if peer else ""
        self._deadline: asyncio.TimerHandle | None = None
        self._in_table = False
        ok, evict = self.guard_table.admit(self)
        for victim, reason in evict:
            victim._close_by_guard(reason)
        if not ok:
            self.guard_on_close("refused")
            transport.write(refused_response())
            transport.close()
            return
        self._in_table = True
        self.guard_on_count(self.guard_table.count)
        self._arm()

    def _arm(self) -> None:
        if self._deadline is None:
            self._deadline = self.loop.call_later(self.guard_limits.header_timeout_s,  # type: ignore[attr-defined]
                                                  self._close_by_guard, "header_timeout")

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _close_by_guard(self, reason: str) -> None:
        self._disarm()
        if self.busy or self.transport.is_closing():  # type: ignore[attr-defined]
            return
        self.guard_on_close(reason)
        self.transport.close()  # type: ignore[attr-defined]

    def data_received(self, data: bytes) -> None:
        super().data_received(data)  # type: ignore[misc]
        if self.busy:  # type: ignore[attr-defined]
            self._disarm()  # the server started a request: its head is complete
        else:
            self._arm()  # (part of) a request head: the whole head within the deadline of its first byte

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._in_table:
            self._in_table = False
            self.guard_table.remove(self)
            self.guard_on_count(self.guard_table.count)
        super().connection_lost(exc)  # type: ignore[misc]


def guarded(base: type, limits: ConnectionLimits, on_close: Callable[[str], None] = lambda reason: None,
            on_count: Callable[[int], None] = lambda n: None) -> type:
    """``base`` (an HTTP server protocol with ``busy``) with the header deadline and the caps, one table per call
    (per server). ``on_close(reason)`` counts each connection closed or refused by the guard (header_timeout |
    client_cap | server_cap | refused); ``on_count(n)`` follows the number open."""
    return type(f"Guarded{base.__name__}", (ConnectionGuard, base),
                {"guard_table": ConnectionTable(limits), "guard_limits": limits,
                 "guard_on_close": staticmethod(on_close), "guard_on_count": staticmethod(on_count)})


def guarded_protocol(limits: ConnectionLimits, on_close: Callable[[str], None] = lambda reason: None,
                     on_count: Callable[[int], None] = lambda n: None) -> type:
    """uvicorn's HTTP protocol with the header deadline and the caps (:func:`guarded`), for ``uvicorn.run(http=...)``.

    The protocol is uvicorn's httptools one (llhttp, C) where httptools is installed, as it is with pdstack's
    runtime extra, else its pure-Python h11 one: on 1-token completions through the router (bench/router.py)
    h11's parsing and event machinery were a fifth of the router's CPU. Both keep ``cycle``, ``client``,
    ``transport`` and ``loop`` as the guard reads them."""

    class UvicornProtocol(http_protocol_class()):  # type: ignore[misc]
        @property
        def busy(self) -> bool:
            return self.cycle is not None and not self.cycle.response_complete

    return guarded(UvicornProtocol, limits, on_close, on_count)
