"""GuardedStream (runtime/pdruntime/server/edge.py) on an ASGI 2.3 server, as uvicorn declares itself: a client that
leaves ends the stream and its ``on_close(False)``, a finished stream gets ``on_close(True)``, a cancellation from the
server itself goes on, and no task is left behind (the disconnect watcher is one plain task, not a task group)."""

from __future__ import annotations

import asyncio

import pytest

from pdruntime.server.edge import GuardedStream

SCOPE = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "method": "POST", "path": "/generate",
         "headers": []}


class Client:
    """ASGI receive and send of one request: ``leave`` makes receive() answer http.disconnect."""

    def __init__(self) -> None:
        self.sent: list[dict] = []
        self.leave = asyncio.Event()

    async def receive(self) -> dict:
        await self.leave.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict) -> None:
        self.sent.append(message)


def stream(closed: list, step: asyncio.Event | None = None):
    async def body():
        yield b"data: {}\n\n"
        if step is not None:
            await step.wait()  # a decode still generating
        yield b"data: [DONE]\n\n"

    async def on_close(completed: bool) -> None:
        closed.append(completed)

    return GuardedStream(body(), on_close)


async def _others() -> set:
    return {t for t in asyncio.all_tasks() if t is not asyncio.current_task()}


async def test_a_finished_stream_closes_completed_and_leaves_no_task():
    closed, client = [], Client()
    await stream(closed)(SCOPE, client.receive, client.send)
    assert closed == [True]
    assert client.sent[-1] == {"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False}
    await asyncio.sleep(0)
    assert await _others() == set()  # the watcher went with the stream


async def test_a_client_that_leaves_mid_stream_ends_it_and_closes_it_not_completed():
    closed, client, step = [], Client(), asyncio.Event()
    call = asyncio.ensure_future(stream(closed, step)(SCOPE, client.receive, client.send))
    await asyncio.sleep(0.05)
    client.leave.set()
    done, _ = await asyncio.wait({call}, timeout=5)  # not wait_for: its own cancel at the timeout would end it too
    assert call in done and call.exception() is None  # it returned (as Starlette's does), not cancelled
    assert closed == [False]
    assert not any(m.get("body") == b"data: [DONE]\n\n" for m in client.sent)
    assert await _others() == set()


async def test_a_cancellation_from_the_server_itself_goes_on():
    closed, client, step = [], Client(), asyncio.Event()
    call = asyncio.ensure_future(stream(closed, step)(SCOPE, client.receive, client.send))
    await asyncio.sleep(0.05)
    call.cancel()  # e.g. the server shutting down, the client still there
    with pytest.raises(asyncio.CancelledError):
        await call
    assert closed == [False]
    await asyncio.sleep(0)
    assert await _others() == set()
