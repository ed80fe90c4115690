"""kopf wiring only. Run with ``python -m pdoperator`` (namespaced by default; see ``__main__``).

One daemon per PDDeployment runs :func:`reconcile.reconcile` in a loop and is the one writer of
its status; it opens the deployment's :class:`state.DeploymentState` when it starts and drops it when it ends.
Pod, router-Deployment and PDDeployment events only wake that daemon (its state's event, set thread-safely:
kopf runs these sync handlers in a thread pool); they never write anything themselves. Watches of children carry
a server-side label selector (``pdstack.io/deployment``), so the API server sends only ours.

Credentials: :class:`kube.Credentials` (``kubernetes_asyncio``) resolves them once; kopf logs in
with the same facts through :func:`login`, and calls it again after a 401 (rotated tokens).
"""

from __future__ import annotations

import asyncio
import datetime
import logging
from typing import Any

import kopf

from pdruntime.util.backoff import capped_backoff

from ..core.config import OperatorConfig
from ..core.peering import outranked
from ..core.render import LABEL_DEPLOYMENT
from ..core.spec import GROUP, PLURAL, VERSION
from . import metrics
from .kube import Credentials, Kube, path
from .reconcile import reconcile
from .routerlink import RouterLink
from .state import Deployments

RESYNC_S = 30.0  # periodic reconcile even without events (observe actual state)
ERROR_BACKOFF_S = (0.5, 30.0)  # after a failed reconcile: first delay, cap

log = logging.getLogger("pdoperator")


class Shared:
    """Operator-wide state. kopf gives each object a shallow copy of the memo: share via this object."""

    credentials: Credentials | None = None
    kube: Kube | None = None
    peering: tuple[str, int, bool] | None = None  # (name, our priority, cluster-wide); None: standalone
    started_at: float = 0.0  # loop time of this run's start
    router: RouterLink | None = None
    config: OperatorConfig = OperatorConfig()
    deployments: Deployments = Deployments()  # every PDDeployment's state (opened and dropped by its daemon)


SHARED = Shared()
LOGIN_LOCK: asyncio.Lock | None = None


async def _credentials(refresh: bool = False) -> Credentials:
    global LOGIN_LOCK
    LOGIN_LOCK = LOGIN_LOCK or asyncio.Lock()
    async with LOGIN_LOCK:
        if SHARED.credentials is None:
            SHARED.credentials = await Credentials.load()
        elif refresh:
            await SHARED.credentials.refresh()
        return SHARED.credentials


@kopf.on.login()
async def login(logger: Any, **_: Any) -> kopf.ConnectionInfo:
    """kopf logs in with what kubernetes_asyncio resolved (kubeconfig incl. exec plugins, or in-cluster).

    kopf calls this again when its credentials are rejected (401): re-resolve (rotated token file,
    expired exec credential) before answering.
    """
    first = SHARED.credentials is None
    creds = await _credentials(refresh=not first)
    logger.info("credentials from %s", creds.source)
    return await creds.connection_info()


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    cfg = OperatorConfig.from_environ()
    SHARED.config = cfg
    # a fresh start resolves credentials afresh (an earlier run in this process may have left its own)
    global LOGIN_LOCK
    SHARED.credentials, SHARED.kube, SHARED.router = None, None, None
    LOGIN_LOCK = asyncio.Lock()  # bound to this run's event loop
    SHARED.started_at = asyncio.get_running_loop().time()
    SHARED.peering = None if settings.peering.standalone else (
        settings.peering.name, settings.peering.priority, bool(settings.peering.clusterwide))
    settings.persistence.finalizer = f"{GROUP}/operator"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=GROUP)
    settings.posting.level = logging.WARNING
    # no namespace/CRD scanning: the namespaces are given (or all), the CRD is installed first;
    # this spares the operator list/watch on namespaces and CRDs (rbac.py)
    settings.scanning.disabled = True
    settings.peering.lifetime = cfg.peering_lifetime_s
    settings.peering.stealth = True
    # server-side label selectors: the API server sends only our children
    for key in (("v1", "pods"), ("v1", "services"), ("v1", "configmaps"), ("apps", "v1", "deployments")):
        settings.watching.label_selectors[key] = LABEL_DEPLOYMENT
    SHARED.deployments = Deployments()
    memo.deployments = SHARED.deployments
    memo.shared = SHARED
    metrics.serve(cfg.metrics_port)


@kopf.on.cleanup()
async def cleanup(memo: kopf.Memo, **_: Any) -> None:
    if SHARED.kube is not None:
        await SHARED.kube.close()
        SHARED.kube = None
    if SHARED.router is not None:
        await SHARED.router.close()
        SHARED.router = None
    SHARED.credentials = None


async def _outranked(namespace: str) -> list[str]:
    """Live peers of higher priority, read from the peering object itself (see :mod:`peering`)."""
    if SHARED.peering is None:
        return []
    name, priority, clusterwide = SHARED.peering
    kind = "ClusterKopfPeering" if clusterwide else "KopfPeering"
    items = await (await _kube()).list(path("kopf.dev/v1", kind, None if clusterwide else namespace),
                                       field_selector=f"metadata.name={name}")
    now = datetime.datetime.now(datetime.timezone.utc)
    return outranked((items[0].get("status") if items else None), priority, now)


async def _kube() -> Kube:
    if SHARED.kube is None:
        SHARED.kube = Kube(await _credentials())
    return SHARED.kube


def _router() -> RouterLink:
    if SHARED.router is None:
        SHARED.router = RouterLink(SHARED.config.router_port, SHARED.config.router_timeout_s)
    return SHARED.router


@kopf.daemon(GROUP, VERSION, PLURAL, cancellation_timeout=2.0)
async def pair_reconciler(namespace: str, name: str, body: Any, memo: kopf.Memo, stopped: Any, **_: Any) -> None:
    """The one writer of this PDDeployment's status: reconcile on every wake-up and on resync."""
    state = memo.deployments.open(namespace, name)
    wake = state.wake
    failures = 0

    async def until_stopped() -> None:
        await stopped.wait()

    stop_task = asyncio.create_task(until_stopped())
    try:
        if SHARED.peering is not None:  # replicas started together: read each other's heartbeat before acting
            settle = SHARED.started_at + SHARED.config.peering_settle_s - asyncio.get_running_loop().time()
            if settle > 0:
                await asyncio.wait({stop_task}, timeout=settle)
        while not stopped:
            wake.clear()
            try:
                higher = await _outranked(namespace)
                if higher:  # kopf will pause this replica; until it does, never act beside the active one
                    log.info("%s/%s standing by: higher-priority peers %s are alive", namespace, name, higher)
                    await asyncio.wait({stop_task}, timeout=1.0)
                    continue
                delay = await reconcile(await _kube(), namespace, name, log=log, router=_router(),
                                        config=SHARED.config, state=state)
                failures = 0
            except Exception as e:  # noqa: BLE001 - any failure is retried with backoff, counted, posted
                failures += 1
                metrics.RECONCILE_ERRORS.labels(namespace, name, type(e).__name__).inc()
                delay = capped_backoff(failures, *ERROR_BACKOFF_S)
                log.exception("%s/%s reconcile failed (retry in %.1fs)", namespace, name, delay)
                if failures == 1 or failures % 10 == 0:  # an Event per streak start, then every 10th
                    kopf.exception(body, reason="ReconcileError",
                                   message=f"reconcile failed ({type(e).__name__}: {e}); retry in {delay:.1f}s")
            timeout = RESYNC_S if delay is None else min(delay, RESYNC_S)
            wake_task = asyncio.create_task(wake.wait())
            await asyncio.wait({wake_task, stop_task}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            wake_task.cancel()
    finally:
        stop_task.cancel()
        memo.deployments.drop(namespace, name)  # its caches, probes and gauges go with it


@kopf.on.event(GROUP, VERSION, PLURAL)
def pddeployment_event(namespace: str, name: str, memo: kopf.Memo, **_: Any) -> None:
    memo.deployments.poke(namespace, name)


@kopf.on.event("v1", "pods", labels={LABEL_DEPLOYMENT: kopf.PRESENT})
def pod_event(namespace: str, labels: Any, memo: kopf.Memo, **_: Any) -> None:
    memo.deployments.poke(namespace, labels.get(LABEL_DEPLOYMENT))


@kopf.on.event("apps", "v1", "deployments", labels={LABEL_DEPLOYMENT: kopf.PRESENT})
def router_event(namespace: str, labels: Any, memo: kopf.Memo, **_: Any) -> None:
    memo.deployments.poke(namespace, labels.get(LABEL_DEPLOYMENT))


@kopf.on.event("v1", "services", labels={LABEL_DEPLOYMENT: kopf.PRESENT})
@kopf.on.event("v1", "configmaps", labels={LABEL_DEPLOYMENT: kopf.PRESENT})
def child_event(namespace: str, labels: Any, memo: kopf.Memo, **_: Any) -> None:
    """Hand edits of children (drift) are noticed at once, not at the next resync."""
    memo.deployments.poke(namespace, labels.get(LABEL_DEPLOYMENT))
