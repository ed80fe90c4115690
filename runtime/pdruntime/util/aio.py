"""``within``: await with a deadline, never swallowing a cancellation; ``detach``: run a coroutine on its own.

Python 3.11's ``asyncio.wait_for`` returns the inner result when the caller is cancelled in the same moment the
awaited thing completes (the cancellation is lost; CPython gh-86296, fixed in 3.12 by building wait_for on
``asyncio.timeout``). In the decode worker that let a request already failed by the router go on to reserve
KV pages nobody would free. Every deadline-bounded await in pdstack goes through here instead.
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Coroutine, TypeVar

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
