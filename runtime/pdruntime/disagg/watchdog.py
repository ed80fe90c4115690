"""Phase-scoped watchdogs that tick on their own.

A :class:`Watchdog` holds armed deadlines ``(key, phase, started_at, timeout_s)``. Its own asyncio
task wakes every ``tick_s`` seconds, independent of traffic and of the engine thread, so a lone
stuck request on an idle engine is still found. Arming happens on entry to the guarded phase and
disarming on exit (prefill transfer: armed at "KV ready", disarmed at "receipt confirmed"), so a
long decode phase is never covered by a transfer timeout.

Time comes from a :class:`Clock` that tests can advance (``ManualOffsetClock``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

from pdruntime.util.periodic import PeriodicTask

log = logging.getLogger("pdruntime.watchdog")


class Clock:
    """Monotonic seconds."""

    def now(self) -> float:
        return time.monotonic()


class OffsetClock(Clock):
    """Monotonic seconds plus an offset that tests advance (test hooks only; never moves backwards)."""

    def __init__(self) -> None:
        self.offset = 0.0

    def now(self) -> float:
        return time.monotonic() + self.offset

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError("the clock only moves forward")
        self.offset += seconds


@dataclass
class Deadline:
    key: str
    phase: str  # bootstrap | transfer | decode_transfer
    started_at: float  # clock seconds
    timeout_s: float
    on_fire: Callable[["Deadline"], None]
    ids: str = ""  # extra ids for the log line (rid, room)

    def expired(self, now: float) -> bool:
        return now - self.started_at > self.timeout_s


class Watchdog:
    """Deadlines per (key, phase), checked on an independent tick."""

    def __init__(self, role: str, clock: Clock, tick_s: float, on_fired: Callable[[str, str], None] | None = None) -> None:
        self.role = role
        self.clock = clock
        self.tick_s = tick_s
        self._armed: dict[tuple[str, str], Deadline] = {}
        self._on_fired = on_fired  # (role, phase) -> None; metrics hook
        self._ticker = PeriodicTask(self.check, tick_s, name=f"watchdog-{role}")
        self.ticks = 0  # number of completed ticks (observable in /debug and tests)

    def arm(self, key: str, phase: str, timeout_s: float, on_fire: Callable[[Deadline], None], ids: str = "") -> None:
        self._armed[(key, phase)] = Deadline(key, phase, self.clock.now(), timeout_s, on_fire, ids)

    def disarm(self, key: str, phase: str | None = None) -> None:
        if phase is not None:
            self._armed.pop((key, phase), None)
            return
        for k in [k for k in self._armed if k[0] == key]:
            del self._armed[k]

    def armed(self) -> list[Deadline]:
        return list(self._armed.values())

    def check(self, now: float | None = None) -> list[Deadline]:
        """Fire every expired deadline once; returns those fired."""
        now = self.clock.now() if now is None else now
        fired = [d for d in self._armed.values() if d.expired(now)]
        for d in fired:
            self._armed.pop((d.key, d.phase), None)
            log.warning(
                "watchdog fired: role=%s phase=%s key=%s %s age=%.3fs timeout=%.3fs",
                self.role, d.phase, d.key, d.ids, now - d.started_at, d.timeout_s,
            )
            if self._on_fired is not None:
                self._on_fired(self.role, d.phase)
            try:
                d.on_fire(d)
            except Exception:  # a failing handler must not stop the watchdog
                log.exception("watchdog handler failed for key=%s phase=%s", d.key, d.phase)
        self.ticks += 1
        return fired

    def start(self) -> None:
        """Check every ``tick_s`` seconds on the running loop (idempotent)."""
        self._ticker.start()

    async def stop(self) -> None:
        await self._ticker.stop()
