"""Kubelet probe semantics (startup, liveness) for one container, as a pure state machine.

What the kubelet does (pkg/kubelet/prober): the startup probe runs every ``periodSeconds`` from container
start; ``failureThreshold`` consecutive failures restart the container. Liveness and readiness do not run
until the startup probe has succeeded once. After that, ``failureThreshold`` consecutive liveness failures
restart the container. A probe fails on a status outside 200-399, a refused connection, or no answer
within ``timeoutSeconds``.

:class:`ContainerProbes` is the decision; :func:`simulate` drives it over a health timeline (pure, for
table tests with hour-long model loads); ``test_probes.py`` drives it in real time against a real worker.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping


@dataclass(frozen=True)
class Probe:
    period_s: float
    failures: int
    timeout_s: float

    @classmethod
    def of(cls, raw: Mapping[str, Any] | None) -> "Probe | None":
        if not raw:
            return None
        return cls(float(raw.get("periodSeconds", 10)), int(raw.get("failureThreshold", 3)),
                   float(raw.get("timeoutSeconds", 1)))


class ContainerProbes:
    """One container incarnation: which probe is due when, and whether the kubelet restarts it."""

    def __init__(self, container: Mapping[str, Any], start: float = 0.0) -> None:
        self.startup = Probe.of(container.get("startupProbe"))
        self.liveness = Probe.of(container.get("livenessProbe"))
        self.started = self.startup is None
        self.fails = 0
        self.next_at = start
        self.restart_reason: str | None = None

    @property
    def current(self) -> tuple[str, Probe] | None:
        if not self.started:
            return ("startup", self.startup) if self.startup else None
        return ("liveness", self.liveness) if self.liveness else None

    def record(self, now: float, ok: bool) -> str | None:
        """The result of the probe due at ``next_at``; returns the restart reason once the kubelet would restart."""
        kind, probe = self.current  # type: ignore[misc]
        if ok:
            self.fails = 0
            if kind == "startup":
                self.started = True  # liveness starts now; its first run one period later
        else:
            self.fails += 1
            if self.fails >= probe.failures:
                self.restart_reason = f"{kind} probe failed {self.fails} times (period {probe.period_s:g}s)"
                return self.restart_reason
        self.next_at = now + probe.period_s
        return None


def probe_ok(status: int | None, latency_s: float, timeout_s: float) -> bool:
    return status is not None and 200 <= status < 400 and latency_s <= timeout_s


def simulate(container: Mapping[str, Any], health: Callable[[float], tuple[int | None, float]],
             horizon_s: float) -> tuple[float, str] | None:
    """(time, reason) of the first restart within ``horizon_s``, or None. ``health(t)`` answers a probe sent at
    ``t`` with (status or None for no answer, seconds to answer)."""
    cp = ContainerProbes(container)
    while cp.current is not None and cp.next_at <= horizon_s:
        t = cp.next_at
        status, latency = health(t)
        reason = cp.record(t, probe_ok(status, latency, cp.current[1].timeout_s))
        if reason:
            return t, reason
    return None
