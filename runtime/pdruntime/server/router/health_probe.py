"""Worker liveness as the router sees it: a frozen (SIGSTOPped) or unhealthy worker is noticed and skipped.

A process that is stopped keeps its listening socket: the kernel still completes TCP handshakes, so a
connect succeeds and the request then waits forever. Only an answer proves a worker runs. The router polls
every worker's ``/health`` on its own tick (traffic or not); a worker whose last 200 is older than
``stale_after_s`` is *stale*, and so is its pair: the router stops dispatching to it until it answers
again. :func:`stale_pairs` is the pure decision; :class:`HealthProber` is the polling shell.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import httpx

from pdruntime.util.periodic import PeriodicTask

log = logging.getLogger("pdruntime.health")

PROBE_INTERVAL_S = 1.0  # seconds between polls of one worker
STALE_AFTER_S = 5.0  # seconds without a 200 from /health before a worker (and its pair) is skipped


@dataclass
class WorkerHealth:
    url: str
    since: float  # time.monotonic() of the first probe (staleness counts from here until a first 200)
    last_ok: float | None = None
    last_error: str | None = None
    instance: str | None = None
    timed_out: bool = False  # the last probe got no answer in time (a frozen process), not a refused connection
    stale: bool = False  # as of the last evaluation (for transitions in the log)

    def as_dict(self, now: float) -> dict:
        return {"url": self.url, "stale": self.stale, "instance": self.instance, "last_error": self.last_error,
                "last_ok_age_s": None if self.last_ok is None else round(now - self.last_ok, 3)}


def is_stale(h: WorkerHealth, now: float, stale_after_s: float) -> bool:
    """Stale: no 200 within ``stale_after_s`` of the last one. A worker never seen healthy is stale only once
    its probes time out for that long (frozen); a refused connection means it is not up yet (or gone), and
    dispatching there fails fast, so it is left to the breaker."""
    if h.last_ok is None:
        return h.timed_out and now - h.since > stale_after_s
    return now - h.last_ok > stale_after_s


def stale_until(health: dict[str, WorkerHealth], now: float, stale_after_s: float) -> float:
    """The first moment after ``now`` when a worker of ``health`` turns stale by time alone (inf: none will): until
    then, or a probe's answer, :func:`stale_pairs` stays the same."""
    at = float("inf")
    for h in health.values():
        start = h.last_ok if h.last_ok is not None else (h.since if h.timed_out else None)
        if start is not None and now - start <= stale_after_s:
            at = min(at, start + stale_after_s)
    return at


def stale_pairs(pairs: Iterable[Any], health: dict[str, WorkerHealth], now: float, stale_after_s: float) -> set[int]:
    """Indexes of pairs with a stale prefill or decode worker. Workers never probed are not stale."""
    out = set()
    for p in pairs:
        for url in (p.prefill_url, p.decode_url):
            h = health.get(url)
            if h is not None and is_stale(h, now, stale_after_s):
                out.add(p.index)
    return out


@dataclass
class HealthProber:
    """Polls ``/health`` of every worker of ``pairs()`` each ``interval_s``; ``stale()`` -> pair indexes to skip."""

    client: Any  # pdruntime.util.h1.Client (or an httpx.AsyncClient)
    pairs: Callable[[], Iterable[Any]]
    interval_s: float = PROBE_INTERVAL_S
    stale_after_s: float = STALE_AFTER_S
    on_change: Callable[[str, bool], None] | None = None  # (worker url, stale) on every transition
    health: dict[str, WorkerHealth] = field(default_factory=dict)
    rounds: int = 0
    _ticker: PeriodicTask | None = None
    #: (the pairs it was for, the stale set, from when and until when it holds): every request asks, and the answer
    #: changes only with a probe's result (_probe and run_once drop it), the topology, or the clock passing
    #: stale_until
    _memo: tuple[Any, frozenset[int], float, float] | None = None

    def stale(self, now: float | None = None) -> frozenset[int]:
        pairs = self.pairs()
        now = time.monotonic() if now is None else now
        memo = self._memo
        if memo is not None and memo[0] is pairs and memo[2] <= now < memo[3]:
            return memo[1]
        out = frozenset(stale_pairs(pairs, self.health, now, self.stale_after_s))
        self._memo = (pairs, out, now, stale_until(self.health, now, self.stale_after_s))
        return out

    def snapshot(self) -> list[dict]:
        now = time.monotonic()
        return [h.as_dict(now) for h in self.health.values()]

    async def _probe(self, url: str) -> None:
        h = self.health.setdefault(url, WorkerHealth(url, time.monotonic()))
        try:
            r = await self.client.get(url + "/health", timeout=httpx.Timeout(self.interval_s * 2, connect=self.interval_s))
        except httpx.HTTPError as exc:
            h.last_error = f"{type(exc).__name__} {exc}".strip()
            h.timed_out = isinstance(exc, httpx.TimeoutException)
        else:
            h.timed_out = False
            body = _json(r)
            if r.status_code == 200:
                instance = body.get("instance")
                if h.instance is not None and instance and instance != h.instance:
                    log.warning("worker %s is a new instance (%s -> %s): it restarted", url, h.instance, instance)
                h.instance = instance or h.instance
                h.last_ok, h.last_error = time.monotonic(), None
            else:
                h.last_error = f"HTTP {r.status_code}: {body.get('reason') or body.get('status') or ''}".strip()
        self._memo = None
        stale = is_stale(h, time.monotonic(), self.stale_after_s)
        if stale != h.stale:
            h.stale = stale
            if stale:
                log.warning("worker %s is stale (no healthy answer for %.1fs: %s); its pair gets no new requests",
                            url, self.stale_after_s, h.last_error)
            else:
                log.info("worker %s answers again; its pair is back", url)
            if self.on_change is not None:
                self.on_change(url, stale)

    async def run_once(self) -> None:
        urls = {u for p in self.pairs() for u in (p.prefill_url, p.decode_url)}
        for gone in set(self.health) - urls:
            del self.health[gone]
            self._memo = None
        await asyncio.gather(*(self._probe(u) for u in urls))
        self.rounds += 1

    def start(self) -> None:
        """Probe now, then every ``interval_s`` (a failing round is logged; the next one still runs)."""
        self._ticker = PeriodicTask(self.run_once, self.interval_s, name="health-probe", immediate=True)
        self._ticker.start()

    async def stop(self) -> None:
        if self._ticker is not None:
            await self._ticker.stop()


def _json(r: httpx.Response) -> dict:
    try:
        body = r.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}
