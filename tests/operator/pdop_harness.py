"""Harness for operator tests: the API emulator, the simulated kubelet, and the real kopf operator.

KUBECONFIG points at a per-session file; each test rewrites it with its own emulator's URL (the
operator resolves credentials through ``kubernetes_asyncio`` when it starts). Operator bounds are
seconds here, not minutes (lost-node margin, drain-confirm timeout).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, AsyncIterator, Callable

import pytest

_KUBE_DIR = tempfile.mkdtemp(prefix="pdstack-operator-tests-")
KUBECONFIG = os.path.join(_KUBE_DIR, "kubeconfig")
os.environ["KUBECONFIG"] = KUBECONFIG
os.environ["PDSTACK_OPERATOR_METRICS_PORT"] = "0"
os.environ["PDSTACK_OPERATOR_LOST_NODE_MARGIN_S"] = "1"  # bounds in seconds, not minutes, in the tests
os.environ["PDSTACK_OPERATOR_DRAIN_CONFIRM_TIMEOUT_S"] = "3"
os.environ["PDSTACK_OPERATOR_PEERING_SETTLE_S"] = "0.2"  # in-thread operators have no simultaneous peer
os.environ.setdefault("PDSTACK_OPERATOR_PROCESS_DRIFT_S", "0")  # emulated pods run no process; tests that have one set it

import kmock  # noqa: E402
import kopf  # noqa: E402
import yaml  # noqa: E402

from pdop_k8s_emulator import PDEmulator, Kubelet, R  # noqa: E402

PDDS = R("pdstack.io", "v1alpha1", "pddeployments")
PODS = R("", "v1", "pods")
EVENTS = R("", "v1", "events")
PEERINGS = R("kopf.dev", "v1", "kopfpeerings")
NS = "default"
# The runtime image of every test PDDeployment: loaded into the kubelet (as `kind load` does); an image the
# operator renders that is not this one waits in ImagePullBackOff, and the PDDeployment never goes Ready.
IMAGE = "ghcr.io/pdstack/runtime:test"


def write_kubeconfig(url: str) -> None:
    cfg = {"apiVersion": "v1", "kind": "Config", "current-context": "emu",
           "clusters": [{"name": "emu", "cluster": {"server": url}}],
           "users": [{"name": "emu", "user": {}}],
           "contexts": [{"name": "emu", "context": {"cluster": "emu", "user": "emu", "namespace": NS}}]}
    Path(KUBECONFIG).write_text(yaml.safe_dump(cfg))


class Cluster:
    def __init__(self, api: PDEmulator, kubelet: Kubelet, url: str):
        self.api, self.kubelet, self.url = api, kubelet, url

    def pdd(self, name: str) -> dict[str, Any] | None:
        return self.api.read(PDDS, NS, name)

    def pods(self, name: str) -> list[dict[str, Any]]:
        return self.api.select(PODS, NS, f"pdstack.io/deployment={name},pdstack.io/component=worker")

    def pair_pods(self, name: str, pair: int) -> dict[str, dict[str, Any]]:
        return {p["metadata"]["labels"]["pdstack.io/role"]: p for p in self.pods(name)
                if p["metadata"]["labels"]["pdstack.io/pair"] == str(pair)}

    def events(self, name: str, reason: str | None = None) -> list[dict[str, Any]]:
        return [e for e in self.api.select(EVENTS, NS) if e["involvedObject"]["name"] == name
                and (reason is None or e["reason"] == reason)]

    def condition(self, name: str, ctype: str) -> dict[str, Any]:
        for c in ((self.pdd(name) or {}).get("status") or {}).get("conditions", []):
            if c["type"] == ctype:
                return c
        return {}

    def apply(self, manifest: dict[str, Any]) -> dict[str, Any]:
        return self.api._create(PDDS, NS, manifest)

    def patch_spec(self, name: str, spec_patch: dict[str, Any]) -> dict[str, Any]:
        from kmock._internal import dicts
        cur = self.pdd(name)
        assert cur is not None
        return self.api._store(PDDS, NS, name, dict(dicts.merge_patch_dict(cur, {"spec": spec_patch})))

    def delete(self, res: Any, name: str) -> None:
        self.api._delete(res, NS, name)


async def eventually(check: Callable[[], Any], *, timeout: float = 15.0, interval: float = 0.05,
                     what: str = "condition") -> Any:
    """Poll ``check`` until it returns a truthy value; fail with ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        await asyncio.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last value: {last!r}")


def reconciles(name: str, namespace: str = NS) -> int:
    """Finished reconciles of one PDDeployment so far by the operators in this process: the count of the
    operator's ``pdstack_operator_reconcile_duration_seconds`` histogram, observed once per reconcile after its
    status write (kept across deployments of the same name: compare with an earlier reading)."""
    from prometheus_client import REGISTRY

    return int(REGISTRY.get_sample_value("pdstack_operator_reconcile_duration_seconds_count",
                                         {"namespace": namespace, "deployment": name}) or 0)


async def more_reconciles(c: Cluster, name: str, n: int = 3, *, timeout: float = 30.0) -> None:
    """Return once the in-process operator has finished ``n`` more reconciles of ``name``, each after a poke made
    when the previous one had finished (an annotation edit: a PDDeployment event wakes its reconciler). A check
    that follows sees what ``n`` reconciles did, however fast or slow the machine; a fixed sleep may see none."""
    for i in range(n):
        before = reconciles(name)
        pdd = c.pdd(name)
        pdd["metadata"].setdefault("annotations", {})["test/poke"] = f"{before}-{i}"
        c.api._store(PDDS, NS, name, pdd, manager="kubectl")
        await eventually(lambda: reconciles(name) > before, timeout=timeout, what=f"reconcile {i + 1}/{n} of {name}")


@pytest.fixture
async def cluster() -> AsyncIterator[Cluster]:
    """Emulator on loopback + kubelet with two 8-GPU nodes."""
    async with PDEmulator() as api, kmock.Server(api) as server:
        write_kubeconfig(str(server.url).rstrip("/"))
        kubelet = Kubelet(api, images=[IMAGE])
        kubelet.add_node("gpu-a", 8, {"pdstack.io/gpu": "h100"})
        kubelet.add_node("gpu-b", 8, {"pdstack.io/gpu": "h100"})
        async with kubelet:
            yield Cluster(api, kubelet, str(server.url))


_tuned = False


def _register_test_tuning() -> None:
    """Short kopf timeouts so each integration test takes seconds (registered once, after the operator's)."""
    global _tuned
    if _tuned:
        return
    _tuned = True

    @kopf.on.startup(id="test-tuning")
    def tune(settings: kopf.OperatorSettings, **_: Any) -> None:
        settings.watching.server_timeout = 30
        settings.watching.client_timeout = 35
        settings.watching.connect_timeout = 2
        settings.watching.reconnect_backoff = 0.05
        settings.queueing.idle_timeout = 1.0
        settings.queueing.exit_timeout = 1.0
        settings.posting.enabled = True
        settings.networking.request_timeout = 10


@contextlib.asynccontextmanager
async def running_operator(cluster: Cluster, *, clusterwide: bool = True, namespaces: tuple[str, ...] = (),
                           peering: str | None = None, priority: int = 0) -> AsyncIterator[Cluster]:
    """The real kopf operator (pdoperator.shell.handlers) in its own thread and loop, against the emulator.

    A separate loop matters: on exit kopf waits for (then cancels) every task of its loop born after
    its start, which in a shared loop would include the emulator's and pytest's own tasks.
    """
    import pdoperator.shell.handlers  # noqa: F401  (registers the handlers)
    _register_test_tuning()
    # the permissive harness grants the optional cluster-wide pod read; the strict one (rbac.py) does not
    os.environ["PDSTACK_OPERATOR_CLUSTER_POD_READ"] = "0" if cluster.api.rbac is not None else "1"
    logging.getLogger("kopf").setLevel(logging.DEBUG if os.environ.get("PDOP_DEBUG") else logging.WARNING)
    stop, ready = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            peer = {"peering_name": peering, "priority": priority} if peering else {"standalone": True}
            asyncio.run(kopf.operator(clusterwide=clusterwide, namespaces=list(namespaces), stop_flag=stop,
                                      ready_flag=ready, **peer))
        except BaseException as e:  # noqa: BLE001 - surfaced by the fixture
            errors.append(e)

    thread = threading.Thread(target=run, name="kopf-operator", daemon=True)
    thread.start()
    await eventually(lambda: ready.is_set() or errors, timeout=20, what="operator ready")
    assert not errors, errors
    try:
        yield cluster
    finally:
        stop.set()
        await eventually(lambda: not thread.is_alive(), timeout=15, what="operator exit")
        assert not errors, errors


@pytest.fixture
async def operator(cluster: Cluster) -> AsyncIterator[Cluster]:
    async with running_operator(cluster) as c:
        yield c


@pytest.fixture
async def strict_operator(cluster: Cluster) -> AsyncIterator[Cluster]:
    """Namespaced operator whose every request must pass RBAC from :mod:`pdoperator.core.rbac` (recorded)."""
    from pdoperator.core import rbac
    cluster.api.rbac = copy.deepcopy(rbac.NAMESPACED_RULES)
    cluster.api.cluster_rbac = copy.deepcopy(rbac.CLUSTER_RULES)
    cluster.api.seed(PEERINGS, NS, {"metadata": {"name": "pdstack-operator"}})  # the chart creates it
    async with running_operator(cluster, clusterwide=False, namespaces=(NS,), peering="pdstack-operator",
                                priority=100) as c:
        yield c


def manifest(name: str, *, pairs: int = 2, gpus: int = 1, **spec: Any) -> dict[str, Any]:
    body = {"image": IMAGE, "pairs": pairs,
            "prefill": {"resources": {"gpus": gpus}}, "decode": {"resources": {"gpus": gpus}},
            "coRestart": {"policy": "Pair", "backoff": {"initialSeconds": 0.2, "maxSeconds": 2}}}
    body.update(spec)
    return {"apiVersion": "pdstack.io/v1alpha1", "kind": "PDDeployment", "metadata": {"name": name, "namespace": NS},
            "spec": body}
