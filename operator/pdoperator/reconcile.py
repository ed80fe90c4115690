"""One reconcile of one PDDeployment: read, plan (pure modules), act, write status.

Called only by the per-PDDeployment daemon in :mod:`handlers`, which makes this the one writer
of ``.status``. Returns the delay after which it wants to run again (backoff, draining), or None.

Every child is its own step: an API rejection (403, 422, quota, admission webhook) of one write
is recorded (condition ``ApiRejected`` naming the verb, the object and the server's message, plus
a Warning Event) and the other children are still reconciled. Child writes are server-side apply
as ``pdstack-operator``; status goes through the status subresource with a resourceVersion
precondition, retried on conflict.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import secrets
import time
import uuid
from dataclasses import replace
from functools import partial
from typing import Any, Awaitable, Callable, Mapping

import yaml

from . import drift, metrics
from .config import OperatorConfig
from .kube import ApiError, Kube, object_path, path
from .pairs import (CoRestart, CreatePods, DeletePods, DrainPair, ForceDelete, Plan, RolloutPair, plan_pairs,
                    pod_view, unschedulable_message)
from .render import (ADMIN_KEY, KV_AUTH_KEY, LABEL_COMPONENT, LABEL_DEPLOYMENT, TOPOLOGY_KEY, Owner, TopologyPair, admin_secret, group_slots, slot_name,
                     admin_secret_name, kv_secret,
                     kv_secret_name, router_name, static_children, topology_doc, topology_generation, topology_name,
                     worker_env, worker_pod)
from .canary import targets
from .revisions import ANN_KNOWN_GOOD, controller_revision, prune_history, revision_hash
from .safety import forget_probes, known_good_records, plan_rollout, pod_drift, rollout_safety_step
from .routerlink import RouterLink, router_pods_ready
from .spec import GROUP, KIND, VERSION, SpecError, parse_spec
from .status import Facts, build_status, invalid_status, iso, memory_from_status, same_status, with_stalls
from . import stall

API = f"{GROUP}/{VERSION}"
STATUS_CONFLICT_RETRIES = 3


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
            self.rejections.append(f"{e.verb} {e.target}: HTTP {e.status}: {e.message}")
            return default


async def _write_status(kube: Kube, ns: str, name: str, body: Mapping[str, Any], new: dict[str, Any]) -> None:
    """Status subresource, resourceVersion precondition; on 409 re-read and retry (we are its one writer)."""
    url = path(API, KIND, ns, name)
    cur = body
    for attempt in range(STATUS_CONFLICT_RETRIES + 1):
        if same_status(cur.get("status"), new):
            return
        try:
            await kube.patch_status(url, new, cur["metadata"]["resourceVersion"])
            return
        except ApiError as e:
            if e.status != 409 or attempt == STATUS_CONFLICT_RETRIES:
                raise
            fresh = await kube.get(url)
            if fresh is None:
                return
            cur = fresh


async def _apply(kube: Kube, obj: dict[str, Any], policy: str, *, enforce: bool = False) -> list[str]:
    """Server-side apply of one static child; returns drift lines (reported, not reverted)."""
    live = await kube.get(object_path(obj))
    d = drift.decide(obj, live, policy, enforce=enforce)
    if d.action in ("create", "apply", "revert"):
        await kube.apply(drift.with_hash(obj))
    elif d.action == "report":
        return [f"{obj['kind']}/{obj['metadata']['name']}: {', '.join(d.paths[:5])}"]
    return []


async def _ensure_revision(kube: Kube, owner: Owner, spec: Any, revision: str, now: float,
                           raw_spec: Mapping[str, Any] | None = None,
                           protected: frozenset[str] = frozenset()) -> list[dict[str, Any]]:
    """Record ``revision`` as current (a ControllerRevision with its config and raw revision fields);
    prune the history, never a ``protected`` revision (the one pairs fall back to, the last known-good).
    Returns the ControllerRevisions kept."""
    sel = f"{LABEL_DEPLOYMENT}={owner.name}"
    existing = await kube.list(path("apps/v1", "ControllerRevision", owner.namespace), label_selector=sel)
    newest = max(existing, key=lambda r: int(r.get("revision", 0)), default=None)
    if newest is not None and (newest.get("data") or {}).get("revision") == revision:
        return await _prune(kube, owner, existing, spec.revision_history_limit, {revision} | set(protected))
    number = max([int(r.get("revision", 0)) for r in existing] + [0]) + 1
    cr = controller_revision(owner.name, owner.namespace, owner.reference(), spec, revision, number, iso(now),
                             raw_spec)
    for old in [r for r in existing if (r.get("data") or {}).get("revision") == revision]:
        # an older revision becomes current again (a revert): re-record it with a new number and time,
        # so the history says when it became current, like a StatefulSet's revisions; it stays known-good
        good = ((old.get("metadata") or {}).get("annotations") or {}).get(ANN_KNOWN_GOOD)
        if good:
            cr["metadata"]["annotations"][ANN_KNOWN_GOOD] = good
        await kube.delete(path("apps/v1", "ControllerRevision", owner.namespace, old["metadata"]["name"]))
        existing.remove(old)
    try:
        await kube.create(cr)
    except ApiError as e:
        if e.status != 409:
            raise
    return await _prune(kube, owner, existing + [cr], spec.revision_history_limit, {revision} | set(protected))


async def _prune(kube: Kube, owner: Owner, revisions: list[dict[str, Any]], keep: int,
                 protected: set[str]) -> list[dict[str, Any]]:
    """Delete the oldest ControllerRevisions beyond ``keep`` (never a protected one, nor the two most recent
    known-good ones: an auto-rollback's targets; they may outlive the limit for a while); returns those kept."""
    good = sorted(known_good_records({(r.get("data") or {}).get("revision"): r for r in revisions}), reverse=True)
    victims = prune_history(revisions, keep, set(protected) | {rev for _, rev in good[:2]})
    for victim in victims:
        await kube.delete(path("apps/v1", "ControllerRevision", owner.namespace, victim))
    return [r for r in revisions if r["metadata"]["name"] not in victims]


# (namespace, name) -> (monotonic time of the last /config sweep, its drift lines); lines last posted
_PROCESS_CHECKED: dict[tuple[str, str], tuple[float, list[str]]] = {}
_PROCESS_POSTED: dict[tuple[str, str], tuple[str, ...]] = {}


def forget_process_drift(namespace: str, name: str) -> None:
    """Drop a deleted (or no longer ours) PDDeployment's last sweep, so a namesake starts afresh."""
    forget_probes(namespace, name)  # and its canary probes
    _PROCESS_CHECKED.pop((namespace, name), None)
    _PROCESS_POSTED.pop((namespace, name), None)


async def _process_drift(http: RouterLink, cfg: OperatorConfig, namespace: str, name: str, spec: Any,
                         views: list[Any]) -> list[str]:
    """Drift source "process": every ready worker's ``/config`` env against the env its role declares,
    at most every ``process_drift_s`` (between sweeps, the last sweep's lines). An unreadable
    ``/config`` is no evidence either way and gives no line."""
    if cfg.process_drift_s <= 0:
        return []
    key = (namespace, name)
    last = _PROCESS_CHECKED.get(key)
    if last is not None and time.monotonic() - last[0] < cfg.process_drift_s:
        return last[1]
    declared = {role: {e["name"]: e.get("value", e.get("valueFrom")) for e in worker_env(spec, role)}
                for role in ("prefill", "decode")}
    targets = [v for v in views if v.ready and v.ip and not v.terminating]
    configs = await asyncio.gather(*(http.get_json(f"http://{v.ip}:{cfg.worker_port}/config") for v in targets))
    lines = []
    for v, c in zip(targets, configs):
        env = (c or {}).get("env") or {}
        reported = env.get("process_env")
        if not isinstance(reported, dict):
            continue
        allow = tuple(env.get("report_env") or ())
        for line in drift.process_env_drift(declared[v.role], reported, allow, drift.PRESENCE_ONLY):
            lines.append(f"process: Pod/{v.name}: {line}")
    _PROCESS_CHECKED[key] = (time.monotonic(), lines)
    return lines


# (namespace, name) -> (monotonic time of the last stall sweep, its evidence per pair)
_STALL_SEEN: dict[tuple[str, str], tuple[float, dict[int, stall.Evidence]]] = {}


async def _stall_sweep(http: RouterLink, cfg: OperatorConfig, kube: Kube, body: Mapping[str, Any], spec: Any,
                       views: list[Any], router_ips: list[str], token: str | None,
                       log: logging.Logger) -> list[stall.Evidence] | None:
    """Stall detection (``stall.evaluate`` decides), at most every ``stall_check_s``: every router's
    ``/debug/requests`` (its rows and its workers') and each ready worker's ``/metrics``. A Warning Event
    ``Stalled`` and a log line when a pair turns stalled (once per episode: the status remembers it);
    ``pdstack_pair_stalled`` per pair. None: no look (off, no router, no router answered)."""
    ns, name = body["metadata"]["namespace"], body["metadata"]["name"]
    last = _STALL_SEEN.get((ns, name))
    if cfg.stall_check_s <= 0 or not router_ips:
        return None
    if last is not None and time.monotonic() - last[0] < cfg.stall_check_s:
        return list(last[1].values())
    workers = [v for v in views if v.ready and v.ip and not v.terminating]
    docs, texts = await asyncio.gather(
        asyncio.gather(*(http.debug_requests(ip, token) for ip in router_ips)),
        asyncio.gather(*(http.get_text(f"http://{v.ip}:{cfg.worker_port}/metrics") for v in workers)))
    if not any(docs):
        return None
    at = time.monotonic()
    rows, unreachable = stall.rows_by_pair(d for d in docs if d)
    before = last[1] if last is not None else {}
    out: dict[int, stall.Evidence] = {}
    for k in sorted(set(range(spec.pairs)) | set(rows)):
        mine = [(v, t) for v, t in zip(workers, texts) if v.pair == k]
        obs = stall.observe(k, at, rows.get(k, ()), [t for _, t in mine],
                            [t for v, t in mine if v.role == "decode"], unreachable.get(k, ()))
        out[k] = stall.evaluate(before[k].observation if k in before else None, obs, spec.stall.seconds)
    _STALL_SEEN[(ns, name)] = (at, out)
    was = {e.get("pair") for e in ((body.get("status") or {}).get("stalls") or []) if isinstance(e, Mapping)}
    for k, e in out.items():
        metrics.PAIR_STALLED.labels(ns, name, str(k)).set(int(e.stalled))
        if e.stalled and k not in was:
            log.warning("%s/%s %s", ns, name, e.reason)
            await post_event(kube, body, "Warning", "Stalled", e.reason)
    metrics.forget_pairs(ns, name, keep=tuple(out))
    return list(out.values())


async def _secret_token(kube: Kube, owner: Owner, name: str, key: str,
                        make: Callable[[Owner, str], dict[str, Any]]) -> str | None:
    """A per-deployment token Secret: generated once, never rotated by a reconcile; its token."""
    url = path("v1", "Secret", owner.namespace, name)
    secret = await kube.get(url)
    if secret is None:
        token = secrets.token_urlsafe(32)
        try:
            await kube.create(make(owner, token))
            return token
        except ApiError as e:
            if e.status != 409:
                raise
            secret = await kube.get(url) or {}
    raw = (secret.get("data") or {}).get(key)
    if raw:
        return base64.b64decode(raw).decode()
    return (secret.get("stringData") or {}).get(key)


async def _lost_nodes(kube: Kube, steps: Steps, views: list[Any]) -> frozenset[str]:
    """Nodes of terminating pods that are NotReady or gone (their kubelets will not confirm)."""
    lost = set()
    for node in sorted({v.node for v in views if v.terminating and v.node}):
        obj = await steps.run(kube.get(path("v1", "Node", None, node)), default={})
        if obj is None:
            lost.add(node)
            continue
        ready = [c for c in (obj.get("status") or {}).get("conditions", []) or [] if c.get("type") == "Ready"]
        if obj and (not ready or ready[0].get("status") != "True"):
            lost.add(node)
    return frozenset(lost)


async def _delete_pods(kube: Kube, steps: Steps, ns: str, names: tuple[str, ...], uids: Mapping[str, str | None],
                       *, grace: int | None = None) -> None:
    for pod in names:
        await steps.run(kube.delete(path("v1", "Pod", ns, pod), uid=uids.get(pod), grace_period_s=grace))


async def _execute(kube: Kube, steps: Steps, body: Mapping[str, Any], owner: Owner, specs: Mapping[str, Any],
                   plan: Plan, uids: Mapping[str, str | None], log: logging.Logger) -> None:
    """Carry out the plan's actions. ``specs``: revision -> the spec its pods are rendered from (the spec's
    own revision, and during a canary the revision the other pairs keep)."""
    ns, name = owner.namespace, owner.name
    spec = next(iter(specs.values()))
    for a in plan.actions:
        if isinstance(a, ForceDelete):
            await _delete_pods(kube, steps, ns, (a.pod,), uids, grace=0)
            msg = (f"pair {a.pair}: force-deleted pod {a.pod}, Terminating {a.overdue_s:.0f}s past its grace period "
                   f"on lost node {a.node} (its kubelet cannot confirm); the pair is recreated")
            log.warning("%s/%s %s", ns, name, msg)
            await post_event(kube, body, "Warning", "ForceDeleted", msg)
        elif isinstance(a, CoRestart):
            await _delete_pods(kube, steps, ns, a.pods, uids)
            state = plan.pairs[a.pair]
            wait = spec.co_restart.backoff(state.memory.streak)
            msg = (f"pair {a.pair} co-restarted: {a.reason} ({a.detail}); deleted pods {list(a.pods)}; "
                   f"recreating both after {wait:g}s backoff (co-restart #{state.memory.restarts})")
            log.warning("%s/%s %s", ns, name, msg)
            metrics.CO_RESTARTS.labels(ns, name, a.reason).inc()
            await post_event(kube, body, "Warning", "CoRestart", msg)
        elif isinstance(a, RolloutPair):
            await _delete_pods(kube, steps, ns, a.pods, uids)
            msg = f"pair {a.pair} rolling out: revision {a.from_revision} -> {a.to_revision}; deleted {list(a.pods)}"
            log.info("%s/%s %s", ns, name, msg)
            metrics.ROLLOUT_PAIRS.labels(ns, name).inc()
            await post_event(kube, body, "Normal", "RollingOut", msg)
        elif isinstance(a, CreatePods):
            suffix = _suffix()
            created: list[str] = []
            try:
                for role in a.roles:
                    pod = worker_pod(specs.get(a.revision, spec), owner, a.revision, a.pair, role, suffix)
                    await kube.apply(pod)
                    created.append(pod["metadata"]["name"])
            except ApiError as e:
                steps.rejections.append(f"{e.verb} {e.target}: HTTP {e.status}: {e.message}")
                for pod_name in created:  # never leave half a pair behind
                    await steps.run(kube.delete(path("v1", "Pod", ns, pod_name)))
            except BaseException:  # cancellation included
                for pod_name in created:
                    await kube.delete(path("v1", "Pod", ns, pod_name))
                raise
        elif isinstance(a, DeletePods):
            await _delete_pods(kube, steps, ns, a.pods, uids)
            log.info("%s/%s pair %d: deleted %s (%s)", ns, name, a.pair, list(a.pods), a.reason)
        elif isinstance(a, DrainPair):
            log.info("%s/%s pair %d draining before %s", ns, name, a.pair, a.reason)




async def reconcile(kube: Kube, namespace: str, name: str, *, log: logging.Logger,
                    router: RouterLink | None = None, config: OperatorConfig | None = None,
                    now: float | None = None) -> float | None:
    """Bring one PDDeployment's children toward its spec; write its status. Returns a requeue delay."""
    cfg = config or OperatorConfig()
    t0 = time.perf_counter()
    body = await kube.get(path(API, KIND, namespace, name))
    if body is None or body["metadata"].get("deletionTimestamp"):
        metrics.forget(namespace, name)
        forget_process_drift(namespace, name)
        _STALL_SEEN.pop((namespace, name), None)
        return None
    now = time.time() if now is None else now
    meta = body["metadata"]
    old_status = body.get("status") or {}
    old_conds = {c.get("type"): c for c in old_status.get("conditions", []) or []}
    generation = int(meta.get("generation", 0) or 0)
    try:
        spec = parse_spec(body.get("spec"), name=name)
    except SpecError as e:
        facts = Facts(generation=generation, desired_revision=None, spec_error=str(e))
        new = invalid_status(old_status, facts, now)
        if old_conds.get("Stalled", {}).get("message") != f"invalid spec: {e}":
            log.error("%s/%s invalid spec: %s", namespace, name, e)
            await post_event(kube, body, "Warning", "InvalidSpec", str(e))
        await _write_status(kube, namespace, name, body, new)
        return None

    steps = Steps()
    owner = Owner(name, namespace, meta["uid"])
    revision = revision_hash(spec)
    current = old_status.get("currentRevision")
    protected = frozenset(r for r in (current, old_status.get("lastKnownGoodRevision")) if r)
    crs = {(c.get("data") or {}).get("revision"): c for c in await steps.run(
        _ensure_revision(kube, owner, spec, revision, now, body.get("spec"), protected), default=[]) or []}
    # the KV-transfer token (workers only) and the router-admin token (router only; authenticates our pushes)
    await steps.run(_secret_token(kube, owner, kv_secret_name(name), KV_AUTH_KEY, kv_secret))
    token = (await steps.run(_secret_token(kube, owner, admin_secret_name(name), ADMIN_KEY, admin_secret))
             if spec.engine == "pdrt" else None)

    selector = f"{LABEL_DEPLOYMENT}={name},{LABEL_COMPONENT}=worker"
    raw_pods = await kube.list(path("v1", "Pod", namespace), label_selector=selector)
    owned = [p for p in raw_pods if any(r.get("uid") == owner.uid for r in p["metadata"].get("ownerReferences") or [])]
    views = [v for v in (pod_view(p) for p in owned) if v is not None]
    uids = {v.name: v.uid for v in views}

    # canary: which revision each pair runs now; the old revision's spec renders the pairs that keep it
    post = partial(post_event, kube, body)
    prior, canary, specs = await plan_rollout(post, log, spec=spec, revision=revision, raw_spec=body.get("spec"),
                                              name=name, old_status=old_status, crs=crs, now=now)
    pod_lines, reverts = pod_drift(specs, owner, [p for p in owned if not p["metadata"].get("deletionTimestamp")],
                                    spec.drift_policy)
    lost = await _lost_nodes(kube, steps, views)

    drains = spec.engine == "pdrt" and router is not None
    router_ips: list[str] = []
    if drains:
        rsel = f"{LABEL_DEPLOYMENT}={name},{LABEL_COMPONENT}=router"
        router_ips = router_pods_ready(await steps.run(kube.list(path("v1", "Pod", namespace), label_selector=rsel),
                                                       default=[]))
    view = await router.sync(router_ips, None, token) if drains else None
    plan = plan_pairs(desired_revision=revision, pairs=spec.pairs, policy=spec.co_restart,
                      slots=group_slots(spec.prefill.replicas, spec.decode.replicas),
                      max_unavailable=spec.max_unavailable_pairs, pods=views,
                      memory=memory_from_status(old_status), now=now,
                      drain_s=spec.drain_seconds, lost_nodes=lost, lost_node_margin_s=cfg.lost_node_margin_s,
                      drain_confirm_timeout_s=cfg.drain_confirm_timeout_s,
                      targets=targets(canary, pairs=spec.pairs, desired=revision), reverts=reverts,
                      **({"router": view} if view is not None else {}))

    # topology first: a pair marked draining is published (and pushed) before anything is deleted
    canary_pair = canary.pair if canary is not None and canary.holds_traffic_off else None
    topo_pairs = [_topology_group(s, spec, canary=s.index == canary_pair) for s in plan.pairs + plan.retiring]
    live_cm = await steps.run(kube.get(path("v1", "ConfigMap", namespace, topology_name(name))))
    try:
        previous = yaml.safe_load(((live_cm or {}).get("data") or {}).get(TOPOLOGY_KEY, "")) if live_cm else None
    except yaml.YAMLError:
        previous = None
    doc = topology_doc(revision, topo_pairs, 0)
    doc["generation"] = topology_generation(previous, doc)
    children = static_children(spec, owner, revision, topo_pairs, doc["generation"], peers=cfg.network_peers)
    drift_lines: list[str] = []
    topo_cm = next(c for c in children if c["kind"] == "ConfigMap" and c["metadata"]["name"] == topology_name(name))
    await steps.run(_apply(kube, topo_cm, spec.drift_policy, enforce=True))
    routers_confirmed = False
    if drains and router_ips and token:
        pushed = await router.sync(router_ips, doc, token)
        routers_confirmed = pushed.version is not None and pushed.version >= doc["generation"]
    plan = replace(plan, pairs=tuple(_stamp_drain(s, doc["generation"]) for s in plan.pairs),
                   retiring=tuple(_stamp_drain(s, doc["generation"]) for s in plan.retiring))

    await _execute(kube, steps, body, owner, specs, plan, uids, log)
    for k in plan.unconfirmed_drains:
        await post_event(kube, body, "Warning", "DrainUnconfirmed",
                         f"pair {k}: the router did not confirm topology version >= {doc['generation']} within "
                         f"drainSeconds + {cfg.drain_confirm_timeout_s:g}s; its pods were deleted anyway")

    unsched = None
    if plan.unschedulable:
        nodes = await steps.run(kube.list(path("v1", "Node")), default=[])
        everyone: list[dict[str, Any]] = []
        if cfg.cluster_pod_read:  # optional cluster-wide read (rbac.OPTIONAL_RULES): GPUs other workloads hold
            everyone = await steps.run(kube.list(path("v1", "Pod")), default=[])
        unsched = unschedulable_message(requested_gpus=spec.pairs * spec.gpus_per_pair, pods=plan.unschedulable,
                                        nodes=nodes, node_selector=spec.placement.node_selector,
                                        deployment=name, all_pods=everyone)

    for child in children:
        if child is topo_cm:
            continue
        drift_lines += await steps.run(_apply(kube, child, spec.drift_policy), default=[])
    drift_lines += pod_lines

    process_lines = await _process_drift(router, cfg, namespace, name, spec, views) if router is not None else []
    image_lines = drift.image_drift([p for p in owned if not p["metadata"].get("deletionTimestamp")])
    metrics.CONFIG_DRIFT.labels(namespace, name, "children").set(len(drift_lines))
    metrics.CONFIG_DRIFT.labels(namespace, name, "process").set(len(process_lines))
    metrics.CONFIG_DRIFT.labels(namespace, name, "image").set(len(image_lines))
    new_lines = sorted(set(process_lines + image_lines) - set(_PROCESS_POSTED.get((namespace, name), ())))
    _PROCESS_POSTED[(namespace, name)] = tuple(process_lines + image_lines)
    if new_lines:  # an Event once per new line (children drift has its own: the condition's transition)
        await post_event(kube, body, "Warning", "ConfigDrift", "; ".join(new_lines)[:900])
    drift_lines = drift_lines + image_lines + process_lines
    stalls = await _stall_sweep(router, cfg, kube, body, spec, views, router_ips, token, log) if drains else None

    router_obj = await steps.run(kube.get(path("apps/v1", "Deployment", namespace, router_name(name))), default={})
    router_ready = int(((router_obj or {}).get("status") or {}).get("availableReplicas", 0) or 0) >= spec.router.replicas

    for s in plan.pairs:
        if s.recovered_after_s is not None:
            metrics.PAIR_RECOVERY.labels(namespace, name).observe(s.recovered_after_s)
    metrics.PAIRS_READY.labels(namespace, name).set(sum(1 for s in plan.pairs if s.ready))
    metrics.PAIRS_DESIRED.labels(namespace, name).set(spec.pairs)

    safety = await rollout_safety_step(kube, steps, post, body, log, spec=spec, revision=revision, plan=plan,
                                       crs=crs, canary=canary, prior=prior, old_status=old_status,
                                       http=router if drains else None, router_ips=router_ips, token=token,
                                       routers_confirmed=routers_confirmed, cfg=cfg, now=now)
    facts = Facts(generation=generation, desired_revision=revision, router_ready=router_ready,
                  unschedulable_message=unsched, drift=drift_lines, rejections=steps.rejections,
                  topology_version=doc["generation"], selector=selector,
                  canary=safety.canary, canary_failed=safety.canary_failed,
                  last_known_good=safety.last_known_good, auto_rollback=safety.auto_rollback)
    new = build_status(old_status, plan, facts, now)
    new = with_stalls(new, old_status, stalls, now)
    if unsched and old_conds.get("Progressing", {}).get("reason") != "Unschedulable":
        await post_event(kube, body, "Warning", "Unschedulable", unsched)
    rejected = "; ".join(steps.rejections)
    if steps.rejections and old_conds.get("ApiRejected", {}).get("message") != rejected:
        for line in steps.rejections:
            log.warning("%s/%s rejected: %s", namespace, name, line)
            await post_event(kube, body, "Warning", "ApiRejected", line)
            metrics.RECONCILE_ERRORS.labels(namespace, name, "ApiRejected").inc()
    await _write_status(kube, namespace, name, body, new)
    metrics.RECONCILE_DURATION.labels(namespace, name).observe(time.perf_counter() - t0)
    if safety.wait is not None:
        plan = replace(plan, requeue_after=min(plan.requeue_after or safety.wait, safety.wait))
    if cfg.process_drift_s > 0 and router is not None:  # the drift timer: read the processes again in time
        plan = replace(plan, requeue_after=min(plan.requeue_after or cfg.process_drift_s, cfg.process_drift_s))
    if stalls is not None and cfg.stall_check_s > 0:  # the stall timer
        plan = replace(plan, requeue_after=min(plan.requeue_after or cfg.stall_check_s, cfg.stall_check_s))
    if steps.rejections:
        return 2.0 if plan.requeue_after is None else min(plan.requeue_after, 2.0)  # retry; fixing RBAC recovers
    if not new["conditions"][0]["status"] == "True" and plan.requeue_after is None:
        return 10.0  # not ready yet: look again even if no event arrives
    return plan.requeue_after


def _topology_group(s: Any, spec: Any, *, canary: bool = False) -> TopologyPair:
    """A planned group as the router sees it: every member slot, with its pod IP once it has one."""
    members = s.members or {}
    prefills = tuple(members.get(slot_name("prefill", m)) for m in range(spec.prefill.replicas))
    decodes = tuple(members.get(slot_name("decode", m)) for m in range(spec.decode.replicas))
    return TopologyPair(s.index, s.ready, s.hosts[0], s.hosts[1], s.draining, prefill_hosts=prefills,
                        decode_hosts=decodes, canary=canary)


def _stamp_drain(state: Any, generation: int) -> Any:
    """A pair published as draining for the first time records the topology version that shows it."""
    if state.draining and state.memory.drain_started_at is not None and state.memory.drain_version is None:
        return replace(state, memory=replace(state.memory, drain_version=generation))
    return state
