"""What the operator keeps about each PDDeployment between reconciles: one :class:`DeploymentState` each.

Every per-deployment cache and background result lives here (the daemon's wake-up, the last process-drift
and stall sweeps, the drift lines already posted as Events, the canary probes, the revisions a canary could not
be run for), never in a module global. :class:`Deployments` holds them: the PDDeployment's daemon
(:func:`handlers.pair_reconciler`) opens its state when it starts and drops it when it ends (the deployment was
deleted, or this operator stops serving it): the one place a state is created and the one place it goes.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field
from typing import Any, Iterator

from . import metrics


@dataclass
class DeploymentState:
    """One PDDeployment's caches. Owned by its daemon's event loop; :meth:`poke` is safe from any thread."""

    namespace: str
    name: str
    loop: asyncio.AbstractEventLoop | None = None  # the daemon's loop (wake-ups from other threads go through it)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    # drift source "process": (monotonic time of the last /config sweep, its drift entries)
    process_sweep: tuple[float, list[Any]] | None = None
    posted_drift: tuple[str, ...] = ()  # process/image drift lines already posted as a ConfigDrift Event
    posted_mappings: dict[str, str] = field(default_factory=dict)  # Event reason -> the revision it was posted for
    # stall detection: (monotonic time of the last sweep, its evidence per pair)
    stall_sweep: tuple[float, dict[int, Any]] | None = None
    probes: dict[str, asyncio.Task] = field(default_factory=dict)  # revision -> its canary probe (background)
    no_canary_logged: set[str] = field(default_factory=set)  # revisions a canary could not be run for (logged)

    @property
    def key(self) -> tuple[str, str]:
        return self.namespace, self.name

    def poke(self) -> None:
        """Wake the daemon. kopf runs sync handlers in a thread pool, and ``asyncio.Event.set`` is not
        thread-safe: from another thread the set is handed to the daemon's loop."""
        loop = self.loop
        if loop is None or _in_loop(loop):
            self.wake.set()
        elif not loop.is_closed():
            loop.call_soon_threadsafe(self.wake.set)

    def cancel_probes(self, keep: str | None = None) -> None:
        """Cancel every canary probe but ``keep``'s (a probe of a revision no longer asked for is of no use)."""
        for revision in [r for r in self.probes if r != keep]:
            self.probes.pop(revision).cancel()

    def close(self) -> None:
        """The deployment is gone (or no longer ours): cancel its probes, drop its gauges."""
        self.cancel_probes()
        metrics.forget(self.namespace, self.name)

    def reset(self) -> None:
        """Seen deleted (its daemon not yet stopped): forget every cache, so a namesake starts afresh."""
        self.close()
        self.process_sweep = self.stall_sweep = None
        self.posted_drift = ()
        self.posted_mappings.clear()
        self.no_canary_logged.clear()


def _in_loop(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


class Deployments:
    """namespace/name -> :class:`DeploymentState`. Opened and dropped by the deployment's daemon only; a pod
    event for a deployment with no daemon (not yet started, or already gone) creates nothing."""

    def __init__(self) -> None:
        self._states: dict[tuple[str, str], DeploymentState] = {}
        self._lock = threading.Lock()  # poke() comes from kopf's thread pool

    def open(self, namespace: str, name: str) -> DeploymentState:
        """The state of a deployment whose daemon starts now (on the running loop)."""
        with self._lock:
            state = self._states.get((namespace, name))
            if state is None:
                state = self._states[(namespace, name)] = DeploymentState(namespace, name)
            state.loop = asyncio.get_running_loop()
            return state

    def get(self, namespace: str, name: str) -> DeploymentState | None:
        with self._lock:
            return self._states.get((namespace, name))

    def poke(self, namespace: str | None, name: str | None) -> None:
        """Wake that deployment's daemon, if it has one (thread-safe)."""
        state = self.get(namespace, name) if namespace and name else None
        if state is not None:
            state.poke()

    def drop(self, namespace: str, name: str) -> None:
        """The deployment's daemon ends: its state goes, with its probes and gauges."""
        with self._lock:
            state = self._states.pop((namespace, name), None)
        if state is not None:
            state.close()

    def __iter__(self) -> Iterator[tuple[str, str]]:
        with self._lock:
            return iter(list(self._states))
