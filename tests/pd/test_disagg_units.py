"""Unit tests of the PD protocol pieces: transfer states, watchdog, queues (the wire: tests/pd/test_wire.py)."""

from __future__ import annotations

import asyncio

import pytest

from pdruntime.disagg.prefill_queues import PrefillQueues, PrefillRequest
from pdruntime.disagg.states import IllegalTransition, TransferState as S, TransferStatus, can_transition
from pdruntime.disagg.watchdog import OffsetClock, Watchdog


# ---- states --------------------------------------------------------------------------------------

def test_transfer_states_are_forward_only_except_failed():
    order = [S.BOOTSTRAPPING, S.WAITING_FOR_INPUT, S.TRANSFERRING, S.SUCCESS]
    for i, a in enumerate(order):
        for j, b in enumerate(order):
            assert can_transition(a, b) == (j > i and a is not S.SUCCESS), (a, b)
        assert can_transition(a, S.FAILED) == (a is not S.SUCCESS)
    assert not any(can_transition(S.FAILED, b) for b in S)


def test_transfer_status_records_times_and_refuses_backwards_moves():
    st = TransferStatus(now=1.0)
    st.advance(S.WAITING_FOR_INPUT, 2.0)
    st.advance(S.TRANSFERRING, 3.5)
    assert st.since() == 3.5 and st.entered[S.BOOTSTRAPPING] == 1.0
    with pytest.raises(IllegalTransition):
        st.advance(S.WAITING_FOR_INPUT, 4.0)
    assert st.fail(5.0, "peer lost") and st.state is S.FAILED and st.reason == "peer lost"
    assert not st.fail(6.0, "again")  # terminal: no change
    assert st.reason == "peer lost"


# ---- wire: tests/pd/test_wire.py -----------------------------------------------------------------


# ---- watchdog ------------------------------------------------------------------------------------

def test_watchdog_fires_once_after_timeout_on_the_injected_clock():
    clock = OffsetClock()
    fired_metric = []
    wd = Watchdog("prefill", clock, tick_s=0.01, on_fired=lambda r, p: fired_metric.append((r, p)))
    hits = []
    wd.arm("a", "transfer", 10.0, lambda d: hits.append(d.key))
    assert wd.check() == [] and hits == []
    clock.advance(10.5)
    assert [d.key for d in wd.check()] == ["a"]
    assert hits == ["a"] and fired_metric == [("prefill", "transfer")]
    assert wd.check() == []  # fired deadlines are gone


def test_watchdog_disarm_covers_only_the_guarded_phase():
    clock = OffsetClock()
    wd = Watchdog("prefill", clock, tick_s=0.01)
    hits = []
    wd.arm("r", "transfer", 1.0, lambda d: hits.append(d.phase))
    clock.advance(0.5)
    wd.disarm("r", "transfer")  # receipt confirmed: the decode phase that follows is not watched
    clock.advance(1000.0)
    wd.check()
    assert hits == []


def test_watchdog_ticks_on_its_own_without_traffic():
    async def main():
        wd = Watchdog("decode", OffsetClock(), tick_s=0.01)
        hits = []
        wd.arm("lonely", "decode_transfer", 0.05, lambda d: hits.append(d.key))
        wd.start()
        fired_at = None
        for _ in range(1000):  # nothing else happens on this loop (up to ~10 s on a loaded machine)
            if hits and fired_at is None:
                fired_at = wd.ticks
            if fired_at is not None and wd.ticks >= max(5, fired_at + 5):  # ticks after it fired: it fired once
                break
            await asyncio.sleep(0.01)
        await wd.stop()
        return hits, wd.ticks

    hits, ticks = asyncio.run(main())
    assert hits == ["lonely"] and ticks >= 5


def test_watchdog_survives_a_failing_handler():
    wd = Watchdog("p", OffsetClock(), 0.01)
    wd.arm("x", "bootstrap", 0.0, lambda d: 1 / 0)
    wd.arm("y", "bootstrap", 0.0, lambda d: None)
    wd.clock.advance(1)
    assert {d.key for d in wd.check()} == {"x", "y"}


# ---- queues --------------------------------------------------------------------------------------

def test_prefill_queues_move_and_room_wait():
    async def main():
        q = PrefillQueues()
        loop = asyncio.get_running_loop()
        mk = lambda rid, room: PrefillRequest(rid, room, "c", [1], None, 0.0, TransferStatus(0.0), loop.create_future())
        waiter = asyncio.create_task(q.wait_room(5, 1.0))
        await asyncio.sleep(0)
        r = mk("a", 5)
        q.register(r)
        assert await waiter is r
        with pytest.raises(KeyError):
            q.register(mk("b", 5))  # room in use
        q.move("a", "inflight")
        assert q.counts() == {"bootstrap": 0, "waiting": 0, "inflight": 1}
        q.finish(r)
        assert len(q) == 0 and 5 not in q.by_room
        assert await q.wait_room(6, 0.05) is None
        assert not q._room_waiters

    asyncio.run(main())
