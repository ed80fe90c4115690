"""Unit tests of the engine-runner thread hand-off and decode admission against a full pool (fake engines)."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest

from pdruntime.disagg.decode_queues import BUSY_GRACE_S
from pdruntime.engine import OutOfBlocks, StepOutput
from pdruntime.env import RuntimeEnv
from pdruntime.server.worker.engine_runner import EngineRunner


class FakeEngine:
    """Emits one token per step for each request until it has produced ``n`` tokens. Records its thread."""

    def __init__(self, n: int = 3) -> None:
        self.n = n
        self.live: dict[str, int] = {}
        self.threads: set[str] = set()
        self.log: list[str] = []

    def add(self, rid: str) -> None:
        self.threads.add(threading.current_thread().name)
        self.log.append(f"add {rid}")
        self.live[rid] = 0

    def has_work(self) -> bool:
        return bool(self.live)

    def step(self):
        self.threads.add(threading.current_thread().name)
        outs = []
        for rid in list(self.live):
            self.live[rid] += 1
            done = self.live[rid] >= self.n
            outs.append(StepOutput(rid, [self.live[rid]], "x", done, "length" if done else None))
            if done:
                del self.live[rid]
        return outs

    def stats(self) -> dict:
        return {"num_running": len(self.live), "blocks_free": 10, "blocks_total": 10}


def test_runner_runs_the_engine_on_its_own_thread_and_streams_outputs():
    async def main():
        eng = FakeEngine(n=3)
        steps = []
        runner = EngineRunner(eng, asyncio.get_running_loop(), on_step=lambda stats, batch: steps.append(batch))
        runner.start()
        got: dict[str, list] = {"a": [], "b": []}
        done = {r: asyncio.Event() for r in got}
        for rid in got:
            runner.set_sink(rid, lambda out, rid=rid: (got[rid].append(out.new_token_ids[0]),
                                                       out.finished and done[rid].set()))
        await runner.call(lambda e: (e.add("a"), e.add("b")))
        await asyncio.wait_for(asyncio.gather(*(d.wait() for d in done.values())), 5)
        # a failing command reaches its caller as an exception, the thread survives
        with pytest.raises(ZeroDivisionError):
            await runner.call(lambda e: 1 / 0)
        assert await runner.call(lambda e: "still alive") == "still alive"
        runner.stop()
        return eng, got, steps

    eng, got, steps = asyncio.run(main())
    assert got == {"a": [1, 2, 3], "b": [1, 2, 3]}
    assert eng.threads == {"engine-runner"}  # never touched from the event loop's thread
    assert max(steps) == 2  # both requests were batched together at some step


def _decode_worker():
    from pdruntime.server.worker.decode import DecodeWorker

    info = SimpleNamespace(name="fake", sha256="", path="/x", max_position_embeddings=64)
    loaded = SimpleNamespace(info=info, tokenizer=None)
    engine = SimpleNamespace(config=SimpleNamespace(max_model_len=64, block_size=16))
    return DecodeWorker(loaded, engine, RuntimeEnv(decode_transfer_timeout_s=2.0))


def test_decode_admission_waits_for_freed_pages_then_reserves():
    async def main():
        w = _decode_worker()
        attempts = []

        class Runner:
            def call(self, fn):
                fut = asyncio.get_running_loop().create_future()
                attempts.append(1)
                if len(attempts) == 1:
                    fut.set_exception(OutOfBlocks("pool full"))
                else:
                    fut.set_result([7, 8])
                return fut

        w.runner = Runner()
        req = SimpleNamespace(rid="r", prompt_ids=[1] * 20, busy_grace_s=BUSY_GRACE_S)
        task = asyncio.create_task(w._reserve(req))
        await asyncio.sleep(0.05)
        assert not task.done() and len(attempts) == 1  # waiting in prealloc, not spinning
        w._pages_freed()  # another request finished
        assert await asyncio.wait_for(task, 1) == [7, 8]

    asyncio.run(main())


def test_decode_admission_answers_busy_429_with_retry_after_within_its_grace():
    from pdruntime.server.worker.decode_stream import DecodeFailed

    async def main():
        w = _decode_worker()
        w.env = RuntimeEnv(decode_transfer_timeout_s=0.2)

        class Full:
            def call(self, fn):
                fut = asyncio.get_running_loop().create_future()
                fut.set_exception(OutOfBlocks("pool full"))
                return fut

        w.runner = Full()
        with pytest.raises(DecodeFailed) as e:
            await w._reserve(SimpleNamespace(rid="r", prompt_ids=[1] * 20, busy_grace_s=BUSY_GRACE_S))
        assert e.value.status == 429 and "at capacity" in e.value.reason and "pool full" in e.value.reason
        assert e.value.retry_after >= 1 and e.value.code == "decode_busy"

    asyncio.run(main())


def test_early_first_token_is_streamed_once_and_only_when_its_text_is_final():
    from pdruntime.engine import SamplingParams
    from pdruntime.server.worker.decode_stream import EarlyToken, _without_early

    w = _decode_worker()
    w.loaded.tokenizer = SimpleNamespace(eos_token_ids=frozenset({0}), decode=lambda ids: {0: "", 5: "Hel", 6: "\ufffd"}[ids[0]])
    req = lambda **kw: SimpleNamespace(params=SamplingParams(max_tokens=8, **kw))
    assert w._early_first_token(req(), 5).text_delta == "Hel"
    assert w._early_first_token(req(stop=("x",)), 5) is None  # a stop string may cut it
    assert w._early_first_token(SimpleNamespace(params=SamplingParams(max_tokens=1)), 5) is None  # last token
    assert w._early_first_token(req(), 0) is None  # EOS
    assert w._early_first_token(req(ignore_eos=True), 0) is not None
    assert w._early_first_token(req(), 6) is None  # incomplete UTF-8
    early = EarlyToken(5, "Hel")
    out = _without_early(StepOutput("r", [5, 9], "Hello", False, None), early)
    assert out.new_token_ids == [9] and out.text_delta == "lo" and not out.finished
    aborted = StepOutput("r", [], "", True, "abort")
    assert _without_early(aborted, early) is aborted
