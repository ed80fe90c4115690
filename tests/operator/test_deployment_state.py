"""Per-deployment state (``pdoperator.shell.state``): one :class:`DeploymentState` per PDDeployment, opened and dropped
by its daemon, and wake-ups that are safe from kopf's thread pool (issue 18; issue 19, defect 9)."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest

from pdop_harness import PDDS, eventually, manifest
from pdoperator.shell import handlers, metrics
from pdoperator.shell.state import Deployments


async def test_a_wake_up_from_kopfs_thread_pool_reaches_the_daemon_at_once():
    """kopf runs the sync event handlers in a thread pool. ``asyncio.Event.set`` from there is not thread-safe:
    the waiting daemon's loop is not woken and sleeps on until its next timer (here 5 s). The state hands the
    set to the daemon's loop (``call_soon_threadsafe``)."""
    deployments = Deployments()
    state = deployments.open("default", "llm")
    waiter = asyncio.ensure_future(state.wake.wait())
    await asyncio.sleep(0)  # the daemon waits on its wake-up
    memo = SimpleNamespace(deployments=deployments)
    labels = {"pdstack.io/deployment": "llm"}

    def kopf_worker() -> None:
        time.sleep(0.2)  # the daemon's loop is asleep in its selector by now
        handlers.pod_event(namespace="default", labels=labels, memo=memo)

    t0 = time.monotonic()
    thread = threading.Thread(target=kopf_worker)
    thread.start()
    await asyncio.wait({waiter}, timeout=5.0)
    elapsed = time.monotonic() - t0
    thread.join()
    assert waiter.done() and elapsed < 2.5, f"the daemon woke after {elapsed:.1f}s"


async def test_events_of_a_deployment_without_a_daemon_create_no_state():
    deployments = Deployments()
    deployments.poke("default", "gone")  # a pod event after its deployment (and daemon) went
    assert list(deployments) == [] and deployments.get("default", "gone") is None
    state = deployments.open("default", "llm")
    state.probes["r1"] = asyncio.ensure_future(asyncio.sleep(60))
    state.no_canary_logged.add("r1")
    deployments.drop("default", "llm")
    await asyncio.sleep(0)
    assert list(deployments) == [] and state.probes == {}


def _gauge_leftovers(prefix: str) -> list[tuple[str, dict[str, str]]]:
    out = []
    for gauge in (metrics.PAIRS_READY, metrics.PAIRS_DESIRED, metrics.CONFIG_DRIFT, metrics.PAIR_STALLED):
        for m in gauge.collect():
            out += [(s.name, s.labels) for s in m.samples if s.labels.get("deployment", "").startswith(prefix)]
    return out


@pytest.mark.slow  # about a minute on 2 cores
async def test_deleting_50_deployments_leaves_no_per_deployment_entry_in_any_cache(operator):
    c = operator
    names = [f"churn-{i}" for i in range(50)]
    for n in names:
        c.apply(manifest(n, pairs=1, gpus=0))

    def reconciled():
        return all(((c.pdd(n) or {}).get("status") or {}).get("observedGeneration") for n in names)
    await eventually(reconciled, timeout=120, interval=0.2, what="every deployment reconciled")
    opened = {k for k in handlers.SHARED.deployments if k[1].startswith("churn-")}
    assert opened == {("default", n) for n in names}
    assert _gauge_leftovers("churn-"), "the gauges are per deployment while it exists"

    for n in names:
        c.delete(PDDS, n)
    await eventually(lambda: not any(c.pdd(n) for n in names), timeout=120, interval=0.2, what="all deleted")
    await eventually(lambda: not [k for k in handlers.SHARED.deployments if k[1].startswith("churn-")],
                     timeout=30, what="every DeploymentState dropped")
    assert _gauge_leftovers("churn-") == []
