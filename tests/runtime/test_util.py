"""pdruntime.util: the one SSE parser, port pickers, capped backoff and periodic task; decode's typed token events."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest

from pdruntime.server.openai.events import TokenEvent
from pdruntime.util.aio import Deadlines
from pdruntime.util.backoff import capped_backoff
from pdruntime.util.periodic import PeriodicTask
from pdruntime.util.ports import BLOCK_RANGE, free_port, free_port_block
from pdruntime.util.sse import DONE, SSE_DONE, aiter_sse, iter_sse, sse


def test_sse_round_trip_skips_other_lines_and_yields_done():
    body = (sse({"a": 1}) + b": comment\n\n" + sse([2]) + SSE_DONE).decode()
    assert list(iter_sse(body.splitlines())) == [{"a": 1}, [2], DONE]
    with pytest.raises(ValueError):
        list(iter_sse(["data: {not json"]))

    async def lines():
        for line in body.splitlines():
            yield line

    async def collect():
        return [ev async for ev in aiter_sse(lines())]

    assert asyncio.run(collect()) == [{"a": 1}, [2], DONE]


@pytest.mark.parametrize("attempt, want", [(-1, 0.0), (0, 0.0), (1, 0.5), (2, 1.0), (3, 2.0), (4, 3.0), (10 ** 6, 3.0)])
def test_capped_backoff_doubles_from_base_up_to_the_cap(attempt, want):
    assert capped_backoff(attempt, 0.5, 3.0) == want


def test_port_block_is_below_the_ephemeral_range_and_free():
    base = free_port_block(5)
    assert BLOCK_RANGE[0] <= base and base + 5 <= BLOCK_RANGE[1] + 1
    socks = [socket.socket() for _ in range(5)]
    try:
        for i, s in enumerate(socks):
            s.bind(("127.0.0.1", base + i))  # all five were free
    finally:
        for s in socks:
            s.close()
    assert len({free_port() for _ in range(3)}) == 3


def test_periodic_task_ticks_outlives_a_failing_tick_and_stops():
    async def main():
        ticks = []

        def tick():
            ticks.append(len(ticks))
            if len(ticks) == 2:
                raise RuntimeError("one bad tick")

        task = PeriodicTask(tick, 0.01, name="test", immediate=True)
        task.start()
        task.start()  # idempotent
        await asyncio.sleep(0)
        assert ticks == [0]  # immediate: the first tick runs at start
        while len(ticks) < 4:
            await asyncio.sleep(0.01)
        await task.stop()
        await task.stop()
        n = len(ticks)
        await asyncio.sleep(0.05)
        return n, len(ticks), task.running

    n, later, running = asyncio.run(main())
    assert n == later and not running


def test_deadlines_fire_each_entry_once_past_its_time_unless_discarded_and_survive_a_failing_entry():
    async def main():
        d = Deadlines(tick=0.01)
        fired: list[tuple[str, float, float]] = []  # (name, due, when it fired)
        now = time.monotonic()

        def entry(name: str, due: float, fail: bool = False) -> None:
            def fire() -> None:
                fired.append((name, due, time.monotonic()))
                if fail:
                    raise RuntimeError("one bad entry")
            d.add(name, due, fire)

        entry("bad", now, fail=True)
        entry("gone", now + 0.01)
        entry("early", now + 0.01)
        entry("early", now + 0.03)  # a second add replaces the first
        entry("late", now + 0.08)
        d.discard("gone")
        d.discard("never added")
        while len(d):
            await asyncio.sleep(0.01)
        entry("closed", time.monotonic())
        d.close()
        entry("after close", time.monotonic())  # a sweep runs after the close: "closed" would have fired in it
        while len(d):
            await asyncio.sleep(0.01)
        return fired

    fired = asyncio.run(main())
    assert [name for name, _, _ in fired] == ["bad", "early", "late", "after close"]  # in due order, each once; the
    # failing entry did not stop the sweep; discarded and closed entries never fire
    assert all(at >= due for _, due, at in fired)
    assert fired[1][1] - fired[0][1] > 0.02  # "early" kept the second add's time (now + 0.03), not the first's


def test_token_event_wire_shape_round_trips():
    ev = TokenEvent(delta="b", token_ids=[7], text="ab", rid="r", prompt_tokens=3, completion_tokens=2,
                    finish="length", index=1, logprobs=[None])
    wire = ev.to_json()
    assert wire == {"text": "ab", "delta": "b", "token_ids": [7], "meta_info": {
        "id": "r", "prompt_tokens": 3, "completion_tokens": 2, "finish_reason": {"type": "length"}},
        "index": 1, "logprobs": [None]}
    assert TokenEvent.from_json(wire, 2) == ev and ev.finish_reason == "length" and ev.choice == 1
    assert TokenEvent.from_json({"delta": "x", "meta_info": {"finish_reason": "eos"}}).finish_reason == "stop"
    with pytest.raises(ValueError, match="index"):
        TokenEvent.from_json(wire, 1)
    cached = TokenEvent(rid="r", prompt_tokens=40, completion_tokens=2, cached_tokens=32)
    assert cached.to_json()["meta_info"]["cached_tokens"] == 32 and TokenEvent.from_json(cached.to_json()) == cached
    assert cached.usage() == {"prompt_tokens": 40, "completion_tokens": 2, "total_tokens": 42,
                              "prompt_tokens_details": {"cached_tokens": 32}}
    assert "prompt_tokens_details" not in ev.usage()  # not reported: not claimed
