"""``within``: await with a deadline, never swallowing a cancellation; ``detach``: run a coroutine on its own;
``Deadlines``: many timers that nearly never fire, at a fraction of a loop timer's cost.

Python 3.11's ``asyncio.wait_for`` returns the inner result when the caller is cancelled in the same moment the
awaited thing completes (the cancellation is lost; CPython gh-86296, fixed in 3.12 by building wait_for on
``asyncio.timeout``). In the decode worker that let a request already failed by the router go on to reserve
KV pages nobody would free. Every deadline-bounded await in pdstack goes through here instead.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Awaitable, Callable, Coroutine, Hashable, TypeVar

T = TypeVar("T")

_DETACHED: set[asyncio.Task] = set()  # the loop holds tasks weakly: these are kept until they finish


async def within(aw: Awaitable[T], seconds: float | None) -> T:
    """``await aw`` for at most ``seconds`` (None: unbounded); TimeoutError past it. A cancellation of the
    caller always propagates, completed or not."""
    async with asyncio.timeout(seconds):
        return await aw


def detach(coro: Coroutine[Any, Any, Any]) -> asyncio.Task:
    """Run ``coro`` as a task that nothing awaits (best-effort clean-up that a reply must not wait for), held until
    it finishes: a bare ``create_task`` result that nobody keeps may be garbage-collected mid-run."""
    task = asyncio.get_running_loop().create_task(coro)
    _DETACHED.add(task)
    task.add_done_callback(_DETACHED.discard)
    return task


class Deadlines:
    """Deadlines that nearly always pass unreached (a request's deadline before its first token, a worker call's
    read timeout), checked by one sweep every ``tick`` seconds instead of a loop timer each.

    Why: on uvloop a ``call_later`` armed and then cancelled costs about 2.6 us (a TimerHandle and a libuv timer,
    closed on the next loop iteration). The router armed two per request, for timers that fire for a handful of
    requests a day: 1.5% of its instructions per request (callgrind, docs/benchmarks.md "Eighth look"). Here an entry is one dict item, and the sweep runs only while
    some entry is due (in ``time.monotonic()`` seconds). An entry fires at most ``tick`` seconds late, and once."""

    __slots__ = ("tick", "_due", "_timer", "_loop")

    def __init__(self, tick: float = 0.05) -> None:
        self.tick = tick
        self._due: dict[Hashable, tuple[float, Callable[[], Any]]] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the first add's (asked once: a system call on 3.11)

    def __len__(self) -> int:
        return len(self._due)

    def add(self, key: Hashable, when: float, fire: Callable[[], Any]) -> None:
        """``fire()`` once ``time.monotonic()`` has passed ``when``, unless :meth:`discard` comes first; one entry
        per ``key`` (a second add replaces the first)."""
        self._due[key] = (when, fire)
        if self._timer is None:
            loop = self._loop
            if loop is None:
                loop = self._loop = asyncio.get_running_loop()
            self._timer = loop.call_later(self.tick, self._sweep)

    def discard(self, key: Hashable) -> None:
        self._due.pop(key, None)

    def _sweep(self) -> None:
        self._timer = None
        now = time.monotonic()
        due = self._due
        try:
            for key in [k for k, (when, _) in due.items() if when <= now]:
                entry = due.pop(key, None)  # an earlier fire() may have discarded it
                if entry is not None:
                    entry[1]()
        finally:  # a fire() that raised leaves the rest to the next sweep, not unswept
            if due and self._timer is None:
                self._timer = self._loop.call_later(self.tick, self._sweep)  # type: ignore[union-attr]

    def close(self) -> None:
        """Drop every entry unfired."""
        self._due.clear()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
