"""What one reconcile of one PDDeployment carries from phase to phase (:mod:`reconcile`).

* :class:`Context`: what every phase needs, fixed for the reconcile: the client, the PDDeployment as read, its
  typed spec and revision, the operator's config, ``now``, the event sink, the deployment's
  :class:`state.DeploymentState`, the log, the router link and the child steps' rejections;
* :class:`Observed`: what the observe phase read (pods, revisions, tokens, the canary, the routers);
* :class:`Steps`: child writes run independently, API rejections collected instead of stopping at the first;
* :class:`EventSink`: Events on the PDDeployment, best effort.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Awaitable, Mapping

from ..core.config import OperatorConfig
from ..core.render import Owner
from ..core.spec import GROUP, KIND, VERSION, PDSpec
from ..core.status import iso
from .kube import ApiError, Kube
from .routerlink import RouterLink
from .state import DeploymentState

API = f"{GROUP}/{VERSION}"


class EventSink:
    """``await events(type, reason, message)``: an Event on the PDDeployment. Best effort: the status and the
    log line carry the same facts."""

    def __init__(self, kube: Kube, body: Mapping[str, Any]) -> None:
        self.kube, self.body = kube, body

    async def __call__(self, etype: str, reason: str, message: str) -> None:
        meta = self.body["metadata"]
        now = iso(time.time())
        event = {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"name": f"{meta['name']}.{uuid.uuid4().hex[:12]}", "namespace": meta["namespace"]},
            "involvedObject": {"apiVersion": API, "kind": KIND, "name": meta["name"], "namespace": meta["namespace"],
                               "uid": meta.get("uid")},
            "type": etype, "reason": reason, "message": message[:1024],
            "source": {"component": "pdstack-operator"},
            "firstTimestamp": now, "lastTimestamp": now, "count": 1,
        }
        try:
            await self.kube.create(event)
        except ApiError:
            pass


class Steps:
    """Runs child steps independently; collects API rejections instead of stopping at the first."""

    def __init__(self) -> None:
        self.rejections: list[str] = []

    async def run(self, step: Awaitable[Any], default: Any = None) -> Any:
        try:
            return await step
        except ApiError as e:
            if e.status == 409 and e.reason == "AlreadyExists":
                return default
            self.reject(e)
            return default

    def reject(self, e: ApiError) -> None:
        self.rejections.append(f"{e.verb} {e.target}: HTTP {e.status}: {e.message}")


@dataclass
class Context:
    """What every phase of one reconcile needs (built once, after the spec parsed)."""

    kube: Kube
    body: Mapping[str, Any]
    spec: PDSpec
    revision: str
    config: OperatorConfig
    now: float
    events: EventSink
    state: DeploymentState
    log: logging.Logger
    router: RouterLink | None = None
    steps: Steps = field(default_factory=Steps)

    @property
    def namespace(self) -> str:
        return self.body["metadata"]["namespace"]

    @property
    def name(self) -> str:
        return self.body["metadata"]["name"]

    @property
    def owner(self) -> Owner:
        return Owner(self.name, self.namespace, self.body["metadata"]["uid"])

    @property
    def old_status(self) -> Mapping[str, Any]:
        return self.body.get("status") or {}

    @property
    def raw_spec(self) -> Mapping[str, Any] | None:
        return self.body.get("spec")

    @property
    def drains(self) -> bool:
        """Drain before delete through the routers (router kind pdstack, any engine: pdstack's router takes pushed
        topology)."""
        return self.spec.pdstack_router and self.router is not None

    def say(self, level: int, message: str) -> None:
        """One log line naming the deployment."""
        self.log.log(level, "%s/%s %s", self.namespace, self.name, message)


@dataclass
class Observed:
    """What the observe phase read from the cluster and the routers."""

    crs: Mapping[str, Mapping[str, Any]]  # revision -> its ControllerRevision
    token: str | None  # the router-admin token (router kind pdstack)
    owned: list[dict[str, Any]]  # our worker pods
    views: list[Any]  # pairs.PodView of each
    prior: Any  # the canary in status (canary.CanaryState | None)
    canary: Any  # the canary for this reconcile
    specs: dict[str, PDSpec]  # revision -> the spec its pods render from
    pod_drift: list[Any]  # drift.DriftEntry of edited pods
    reverts: dict[int, str]  # pair -> what to undo (drift.policy Revert)
    lost_nodes: frozenset[str]
    router_ips: list[str] = field(default_factory=list)
    router_view: Any = None  # pairs.RouterView (None: no router to ask)
    topology: Any = None  # the live topology document (for its generation)

    @property
    def uids(self) -> dict[str, str | None]:
        return {v.name: v.uid for v in self.views}

    @property
    def live(self) -> list[dict[str, Any]]:
        """Our worker pods not being deleted."""
        return [p for p in self.owned if not p["metadata"].get("deletionTimestamp")]
