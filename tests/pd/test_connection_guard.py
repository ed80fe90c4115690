"""Connection hygiene (issue 20, build item 5): header deadline and caps per client and per server.

The table's decisions are pure (table-tested); the protocol runs in a real ``pdrt serve`` router on loopback:
2,000 idle connections and 200 slow-header connections are closed within their timeouts while a clean
client gets every answer, and file descriptors return to their baseline."""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from types import SimpleNamespace

import httpx
import pytest

from pdruntime.server.connections import ConnectionLimits, ConnectionTable, refused_response

sys.path.insert(0, os.path.dirname(__file__))
from pd_harness import base_env, free_port, spawn, wait_for, wait_healthy  # noqa: E402


def _c(addr: str, busy: bool = False):
    return SimpleNamespace(client_addr=addr, busy=busy)


def test_a_full_client_slot_evicts_that_clients_oldest_idle_connection():
    t = ConnectionTable(ConnectionLimits(max_connections=100, max_per_client=3))
    a = [_c("1.1.1.1", busy=True), _c("1.1.1.1"), _c("1.1.1.1")]
    for c in a:
        assert t.admit(c) == (True, [])
    ok, evict = t.admit(_c("1.1.1.1"))
    assert ok and evict == [(a[1], "client_cap")] and t.count == 3


def test_a_client_whose_connections_all_carry_requests_is_refused_not_cut():
    t = ConnectionTable(ConnectionLimits(max_connections=100, max_per_client=2))
    t.admit(_c("x", busy=True))
    t.admit(_c("x", busy=True))
    assert t.admit(_c("x")) == (False, [])


def test_a_full_server_evicts_the_largest_holders_oldest_idle_connection():
    t = ConnectionTable(ConnectionLimits(max_connections=4, max_per_client=4))
    flood = [_c("attacker") for _ in range(3)]
    for c in flood:
        t.admit(c)
    t.admit(_c("client"))
    ok, evict = t.admit(_c("client"))
    assert ok and evict == [(flood[0], "server_cap")]
    assert len(t.by_client["attacker"]) == 2 and len(t.by_client["client"]) == 2


def test_limits_reject_what_they_cannot_keep():
    with pytest.raises(ValueError, match="accepted: 1 <= max_per_client <= max_connections"):
        ConnectionLimits(max_connections=2, max_per_client=3)
    with pytest.raises(ValueError, match="accepted: seconds > 0"):
        ConnectionLimits(header_timeout_s=0)


def test_the_refusal_is_a_503_with_retry_after_in_the_openai_shape():
    raw = refused_response(2).decode()
    head, body = raw.split("\r\n\r\n")
    assert head.startswith("HTTP/1.1 503") and "retry-after: 2" in head and '"code": "too_many_connections"' in body


# ---- a real router process -----------------------------------------------------------------------------

def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@pytest.fixture(scope="module")
def guarded_router(tmp_path_factory):
    """A router (no pairs needed: /metrics and /v1/models answer) with a 2 s header deadline."""
    d = str(tmp_path_factory.mktemp("conn-guard"))
    port = free_port()
    p = spawn("router", ["--role", "router", "--port", str(port), "--prefill", "http://127.0.0.1:9",
                         "--decode", "http://127.0.0.1:9", "--bootstrap-ports", "9", "--header-timeout-s", "2",
                         "--max-connections-per-client", "256", "--max-connections", "4096"], base_env(), d, port)
    try:
        wait_healthy([p], path="/metrics")
        yield p
    finally:
        p.stop()


def _closed_by_server(s: socket.socket) -> bool:
    try:
        return s.recv(1) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def test_2000_idle_connections_are_closed_and_a_clean_client_gets_every_answer(guarded_router):
    pid = guarded_router.popen.pid
    base = _fds(pid)
    socks = []
    for _ in range(2000):
        s = socket.create_connection(("127.0.0.1", int(guarded_router.url.rsplit(":", 1)[1])))
        s.setblocking(False)
        socks.append(s)
    try:
        with httpx.Client(timeout=10) as clean:  # evicts idle ones as it connects: it is the newest
            codes = [clean.get(guarded_router.url + "/metrics").status_code for _ in range(20)]
        assert codes == [200] * 20
        wait_for(lambda: all(_closed_by_server(s) for s in socks), 15, "every idle connection closed")
    finally:
        for s in socks:
            s.close()
    wait_for(lambda: _fds(pid) <= base + 2, 15, f"fds back to the baseline {base}")
    text = httpx.get(guarded_router.url + "/metrics", timeout=10).text
    assert 'pdrt_http_connections_closed_total{reason="header_timeout"}' in text
    assert 'pdrt_http_connections_closed_total{reason="client_cap"}' in text


def test_200_slow_header_connections_are_closed_at_the_header_deadline(guarded_router):
    port = int(guarded_router.url.rsplit(":", 1)[1])
    stop = threading.Event()
    closed_after: list[float] = []

    def slow() -> None:
        s = socket.create_connection(("127.0.0.1", port))
        t0 = time.monotonic()
        try:
            for ch in b"GET /metrics HTTP/1.1\r\nHost: x\r\n":
                if stop.wait(1.0):
                    return
                s.send(bytes([ch]))
        except OSError:
            closed_after.append(time.monotonic() - t0)
        finally:
            s.close()

    threads = [threading.Thread(target=slow, daemon=True) for _ in range(200)]
    for t in threads:
        t.start()
    try:
        with httpx.Client(timeout=10) as clean:
            t_end = time.monotonic() + 6
            while time.monotonic() < t_end:
                assert clean.get(guarded_router.url + "/v1/models").status_code == 200
                time.sleep(0.2)
        wait_for(lambda: len(closed_after) == 200, 20, "every slow-header connection closed")
    finally:
        stop.set()
    assert max(closed_after) < 2 + 4, max(closed_after)  # the deadline (2 s) + a send's worth of slack
