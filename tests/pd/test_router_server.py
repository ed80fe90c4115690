"""The router's own HTTP/1.1 server (runtime/pdruntime/server/router/server.py), in a real ``pdrt serve --role router``
on loopback in front of two scripted workers (an asyncio server in this process speaking pdrt's ``/generate``): HTTP
behaviour uvicorn gave the router before (pipelining, HTTP/1.0, ``Connection: close``, ``Expect: 100-continue``,
malformed requests), a client that leaves a non-streamed request aborting both legs, and SIGTERM finishing the
requests in flight."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sys
import threading
import time

import httpx
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from pd_harness import base_env, free_port, spawn, wait_for, wait_healthy  # noqa: E402
from raw_http import read_request  # noqa: E402

pytestmark = pytest.mark.timeout(120)

BODY = {"model": "tiny", "prompt": "Say hi", "max_tokens": 1}


def _event(rid: str | None, tokens: int, finish: bool) -> bytes:
    ev = {"text": "H" * tokens, "delta": "H", "token_ids": [42], "meta_info": {
        "id": rid, "prompt_tokens": 2, "completion_tokens": tokens, "finish_reason": {"type": "length"} if finish else None}}
    return b"data: " + json.dumps(ev).encode() + b"\n\n"


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


class ScriptedWorker:
    """A pdrt worker's routes, answered at once; it keeps the /abort_request ids it got and counts calls the router
    hung up on. ``hold`` "before": /generate waits until ``release`` is set; "after_first" (decode): it streams a
    first token, then waits, then the second and last."""

    def __init__(self, role: str) -> None:
        self.role = role
        self.port = free_port()
        self.aborted: list[str] = []
        self.generates = 0
        self.hung_up = 0
        self.hold: str | None = None
        self.release: asyncio.Event | None = None

    def _answer(self, method: str, path: str, req: dict) -> bytes:
        if path == "/get_model_info":
            body = {"model_path": "tiny", "model_name": "tiny", "max_model_len": 512}
        elif path == "/abort_request":
            self.aborted.append(req.get("rid"))
            body = {}
        elif path == "/generate" and self.role == "decode":
            data = _event(req.get("rid"), 1, True) + b"data: [DONE]\n\n"
            return b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: %d\r\n\r\n%b" % (len(data), data)
        elif path == "/generate":
            body = {"text": "H", "token_ids": [42], "meta_info": {"id": req.get("rid")}}
        else:
            body = {}
        data = json.dumps(body).encode()
        return b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%b" % (len(data), data)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                method, path, headers, body = await read_request(reader)
                req = json.loads(body) if body else {}
                if path == "/generate":
                    self.generates += 1
                    if self.hold == "after_first" and self.role == "decode":
                        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: "
                                     b"chunked\r\n\r\n" + _chunk(_event(req.get("rid"), 1, False)))
                        await writer.drain()
                    if self.hold and not await self._released(reader):
                        self.hung_up += 1
                        return
                    if self.hold == "after_first" and self.role == "decode":
                        writer.write(_chunk(_event(req.get("rid"), 2, True)) + _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
                        await writer.drain()
                        continue
                writer.write(self._answer(method, path, req))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def _released(self, reader: asyncio.StreamReader) -> bool:
        """True once ``release`` is set; False if the router hangs up first."""
        waiting = asyncio.ensure_future(self.release.wait())
        gone = asyncio.ensure_future(reader.read(1))
        await asyncio.wait({waiting, gone}, return_when=asyncio.FIRST_COMPLETED)
        waiting.cancel()
        if gone.done() and gone.result() == b"":
            return False
        gone.cancel()
        return True

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        async def serve() -> None:
            self.release = asyncio.Event()
            await asyncio.start_server(self._handle, "127.0.0.1", self.port)

        asyncio.run_coroutine_threadsafe(serve(), loop).result(10)


@pytest.fixture(scope="module")
def workers():
    loop = asyncio.new_event_loop()
    th = threading.Thread(target=loop.run_forever, daemon=True)
    th.start()
    prefill, decode = ScriptedWorker("prefill"), ScriptedWorker("decode")
    prefill.start(loop)
    decode.start(loop)
    yield prefill, decode, loop
    loop.call_soon_threadsafe(loop.stop)


def _router(tmp_path, prefill: ScriptedWorker, decode: ScriptedWorker):
    port = free_port()
    p = spawn("router", ["--role", "router", "--port", str(port), "--prefill", f"http://127.0.0.1:{prefill.port}",
                         "--decode", f"http://127.0.0.1:{decode.port}", "--bootstrap-ports", "1"],
              base_env(), str(tmp_path), port)
    wait_healthy([p], timeout=60)
    return p


@pytest.fixture(scope="module")
def router(workers, tmp_path_factory):
    prefill, decode, _ = workers
    p = _router(tmp_path_factory.mktemp("router-server"), prefill, decode)
    yield p
    p.stop()


def _port(proc) -> int:
    return int(proc.url.rsplit(":", 1)[1])


def _read_answers(sock: socket.socket, count: int) -> list[tuple[int, bytes]]:
    """``count`` whole HTTP/1.1 answers read off ``sock`` in order: (status, body); chunked bodies are joined."""
    buf, out = b"", []
    while len(out) < count:
        while b"\r\n\r\n" not in buf:
            part = sock.recv(65536)
            assert part, f"the connection closed after {len(out)} answers"
            buf += part
        head, buf = buf.split(b"\r\n\r\n", 1)
        status = int(head.split(b" ", 2)[1])
        lower = head.lower()
        if b"transfer-encoding: chunked" in lower:
            body = b""
            while True:
                while b"\r\n" not in buf:
                    buf += sock.recv(65536)
                size_line, buf = buf.split(b"\r\n", 1)
                size = int(size_line, 16)
                while len(buf) < size + 2:
                    buf += sock.recv(65536)
                body, buf = body + buf[:size], buf[size + 2:]
                if size == 0:
                    break
        else:
            length = int(lower.split(b"content-length: ", 1)[1].split(b"\r\n", 1)[0])
            while len(buf) < length:
                buf += sock.recv(65536)
            body, buf = buf[:length], buf[length:]
        out.append((status, body))
    return out


def _post(path: str, body: bytes, extra: bytes = b"") -> bytes:
    return (b"POST %b HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%b\r\n%b"
            % (path.encode(), len(body), extra, body))


def test_pipelined_requests_are_answered_in_order_whichever_route_serves_them(router):
    """A completion (the router's own path), /metrics (the FastAPI app) and a bad body (the own path's 400), sent
    back to back on one connection, come back in that order."""
    with socket.create_connection(("127.0.0.1", _port(router)), timeout=30) as s:
        s.sendall(_post("/v1/completions", json.dumps(BODY).encode()) + b"GET /metrics HTTP/1.1\r\nHost: r\r\n\r\n"
                  + _post("/v1/completions", b"{not json"))
        (st1, b1), (st2, b2), (st3, b3) = _read_answers(s, 3)
    assert st1 == 200 and json.loads(b1)["choices"][0]["text"] == "H"
    assert st2 == 200 and b"pdrt_requests_total" in b2
    assert st3 == 400 and "not valid JSON" in json.loads(b3)["error"]["message"]


def test_http_1_0_and_connection_close_are_answered_then_closed(router):
    for request in (b"GET /metrics HTTP/1.0\r\n\r\n", b"GET /metrics HTTP/1.1\r\nHost: r\r\nConnection: close\r\n\r\n",
                    _post("/v1/completions", json.dumps(BODY).encode(), b"Connection: close\r\n")):
        with socket.create_connection(("127.0.0.1", _port(router)), timeout=30) as s:
            s.sendall(request)
            data = b""
            while part := s.recv(65536):  # ends: the router closes the connection after its answer
                data += part
        assert data.startswith(b"HTTP/1.1 200 "), data[:200]


def test_expect_100_continue_is_answered_before_the_body_is_sent(router):
    body = json.dumps(BODY).encode()
    with socket.create_connection(("127.0.0.1", _port(router)), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
                  b"Expect: 100-continue\r\n\r\n" % len(body))
        assert s.recv(65536).startswith(b"HTTP/1.1 100 Continue\r\n")
        s.sendall(body)
        [(status, answer)] = _read_answers(s, 1)
    assert status == 200 and json.loads(answer)["object"] == "text_completion"


@pytest.mark.parametrize("raw, says", [
    (b"GET / HTTP/1.1\r\nHost: r\r\nBad Header\r\n\r\n", "malformed HTTP request"),
    (b"GET /metrics HTTP/1.1\r\nHost: r\r\nConnection: Upgrade\r\nUpgrade: h2c\r\n\r\n", "Upgrade"),
])
def test_a_request_the_server_cannot_serve_is_a_400_that_says_what_is_accepted(router, raw, says):
    with socket.create_connection(("127.0.0.1", _port(router)), timeout=30) as s:
        s.sendall(raw)
        data = b""
        while part := s.recv(65536):
            data += part
    head, body = data.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 400 ") and b"connection: close" in head.lower()
    err = json.loads(body)["error"]
    assert says in err["message"] and "accepted:" in err["message"]


def test_a_streamed_completion_is_chunked_sse_ending_in_done(router):
    with httpx.stream("POST", router.url + "/v1/chat/completions", timeout=30,
                      json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                            "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and json.loads(lines[0][6:])["choices"][0]["delta"]["content"] == "H"


def _metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


@pytest.mark.parametrize("hold", ["before", "after_first"])
def test_a_client_that_leaves_a_non_streamed_request_aborts_both_legs(router, workers, hold):
    """Before its first token (as before) and after it: until the router's own server, a non-streamed request whose
    client left after the first token ran on to its end. Now the handler is cancelled with the connection and both
    legs are aborted: decode sees its call hung up, and each worker an /abort_request with the request's id."""
    prefill, decode, loop = workers
    left_before = _metric(router.url, "pdrt_router_client_disconnects_total")
    loop.call_soon_threadsafe(decode.release.clear)
    decode.hold = hold
    try:
        seen = decode.generates
        with socket.create_connection(("127.0.0.1", _port(router)), timeout=30) as s:
            s.sendall(_post("/v1/completions", json.dumps(BODY).encode()))
            wait_for(lambda: decode.generates > seen, 30, "decode's /generate")
        wait_for(lambda: decode.hung_up >= 1 and decode.aborted and prefill.aborted, 30, "both legs aborted")
        assert decode.aborted[-1] == prefill.aborted[-1]
        assert _metric(router.url, "pdrt_router_client_disconnects_total") == left_before + 1
    finally:
        decode.hold = None
        loop.call_soon_threadsafe(decode.release.set)


def test_sigterm_finishes_the_requests_in_flight_then_exits(workers, tmp_path):
    prefill, decode, loop = workers
    p = _router(tmp_path, prefill, decode)
    decode.hold = "before"
    loop.call_soon_threadsafe(decode.release.clear)
    result: dict = {}
    seen = decode.generates
    t = threading.Thread(target=lambda: result.update(r=httpx.post(p.url + "/v1/completions", json=BODY, timeout=60)))
    try:
        t.start()
        wait_for(lambda: decode.generates > seen, 30, "decode's /generate")
        p.popen.send_signal(signal.SIGTERM)
        time.sleep(0.5)  # the router has the signal; the request is still held by decode
        assert p.popen.poll() is None, "the router exited with a request in flight"
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", _port(p)), timeout=5).close()  # no new connections
        loop.call_soon_threadsafe(decode.release.set)
        t.join(30)
        assert result["r"].status_code == 200 and result["r"].json()["choices"][0]["text"] == "H"
        assert p.popen.wait(30) == 0
    finally:
        decode.hold = None
        loop.call_soon_threadsafe(decode.release.set)
        p.stop()


def test_a_request_through_the_router_leaves_no_reference_cycle(workers):
    """Everything the router allocates for a request is freed by reference counting as the request ends, streamed
    or not. Objects left in reference cycles wait for the cyclic collector instead, whose passes cost a loaded
    router a few percent of its CPU (an h1 answer that held its call, whose future held the answer, once left 19
    such objects per request). The router runs in this process here, so that the collector's finds can be named."""
    import collections
    import gc

    from pdruntime.env import RuntimeEnv
    from pdruntime.server.connections import ConnectionLimits
    from pdruntime.server.router import server as router_server
    from pdruntime.server.router.app import Router
    from pdruntime.server.router.topology import topology_from_flags
    from pdruntime.util import h1

    prefill, decode, _ = workers
    requests = 200

    async def main() -> list:
        router = Router(RuntimeEnv.from_environ({}), topology=topology_from_flags(
            [f"http://127.0.0.1:{prefill.port}"], [f"http://127.0.0.1:{decode.port}"], [1]))
        proto = router_server.protocol_class(router, router.build_app(), ConnectionLimits(), set(), lambda why: None,
                                             lambda n: None)
        await router.start()
        server = await asyncio.get_running_loop().create_server(proto, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1/completions"
        client = h1.Client()

        async def one(i: int) -> None:
            r = await client.post(url, json={**BODY, "stream": i % 2 == 1})
            assert r.status_code == 200, r.content

        async def rounds(n: int) -> None:
            for k in range(n // 4):
                await asyncio.gather(*(one(4 * k + j) for j in range(4)))

        try:
            await rounds(40)  # warm: pools, caches, metric children
            gc.collect()
            gc.disable()
            try:
                await rounds(requests)
                gc.set_debug(gc.DEBUG_SAVEALL)
                gc.collect()
                return [o for o in gc.garbage if type(o).__module__.startswith("pdruntime")]
            finally:
                gc.set_debug(0)
                gc.garbage.clear()
                gc.enable()
        finally:
            await client.aclose()
            server.close()
            await router.stop()

    left = asyncio.run(main())
    assert len(left) < requests // 20, collections.Counter(type(o).__qualname__ for o in left).most_common(8)
