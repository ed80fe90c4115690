"""A recording reverse proxy on loopback, in front of one worker: every request is forwarded as it came (streamed
answers stream through), and each POST's path, JSON body and (when not streamed) JSON answer is recorded. Tests put
one in front of each worker and point a router at the proxies, to see exactly what that router sends each leg.

It runs uvicorn (asyncio loop) in a thread of the test process; :meth:`RecordingProxy.stop` shuts it down.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from pdruntime.util.ports import free_port

HOP_HEADERS = {"host", "content-length", "transfer-encoding", "connection", "keep-alive"}


@dataclass
class Recorded:
    method: str
    path: str
    headers: dict
    body: Any  # the JSON body (None: none or not JSON)
    status: int | None = None
    answer: Any = None  # the JSON answer of a non-streamed POST


@dataclass
class RecordingProxy:
    target: str  # the worker's URL
    port: int = field(default_factory=free_port)
    records: list[Recorded] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def posts(self, *paths: str) -> list[Recorded]:
        """The recorded POSTs (to ``paths`` when given), in arrival order."""
        return [r for r in self.records if r.method == "POST" and (not paths or r.path in paths)]

    def clear(self) -> None:
        self.records.clear()

    async def _forward(self, request: Request) -> Response:
        raw = await request.body()
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = None
        rec = Recorded(request.method, request.url.path, dict(request.headers), body)
        if request.method == "POST":
            self.records.append(rec)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        upstream = self._client.build_request(request.method, self.target + request.url.path,
                                              params=request.url.query or None, content=raw, headers=headers)
        resp = await self._client.send(upstream, stream=True)
        rec.status = resp.status_code
        out_headers = {k: v for k, v in resp.headers.items() if k.lower() not in HOP_HEADERS}
        if resp.headers.get("content-type", "").startswith("text/event-stream"):
            async def relay():
                try:
                    async for chunk in resp.aiter_raw():
                        yield chunk
                finally:
                    await resp.aclose()
            return StreamingResponse(relay(), status_code=resp.status_code, headers=out_headers)
        data = await resp.aread()
        await resp.aclose()
        try:
            rec.answer = json.loads(data) if data else None
        except ValueError:
            rec.answer = None
        return Response(data, status_code=resp.status_code, headers=out_headers)

    def start(self) -> "RecordingProxy":
        async def handler(request: Request) -> Response:
            return await self._forward(request)

        @contextlib.asynccontextmanager
        async def lifespan(app):
            self._client = httpx.AsyncClient(timeout=httpx.Timeout(120.0), trust_env=False)
            try:
                yield
            finally:
                await self._client.aclose()

        app = Starlette(routes=[Route("/{path:path}", handler, methods=["GET", "POST"])], lifespan=lifespan)

        self._server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                     loop="asyncio", access_log=False))
        self._thread = threading.Thread(target=lambda: asyncio.run(self._server.serve()), daemon=True,
                                        name=f"proxy-{self.port}")
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            assert time.monotonic() < deadline, "recording proxy did not start"
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(10)


@contextlib.contextmanager
def proxied(stack: Any) -> Iterator[tuple[RecordingProxy, RecordingProxy]]:
    """A recording proxy in front of each worker of ``stack`` (prefill's, decode's)."""
    p, d = RecordingProxy(stack.prefill.url).start(), RecordingProxy(stack.decode.url).start()
    try:
        yield p, d
    finally:
        p.stop()
        d.stop()
