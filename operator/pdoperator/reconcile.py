"""One reconcile of one PDDeployment: read, plan (pure modules), act, write status.

Called only by the per-PDDeployment daemon in :mod:`handlers`, which makes this the one writer
of ``.status``. Returns the delay after which it wants to run again (backoff, draining), or None.
"""

from __future__ import annotations

import logging
import secrets
import time
import uuid
from typing import Any, Mapping

from . import drift, metrics
from .kube import ApiError, Kube, object_path, path
from .pairs import CoRestart, CreatePods, DeletePods, Plan, RolloutPair, plan_pairs, pod_view, unschedulable_message
from .render import (LABEL_COMPONENT, LABEL_DEPLOYMENT, Owner, TopologyPair, kv_secret, kv_secret_name,
                     router_name, static_children, topology_name, worker_pod)
from .revisions import controller_revision, prune_history, revision_hash
from .spec import GROUP, KIND, VERSION, SpecError, parse_spec
from .status import Facts, build_status, invalid_status, iso, memory_from_status, same_status

API = f"{GROUP}/{VERSION}"


def _suffix() -> str:
    return secrets.token_hex(3)


async def post_event(kube: Kube, body: Mapping[str, Any], etype: str, reason: str, message: str) -> None:
    meta = body["metadata"]
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
        await kube.create(event)
    except ApiError:  # events are best effort; the status and the log line carry the same facts
        pass


async def _write_status(kube: Kube, ns: str, name: str, old: Mapping[str, Any] | None, new: dict[str, Any]) -> None:
    if not same_status(old, new):
        await kube.merge_patch(path(API, KIND, ns, name, "status"), {"status": new})


async def _apply(kube: Kube, obj: dict[str, Any], policy: str, *, enforce: bool = False) -> list[str]:
    """Create or update one static child; returns drift lines (reported, not reverted)."""
    live = await kube.get(object_path(obj))
    d = drift.decide(obj, live, policy, enforce=enforce)
    desired = drift.with_hash(obj)
    if d.action == "create":
        try:
            await kube.create(desired)
        except ApiError as e:
            if e.status != 409:
                raise
    elif d.action in ("apply", "revert"):
        patch = {k: desired[k] for k in drift.MANAGED_KEYS if k in desired}
        patch["metadata"] = {"labels": desired["metadata"]["labels"], "annotations": desired["metadata"]["annotations"]}
        await kube.merge_patch(object_path(obj), patch)
    elif d.action == "report":
        return [f"{obj['kind']}/{obj['metadata']['name']}: {', '.join(d.paths[:5])}"]
    return []


async def _ensure_revision(kube: Kube, owner: Owner, spec: Any, revision: str, now: float) -> None:
    sel = f"{LABEL_DEPLOYMENT}={owner.name}"
    existing = await kube.list(path("apps/v1", "ControllerRevision", owner.namespace), label_selector=sel)
    if any(r.get("data", {}).get("revision") == revision for r in existing):
        return
    number = max([int(r.get("revision", 0)) for r in existing] + [0]) + 1
    cr = controller_revision(owner.name, owner.namespace, owner.reference(), spec, revision, number, iso(now))
    try:
        await kube.create(cr)
    except ApiError as e:
        if e.status != 409:
            raise
    for victim in prune_history(existing + [cr], spec.revision_history_limit, {revision}):
        await kube.delete(path("apps/v1", "ControllerRevision", owner.namespace, victim))


async def _execute(kube: Kube, body: Mapping[str, Any], owner: Owner, spec: Any, plan: Plan,
                   log: logging.Logger) -> None:
    ns, name = owner.namespace, owner.name
    for a in plan.actions:
        if isinstance(a, CoRestart):
            for pod in a.pods:
                await kube.delete(path("v1", "Pod", ns, pod))
            state = plan.pairs[a.pair]
            wait = spec.co_restart.backoff(state.memory.streak)
            msg = (f"pair {a.pair} co-restarted: {a.reason} ({a.detail}); deleted pods {list(a.pods)}; "
                   f"recreating both after {wait:g}s backoff (co-restart #{state.memory.restarts})")
            log.warning("%s/%s %s", ns, name, msg)
            metrics.CO_RESTARTS.labels(ns, name, a.reason).inc()
            await post_event(kube, body, "Warning", "CoRestart", msg)
        elif isinstance(a, RolloutPair):
            for pod in a.pods:
                await kube.delete(path("v1", "Pod", ns, pod))
            msg = f"pair {a.pair} rolling out: revision {a.from_revision} -> {a.to_revision}; deleted {list(a.pods)}"
            log.info("%s/%s %s", ns, name, msg)
            metrics.ROLLOUT_PAIRS.labels(ns, name).inc()
            await post_event(kube, body, "Normal", "RollingOut", msg)
        elif isinstance(a, CreatePods):
            suffix = _suffix()
            created: list[str] = []
            try:
                for role in a.roles:
                    pod = worker_pod(spec, owner, a.revision, a.pair, role, suffix)
                    await kube.create(pod)
                    created.append(pod["metadata"]["name"])
            except BaseException:  # cancellation included
                # never leave half a pair behind: it would read as a deleted pod next time
                for pod_name in created:
                    await kube.delete(path("v1", "Pod", ns, pod_name))
                raise
        elif isinstance(a, DeletePods):
            for pod in a.pods:
                await kube.delete(path("v1", "Pod", ns, pod))
            log.info("%s/%s pair %d: deleted %s (%s)", ns, name, a.pair, list(a.pods), a.reason)


async def reconcile(kube: Kube, namespace: str, name: str, *, log: logging.Logger,
                    now: float | None = None) -> float | None:
    """Bring one PDDeployment's children toward its spec; write its status. Returns a requeue delay."""
    t0 = time.perf_counter()
    body = await kube.get(path(API, KIND, namespace, name))
    if body is None or body["metadata"].get("deletionTimestamp"):
        metrics.forget(namespace, name)
        return None
    now = time.time() if now is None else now
    meta = body["metadata"]
    old_status = body.get("status") or {}
    generation = int(meta.get("generation", 0) or 0)
    try:
        spec = parse_spec(body.get("spec"), name=name)
    except SpecError as e:
        facts = Facts(generation=generation, desired_revision=None, spec_error=str(e))
        new = invalid_status(old_status, facts, now)
        prev = {c.get("type"): c for c in old_status.get("conditions", []) or []}.get("Stalled", {})
        if prev.get("message") != f"invalid spec: {e}":
            log.error("%s/%s invalid spec: %s", namespace, name, e)
            await post_event(kube, body, "Warning", "InvalidSpec", str(e))
        await _write_status(kube, namespace, name, old_status, new)
        return None

    owner = Owner(name, namespace, meta["uid"])
    revision = revision_hash(spec)
    await _ensure_revision(kube, owner, spec, revision, now)
    if await kube.get(path("v1", "Secret", namespace, kv_secret_name(name))) is None:
        try:  # generated once; never rotated by a reconcile
            await kube.create(kv_secret(owner, secrets.token_urlsafe(32)))
        except ApiError as e:
            if e.status != 409:
                raise

    selector = f"{LABEL_DEPLOYMENT}={name},{LABEL_COMPONENT}=worker"
    raw_pods = await kube.list(path("v1", "Pod", namespace), label_selector=selector)
    views = [v for v in (pod_view(p) for p in raw_pods) if v is not None]
    plan = plan_pairs(desired_revision=revision, pairs=spec.pairs, policy=spec.co_restart,
                      max_unavailable=spec.max_unavailable_pairs, pods=views,
                      memory=memory_from_status(old_status), now=now)
    await _execute(kube, body, owner, spec, plan, log)

    unsched = None
    if plan.unschedulable:
        nodes = await kube.list(path("v1", "Node"))
        everyone = await kube.list(path("v1", "Pod"))  # cluster-wide: GPUs other workloads hold
        unsched = unschedulable_message(requested_gpus=spec.pairs * spec.gpus_per_pair, pods=plan.unschedulable,
                                        nodes=nodes, node_selector=spec.placement.node_selector,
                                        deployment=name, all_pods=everyone)

    topology = [TopologyPair(s.index, s.ready, s.hosts[0], s.hosts[1]) for s in plan.pairs]
    drift_lines: list[str] = []
    for child in static_children(spec, owner, revision, topology):
        enforce = child["metadata"]["name"] == topology_name(name) and child["kind"] == "ConfigMap"
        drift_lines += await _apply(kube, child, spec.drift_policy, enforce=enforce)

    router = await kube.get(path("apps/v1", "Deployment", namespace, router_name(name))) or {}
    router_ready = int((router.get("status") or {}).get("availableReplicas", 0) or 0) >= spec.router.replicas

    for s in plan.pairs:
        if s.recovered_after_s is not None:
            metrics.PAIR_RECOVERY.labels(namespace, name).observe(s.recovered_after_s)
    metrics.PAIRS_READY.labels(namespace, name).set(sum(1 for s in plan.pairs if s.ready))
    metrics.PAIRS_DESIRED.labels(namespace, name).set(spec.pairs)

    facts = Facts(generation=generation, desired_revision=revision, router_ready=router_ready,
                  unschedulable_message=unsched, drift=drift_lines)
    new = build_status(old_status, plan, facts, now)
    prev_unsched = {c.get("type"): c for c in old_status.get("conditions", []) or []}.get("Progressing", {})
    if unsched and prev_unsched.get("reason") != "Unschedulable":
        await post_event(kube, body, "Warning", "Unschedulable", unsched)
    await _write_status(kube, namespace, name, old_status, new)
    metrics.RECONCILE_DURATION.labels(namespace, name).observe(time.perf_counter() - t0)
    if not new["conditions"][0]["status"] == "True" and plan.requeue_after is None:
        return 10.0  # not ready yet: look again even if no event arrives
    return plan.requeue_after
