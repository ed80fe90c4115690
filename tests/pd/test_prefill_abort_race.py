"""Prefill's KV-ready step and an abort in the same moment (runtime/pdruntime/server/worker/prefill.py, ``_compute``).

The engine reports a prompt's KV ready; before the worker asks the engine for its pages, the request is aborted (the
router's abort when its client left): the failure queued the engine's Abort and dropped the pages the runner had
noted. Asking for the pages then reached an engine that no longer knew the request: a KeyError, logged as an
unexpected error (four in one run of the router bench, where wrk leaves mid-request at the end of every run). The
worker now sees the failure first and ends the step as a failed transfer."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from pdruntime.disagg.prefill_queues import PrefillRequest
from pdruntime.disagg.states import TransferStatus
from pdruntime.server.worker.engine_commands import AddRequest, Pages
from pdruntime.server.worker.prefill import PrefillWorker, TransferFailed


class Runner:
    """The engine runner as ``_compute`` sees it: AddRequest reports the KV ready, then ``between`` runs (what the
    loop does before the worker's next step); Pages answers from the engine's table, which an Abort emptied."""

    def __init__(self, between) -> None:
        self.ready_pages: dict = {}
        self.engine_knows: set[str] = set()
        self.between = between
        self.asked_pages = 0

    def set_sink(self, rid, sink) -> None:
        pass

    async def call(self, cmd):
        if isinstance(cmd, AddRequest):
            self.engine_knows.add(cmd.req.rid)
            cmd.req.kv_ready.set_result(42)
            self.between(cmd.req)
            return None
        if isinstance(cmd, Pages):
            self.asked_pages += 1
            if cmd.rid not in self.engine_knows:
                raise KeyError(f"unknown request id {cmd.rid!r}")
            return [3, 4], 20
        raise AssertionError(cmd)


def _worker(runner: Runner) -> PrefillWorker:
    w = PrefillWorker.__new__(PrefillWorker)  # only what _compute touches
    w.runner = runner
    w.clock = SimpleNamespace(now=lambda: 1.0)
    w.metrics = SimpleNamespace(queue_time=SimpleNamespace(labels=lambda role: SimpleNamespace(observe=lambda s: None)))
    w.role = "prefill"
    return w


async def _compute(runner: Runner) -> tuple[list[int], int, int]:
    req = PrefillRequest("r1", 7, "c", list(range(20)), None, 0.0, TransferStatus(0.0),
                         asyncio.get_running_loop().create_future())
    return await _worker(runner)._compute(req)


def test_an_abort_after_the_kv_is_ready_ends_the_step_as_a_failed_transfer():
    def abort(req) -> None:  # what _fail does: the status fails, the engine's Abort, the noted pages dropped
        req.status.fail(1.0, "aborted (abort_request)")
        runner.engine_knows.discard(req.rid)
        runner.ready_pages.pop(req.rid, None)

    runner = Runner(abort)
    with pytest.raises(TransferFailed, match="failed while prefilling"):
        asyncio.run(_compute(runner))
    assert runner.asked_pages == 0  # the engine, which let the request go, is not asked


def test_without_an_abort_the_pages_are_asked_for_and_returned():
    runner = Runner(lambda req: None)
    assert asyncio.run(_compute(runner)) == ([3, 4], 20, 42) and runner.asked_pages == 1
