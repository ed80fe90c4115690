"""An asyncio task that runs one tick every ``interval_s`` seconds until stopped (watchdogs, probes, watchers)."""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from typing import Any, Awaitable, Callable

log = logging.getLogger("pdruntime.periodic")


class PeriodicTask:
    """``tick()`` (sync or async) every ``interval_s`` seconds on the running loop, independent of traffic.

    ``immediate``: the first tick runs at start, and each sleep is the interval minus the tick's own time;
    otherwise every tick follows a full interval. A tick that raises is logged and the next one still runs."""

    def __init__(self, tick: Callable[[], Awaitable[Any] | Any], interval_s: float, *, name: str,
                 immediate: bool = False) -> None:
        self.tick = tick
        self.interval_s = interval_s
        self.name = name
        self.immediate = immediate
        self._task: asyncio.Task | None = None

    @property
    def running(self) -> bool:
        return self._task is not None

    async def _once(self) -> None:
        try:
            result = self.tick()
            if inspect.isawaitable(result):
                await result
        except Exception:  # noqa: BLE001 - the task must outlive any one bad tick
            log.exception("%s: tick failed", self.name)

    async def _run(self) -> None:
        if not self.immediate:
            await asyncio.sleep(self.interval_s)
        while True:
            t0 = time.monotonic()
            await self._once()
            spent = time.monotonic() - t0 if self.immediate else 0.0
            await asyncio.sleep(max(0.0, self.interval_s - spent))

    def start(self) -> None:
        """Start ticking (idempotent)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name=self.name)

    async def stop(self) -> None:
        """Cancel the task and wait until it has ended (idempotent)."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
