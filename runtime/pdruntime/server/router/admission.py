"""Router admission: bounded queues and quick back-pressure (issue 20, build item 4).

A request is refused early, at the router, instead of late, by a worker that had to look at it first:

* **pending bound**: a pair holds at most ``max_pending`` requests between dispatch and their first token (its
  prefill queue plus decode's page reservations). More would only wait inside the workers, where a refusal
  costs their HTTP work and comes late.
* **learned capacity**: a pair that refused a request as busy (decode's KV pool full: a 429) is *full* at the
  load it was serving: the router sends it nothing new while its outstanding requests are at that level, until
  one finishes or the mark lapses (the refusal's Retry-After, at most ``MAX_MARK_S``).
* **the queue**: a request that finds every eligible pair at one of those bounds waits in the router for a slot,
  at most ``wait_s``; at most ``max_queued`` requests wait at once. Then it is refused with a 429 whose
  Retry-After comes from the marks and the queue, well within a second of its arrival. The queue is first in,
  first out: each freed slot wakes the one request that has waited longest, not every waiter (a herd of
  hundreds re-checking every pair for each freed slot is what delayed refusals on a busy router).

The state is plain counters and marks (tested in tests/pd/test_admission.py); :meth:`Admission.wait` is the
one ``await``, woken by :meth:`Admission.first_token` and :meth:`Admission.release`.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass

from pdruntime.util.aio import within

MAX_PENDING = 32  # requests per pair between dispatch and their first token
WAIT_S = 0.25  # seconds a request waits for a slot (in the router, then in decode) before it is refused
MAX_QUEUED = 512  # requests waiting for a slot at once; beyond it, refused at arrival
MAX_MARK_S = 5.0  # seconds a busy refusal marks its pair full at most (the mark also ends when a request ends)


@dataclass
class FullMark:
    level: int  # the pair's outstanding requests when it refused, the refused one excluded
    until: float  # time.monotonic(): the mark lapses


class Admission:
    def __init__(self, max_pending: int = MAX_PENDING, wait_s: float = WAIT_S, max_queued: int = MAX_QUEUED) -> None:
        for name, v, lo in (("max_pending", max_pending, 1), ("max_queued", max_queued, 0)):
            if not isinstance(v, int) or v < lo:
                raise ValueError(f"{name}={v!r} is not accepted; accepted: an integer >= {lo}")
        if not wait_s >= 0:
            raise ValueError(f"wait_s={wait_s!r} is not accepted; accepted: seconds >= 0")
        self.max_pending, self.wait_s, self.max_queued = max_pending, wait_s, max_queued
        self.pending: dict[int, int] = {}  # pair index -> requests dispatched there without a first token
        self.marks: dict[int, FullMark] = {}
        self.queued = 0  # requests waiting in wait() now
        self._waiters: deque[asyncio.Future] = deque()  # in arrival order; a done one is skipped

    # ---- what is full ------------------------------------------------------------------------
    def blocked(self, now: float, outstanding: dict[int, int]) -> set[int]:
        """Pairs that take no new request now: at the pending bound, or marked full at their current load."""
        if not self.marks and max(self.pending.values(), default=0) < self.max_pending:
            return set()  # the usual answer, without a comprehension's frame per request
        out = {i for i, n in self.pending.items() if n >= self.max_pending}
        if not self.marks:
            return out
        for i, m in list(self.marks.items()):
            if now >= m.until or i not in outstanding:
                del self.marks[i]
            elif outstanding[i] >= m.level:
                out.add(i)
        return out

    def retry_after(self, now: float) -> int:
        """Seconds a refused request should wait: until the first full mark lapses, else one; more when many wait."""
        lapses = [m.until - now for m in self.marks.values() if m.until > now]
        base = min(lapses) if lapses else 1.0
        return max(1, round(base + self.queued / max(1, self.max_pending)))

    # ---- events --------------------------------------------------------------------------------
    def dispatched(self, pair: int) -> None:
        self.pending[pair] = self.pending.get(pair, 0) + 1

    def first_token(self, pair: int) -> None:
        """The request left the pending phase (a first token, or it ended before one)."""
        n = self.pending.get(pair, 0) - 1
        if n > 0:
            self.pending[pair] = n
        else:
            self.pending.pop(pair, None)
        self._wake()

    def busy(self, pair: int, outstanding: int, retry_after: int | None, now: float) -> None:
        """``pair`` refused a request as busy while serving ``outstanding`` (the refused one excluded)."""
        level = max(1, outstanding)
        old = self.marks.get(pair)
        hold = min(float(retry_after or 1), MAX_MARK_S)
        self.marks[pair] = FullMark(min(level, old.level) if old and old.until > now else level, now + hold)

    def release(self, pair: int | None) -> None:
        """A request on ``pair`` ended: it holds no page any more, so a full pair may take the next one."""
        m = self.marks.get(pair) if pair is not None else None
        if m is not None:
            m.level += 1  # probe upwards: the level it refused at may have been a moment's peak
        self._wake()

    def _wake(self, hops: int = 0) -> None:
        """One slot came free: wake the request that has waited longest (``hops``: how often it was passed on)."""
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(hops)
                return

    def pass_on(self, hops: int) -> None:
        """A woken request could not take the slot (e.g. its pair is one it already tried): wake the next one,
        until every request waiting now has had it (so two that cannot use it never pass it back and forth)."""
        if hops < self.queued:
            self._wake(hops + 1)

    # ---- the queue -----------------------------------------------------------------------------
    def can_queue(self) -> bool:
        return self.queued < self.max_queued

    async def wait(self, timeout: float) -> int | None:
        """Wait (queued, in arrival order) until a slot may have come free or ``timeout`` seconds pass; -> the
        wake's hops (:meth:`pass_on`), None at the timeout. One that leaves instead after a wake (its timeout or
        its client gone, in the same moment) passes the wake on."""
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        self.queued += 1
        hops = None
        try:
            await within(fut, max(0.0, timeout))
            hops = fut.result()
            return hops
        except TimeoutError:
            return None
        finally:
            self.queued -= 1
            if hops is None and fut.done() and not fut.cancelled():
                self._wake(fut.result())  # the slot goes to the next request, not nowhere
            try:
                self._waiters.remove(fut)
            except ValueError:
                pass
