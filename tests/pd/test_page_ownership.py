"""Every page has one owner at every moment (issue 20, build item 1): the races that leaked decode pages.

Python 3.11's ``asyncio.wait_for`` swallows a cancellation that arrives as the awaited thing completes. The
decode worker waited for freed pages with it, so a request the router failed at that moment went on to
reserve pages after its failure's Abort had been queued: nothing freed them (570 of 728 pages held with 0 live
requests, in the issue's repro). Pinned here deterministically, then the engine-thread guard that makes the
order of commands irrelevant."""

from __future__ import annotations

import asyncio
import types

import pytest

from pdruntime.engine import OutOfBlocks
from pdruntime.disagg.decode_queues import BUSY_GRACE_S
from pdruntime.server.worker.decode import DecodeWorker
from pdruntime.server.worker.engine_commands import Abort, AddRequest, RequestGone, Reserve
from pdruntime.util.aio import within


class _Engine:
    """Pages only: reserve all-or-nothing, abort frees what an id holds (unknown ids: a no-op)."""

    def __init__(self, total: int) -> None:
        self.total = self.free = total
        self.held: dict[str, int] = {}

    def reserve(self, rid: str, n: int, forks, prompt_token_ids=None) -> list[int]:
        if n > self.free:
            raise OutOfBlocks(f"need {n} KV blocks, {self.free} of {self.total} free")
        self.free -= n
        self.held[rid] = self.held.get(rid, 0) + n
        return list(range(n))

    def pages(self, rid: str) -> tuple[list[int], int]:
        return list(range(self.held[rid])), 0  # no prefix cache: nothing held before the transfer

    def abort(self, rid: str) -> bool:
        self.free += self.held.pop(rid, 0)
        return True


class _Runner:
    """The engine thread as EngineRunner is: commands run one at a time, in the order sent, and answer through
    a loop future (one loop iteration later here, as a thread's call_soon_threadsafe would)."""

    def __init__(self, engine: _Engine) -> None:
        self.engine = engine
        self.queue: asyncio.Queue = asyncio.Queue()
        self.reserves = 0
        self.task = asyncio.create_task(self._run())

    def call(self, cmd) -> asyncio.Future:
        fut = asyncio.get_running_loop().create_future()
        self.queue.put_nowait((cmd, fut))
        return fut

    async def _run(self) -> None:
        while True:
            cmd, fut = await self.queue.get()
            self.reserves += isinstance(cmd, Reserve)
            try:
                ok, value = True, cmd(self.engine)
            except Exception as exc:  # noqa: BLE001 - delivered to the caller, as the real runner does
                ok, value = False, exc
            await asyncio.sleep(0)
            if not fut.done():
                fut.set_result(value) if ok else fut.set_exception(value)
            self.queue.task_done()


def _worker(runner):
    return types.SimpleNamespace(pages_freed=asyncio.Event(), runner=runner,
                                 env=types.SimpleNamespace(decode_transfer_timeout_s=5.0))


class _Req(types.SimpleNamespace):
    @property
    def gone(self) -> bool:
        return self.failure is not None


def _request(**kw):
    return _Req(rid="r1", prompt_ids=[1, 2, 3], forks=[], failure=None, busy_grace_s=BUSY_GRACE_S, **kw)


@pytest.mark.parametrize("yields", range(6))
async def test_a_request_failed_as_pages_come_free_never_keeps_them(yields):
    """The pool is full; r1 waits for pages; another request frees its pages as the router fails r1, ``yields``
    loop iterations apart (every interleaving of the race). Whatever r1 got is freed: the pool ends full."""
    engine = _Engine(total=4)
    engine.reserve("other", 4, [])
    runner = _Runner(engine)
    me, req = _worker(runner), _request()
    task = asyncio.create_task(DecodeWorker._reserve(me, req))
    while runner.reserves < 1 or not runner.queue.empty():
        assert not task.done(), task  # it ended before its first Reserve: its error, not a hang
        await asyncio.sleep(0)  # the first Reserve failed (pool full): r1 waits for freed pages
    for _ in range(3):
        await asyncio.sleep(0)
    engine.abort("other")
    me.pages_freed.set()  # "other" finished: its pages are free
    for _ in range(yields):
        await asyncio.sleep(0)
    req.failure = "router failed the request"  # DecodeWorker._fail: mark, cancel the task, queue the Abort
    task.cancel()
    runner.call(Abort(("r1",)))
    try:
        await task
    except (asyncio.CancelledError, RequestGone):
        pass
    await runner.queue.join()
    runner.task.cancel()
    assert engine.free == engine.total, f"{engine.total - engine.free} pages held by no live request ({engine.held})"


@pytest.mark.parametrize("yields", range(4))
async def test_within_never_swallows_a_cancellation_that_meets_a_completion(yields):
    """When cancel() reaches the task before it finished, awaiting it raises CancelledError, whatever the
    awaited future did meanwhile (3.11's wait_for returns the result instead at yields=1)."""
    fut = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(within(fut, 5))
    await asyncio.sleep(0)
    fut.set_result("done")
    for _ in range(yields):
        await asyncio.sleep(0)
    if task.cancel():  # False: it had finished already, nothing to swallow
        with pytest.raises(asyncio.CancelledError):
            await task


@pytest.mark.parametrize("cmd", [lambda r: Reserve(r), lambda r: AddRequest(r, prefill_only=True)])
def test_a_command_that_gives_pages_refuses_a_request_already_gone(cmd):
    engine = types.SimpleNamespace(reserve=lambda *a: pytest.fail("reserved for a failed request"),
                                   add_request=lambda *a, **k: pytest.fail("admitted a failed request"))
    req = _request(params=None)
    req.failure = "aborted"
    with pytest.raises(RequestGone, match="already ended"):
        cmd(req)(engine)


def test_the_real_request_types_say_when_they_are_gone():
    from pdruntime.disagg.decode_queues import DecodeRequest
    from pdruntime.disagg.prefill_queues import PrefillRequest
    from pdruntime.disagg.states import TransferStatus

    d = DecodeRequest(rid="d", room=1, client="c", prompt_ids=[1], params=None, bootstrap_host="h", bootstrap_port=1,
                      created_at=0.0, status=TransferStatus(0.0))
    assert not d.gone
    d.failure = "router went away"
    assert d.gone
    loop = asyncio.new_event_loop()
    try:
        p = PrefillRequest(rid="p", room=1, client="c", prompt_ids=[1], params=None, created_at=0.0,
                           status=TransferStatus(0.0), done=loop.create_future())
        assert not p.gone
        p.status.fail(1.0, "bootstrap timeout")
        assert p.gone
    finally:
        loop.close()
