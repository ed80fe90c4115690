"""Frozen-worker detection: the staleness rule (table) and the prober against a real server that stops answering."""

from __future__ import annotations

import asyncio
import socket
from types import SimpleNamespace

import httpx
import pytest

from pdruntime.server.router.health_probe import HealthProber, WorkerHealth, is_stale, stale_pairs, stale_until


@pytest.mark.parametrize("last_ok,timed_out,now,want", [
    (None, False, 100.0, False),  # never answered, connection refused: not up yet (the breaker handles it)
    (None, True, 104.0, False),   # never answered, timing out for 4 s < 5 s
    (None, True, 106.0, True),    # never answered, timing out for 6 s: frozen
    (101.0, False, 105.0, False),  # answered 4 s ago
    (101.0, True, 107.0, True),   # last answer 6 s ago (frozen, or unhealthy with 503, or gone)
    (101.0, False, 107.0, True),
])
def test_a_worker_is_stale_without_a_healthy_answer_for_stale_after_s(last_ok, timed_out, now, want):
    h = WorkerHealth("http://w", since=100.0, last_ok=last_ok, timed_out=timed_out)
    assert is_stale(h, now, 5.0) is want


def test_a_pair_is_stale_when_either_of_its_workers_is():
    pairs = [SimpleNamespace(index=0, prefill_url="p0", decode_url="d0"),
             SimpleNamespace(index=1, prefill_url="p1", decode_url="d1")]
    health = {u: WorkerHealth(u, since=0.0, last_ok=10.0) for u in ("p0", "d0", "p1", "d1")}
    health["d1"].last_ok = 2.0
    assert stale_pairs(pairs, health, 11.0, 5.0) == {1}
    assert stale_pairs(pairs, {}, 11.0, 5.0) == set()  # never probed: not stale


def test_the_probers_stale_set_is_remembered_only_until_the_clock_or_a_probe_or_the_topology_changes_it():
    """Every request asks for the stale pairs; the prober answers from its last computation while nothing that
    decides it has changed, and computes it afresh the moment the clock passes a worker's staleness threshold."""
    pairs = (SimpleNamespace(index=0, prefill_url="p0", decode_url="d0"),
             SimpleNamespace(index=1, prefill_url="p1", decode_url="d1"))
    topology = [pairs]
    prober = HealthProber(None, lambda: topology[0], stale_after_s=5.0)
    prober.health = {u: WorkerHealth(u, since=0.0, last_ok=10.0) for u in ("p0", "d0", "p1")}
    prober.health["d1"] = WorkerHealth("d1", since=0.0, last_ok=12.0)
    assert prober.stale(now=11.0) == frozenset()
    assert prober.stale(now=15.0) == frozenset()  # 10 + 5: not yet past
    assert prober.stale(now=15.01) == {0, 1}  # p0, d0 and p1 went stale as the clock passed 15
    assert prober.stale(now=14.0) == frozenset()  # a time before the memo's: computed again, not taken from it
    assert prober.stale(now=15.01) == {0, 1}
    assert prober.stale(now=17.01) == {0, 1}  # d1 too now; pair 1 was stale already
    prober.health["p0"].last_ok = prober.health["d0"].last_ok = 17.0  # what a probe's answer writes...
    prober._memo = None  # ...and _probe drops the memo with it
    assert prober.stale(now=17.02) == {1}
    topology[0] = pairs[:1]  # the topology changed: pair 1 left
    assert prober.stale(now=17.03) == frozenset()
    assert stale_until(prober.health, 17.03, 5.0) == 22.0  # the next threshold: p0's and d0's


def test_prober_marks_a_worker_that_accepts_but_never_answers_stale_and_back_when_it_answers():
    # a listening socket nobody reads from: what a SIGSTOPped process looks like from outside
    async def main():
        frozen = socket.socket()
        frozen.bind(("127.0.0.1", 0))
        frozen.listen(16)
        url = f"http://127.0.0.1:{frozen.getsockname()[1]}"
        pairs = [SimpleNamespace(index=0, prefill_url=url, decode_url=url)]
        changes = []
        async with httpx.AsyncClient() as client:
            prober = HealthProber(client, lambda: pairs, interval_s=0.1, stale_after_s=0.5,
                                  on_change=lambda u, st: changes.append(st))
            for _ in range(8):
                await prober.run_once()
            frozen.close()
            return prober.stale(), changes, prober.snapshot()

    stale, changes, snap = asyncio.run(main())
    assert stale == {0} and changes == [True]
    assert snap[0]["stale"] and "Timeout" in snap[0]["last_error"]
