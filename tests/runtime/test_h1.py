"""pdruntime.util.h1, the router's HTTP/1.1 client for its workers, against real servers on loopback: a raw asyncio
server whose behaviour each test sets (keep-alive, chunked, close-delimited, a peer that closes idle connections,
one that stalls, one that dies mid-body), and uvicorn serving a Starlette app as the workers do."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest

from pdruntime.util import h1
from pdruntime.util.ports import free_port
from pdruntime.util.sse import DONE, aiter_sse
from raw_http import read_request


CLOSE = object()  # in a reply list: close the connection there


class RawServer:
    """An HTTP/1.1 server on 127.0.0.1 whose answers ``reply(method, path, headers, body)`` -> bytes (or None:
    close without answering) builds; it counts connections and keeps the requests it read."""

    def __init__(self, reply) -> None:
        self.reply = reply
        self.connections = 0
        self.requests: list[tuple[str, str, dict, bytes]] = []
        self.open_now = 0

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.open_now += 1
        try:
            while True:
                method, path, headers, body = await read_request(reader)
                self.requests.append((method, path, headers, body))
                out = self.reply(method, path, headers, body)
                if asyncio.iscoroutine(out):
                    out = await out
                if out is None:
                    break
                hung_up = False
                for piece in out if isinstance(out, list) else [out]:
                    if piece is CLOSE:
                        hung_up = True
                        break
                    if isinstance(piece, (int, float)):  # a pause, cut short if the client hangs up meanwhile
                        try:
                            if await asyncio.wait_for(reader.read(1), piece) == b"":
                                hung_up = True
                                break
                        except asyncio.TimeoutError:
                            pass
                        continue
                    writer.write(piece)
                    await writer.drain()
                if hung_up or b"connection: close" in (out[0] if isinstance(out, list) else out).lower():
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.open_now -= 1
            writer.close()

    async def __aenter__(self) -> "RawServer":
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc) -> None:
        self.server.close()


def ok(body: bytes, ctype: str = "application/json", extra: str = "") -> bytes:
    return f"HTTP/1.1 200 OK\r\ncontent-type: {ctype}\r\ncontent-length: {len(body)}\r\n{extra}\r\n".encode() + body


def chunked(*parts: bytes) -> list:
    out = [b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"]
    for p in parts:
        out.append(p if isinstance(p, (int, float)) else b"%x\r\n%s\r\n" % (len(p), p))
    return out + [b"0\r\n\r\n"]


async def test_a_post_sends_json_and_headers_and_the_connection_is_kept_alive():
    async with RawServer(lambda m, p, h, b: ok(json.dumps({"got": json.loads(b), "h": h.get("x-client-id")})
                                               .encode())) as srv:
        client = h1.Client()
        for i in range(5):
            r = await client.post(srv.url + "/generate", json={"i": i}, headers={"x-client-id": "c1"})
            assert r.status_code == 200 and r.json() == {"got": {"i": i}, "h": "c1"}
            assert r.headers.get("Content-Type") == "application/json"
        await client.aclose()
    assert srv.connections == 1, "five sequential calls should share one kept-alive connection"
    method, path, headers, body = srv.requests[0]
    assert (method, path, headers["content-type"], headers["host"]) == \
        ("POST", "/generate", "application/json", srv.url.removeprefix("http://"))


async def test_a_chunked_sse_stream_read_to_done_returns_its_connection_to_the_pool():
    events = [b'data: {"text":"H"}\n\n', b'data: {"text":"Hi"}\n\n', b"data: [DONE]\n\n"]
    async with RawServer(lambda m, p, h, b: chunked(*events) if p == "/stream" else ok(b"{}")) as srv:
        client = h1.Client()
        for _ in range(3):
            resp = await client.send(client.build_request("POST", srv.url + "/stream", json={}), stream=True)
            got = []
            async for ev in aiter_sse(resp.aiter_lines()):
                got.append(ev)
                if ev == DONE:
                    break  # as the router's legs do: the last chunk is still unread
            await resp.aclose()
            assert got == [{"text": "H"}, {"text": "Hi"}, DONE]
        assert (await client.get(srv.url + "/health")).status_code == 200
        await client.aclose()
    assert srv.connections == 1


async def test_an_abandoned_live_stream_closes_its_connection_and_the_server_sees_it():
    async with RawServer(lambda m, p, h, b: chunked(b"data: 1\n\n", 30, b"data: 2\n\n")) as srv:
        client = h1.Client()
        resp = await client.send(client.build_request("POST", srv.url + "/s", json={}), stream=True)
        lines = resp.aiter_lines()
        assert await lines.__anext__() == "data: 1"
        t0 = time.monotonic()
        await resp.aclose()
        assert time.monotonic() - t0 < 1.0  # DRAIN_S, not the stream's 30 s
        for _ in range(100):
            if srv.open_now == 0:
                break
            await asyncio.sleep(0.02)
        assert srv.open_now == 0, "the worker must see the router hang up (it aborts the request)"
        await client.aclose()


async def test_release_leaves_a_finishing_stream_to_return_its_connection_and_cuts_a_stalled_one():
    """``release`` does not wait: a stream whose last chunk comes 5 ms later goes back to the pool as it ends; one
    that stalls past DRAIN_S has its connection closed (the worker sees the router hang up)."""
    async with RawServer(lambda m, p, h, b: chunked(b"data: 1\n\n", 0.005, b"data: [DONE]\n\n") if p == "/soon"
                         else chunked(b"data: 1\n\n", 30, b"data: 2\n\n")) as srv:
        client = h1.Client()
        resp = await client.send(client.build_request("POST", srv.url + "/soon", json={}), stream=True)
        assert await resp.read_some() == b"data: 1\n\n"
        resp.release()  # returns at once
        for _ in range(100):
            if sum(len(q) for q in client._idle.values()) == 1:
                break
            await asyncio.sleep(0.01)
        assert sum(len(q) for q in client._idle.values()) == 1, "the finished stream's connection is pooled"
        resp = await client.send(client.build_request("POST", srv.url + "/stall", json={}), stream=True)
        assert srv.connections == 1  # the pooled one served it
        assert await resp.read_some() == b"data: 1\n\n"
        resp.release()
        for _ in range(100):
            if srv.open_now == 0:
                break
            await asyncio.sleep(0.02)
        assert srv.open_now == 0 and not client._idle.get(("127.0.0.1", int(srv.url.rsplit(":", 1)[1])))
        await client.aclose()


async def test_a_kept_alive_connection_the_peer_closed_is_retried_on_a_new_one():
    served = []

    def reply(m, p, h, b):
        served.append(p)
        if p == "/a":
            return ok(b'{"n": 1}', extra="connection: close\r\n")  # closes after answering: not pooled
        if p == "/c" and served.count("/c") == 1:
            return None  # closes a kept-alive connection as the next request arrives (an idle-timeout race)
        return ok(b'{"n": %d}' % len(served))

    async with RawServer(reply) as srv:
        client = h1.Client()
        assert (await client.get(srv.url + "/a")).json() == {"n": 1}
        assert (await client.get(srv.url + "/b")).json() == {"n": 2}
        assert (await client.post(srv.url + "/c", json={})).json() == {"n": 4}  # answered on a new connection
        assert (await client.get(srv.url + "/d")).json() == {"n": 5}
        await client.aclose()
    assert served == ["/a", "/b", "/c", "/c", "/d"] and srv.connections == 3
    # a new connection that closes without an answer is an error, not retried
    async with RawServer(lambda m, p, h, b: None) as srv:
        client = h1.Client()
        with pytest.raises(httpx.RemoteProtocolError, match="without an answer"):
            await client.get(srv.url + "/x")
        await client.aclose()
    assert srv.requests and len(srv.requests) == 1


async def test_content_length_and_close_delimited_bodies():
    def reply(m, p, h, b):
        if p == "/close":
            return [b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\nconnection: close\r\n\r\nall of it"]
        return ok(b"x" * 200_000, "text/plain")

    async with RawServer(reply) as srv:
        client = h1.Client()
        assert (await client.get(srv.url + "/big")).content == b"x" * 200_000
        r = await client.get(srv.url + "/close")
        assert r.text == "all of it"
        assert (await client.get(srv.url + "/big")).status_code == 200
        await client.aclose()
    assert srv.connections == 2  # the close-delimited answer's connection is not reused


async def test_errors_are_httpx_errors_that_name_the_cause():
    client = h1.Client()
    with pytest.raises(httpx.ConnectError, match=r"127\.0\.0\.1:\d+"):
        await client.get(f"http://127.0.0.1:{free_port()}/health")

    async def stall(m, p, h, b):
        await asyncio.sleep(5)
        return ok(b"{}")

    async with RawServer(stall) as srv:
        t0 = time.monotonic()
        with pytest.raises(httpx.ReadTimeout, match="within 0.3s"):
            await client.get(srv.url + "/slow", timeout=httpx.Timeout(0.3, connect=5))
        assert time.monotonic() - t0 < 3

    async with RawServer(lambda m, p, h, b: [b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly this", CLOSE]
                         if p == "/cut" else None) as srv:
        with pytest.raises(httpx.RemoteProtocolError, match="mid-body"):
            await client.get(srv.url + "/cut")
        with pytest.raises(httpx.RemoteProtocolError, match="without an answer"):
            await client.get(srv.url + "/none")
    async with RawServer(lambda m, p, h, b: b"SSH-2.0-OpenSSH\r\n\r\n") as srv:
        with pytest.raises(httpx.RemoteProtocolError, match="not an HTTP/1.x answer"):
            await client.get(srv.url + "/")
    with pytest.raises(httpx.UnsupportedProtocol, match="only http://"):
        await client.get("https://example.com/")
    await client.aclose()


def test_against_uvicorn_as_the_workers_serve():
    """Keep-alive, a streamed answer and a 429 with Retry-After from uvicorn + Starlette."""
    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    async def gen(request):
        body = await request.json()

        async def events():
            for i in range(body["n"]):
                yield f"data: {json.dumps({'i': i})}\n\n"
            yield "data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")

    async def busy(request):
        return JSONResponse({"error": {"message": "busy"}}, status_code=429, headers={"Retry-After": "2"})

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(Starlette(routes=[Route("/gen", gen, methods=["POST"]),
                                                             Route("/busy", busy, methods=["POST"])]),
                                           host="127.0.0.1", port=port, log_level="warning", loop="asyncio"))
    th = threading.Thread(target=server.run, daemon=True)
    th.start()
    try:
        for _ in range(100):
            if server.started:
                break
            time.sleep(0.05)

        async def run():
            client = h1.Client()
            url = f"http://127.0.0.1:{port}"
            for n in (1, 3, 50):
                resp = await client.send(client.build_request("POST", url + "/gen", json={"n": n}), stream=True)
                got = [ev async for ev in aiter_sse(resp.aiter_lines())]
                await resp.aclose()
                assert got == [{"i": i} for i in range(n)] + [DONE]
            r = await client.post(url + "/busy", json={})
            assert r.status_code == 429 and r.headers.get("retry-after") == "2" and r.json()["error"]["message"] == "busy"
            reused = sum(len(q) for q in client._idle.values())
            await client.aclose()
            return reused

        assert asyncio.run(run()) == 1  # one connection served all four calls
    finally:
        server.should_exit = True
        th.join(10)


def test_a_request_head_carries_every_header_and_a_non_text_value_too():
    """The head is joined in C for str values (the router's legs) and written value by value otherwise."""
    req = h1.Request("POST", "http://127.0.0.1:9/generate?x=1", b"{}", {"x-client-id": "c1", "x-n": 3}, None)
    assert req.encode() == (b"POST /generate?x=1 HTTP/1.1\r\nHost: 127.0.0.1:9\r\nContent-Length: 2\r\n"
                            b"x-client-id: c1\r\nx-n: 3\r\n\r\n{}")
    assert h1.Request("GET", "http://h:8/health", b"", None, None).encode() == \
        b"GET /health HTTP/1.1\r\nHost: h:8\r\n\r\n"


async def test_requests_started_in_one_loop_pass_go_out_together_after_it_and_one_cancelled_in_it_is_never_sent():
    """The client writes what one pass of the loop started at its end (a worker woken by the first finds the others):
    a call cancelled within that pass never reaches the worker, and the rest are answered on their kept-alive
    connections."""
    async with RawServer(lambda m, p, h, b: ok(b)) as srv:
        client = h1.Client()
        await asyncio.gather(*(client.post(srv.url + "/x", json={"warm": i}) for i in range(3)))  # three pooled
        before = len(srv.requests)
        calls = [client.start(client.build_request("POST", srv.url + "/x", json={"j": j})) for j in range(3)]
        calls[1].cancel()  # in the same pass: not written yet
        answers = await asyncio.gather(calls[0].fut, calls[2].fut)
        assert [r.json() for r in answers] == [{"j": 0}, {"j": 2}]
        deadline = time.monotonic() + 10  # the server has read the cancelled call's connection to its end:
        while srv.open_now > 2 and time.monotonic() < deadline:  # whatever was written on it has arrived
            await asyncio.sleep(0.01)
        assert srv.open_now == 2
        assert sorted(json.loads(b)["j"] for *_, b in srv.requests[before:]) == [0, 2]
        await client.aclose()
    assert srv.connections == 3


async def test_a_connect_and_read_timeout_pair_bounds_the_wait_for_an_answer():
    """``timeout=(connect, read)``, as the router's legs pass it: the read bound cuts a peer that never answers;
    ``(connect, None)``: no read bound of its own (decode's stream)."""
    async with RawServer(lambda m, p, h, b: [30.0, ok(b"{}")]) as srv:
        client = h1.Client()
        with pytest.raises(httpx.ReadTimeout):
            await client.send(client.build_request("POST", srv.url + "/generate", json={}, timeout=(5.0, 0.3)))
        call = client.start(client.build_request("POST", srv.url + "/generate", json={}, timeout=(5.0, None)))
        assert (call.connect_s, call.read_s, call.timer) == (5.0, None, None)
        call.cancel()
        await client.aclose()


async def test_an_answer_whose_head_never_ends_is_cut_at_the_head_limit():
    """A worker that keeps sending header lines (in one read or many) fails the call once its head passes
    HEAD_LIMIT, and the connection is not reused; a large body after a small head is read whole."""
    line = b"x-pad: " + b"a" * 1000 + b"\r\n"
    endless = [b"HTTP/1.1 200 OK\r\n"] + [line * 8, 0.005] * 12  # ~96 KiB of head in 12 reads, never ended
    big = b"x" * (3 * h1.HEAD_LIMIT)
    async with RawServer(lambda m, p, h, b: endless if p == "/endless" else ok(big)) as srv:
        client = h1.Client()
        with pytest.raises(httpx.RemoteProtocolError, match=f"head exceeds {h1.HEAD_LIMIT} bytes"):
            await client.post(srv.url + "/endless", json={}, timeout=(5.0, 10.0))
        r = await client.post(srv.url + "/big", json={})
        assert r.status_code == 200 and r.content == big
        await client.aclose()
    assert srv.connections == 2
