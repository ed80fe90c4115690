"""Test-only fault injection (``PDRT_FAULT_*``, read in ``pdruntime.env``). Off unless a knob is set.

``ConnectionStall`` (``PDRT_FAULT_DECODE_STALL_AFTER=N``): the decode worker counts PD requests per client
connection and stalls every request after the N-th on the same connection. The connection is the one the
client opened to the router: pdrt's router forwards it to the decode leg as ``X-PDStack-Client-Connection``
(``host:port``), because its own connections to workers are not kept per client (a decode stream is closed at
its last token). Without the header (another router, a direct request) it is the worker's own incoming
connection (the ASGI ``scope["client"]``). A one-shot request on a fresh connection passes; agents whose rounds
reuse keep-alive connections hang from round N+1: the shape of the incident in docs/reliability.md, so that the
canary probe can be shown to catch it.
"""

from __future__ import annotations

from collections import OrderedDict
from contextvars import ContextVar
from typing import Any

from pdruntime.util.headers import CLIENT_CONNECTION_HEADER  # set by pdrt's router on the decode leg

MAX_CONNECTIONS = 4096  # connections remembered (LRU); a forgotten one counts from zero again


class ConnectionStall:
    """Pure counter: ``admit(connection)`` is True when this request (the next on that connection) must stall."""

    def __init__(self, after: int) -> None:
        if after < 1:
            raise ValueError(f"stall after {after} requests per connection is not accepted; accepted: an integer >= 1")
        self.after = after
        self.counts: OrderedDict[str, int] = OrderedDict()
        self.stalled = 0  # requests stalled so far

    def admit(self, connection: str) -> bool:
        key = connection or "unknown"
        n = self.counts.pop(key, 0) + 1
        self.counts[key] = n
        while len(self.counts) > MAX_CONNECTIONS:
            self.counts.popitem(last=False)
        stall = n > self.after
        self.stalled += stall
        return stall


#: set per request by the decode worker's handler; tasks it starts (the KV pull) inherit it
STALL_THIS_REQUEST: ContextVar[bool] = ContextVar("pdrt_fault_stall_this_request", default=False)




def connection_of(headers: Any, scope: Any) -> str:
    """The client connection a request came over: the router's forwarded header, else this server's own peer."""
    forwarded = headers.get(CLIENT_CONNECTION_HEADER)
    if forwarded:
        return forwarded
    client = scope.get("client")
    return f"{client[0]}:{client[1]}" if client else "unknown"


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
