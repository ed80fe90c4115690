"""The router's admission (runtime/pdruntime/server/router/admission.py): bounds, learned capacity, the queue."""

from __future__ import annotations

import asyncio
import time

import pytest

from pdruntime.server.router.admission import MAX_MARK_S, Admission


def test_the_pending_bound_blocks_a_pair_until_a_request_gets_its_first_token():
    a = Admission(max_pending=2)
    a.dispatched(0), a.dispatched(0), a.dispatched(1)
    assert a.blocked(0.0, {0: 2, 1: 1}) == {0}
    a.first_token(0)
    assert a.blocked(0.0, {0: 2, 1: 1}) == set()
    a.first_token(0), a.first_token(1)
    assert a.pending == {}


def test_a_busy_refusal_marks_the_pair_full_at_the_load_it_served():
    a = Admission()
    a.busy(0, outstanding=6, retry_after=2, now=10.0)  # it refused the 7th
    assert a.blocked(10.0, {0: 6}) == {0}
    assert a.blocked(10.0, {0: 5}) == set()  # one finished: room for one
    assert a.blocked(12.0, {0: 6}) == set()  # the mark lapsed with its Retry-After
    assert 0 not in a.marks


@pytest.mark.parametrize("levels,expect", [((9, 7, 6), 6), ((6, 9), 6)])
def test_refusals_in_a_burst_keep_the_lowest_level(levels, expect):
    a = Admission()
    for n in levels:
        a.busy(0, outstanding=n, retry_after=1, now=0.0)
    assert a.marks[0].level == expect


def test_a_mark_never_holds_longer_than_its_cap_and_probes_upwards_on_served_requests():
    a = Admission()
    a.busy(0, outstanding=4, retry_after=30, now=0.0)
    assert a.marks[0].until == MAX_MARK_S
    a.release(0)  # a request on pair 0 was served and ended
    assert a.marks[0].level == 5
    a.release(None)  # a refused or failed attempt ended: says nothing about room
    assert a.marks[0].level == 5


def test_a_pair_that_left_the_topology_loses_its_mark():
    a = Admission()
    a.busy(3, outstanding=1, retry_after=1, now=0.0)
    assert a.blocked(0.0, {0: 0}) == set() and a.marks == {}


def test_retry_after_comes_from_the_marks_and_the_queue():
    a = Admission(max_pending=4)
    assert a.retry_after(0.0) == 1
    a.busy(0, outstanding=2, retry_after=3, now=0.0)
    assert a.retry_after(0.0) == 3
    a.queued = 8  # 8 waiting for 4 slots: two more rounds
    assert a.retry_after(0.0) == 5


@pytest.mark.parametrize("kw,msg", [({"max_pending": 0}, "max_pending=0"), ({"max_queued": -1}, "max_queued=-1"),
                                    ({"wait_s": -1.0}, "wait_s=-1.0")])
def test_bad_bounds_are_refused_with_what_is_accepted(kw, msg):
    with pytest.raises(ValueError, match=msg) as e:
        Admission(**kw)
    assert "accepted" in str(e.value)


async def test_a_waiter_wakes_when_a_slot_frees_and_gives_up_at_its_timeout():
    a = Admission(max_queued=1)
    t0 = time.monotonic()
    waiter = asyncio.create_task(a.wait(5.0))
    await asyncio.sleep(0.05)
    assert a.queued == 1 and not a.can_queue()
    a.first_token(0)
    await asyncio.wait_for(waiter, 2.0)
    assert time.monotonic() - t0 < 2.0 and a.queued == 0
    await a.wait(0.05)  # nothing frees: back after its timeout
    assert a.queued == 0


async def _queue(a: Admission, n: int) -> list[asyncio.Task]:
    """``n`` waiters, queued in this order (each has reached the queue before the next starts)."""
    out = []
    for _ in range(n):
        out.append(asyncio.create_task(a.wait(5.0)))
        await asyncio.sleep(0)
    return out


async def test_a_freed_slot_wakes_only_the_request_that_waited_longest():
    a = Admission()
    waiters = await _queue(a, 3)
    assert a.queued == 3
    a.first_token(0)  # one slot: one wake, to the first in
    assert await asyncio.wait_for(waiters[0], 1.0) == 0
    await asyncio.sleep(0.05)
    assert not waiters[1].done() and not waiters[2].done() and a.queued == 2  # the others still wait: no herd
    a.release(0)
    assert await asyncio.wait_for(waiters[1], 1.0) == 0
    for w in waiters[2:]:
        w.cancel()


async def test_a_wake_no_waiter_can_use_is_passed_on_once_round_and_then_dropped():
    a = Admission()
    first, second = await _queue(a, 2)
    a.first_token(0)
    hops = await asyncio.wait_for(first, 1.0)
    a.pass_on(hops)  # the first could not take it: the second gets it
    (again,) = await _queue(a, 1)  # the first waits again, behind the second
    hops = await asyncio.wait_for(second, 1.0)
    assert hops == 1
    a.pass_on(hops)  # nobody who waits now has not had it: dropped, not handed back
    await asyncio.sleep(0.05)
    assert not again.done() and a.queued == 1
    again.cancel()


async def test_a_waiter_that_leaves_in_the_moment_it_is_woken_hands_the_slot_on():
    a = Admission()
    leaving, staying = await _queue(a, 2)
    a.first_token(0)  # wakes `leaving` ...
    leaving.cancel()  # ... whose client goes before it runs
    with pytest.raises(asyncio.CancelledError):
        await leaving
    assert await asyncio.wait_for(staying, 1.0) == 0  # the slot was not lost
    assert a.queued == 0 and not a._waiters
