"""Decode's token events in batches: outputs that are ready together become one event per choice, and a router
that asked for one response (STREAM_INTERVAL_HEADER) gets its tokens gathered over an interval. Nothing is lost,
duplicated or reordered, the first token is never held back, and a failure still ends the stream after the
tokens before it."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from pdruntime.engine import StepOutput
from pdruntime.server.metrics import Metrics
from pdruntime.server.openai.events import TokenEvent
from pdruntime.disagg.decode_queues import BUSY_GRACE_S
from pdruntime.server.worker.decode import MAX_STREAM_INTERVAL_S, busy_grace, stream_interval
from pdruntime.server.worker.decode_stream import DecodeFailed, DecodeStream


def _stream(n: int = 1, interval_s: float = 0.0) -> DecodeStream:
    worker = SimpleNamespace(role="decode", metrics=Metrics("decode"), clock=SimpleNamespace(now=lambda: 0.0),
                             loaded=SimpleNamespace(tokenizer=None))
    forks = [(f"r-{i}", None) for i in range(1, n)]
    req = SimpleNamespace(rid="r", n=n, forks=forks, outputs=asyncio.Queue(), params=SimpleNamespace(logprobs=None),
                          prompt_ids=[1, 2, 3], cached_tokens=None, completion_tokens=0, last_token_at=None,
                          engine_ids=lambda: ["r"] + [f for f, _ in forks])
    return DecodeStream(worker, req, "anonymous", interval_s)


def _out(tok: int, *, rid: str = "r", finished: bool = False) -> StepOutput:
    return StepOutput(rid, [tok], f"<{tok}>", finished, "length" if finished else None)


async def _collect(s: DecodeStream) -> list[TokenEvent]:
    return [ev async for ev in s.events()]


def test_outputs_waiting_together_become_one_event_with_every_token_in_order():
    async def main():
        s = _stream()
        for t in range(5):
            s.req.outputs.put_nowait(_out(t, finished=t == 4))
        evs = await _collect(s)
        assert len(evs) == 1
        ev = evs[0]
        assert ev.token_ids == [0, 1, 2, 3, 4] and ev.delta == "<0><1><2><3><4>" and ev.text == ev.delta
        assert ev.completion_tokens == 5 and ev.finish == "length"
        assert s.req.completion_tokens == 5

    asyncio.run(main())


def test_one_at_a_time_outputs_stay_one_event_each_without_an_interval():
    async def main():
        s = _stream()
        got: list[TokenEvent] = []

        async def consume():
            async for ev in s.events():
                got.append(ev)

        task = asyncio.create_task(consume())
        for t in range(4):
            s.req.outputs.put_nowait(_out(t, finished=t == 3))
            await asyncio.sleep(0.01)  # the reader takes each before the next exists
        await asyncio.wait_for(task, 5)
        assert [ev.token_ids for ev in got] == [[0], [1], [2], [3]]
        assert [ev.text for ev in got] == ["<0>", "<0><1>", "<0><1><2>", "<0><1><2><3>"]

    asyncio.run(main())


def test_an_interval_gathers_later_tokens_but_never_holds_the_first_or_waits_past_the_finish():
    async def main():
        s = _stream(interval_s=MAX_STREAM_INTERVAL_S)
        it = s.events()
        s.req.outputs.put_nowait(_out(0))
        first = await asyncio.wait_for(it.__anext__(), 0.5)  # not held for the interval
        assert first.token_ids == [0]
        for t in range(1, 6):
            s.req.outputs.put_nowait(_out(t, finished=t == 5))
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        rest = [ev async for ev in it]
        assert loop.time() - t0 < MAX_STREAM_INTERVAL_S / 2  # the finish ends the batch (a generous bound)
        assert [ev.token_ids for ev in rest] == [[1, 2, 3, 4, 5]] and rest[0].text == "".join(f"<{t}>" for t in range(6))

    asyncio.run(main())


def test_tokens_before_a_failure_are_sent_then_the_failure_is_raised():
    async def main():
        s = _stream(interval_s=0.05)
        s.req.outputs.put_nowait(_out(0))
        s.req.outputs.put_nowait(_out(1))
        s.req.outputs.put_nowait(DecodeFailed("KV transfer failed", 502))
        got = []
        with pytest.raises(DecodeFailed, match="KV transfer failed"):
            async for ev in s.events():
                got.append(ev.token_ids)
        assert got == [[0, 1]]

    asyncio.run(main())


def test_choices_are_merged_each_on_its_own_and_all_finish():
    async def main():
        s = _stream(n=2)
        q = s.req.outputs
        for item in (_out(0), _out(10, rid="r-1"), _out(1), _out(11, rid="r-1", finished=True), _out(2, finished=True)):
            q.put_nowait(item)
        evs = await _collect(s)
        by_choice: dict[int, list[int]] = {}
        for ev in evs:
            by_choice.setdefault(ev.choice, []).extend(ev.token_ids)
        assert by_choice == {0: [0, 1, 2], 1: [10, 11]}
        assert [ev.index for ev in evs if ev.finish] == [1, 0]  # a finish ends its batch: choice 1's came first
        assert all(ev.index is not None for ev in evs)  # n > 1: every event names its choice

    asyncio.run(main())


def test_token_event_then_joins_deltas_ids_and_logprobs():
    a = TokenEvent(delta="a", token_ids=[1], text="a", completion_tokens=1, logprobs=[None], prompt_logprobs=[[0.0]])
    b = TokenEvent(delta="b", token_ids=[2], text="ab", completion_tokens=2, finish="stop", logprobs=[(-0.1, [])])
    ab = a.then(b)
    assert (ab.delta, ab.token_ids, ab.text, ab.completion_tokens, ab.finish) == ("ab", [1, 2], "ab", 2, "stop")
    assert ab.logprobs == [None, (-0.1, [])] and ab.prompt_logprobs == [[0.0]]
    assert TokenEvent(delta="x", token_ids=[3]).then(TokenEvent(delta="y", token_ids=[4])).logprobs is None


@pytest.mark.parametrize("raw,want", [(None, 0.0), ("0.25", 0.25), ("5", MAX_STREAM_INTERVAL_S), ("-1", 0.0),
                                      ("soon", 0.0), ("nan", 0.0), ("", 0.0)])
def test_the_stream_interval_header_is_clamped_and_a_bad_value_ignored(raw, want):
    headers = {} if raw is None else {"x-pdstack-stream-interval-s": raw}
    assert stream_interval(headers) == want


@pytest.mark.parametrize("raw,want", [(None, BUSY_GRACE_S), ("0.125", 0.125), ("0", 0.0), ("0.000", 0.0),
                                      ("9", BUSY_GRACE_S), ("-1", 0.0), ("soon", BUSY_GRACE_S), ("nan", BUSY_GRACE_S)])
def test_the_busy_wait_header_can_only_shorten_decodes_wait_for_pages(raw, want):
    """The router's BUSY_WAIT_HEADER (what is left of its admission wait) bounds how long decode waits for KV pages
    before a 429; absent or unreadable, decode waits its own BUSY_GRACE_S, and never longer."""
    headers = {} if raw is None else {"x-pdstack-busy-wait-s": raw}
    assert busy_grace(headers) == want
