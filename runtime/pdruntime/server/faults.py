"""Test-only fault injection (``PDRT_FAULT_*``, read in ``pdruntime.env``). Off unless a knob is set.

``ConnectionStall`` (``PDRT_FAULT_DECODE_STALL_AFTER=N``): the decode worker counts PD requests per
incoming HTTP connection (the ASGI ``scope["client"]``: the router's keep-alive connection) and stalls every
request after the N-th on the same connection. A one-shot request on a fresh connection passes; agents
whose rounds reuse keep-alive connections hang from round N+1: the shape of the incident in
/work/shared/INCIDENT.md, so that the canary probe can be shown to catch it.
"""

from __future__ import annotations

from collections import OrderedDict
from contextvars import ContextVar
from typing import Any

MAX_CONNECTIONS = 4096  # connections remembered (LRU); a forgotten one counts from zero again


class ConnectionStall:
    """Pure counter: ``admit(scope)`` is True when this request must stall."""

    def __init__(self, after: int) -> None:
        if after < 1:
            raise ValueError(f"stall after {after} requests per connection is not accepted; accepted: an integer >= 1")
        self.after = after
        self.counts: OrderedDict[tuple, int] = OrderedDict()
        self.stalled = 0  # requests stalled so far

    def admit(self, scope: Any) -> bool:
        client = scope.get("client") if isinstance(scope, dict) else None
        key = tuple(client) if client else ("unknown",)
        n = self.counts.pop(key, 0) + 1
        self.counts[key] = n
        while len(self.counts) > MAX_CONNECTIONS:
            self.counts.popitem(last=False)
        stall = n > self.after
        self.stalled += stall
        return stall


#: set per request by the decode worker's handler; tasks it starts (the KV pull) inherit it
STALL_THIS_REQUEST: ContextVar[bool] = ContextVar("pdrt_fault_stall_this_request", default=False)
