"""Integration: request bodies are limited while they stream in (issue 13, defect 6), real router process.

Run against the unfixed code (main at 1c0b2fc's runtime on PYTHONPATH): every test failed there — the
400 MiB bodies (chunked, and declared by Content-Length) got no answer within 30 s while the router kept
reading them into memory, and none of the 50 dripping bodies was cut. Measured after the fix: the refusal
came after 12 MiB had been offered (8 MiB limit plus socket buffers), router RSS +9 MiB from 56 MiB.
"""

from __future__ import annotations

import select
import socket
import time

import httpx
import pytest

from pd_harness import base_env, free_port, spawn, wait_healthy

pytestmark = pytest.mark.timeout(180)

BODY_TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def router(tmp_path_factory):
    """A router alone (its pair's workers are not running: bodies are refused before any dispatch)."""
    port = free_port()
    dead = f"http://127.0.0.1:{free_port()}"
    p = spawn("router", ["--role", "router", "--port", str(port), "--prefill", dead, "--decode", dead,
                         "--bootstrap-ports", "1", "--body-timeout-s", str(BODY_TIMEOUT_S)],
              base_env(), str(tmp_path_factory.mktemp("router")), port)
    wait_healthy([p], timeout=60, path="/metrics")  # no pair is up: /health is 503 by design
    yield p
    p.stop()


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _status(resp: bytes) -> int:
    return int(resp.split(b" ", 2)[1])


def test_a_400_mb_chunked_body_is_refused_early_with_bounded_memory(router):
    port = int(router.url.rsplit(":", 1)[1])
    rss0 = rss_mib(router.popen.pid)
    chunk = b"a" * (1 << 20)
    frame = b"%x\r\n" % len(chunk) + chunk + b"\r\n"
    sent, peak = 0, rss0
    resp = b""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")
        try:
            for _ in range(400):  # 400 MiB offered
                if select.select([sock], [], [], 0)[0]:
                    break  # the router answered: stop sending
                sock.sendall(frame)
                sent += len(chunk)
                peak = max(peak, rss_mib(router.popen.pid))
        except (BrokenPipeError, ConnectionResetError):
            pass  # the router closed the connection on us: refused
        sock.settimeout(30)
        try:
            while b"\r\n\r\n" not in resp:
                part = sock.recv(65536)
                if not part:
                    break
                resp += part
        except ConnectionResetError:
            pass
    peak = max(peak, rss_mib(router.popen.pid))
    assert resp, f"no answer after {sent >> 20} MiB sent"
    assert _status(resp) == 413, resp[:300]
    assert sent < 100 << 20, f"{sent >> 20} MiB were accepted before the refusal"
    assert peak - rss0 < 64, f"router RSS grew {peak - rss0:.0f} MiB (from {rss0:.0f} MiB) for a refused body"
    assert httpx.get(router.url + "/metrics", timeout=10).status_code == 200  # still serving


def test_a_declared_oversized_body_is_refused_before_it_is_read(router):
    port = int(router.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 419430400\r\n\r\n")
        resp = b""
        while part := sock.recv(65536):  # the router closes the connection after its answer
            resp += part
    assert _status(resp) == 413 and b"accepted: up to" in resp


def test_bodies_dripping_one_byte_a_second_are_cut_after_the_body_timeout(router):
    """50 slow-drip connections at once (a slowloris): each gets 408 within the body timeout plus a margin,
    and a normal request is served meanwhile."""
    port = int(router.url.rsplit(":", 1)[1])
    socks = []
    for _ in range(50):
        s = socket.create_connection(("127.0.0.1", port), timeout=30)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000\r\n\r\n{")
        socks.append(s)
    t0 = time.monotonic()
    answers: dict[int, bytes] = {}
    assert httpx.get(router.url + "/metrics", timeout=10).status_code == 200
    deadline = t0 + BODY_TIMEOUT_S + 30  # generous: a loaded 2-core machine
    while len(answers) < len(socks) and time.monotonic() < deadline:
        for i, s in enumerate(socks):
            if i in answers:
                continue
            r, _, _ = select.select([s], [], [], 0)
            if r:
                answers[i] = s.recv(65536)
            else:
                try:
                    s.sendall(b" ")  # one more byte
                except OSError:
                    answers[i] = b"HTTP/1.1 000 closed"
        time.sleep(1.0)
    for s in socks:
        s.close()
    assert len(answers) == len(socks), f"{len(socks) - len(answers)} dripping bodies were never cut"
    assert all(_status(a) == 408 for a in answers.values()), {a[:40] for a in answers.values()}
    text = httpx.get(router.url + "/metrics", timeout=10).text
    assert 'pdrt_requests_total{client="anonymous",outcome="client_error",role="router"}' in text
