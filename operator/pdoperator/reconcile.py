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
from dataclasses import dataclass, replace
from typing import Any, Awaitable, Callable, Mapping

import yaml

from . import canary as rollout_safety
from . import drift, metrics
from .config import OperatorConfig
from .kube import ApiError, Kube, object_path, path
from .pairs import (CoRestart, CreatePods, DeletePods, DrainPair, ForceDelete, Plan, RolloutPair, parse_iso,
                    plan_pairs, pod_view, unschedulable_message)
from .render import (ADMIN_KEY, KV_AUTH_KEY, LABEL_COMPONENT, LABEL_DEPLOYMENT, TOPOLOGY_KEY, Owner, TopologyPair, admin_secret, group_slots, slot_name,
                     admin_secret_name, kv_secret,
                     kv_secret_name, router_name, static_children, topology_doc, topology_generation, topology_name,
                     worker_env, worker_pod)
from .revisions import (ANN_CURRENT_SINCE, ANN_KNOWN_GOOD, controller_revision, diff_configs, merge_patch,
                        prune_history, recorded_spec, restore_spec, revision_hash, revision_view, show)
from .routerlink import RouterLink, router_pods_ready
from .spec import GROUP, KIND, VERSION, SpecError, parse_spec
from .status import Facts, build_status, invalid_status, iso, memory_from_status, same_status

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
    good = sorted(_known_good_records({(r.get("data") or {}).get("revision"): r for r in revisions}), reverse=True)
    victims = prune_history(revisions, keep, set(protected) | {rev for _, rev in good[:2]})
    for victim in victims:
        await kube.delete(path("apps/v1", "ControllerRevision", owner.namespace, victim))
    return [r for r in revisions if r["metadata"]["name"] not in victims]


# (namespace, name) -> (monotonic time of the last /config sweep, its drift lines); lines last posted
_PROCESS_CHECKED: dict[tuple[str, str], tuple[float, list[str]]] = {}
_PROCESS_POSTED: dict[tuple[str, str], tuple[str, ...]] = {}
# (namespace, name, revision) -> the canary probe running in the background (never awaited by a reconcile)
_PROBES: dict[tuple[str, str, str], asyncio.Task] = {}


def forget_process_drift(namespace: str, name: str) -> None:
    """Drop a deleted (or no longer ours) PDDeployment's last sweep and canary probes, so a namesake starts
    afresh."""
    _PROCESS_CHECKED.pop((namespace, name), None)
    _PROCESS_POSTED.pop((namespace, name), None)
    for key in [k for k in _PROBES if k[:2] == (namespace, name)]:
        _PROBES.pop(key).cancel()


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


# --- rollout safety: pod drift under Revert, canary, known-good, auto-rollback (decisions in canary.py) ----

ROLLBACK_MANAGER = "pdstack-rollback"  # the field manager of spec patches by a rollback
CANARY_POLL_S = 1.0  # while a probe runs in the background, look at it this often
WATCHDOG_METRIC = "pdrt_watchdog_fired_total"


def revision_spec_of(cr: Mapping[str, Any] | None, current_raw: Mapping[str, Any] | None, name: str) -> Any:
    """The PDSpec a recorded revision ran: its raw revision fields over the current spec's other fields.
    None when the record kept no spec (made by an older operator) or it no longer parses."""
    raw = recorded_spec(cr) if cr else None
    if raw is None:
        return None
    try:
        return parse_spec(restore_spec(current_raw, raw), name=name)
    except SpecError:
        return None


def _pod_drift(specs: Mapping[str, Any], owner: Owner, pods: list[dict[str, Any]],
               policy: str) -> tuple[list[str], dict[int, str]]:
    """Declared fields of live worker pods that another manager now owns (``kubectl edit``; managedFields).
    Returns (drift lines, pair -> what to undo under Revert). A pod is judged against the spec of its own
    revision; pods of a revision we cannot render are not judged."""
    lines: list[str] = []
    reverts: dict[int, str] = {}
    for pod in pods:
        v = pod_view(pod)
        if v is None or v.terminating or v.revision not in specs:
            continue
        suffix = v.name[len(f"{owner.name}-{v.pair}-{v.slot}-"):]
        desired = worker_pod(specs[v.revision], owner, v.revision, v.pair, v.slot, suffix)
        paths = drift.owned_elsewhere(desired, pod)
        if not paths:
            continue
        lines.append(f"Pod/{v.name}: {', '.join(paths[:5])}")
        if policy == "Revert":
            what = f"{v.slot} pod {v.name}: {', '.join(paths[:5])} edited by someone else"
            reverts[v.pair] = f"{reverts[v.pair]}; {what}" if v.pair in reverts else what
    return lines, reverts


def change_lines(crs: Mapping[str, Mapping[str, Any]], old: str, new: str) -> list[str]:
    """``field: old -> new`` over the recorded effective configs of two revisions (``kubectl-pd diff``)."""
    a, b = crs.get(old), crs.get(new)
    if a is None or b is None:
        return [f"revision {old} -> {new} (a record is missing)"]
    return [f"{p}: {show(x)} -> {show(y)}" for p, x, y in diff_configs(revision_view(a), revision_view(b))]


async def _watchdog_fires(http: RouterLink, urls: list[str]) -> int:
    """Watchdog fires counted by the workers' ``/metrics`` (unreadable: 0, no evidence)."""
    total = 0.0
    for text in await asyncio.gather(*(http.get_text(u) for u in urls)):
        for line in (text or "").splitlines():
            if line.startswith(WATCHDOG_METRIC):
                try:
                    total += float(line.rsplit(" ", 1)[1])
                except (IndexError, ValueError):
                    pass
    return int(total)


async def _canary_probe(http: RouterLink, url: str, headers: dict[str, str], spec: Any,
                        metrics_urls: list[str]) -> tuple[dict[str, Any], int]:
    """The multi-round agent probe against a router, pinned to the canary pair; (report, watchdog fires)."""
    c = spec.rollout.canary
    try:
        from pdruntime.probe_agents import run_agents_probe
        before = await _watchdog_fires(http, metrics_urls)
        report = await run_agents_probe(url, agents=c.agents, rounds=c.rounds, round_timeout_s=c.round_timeout_s,
                                        max_tokens=c.max_tokens, headers=headers, model=spec.model.served_name)
        return report.to_dict(), max(0, await _watchdog_fires(http, metrics_urls) - before)
    except asyncio.CancelledError:
        raise
    except Exception as e:  # noqa: BLE001 - a probe that cannot run is no evidence of health: the canary fails
        return {"ok": False, "rounds": [], "failure": {"round": None, "agent": None, "kind": "error",
                                                         "detail": f"the probe could not run: {e!r}"}}, 0


async def _advance_canary(state: Any, *, key: tuple[str, str, str], plan: Plan, spec: Any, http: RouterLink | None,
                          router_ips: list[str], token: str | None, routers_confirmed: bool,
                          stall: Mapping[str, Any] | None, cfg: OperatorConfig, now: float) -> Any:
    """Pending -> Probing (start the background probe) -> Passed | Failed (its result). Never waits on it."""
    pair = plan.pairs[state.pair] if state.pair < len(plan.pairs) else None
    if pair is None or http is None:
        return state
    state = rollout_safety.crashed(state, last_co_restart_at=pair.memory.last_co_restart_at,
                                   reason=pair.memory.last_co_restart_reason, now=now)
    if state.phase == rollout_safety.PENDING:
        if not (router_ips and token and rollout_safety.ready_to_probe(
                state, pair_revision=pair.revision, pair_ready=pair.ready, routers_confirmed=routers_confirmed)):
            return state
        state = rollout_safety.start_probe(state, now)
    if state.phase != rollout_safety.PROBING:
        return state
    task = _PROBES.get(key)
    if task is None:  # just started, or the operator restarted while probing: (re)start it once a router is up
        if router_ips and token:
            headers = {"X-PDStack-Pair": str(state.pair), "X-PDStack-Admin-Token": token}
            metrics_urls = [f"http://{ip}:{cfg.worker_port}/metrics" for ip in (pair.members or {}).values() if ip]
            _PROBES[key] = asyncio.create_task(_canary_probe(http, f"http://{router_ips[0]}:{http.port}", headers,
                                                             spec, metrics_urls))
        return state
    if not task.done():
        return state
    _PROBES.pop(key, None)
    report, fires = task.result() if not task.cancelled() else ({"ok": False, "failure": {"detail": "cancelled"}}, 0)
    msg = (stall or {}).get("message") or ""
    pair_stall = msg if rollout_safety.stalled(stall) and (f"pair {state.pair}" in msg or "pair " not in msg) else None
    return rollout_safety.finish_probe(state, report, now, watchdog_fires=fires, stall=pair_stall)


async def _rollback_spec(kube: Kube, body: Mapping[str, Any], cr: Mapping[str, Any]) -> None:
    """Patch the PDDeployment's spec back to a recorded revision's fields (resourceVersion precondition)."""
    raw = recorded_spec(cr)
    if raw is None:
        raise ValueError(f"ControllerRevision {cr['metadata']['name']} recorded no spec to restore")
    meta = body["metadata"]
    patch = {"metadata": {"resourceVersion": meta["resourceVersion"]},
             "spec": rollback_patch(body.get("spec") or {}, raw)}
    await kube.request("PATCH", path(API, KIND, meta["namespace"], meta["name"]), body=patch,
                       query={"fieldManager": ROLLBACK_MANAGER}, content_type="application/merge-patch+json")


def rollback_patch(current: Mapping[str, Any], recorded: Mapping[str, Any]) -> dict[str, Any]:
    """The merge patch of ``spec`` that restores a revision's fields (the others untouched)."""
    return merge_patch(dict(current), restore_spec(current, recorded))


def _known_good_records(crs: Mapping[str, Mapping[str, Any]]) -> list[tuple[float, str]]:
    """(known-good since, revision) of every recorded revision annotated known-good."""
    out = []
    for rev, c in crs.items():
        t = parse_iso(((c.get("metadata") or {}).get("annotations") or {}).get(ANN_KNOWN_GOOD))
        if t is not None and rev:
            out.append((t, rev))
    return out


async def _known_good(kube: Kube, steps: Steps, body: Mapping[str, Any], log: logging.Logger, *, spec: Any,
                      revision: str, plan: Plan, crs: Mapping[str, Mapping[str, Any]], previous: str | None,
                      stall: Mapping[str, Any] | None, now: float) -> tuple[str | None, float | None]:
    """(lastKnownGoodRevision, seconds until the soak ends). Recorded in status and as an annotation on
    the revision's ControllerRevision (so a lost status can be rebuilt)."""
    if previous is None:  # from the records
        good = _known_good_records(crs)
        previous = max(good)[1] if good else None
    left = rollout_safety.soak_left(revision=revision, pairs=plan.pairs, n_pairs=spec.pairs, stall=stall,
                                    soak_s=spec.rollout.soak_s, now=now)
    if left is None or left > 0:
        return previous, left
    cr = crs.get(revision)
    if cr is not None and not ((cr.get("metadata") or {}).get("annotations") or {}).get(ANN_KNOWN_GOOD):
        meta = cr["metadata"]
        await steps.run(kube.request("PATCH", path("apps/v1", "ControllerRevision", meta["namespace"], meta["name"]),
                                     body={"metadata": {"annotations": {ANN_KNOWN_GOOD: iso(now)}}},
                                     query={"fieldManager": "pdstack-operator"},
                                     content_type="application/merge-patch+json"))
    if previous != revision:
        msg = (f"revision {revision} is known-good: every pair served it for {spec.rollout.soak_s}s "
               "with no stall")
        log.info("%s/%s %s", body["metadata"]["namespace"], body["metadata"]["name"], msg)
        await post_event(kube, body, "Normal", "KnownGood", msg)
    return revision, None

async def _canary_event(kube: Kube, body: Mapping[str, Any], log: logging.Logger, canary: Any,
                        crs: Mapping[str, Mapping[str, Any]]) -> None:
    ns, name = body["metadata"]["namespace"], body["metadata"]["name"]
    tried = "; ".join(change_lines(crs, canary.from_revision, canary.revision))
    if canary.phase == rollout_safety.PROBING:
        etype, reason, msg = "Normal", "CanaryProbing", (f"pair {canary.pair} runs revision {canary.revision}: "
                                                         "the agent probe starts")
    elif canary.phase == rollout_safety.PASSED:
        etype, reason, msg = "Normal", "CanaryPassed", (f"revision {canary.revision} passed its canary on pair "
                                                        f"{canary.pair} ({canary.evidence}); rolling out to every pair")
    elif canary.phase == rollout_safety.FAILED:
        etype, reason, msg = "Warning", "CanaryFailed", (
            f"revision {canary.revision} failed its canary on pair {canary.pair}: {canary.evidence}; pair "
            f"{canary.pair} rolls back to {canary.from_revision} and the rollout stops; tried: {tried}")
    else:
        return
    (log.warning if etype == "Warning" else log.info)("%s/%s %s", ns, name, msg)
    await post_event(kube, body, etype, reason, msg)


async def _auto_rollback(kube: Kube, body: Mapping[str, Any], log: logging.Logger, *, spec: Any, revision: str,
                         crs: Mapping[str, Mapping[str, Any]], good: str | None, stall: Mapping[str, Any] | None,
                         previous: Mapping[str, Any] | None, canary: Any, now: float) -> dict[str, Any] | None:
    """Roll the spec back to the last known-good revision when a stall began soon after this revision
    became current (``rollout.autoRollback``). Returns the new ``status.autoRollback`` (None: unchanged)."""
    reverted = list((previous or {}).get("reverted") or [])
    cr = crs.get(revision)
    changed_at = parse_iso(((cr or {}).get("metadata") or {}).get("annotations", {}).get(ANN_CURRENT_SINCE))
    target = good if good != revision else rollout_safety.rollback_target(_known_good_records(crs), revision)
    to = rollout_safety.auto_rollback(enabled=spec.rollout.auto_rollback, window_s=spec.rollout.rollback_window_s,
                                      desired=revision, last_known_good=target, changed_at=changed_at, stall=stall,
                                      reverted=reverted, canary=canary)
    if to is None:
        return None
    ns, name = body["metadata"]["namespace"], body["metadata"]["name"]
    changes = change_lines(crs, to, revision)
    record = {"from": revision, "to": to, "time": iso(now), "reverted": (reverted + [revision])[-10:],
              "changes": changes}
    try:
        if crs.get(to) is None:
            raise ValueError(f"revision {to} is no longer recorded")
        await _rollback_spec(kube, body, crs[to])
    except (ApiError, ValueError) as e:
        msg = f"stall after revision {revision} became current, but rolling back to {to} failed: {e}"
        log.error("%s/%s %s", ns, name, msg)
        await post_event(kube, body, "Warning", "AutoRollbackFailed", msg)
        return dict(record, error=str(e)[:300])
    msg = (f"stalled within {spec.rollout.rollback_window_s}s of revision {revision} becoming current "
           f"({(stall or {}).get('message') or 'Stalled'}); rolled the spec back to last known-good revision {to}, "
           f"reverting: {'; '.join(changes)}")
    log.warning("%s/%s %s", ns, name, msg)
    await post_event(kube, body, "Warning", "AutoRollback", msg)
    return record


@dataclass(frozen=True)
class Safety:
    """What one reconcile's rollout-safety step leaves for the status and the requeue."""

    canary: dict[str, Any] | None  # status.canary
    canary_failed: str | None  # the CanaryFailed message
    last_known_good: str | None
    auto_rollback: dict[str, Any] | None  # a new status.autoRollback (None: unchanged)
    wait: float | None  # look again this soon (a probe running, a soak ending)


async def _rollout_safety(kube: Kube, steps: Steps, body: Mapping[str, Any], log: logging.Logger, *, spec: Any,
                          revision: str, plan: Plan, crs: Mapping[str, Mapping[str, Any]], canary: Any, prior: Any,
                          old_status: Mapping[str, Any], http: RouterLink | None, router_ips: list[str],
                          token: str | None, routers_confirmed: bool, cfg: OperatorConfig, now: float) -> Safety:
    """The canary's next step, known-good after the soak, auto-rollback on an early stall (canary.py decides)."""
    ns, name = body["metadata"]["namespace"], body["metadata"]["name"]
    stall = next((c for c in old_status.get("conditions") or [] if c.get("type") == "Stalled"), None)
    _cancel_probes(ns, name, keep=canary.revision if canary is not None and canary.holds_traffic_off else None)
    wait: float | None = None
    canary_failed = None
    if canary is not None:
        before = canary.phase
        canary = await _advance_canary(canary, key=(ns, name, canary.revision), plan=plan, spec=spec, http=http,
                                       router_ips=router_ips, token=token, routers_confirmed=routers_confirmed,
                                       stall=stall, cfg=cfg, now=now)
        if canary.phase in (rollout_safety.PENDING, rollout_safety.PROBING):
            wait = CANARY_POLL_S
        elif canary.phase != before:
            wait = 0.05  # promote, or roll the canary pair back, at once
        if canary.phase != before:
            await _canary_event(kube, body, log, canary, crs)
        if canary.phase == rollout_safety.FAILED:
            canary_failed = (f"revision {canary.revision} failed its canary on pair {canary.pair}: {canary.evidence}; "
                             f"tried: {'; '.join(change_lines(crs, canary.from_revision, canary.revision))}")
    serving = {p.revision for p in plan.pairs}  # the revision every pair runs (the spec's, or a canary's old one)
    good, soak = await _known_good(kube, steps, body, log, spec=spec,
                                   revision=serving.pop() if len(serving) == 1 else revision, plan=plan, crs=crs,
                                   previous=old_status.get("lastKnownGoodRevision"), stall=stall, now=now)
    auto = await _auto_rollback(kube, body, log, spec=spec, revision=revision, crs=crs, good=good, stall=stall,
                                previous=old_status.get("autoRollback"), canary=canary, now=now)
    return Safety(_canary_record(canary, prior, revision), canary_failed, good, auto,
                  min((w for w in (wait, soak) if w is not None), default=None))


def _cancel_probes(namespace: str, name: str, keep: str | None) -> None:
    """A probe of a revision the spec no longer asks for is of no use: cancel it."""
    for key in [k for k in _PROBES if k[:2] == (namespace, name) and k[2] != keep]:
        _PROBES.pop(key).cancel()


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
    specs = {revision: spec}
    prior = rollout_safety.CanaryState.from_status(old_status.get("canary"))
    # (engine sglang: its router takes a static list and cannot hold a pair out of traffic; no canary)
    canary = rollout_safety.plan_canary(spec.rollout.canary if spec.engine == "pdrt" else None, pairs=spec.pairs,
                                        desired=revision, current=current,
                                        prior=prior, known_good=old_status.get("lastKnownGoodRevision"), now=now)
    if canary is not None:
        old_spec = revision_spec_of(crs.get(canary.from_revision), body.get("spec"), name)
        if old_spec is None:
            log.warning("%s/%s no canary for revision %s: revision %s recorded no spec to keep the other pairs on",
                        namespace, name, revision, canary.from_revision)
            canary = None
        else:
            specs[canary.from_revision] = old_spec
    if canary is not None and (prior is None or prior.revision != canary.revision):
        await post_event(kube, body, "Normal", "CanaryStarted",
                         f"revision {revision} goes to pair {canary.pair} first (out of normal traffic); the other "
                         f"pairs keep {canary.from_revision} until the agent probe passes")
    pod_lines, reverts = _pod_drift(specs, owner, [p for p in owned if not p["metadata"].get("deletionTimestamp")],
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
                      targets=rollout_safety.targets(canary, pairs=spec.pairs, desired=revision), reverts=reverts,
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
    children = static_children(spec, owner, revision, topo_pairs, doc["generation"])
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

    router_obj = await steps.run(kube.get(path("apps/v1", "Deployment", namespace, router_name(name))), default={})
    router_ready = int(((router_obj or {}).get("status") or {}).get("availableReplicas", 0) or 0) >= spec.router.replicas

    for s in plan.pairs:
        if s.recovered_after_s is not None:
            metrics.PAIR_RECOVERY.labels(namespace, name).observe(s.recovered_after_s)
    metrics.PAIRS_READY.labels(namespace, name).set(sum(1 for s in plan.pairs if s.ready))
    metrics.PAIRS_DESIRED.labels(namespace, name).set(spec.pairs)

    safety = await _rollout_safety(kube, steps, body, log, spec=spec, revision=revision, plan=plan, crs=crs,
                                   canary=canary, prior=prior, old_status=old_status,
                                   http=router if drains else None, router_ips=router_ips, token=token,
                                   routers_confirmed=routers_confirmed, cfg=cfg, now=now)
    facts = Facts(generation=generation, desired_revision=revision, router_ready=router_ready,
                  unschedulable_message=unsched, drift=drift_lines, rejections=steps.rejections,
                  topology_version=doc["generation"], selector=selector,
                  canary=safety.canary, canary_failed=safety.canary_failed,
                  last_known_good=safety.last_known_good, auto_rollback=safety.auto_rollback)
    new = build_status(old_status, plan, facts, now)
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
    if steps.rejections:
        return 2.0 if plan.requeue_after is None else min(plan.requeue_after, 2.0)  # retry; fixing RBAC recovers
    if not new["conditions"][0]["status"] == "True" and plan.requeue_after is None:
        return 10.0  # not ready yet: look again even if no event arrives
    return plan.requeue_after


def _canary_record(canary: Any, prior: Any, revision: str) -> dict[str, Any] | None:
    """``status.canary``: the canary in progress, else the last one of the spec's revision (it passed and the
    rollout finished), else none."""
    if canary is None and prior is not None and prior.revision == revision:
        canary = prior
    return canary.to_status(iso) if canary is not None else None


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
