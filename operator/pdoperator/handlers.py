"""kopf wiring only. Run with ``kopf run -m pdoperator.handlers --all-namespaces``.

One daemon per PDDeployment runs :func:`reconcile.reconcile` in a loop and is the one writer of
its status. Pod, router-Deployment and PDDeployment events only wake that daemon (an in-process
signal keyed by namespace/name); they never write anything themselves.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

import kopf

from . import metrics
from .kube import Kube
from .reconcile import reconcile
from .render import LABEL_DEPLOYMENT
from .spec import GROUP, PLURAL, VERSION

RESYNC_S = 30.0  # periodic reconcile even without events (observe actual state)
ERROR_BACKOFF_S = (0.5, 30.0)  # after a failed reconcile: first delay, cap

log = logging.getLogger("pdoperator")


class Wakers:
    """namespace/name -> asyncio.Event that wakes that PDDeployment's daemon."""

    def __init__(self) -> None:
        self._events: dict[tuple[str, str], asyncio.Event] = {}

    def get(self, namespace: str, name: str) -> asyncio.Event:
        return self._events.setdefault((namespace, name), asyncio.Event())

    def poke(self, namespace: str | None, name: str | None) -> None:
        if namespace and name:
            self.get(namespace, name).set()

    def drop(self, namespace: str, name: str) -> None:
        self._events.pop((namespace, name), None)


_credentials: dict[str, kopf.ConnectionInfo] = {}


@kopf.on.login()
def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    """kopf's own minimal logins (service account, else kubeconfig); remembered for :class:`Kube`."""
    info = kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)
    if info is not None:
        _credentials["current"] = info
    return info


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    settings.persistence.finalizer = f"{GROUP}/operator"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=GROUP)
    settings.posting.level = logging.WARNING
    memo.wakers = Wakers()
    memo.shared = Shared()
    metrics.serve(int(os.environ.get("PDSTACK_OPERATOR_METRICS_PORT", "8080")))


@kopf.on.cleanup()
async def cleanup(memo: kopf.Memo, **_: Any) -> None:
    shared = getattr(memo, "shared", None)
    if shared is not None and shared.kube is not None:
        await shared.kube.close()
        shared.kube = None


class Shared:
    """Operator-wide state. kopf gives each object a shallow copy of the memo: share via this object."""

    kube: Kube | None = None


def _kube(memo: kopf.Memo) -> Kube:
    shared: Shared = memo.shared
    if shared.kube is None:
        info = _credentials.get("current")  # the same credentials kopf logged in with
        if info is None:
            raise kopf.PermanentError("no Kubernetes credentials (service account or kubeconfig)")
        shared.kube = Kube.from_connection_info(info)
    return shared.kube


@kopf.daemon(GROUP, VERSION, PLURAL, cancellation_timeout=2.0)
async def pair_reconciler(namespace: str, name: str, memo: kopf.Memo, stopped: Any, **_: Any) -> None:
    """The one writer of this PDDeployment's status: reconcile on every wake-up and on resync."""
    wake = memo.wakers.get(namespace, name)
    failures = 0

    async def until_stopped() -> None:
        await stopped.wait()

    stop_task = asyncio.create_task(until_stopped())
    try:
        while not stopped:
            wake.clear()
            try:
                delay = await reconcile(_kube(memo), namespace, name, log=log)
                failures = 0
            except Exception as e:  # noqa: BLE001 - any failure is retried with backoff, counted
                failures += 1
                metrics.RECONCILE_ERRORS.labels(namespace, name, type(e).__name__).inc()
                delay = min(ERROR_BACKOFF_S[0] * 2 ** (failures - 1), ERROR_BACKOFF_S[1])
                log.exception("%s/%s reconcile failed (retry in %.1fs)", namespace, name, delay)
            timeout = RESYNC_S if delay is None else min(delay, RESYNC_S)
            wake_task = asyncio.create_task(wake.wait())
            await asyncio.wait({wake_task, stop_task}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            wake_task.cancel()
    finally:
        stop_task.cancel()
        memo.wakers.drop(namespace, name)
        metrics.forget(namespace, name)


@kopf.on.event(GROUP, VERSION, PLURAL)
def pddeployment_event(namespace: str, name: str, memo: kopf.Memo, **_: Any) -> None:
    memo.wakers.poke(namespace, name)


@kopf.on.event("v1", "pods", labels={LABEL_DEPLOYMENT: kopf.PRESENT})
def pod_event(namespace: str, labels: Any, memo: kopf.Memo, **_: Any) -> None:
    memo.wakers.poke(namespace, labels.get(LABEL_DEPLOYMENT))


@kopf.on.event("apps", "v1", "deployments", labels={LABEL_DEPLOYMENT: kopf.PRESENT})
def router_event(namespace: str, labels: Any, memo: kopf.Memo, **_: Any) -> None:
    memo.wakers.poke(namespace, labels.get(LABEL_DEPLOYMENT))


@kopf.on.event("v1", "services", labels={LABEL_DEPLOYMENT: kopf.PRESENT})
@kopf.on.event("v1", "configmaps", labels={LABEL_DEPLOYMENT: kopf.PRESENT})
def child_event(namespace: str, labels: Any, memo: kopf.Memo, **_: Any) -> None:
    """Hand edits of children (drift) are noticed at once, not at the next resync."""
    memo.wakers.poke(namespace, labels.get(LABEL_DEPLOYMENT))
