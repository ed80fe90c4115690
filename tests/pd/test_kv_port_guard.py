"""The KV bootstrap port is guarded like the HTTP ports (issue 20, build item 6).

The handshake runs on the event loop within one absolute deadline (a peer dripping bytes gains nothing), and
unauthenticated connections are capped per peer, the oldest evicted: a flood of silent or slow connections
never holds a transfer thread, so real pairs' transfers go on. Pure table tests of the cap, the deadline on
real sockets, then a flood against a live stack's prefill while clean requests are served.
"""

from __future__ import annotations

import asyncio
import os
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from pdruntime.disagg import transfer, wire
from pdruntime.disagg.wire import Attach, WireError

sys.path.insert(0, os.path.dirname(__file__))
from pd_harness import wait_for  # noqa: E402

SHARED_STACK = True  # its traffic leaves the stack as it found it: the process's shared stack (tiny_stack.py)


class _Conn:
    """A stand-in with the two attributes PendingHandshakes reads."""

    def __init__(self, peer: str) -> None:
        self.peer, self.attach, self.closed = peer, None, False

    @property
    def pending(self) -> bool:
        return self.attach is None and not self.closed


def test_pending_handshakes_evicts_a_peers_oldest_beyond_its_cap():
    p = transfer.PendingHandshakes(per_peer=3, total=10)
    conns = [_Conn("10.0.0.1") for _ in range(5)]
    evicted = [v for c in conns for v, _ in p.admit(c)]
    assert evicted == conns[:2]
    assert p.count() == 3


def test_pending_handshakes_counts_neither_authenticated_nor_closed_connections():
    p = transfer.PendingHandshakes(per_peer=2, total=10)
    a, b, c = _Conn("x"), _Conn("x"), _Conn("x")
    p.admit(a)
    p.admit(b)
    a.attach = object()  # authenticated: a transfer, no longer pending
    assert p.admit(c) == []
    b.closed = True
    assert p.count() == 1


def test_pending_handshakes_total_cap_takes_from_the_largest_holder():
    p = transfer.PendingHandshakes(per_peer=4, total=5)
    flood = [_Conn("attacker") for _ in range(4)]
    for c in flood:
        assert p.admit(c) == []
    quiet = _Conn("decode")
    assert p.admit(quiet) == []
    out = p.admit(_Conn("decode"))
    assert [v for v, _ in out] == [flood[0]] and "more than 5" in out[0][1]


def test_pending_handshakes_rejects_a_cap_it_cannot_keep():
    with pytest.raises(ValueError, match="accepted: 1 <= per_peer <= total"):
        transfer.PendingHandshakes(per_peer=0, total=4)


def _drip(port: int, stop: threading.Event, every_s: float) -> float | None:
    """One byte every ``every_s`` seconds; -> seconds until the server closed it (None: still open at stop)."""
    s = socket.create_connection(("127.0.0.1", port))
    t0 = time.monotonic()
    try:
        s.settimeout(0.2)
        while not stop.is_set():
            try:
                s.send(wire.PREAMBLE[:1])
            except OSError:
                return time.monotonic() - t0
            end = time.monotonic() + every_s
            while time.monotonic() < end and not stop.is_set():
                try:
                    if s.recv(4096) == b"":
                        return time.monotonic() - t0
                except socket.timeout:
                    pass
                except OSError:
                    return time.monotonic() - t0
        return None
    finally:
        s.close()


async def test_a_dripping_peer_is_closed_at_the_absolute_deadline_not_kept_alive_by_each_byte():
    closed_after: list[float | None] = []

    async def handler(conn):
        try:
            await transfer.accept_attach(conn, "tok", deadline_s=1.0)
        except WireError as exc:
            assert exc.reason == "timeout" and "1s handshake deadline" in exc.message
            await transfer.send_error(conn, exc.reason, exc.message)

    server = await transfer.BootstrapServer.start("127.0.0.1", 0, handler)
    stop = threading.Event()
    try:
        closed_after.append(await asyncio.to_thread(_drip, server.port, stop, 0.3))
    finally:
        stop.set()
        server.close()
    assert closed_after[0] is not None and closed_after[0] < 4.0, closed_after


async def test_a_flood_holds_no_transfer_thread_and_an_authenticated_peer_still_attaches():
    attached: list[Attach] = []

    async def handler(conn):
        try:
            attached.append(await transfer.accept_attach(conn, "tok", deadline_s=3.0))
            await transfer.send_error(conn, "done", "test over")
        except WireError as exc:
            await transfer.send_error(conn, exc.reason, exc.message)

    server = await transfer.BootstrapServer.start("127.0.0.1", 0, handler)
    silent = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(300)]
    try:
        # the old handshake blocked one of the 32 transfer threads per connection: all taken now, if it still did
        busy = [transfer._EXECUTOR.submit(time.sleep, 0) for _ in range(transfer.MAX_TRANSFER_THREADS)]
        await asyncio.wait_for(asyncio.gather(*(asyncio.wrap_future(f) for f in busy)), 5)
        conn = await transfer.open_attach("127.0.0.1", server.port, "tok", Attach(room=9, rid="r9", num_tokens=3,
                                                                                 prompt_crc=1))
        conn.close()
        await asyncio.wait_for(_until(lambda: attached), 5)
        assert attached[0].room == 9
        assert server.pending.count() <= transfer.MAX_PENDING_PER_PEER
    finally:
        for s in silent:
            s.close()
        server.close()


async def _until(pred, every: float = 0.02):
    while not pred():
        await asyncio.sleep(every)


# ---- a live stack: the flood on prefill's bootstrap port, clean requests through the router -----------

def _chat(url: str, model: str, i: int) -> int:
    r = httpx.post(url + "/v1/chat/completions", timeout=60, json={
        "model": model, "max_tokens": 4, "messages": [{"role": "user", "content": f"clean request {i}"}]})
    return r.status_code


def _clean_round(stack, model_id: str, n: int) -> list[int]:
    with ThreadPoolExecutor(4) as pool:
        return list(pool.map(lambda i: _chat(stack.router.url, model_id, i), range(n)))


def test_clean_requests_all_succeed_while_300_silent_connections_hold_the_bootstrap_port(stack, model_id):
    def rejected() -> float:
        return stack.metric(stack.prefill, "pdrt_kv_transfer_rejected_total", {"reason": "protocol"})

    before = rejected()
    silent = [socket.create_connection(("127.0.0.1", stack.bootstrap_port)) for _ in range(300)]
    try:
        assert _clean_round(stack, model_id, 12) == [200] * 12
    finally:
        for s in silent:
            s.close()
    assert rejected() > before  # this flood's connections were refused, not an earlier module's
    p, d = stack.wait_idle()
    assert p["pool"]["free"] == p["pool"]["total"] and d["pool"]["free"] == d["pool"]["total"]


def test_clean_requests_all_succeed_while_32_peers_drip_one_byte_every_4s(stack, model_id):
    stop = threading.Event()
    with ThreadPoolExecutor(32) as pool:
        drips = [pool.submit(_drip, stack.bootstrap_port, stop, 4.0) for _ in range(32)]
        try:
            t_end = time.monotonic() + 9.0  # past the 5 s handshake deadline: every dripper has been cut
            codes: list[int] = []
            while time.monotonic() < t_end:
                codes += _clean_round(stack, model_id, 4)
        finally:
            closed = wait_for(lambda: all(f.done() for f in drips) or None, 15, "drippers closed by the deadline")
            stop.set()
    assert closed and codes and all(c == 200 for c in codes), codes
    cut = [f.result() for f in drips]
    assert all(t is not None and t < transfer.HANDSHAKE_DEADLINE_S + 4.5 for t in cut), cut
