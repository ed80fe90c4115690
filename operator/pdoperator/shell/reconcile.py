"""One reconcile of one PDDeployment, in four phases: observe, plan, act, report.

* :func:`observe` reads: the revision records, the tokens, our worker pods, the canary, pod drift, lost nodes,
  the routers and the live topology;
* :func:`plan` decides (pure): the pair plan (:mod:`pairs`), the topology and the static children;
* :func:`act` writes: topology first (pushed to the routers), then the plan's pod actions, the children, and
  reads the evidence (drift, stalls, the canary probe);
* :func:`report` writes the status and returns the requeue delay.

Called only by the per-PDDeployment daemon in :mod:`handlers`, which makes this the one writer of
``.status``. Returns the delay after which it wants to run again (backoff, draining), or None.

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
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping

import yaml

from ..core import drift, stall
from ..core.config import OperatorConfig
from ..core.engines import kernel_mapping, watchdog_mapping
from ..core.drift import DriftEntry
from ..core.pairs import (CoRestart, CreatePods, DeletePods, DrainPair, ForceDelete, Plan, PlanInput, RolloutPair,
                          RouterView, plan_pairs, pod_view, unschedulable_message)
from ..core.render import (ADMIN_KEY, KV_AUTH_KEY, LABEL_COMPONENT, LABEL_DEPLOYMENT, TOPOLOGY_KEY, Owner,
                           TopologyPair, admin_secret, admin_secret_name, group_slots, kv_secret, kv_secret_name,
                           router_name, slot_name, static_children, topology_doc, topology_generation, topology_name,
                           worker_env, worker_pod)
from ..core.revisions import ANN_KNOWN_GOOD, controller_revision, known_good, prune_history, revision_hash
from ..core.spec import KIND, SpecError, parse_spec
from ..core.status import Facts, build_status, invalid_status, iso, memory_from_status, same_status, with_stalls
from ..safety.canary import targets
from ..safety.rollout import Safety, plan_rollout, pod_drift, rollout_safety_step
from . import metrics
from .context import API, Context, EventSink, Observed, Steps
from .kube import ApiError, Kube, object_path, path
from .routerlink import RouterLink, router_pods_ready
from .state import DeploymentState

STATUS_CONFLICT_RETRIES = 3


def _suffix() -> str:
    return secrets.token_hex(3)


async def reconcile(kube: Kube, namespace: str, name: str, *, log: logging.Logger,
                    router: RouterLink | None = None, config: OperatorConfig | None = None,
                    now: float | None = None, state: DeploymentState | None = None) -> float | None:
    """Bring one PDDeployment's children toward its spec; write its status. Returns a requeue delay.
    ``state``: the deployment's caches (its daemon's; a fresh one when not given)."""
    t0 = time.perf_counter()
    state = state if state is not None else DeploymentState(namespace, name)
    body = await kube.get(path(API, KIND, namespace, name))
    if body is None or body["metadata"].get("deletionTimestamp"):
        state.reset()  # gone or going: a namesake starts afresh
        return None
    now = time.time() if now is None else now
    try:
        spec = parse_spec(body.get("spec"), name=name)
    except SpecError as e:
        await _report_invalid(kube, body, log, now, e)
        return None
    ctx = Context(kube, body, spec, revision_hash(spec), config or OperatorConfig(), now, EventSink(kube, body),
                  state, log, router)
    obs = await observe(ctx)
    planned = plan(ctx, obs)
    acted = await act(ctx, obs, planned)
    return await report(ctx, planned, acted, t0)


async def _report_invalid(kube: Kube, body: Mapping[str, Any], log: logging.Logger, now: float,
                          e: SpecError) -> None:
    """An invalid spec: children are left as they are; the status (and an Event, once) says what is wrong."""
    old = body.get("status") or {}
    meta = body["metadata"]
    generation = int(meta.get("generation", 0) or 0)
    new = invalid_status(old, Facts(generation=generation, desired_revision=None, spec_error=str(e)), now)
    if _conditions(old).get("Stalled", {}).get("message") != f"invalid spec: {e}":
        log.error("%s/%s invalid spec: %s", meta["namespace"], meta["name"], e)
        await EventSink(kube, body)("Warning", "InvalidSpec", str(e))
    await _write_status(kube, body, new)


def _conditions(status: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    return {c.get("type"): c for c in status.get("conditions", []) or []}


# ---------------------------------------------------------------- observe
async def observe(ctx: Context) -> Observed:
    """Read what this reconcile decides on. Child reads and writes here are steps (a rejection is recorded)."""
    steps, kube, owner, old = ctx.steps, ctx.kube, ctx.owner, ctx.old_status
    protected = frozenset(r for r in (old.get("currentRevision"), old.get("lastKnownGoodRevision")) if r)
    crs = {(c.get("data") or {}).get("revision"): c
           for c in await steps.run(_ensure_revision(ctx, protected), default=[]) or []}
    # the KV-transfer token (workers only) and the router-admin token (router only; authenticates our pushes)
    await steps.run(_secret_token(kube, owner, kv_secret_name(ctx.name), KV_AUTH_KEY, kv_secret))
    token = (await steps.run(_secret_token(kube, owner, admin_secret_name(ctx.name), ADMIN_KEY, admin_secret))
             if ctx.spec.pdstack_router else None)

    selector = f"{LABEL_DEPLOYMENT}={ctx.name},{LABEL_COMPONENT}=worker"
    raw_pods = await kube.list(path("v1", "Pod", ctx.namespace), label_selector=selector)
    owned = [p for p in raw_pods if any(r.get("uid") == owner.uid for r in p["metadata"].get("ownerReferences") or [])]
    views = [v for v in (pod_view(p) for p in owned) if v is not None]

    # canary: which revision each pair runs now; the old revision's spec renders the pairs that keep it
    prior, canary, specs = await plan_rollout(ctx, crs)
    live = [p for p in owned if not p["metadata"].get("deletionTimestamp")]
    pod_entries, reverts = pod_drift(specs, owner, live, ctx.spec.drift_policy)
    obs = Observed(crs, token, owned, views, prior, canary, specs, pod_entries, reverts,
                   await _lost_nodes(kube, steps, views))
    if ctx.drains:
        rsel = f"{LABEL_DEPLOYMENT}={ctx.name},{LABEL_COMPONENT}=router"
        obs.router_ips = router_pods_ready(await steps.run(kube.list(path("v1", "Pod", ctx.namespace),
                                                                     label_selector=rsel), default=[]))
        obs.router_view = await ctx.router.sync(obs.router_ips, None, token)  # type: ignore[union-attr]
    obs.topology = await _live_topology(ctx)
    return obs


async def _live_topology(ctx: Context) -> Any:
    """The topology document the ConfigMap holds now (None: none, or not YAML): the next generation follows it."""
    live_cm = await ctx.steps.run(ctx.kube.get(path("v1", "ConfigMap", ctx.namespace, topology_name(ctx.name))))
    try:
        return yaml.safe_load(((live_cm or {}).get("data") or {}).get(TOPOLOGY_KEY, "")) if live_cm else None
    except yaml.YAMLError:
        return None


async def _ensure_revision(ctx: Context, protected: frozenset[str]) -> list[dict[str, Any]]:
    """Record the spec's revision as current (a ControllerRevision with its config and raw revision fields);
    prune the history, never a ``protected`` revision (the one pairs fall back to, the last known-good).
    Returns the ControllerRevisions kept."""
    kube, owner, spec, revision = ctx.kube, ctx.owner, ctx.spec, ctx.revision
    sel = f"{LABEL_DEPLOYMENT}={owner.name}"
    existing = await kube.list(path("apps/v1", "ControllerRevision", owner.namespace), label_selector=sel)
    newest = max(existing, key=lambda r: int(r.get("revision", 0)), default=None)
    if newest is not None and (newest.get("data") or {}).get("revision") == revision:
        return await _prune(kube, owner, existing, spec.revision_history_limit, {revision} | set(protected))
    number = max([int(r.get("revision", 0)) for r in existing] + [0]) + 1
    cr = controller_revision(owner.name, owner.namespace, owner.reference(), spec, revision, number, iso(ctx.now),
                             ctx.raw_spec)
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
    good = known_good({(r.get("data") or {}).get("revision"): r for r in revisions}.values())
    victims = prune_history(revisions, keep, set(protected) | {rev for _, rev in good[:2]})
    for victim in victims:
        await kube.delete(path("apps/v1", "ControllerRevision", owner.namespace, victim))
    return [r for r in revisions if r["metadata"]["name"] not in victims]


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


async def _delete_pods(ctx: Context, names: tuple[str, ...], uids: Mapping[str, str | None], *,
                       grace: int | None = None) -> None:
    for pod in names:
        await ctx.steps.run(ctx.kube.delete(path("v1", "Pod", ctx.namespace, pod), uid=uids.get(pod),
                                            grace_period_s=grace))


# ---------------------------------------------------------------- plan
@dataclass(frozen=True)
class Planned:
    """What the plan phase decided: the pair plan, the topology it publishes, the static children."""

    plan: Plan
    topology: dict[str, Any]  # the topology document (its generation included)
    children: list[dict[str, Any]]
    topology_cm: dict[str, Any]  # the child that carries the topology (applied first, enforced)


def plan(ctx: Context, obs: Observed) -> Planned:
    """Decide, from what was observed (pure: no I/O)."""
    spec, cfg = ctx.spec, ctx.config
    planned = plan_pairs(PlanInput(
        desired_revision=ctx.revision, pairs=spec.pairs, policy=spec.co_restart,
        slots=group_slots(spec.prefill.replicas, spec.decode.replicas),
        max_unavailable=spec.max_unavailable_pairs, pods=obs.views, memory=memory_from_status(ctx.old_status),
        now=ctx.now, drain_s=spec.drain_seconds, lost_nodes=obs.lost_nodes, lost_node_margin_s=cfg.lost_node_margin_s,
        drain_confirm_timeout_s=cfg.drain_confirm_timeout_s,
        targets=targets(obs.canary, pairs=spec.pairs, desired=ctx.revision), reverts=obs.reverts,
        router=obs.router_view if obs.router_view is not None else RouterView()))
    # topology first: a pair marked draining is published (and pushed) before anything is deleted
    canary_pair = obs.canary.pair if obs.canary is not None and obs.canary.holds_traffic_off else None
    topo_pairs = [_topology_group(s, spec, canary=s.index == canary_pair) for s in planned.pairs + planned.retiring]
    doc = topology_doc(ctx.revision, topo_pairs, 0)
    doc["generation"] = topology_generation(obs.topology, doc)
    children = static_children(spec, ctx.owner, ctx.revision, topo_pairs, doc["generation"], peers=cfg.network_peers)
    topo_cm = next(c for c in children if c["kind"] == "ConfigMap" and c["metadata"]["name"] == topology_name(ctx.name))
    planned = replace(planned, pairs=tuple(_stamp_drain(s, doc["generation"]) for s in planned.pairs),
                      retiring=tuple(_stamp_drain(s, doc["generation"]) for s in planned.retiring))
    return Planned(planned, doc, children, topo_cm)


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


# ---------------------------------------------------------------- act
@dataclass(frozen=True)
class Acted:
    """What the act phase wrote and read back, for the status."""

    unschedulable: str | None  # the Progressing/Unschedulable message
    drift: list[DriftEntry]
    stalls: list[stall.Evidence] | None  # None: no look this time
    router_ready: bool
    safety: Safety
    #: the stall sweep is on and has routers to ask: the next look is due in stall_check_s, whether or not a router
    #: answered this time (one restarting must not leave stalls unwatched until the next resync)
    stall_due: bool = False


async def act(ctx: Context, obs: Observed, planned: Planned) -> Acted:
    """Write: the topology (pushed to every router), the plan's pod actions, the children; read the evidence."""
    steps, plan_ = ctx.steps, planned.plan
    await steps.run(_apply(ctx.kube, planned.topology_cm, ctx.spec.drift_policy, enforce=True))
    confirmed = await _push_topology(ctx, obs, planned.topology)
    await _execute(ctx, obs, plan_)
    for k in plan_.unconfirmed_drains:
        await ctx.events("Warning", "DrainUnconfirmed",
                         f"pair {k}: the router did not confirm topology version >= {planned.topology['generation']} "
                         f"within drainSeconds + {ctx.config.drain_confirm_timeout_s:g}s; its pods were deleted anyway")
    unsched = await _unschedulable(ctx, plan_)
    entries = await _apply_children(ctx, planned) + obs.pod_drift
    entries += await _runtime_drift(ctx, obs, entries)
    await _engine_mappings(ctx)
    stall_due = _stall_sweep_on(ctx, obs)
    stalls = await _stall_sweep(ctx, obs) if stall_due else None
    router_obj = await steps.run(ctx.kube.get(path("apps/v1", "Deployment", ctx.namespace, router_name(ctx.name))),
                                 default={})
    router_ready = (int(((router_obj or {}).get("status") or {}).get("availableReplicas", 0) or 0)
                    >= ctx.spec.router.replicas)
    _pair_metrics(ctx, plan_)
    safety = await rollout_safety_step(ctx, obs, plan_, confirmed)
    return Acted(unsched, entries, stalls, router_ready, safety, stall_due)


async def _push_topology(ctx: Context, obs: Observed, doc: Mapping[str, Any]) -> bool:
    """Push the topology to every router behind it; True when every router confirms its generation."""
    if not (ctx.drains and obs.router_ips and obs.token):
        return False
    pushed = await ctx.router.sync(obs.router_ips, doc, obs.token)  # type: ignore[union-attr]
    return pushed.version is not None and pushed.version >= doc["generation"]


async def _execute(ctx: Context, obs: Observed, plan_: Plan) -> None:
    """Carry out the plan's actions. ``obs.specs``: revision -> the spec its pods are rendered from (the spec's
    own revision, and during a canary the revision the other pairs keep)."""
    uids = obs.uids
    for a in plan_.actions:
        if isinstance(a, ForceDelete):
            await _delete_pods(ctx, (a.pod,), uids, grace=0)
            msg = (f"pair {a.pair}: force-deleted pod {a.pod}, Terminating {a.overdue_s:.0f}s past its grace period "
                   f"on lost node {a.node} (its kubelet cannot confirm); the pair is recreated")
            ctx.say(logging.WARNING, msg)
            await ctx.events("Warning", "ForceDeleted", msg)
        elif isinstance(a, CoRestart):
            await _delete_pods(ctx, a.pods, uids)
            state = plan_.pairs[a.pair]
            wait = ctx.spec.co_restart.backoff(state.memory.streak)
            msg = (f"pair {a.pair} co-restarted: {a.reason} ({a.detail}); engine {ctx.spec.engine}; deleted pods "
                   f"{list(a.pods)}; recreating both after {wait:g}s backoff (co-restart #{state.memory.restarts})")
            ctx.say(logging.WARNING, msg)
            metrics.CO_RESTARTS.labels(ctx.namespace, ctx.name, a.reason).inc()
            await ctx.events("Warning", "CoRestart", msg)
        elif isinstance(a, RolloutPair):
            await _delete_pods(ctx, a.pods, uids)
            msg = f"pair {a.pair} rolling out: revision {a.from_revision} -> {a.to_revision}; deleted {list(a.pods)}"
            ctx.say(logging.INFO, msg)
            metrics.ROLLOUT_PAIRS.labels(ctx.namespace, ctx.name).inc()
            await ctx.events("Normal", "RollingOut", msg)
        elif isinstance(a, CreatePods):
            await _create_pods(ctx, obs, a)
        elif isinstance(a, DeletePods):
            await _delete_pods(ctx, a.pods, uids)
            ctx.say(logging.INFO, f"pair {a.pair}: deleted {list(a.pods)} ({a.reason})")
        elif isinstance(a, DrainPair):
            ctx.say(logging.INFO, f"pair {a.pair} draining before {a.reason}")


async def _create_pods(ctx: Context, obs: Observed, a: CreatePods) -> None:
    """A group's pods, created together: never half a pair left behind."""
    suffix = _suffix()
    created: list[str] = []
    try:
        for role in a.roles:
            pod = worker_pod(obs.specs.get(a.revision, ctx.spec), ctx.owner, a.revision, a.pair, role, suffix)
            await ctx.kube.apply(pod)
            created.append(pod["metadata"]["name"])
    except ApiError as e:
        ctx.steps.reject(e)
        for pod_name in created:  # never leave half a pair behind
            await ctx.steps.run(ctx.kube.delete(path("v1", "Pod", ctx.namespace, pod_name)))
    except BaseException:  # cancellation included
        for pod_name in created:
            await ctx.kube.delete(path("v1", "Pod", ctx.namespace, pod_name))
        raise


async def _unschedulable(ctx: Context, plan_: Plan) -> str | None:
    """The Progressing/Unschedulable message: GPUs requested against what the matching nodes hold."""
    if not plan_.unschedulable:
        return None
    spec = ctx.spec
    nodes = await ctx.steps.run(ctx.kube.list(path("v1", "Node")), default=[])
    everyone: list[dict[str, Any]] = []
    if ctx.config.cluster_pod_read:  # optional cluster-wide read (rbac.OPTIONAL_RULES): GPUs other workloads hold
        everyone = await ctx.steps.run(ctx.kube.list(path("v1", "Pod")), default=[])
    return unschedulable_message(requested_gpus=spec.pairs * spec.gpus_per_pair, pods=plan_.unschedulable,
                                 nodes=nodes, node_selector=spec.placement.node_selector,
                                 deployment=ctx.name, all_pods=everyone)


async def _apply(kube: Kube, obj: dict[str, Any], policy: str, *, enforce: bool = False) -> list[DriftEntry]:
    """Server-side apply of one static child; returns its drift (reported, not reverted)."""
    live = await kube.get(object_path(obj))
    d = drift.decide(obj, live, policy, enforce=enforce)
    if d.action in ("create", "apply", "revert"):
        await kube.apply(drift.with_hash(obj))
    elif d.action == "report":
        return drift.children_entries(f"{obj['kind']}/{obj['metadata']['name']}", obj, live or {}, d.paths[:5])
    return []


async def _apply_children(ctx: Context, planned: Planned) -> list[DriftEntry]:
    """Every static child but the topology (applied first); the drift of each."""
    out: list[DriftEntry] = []
    for child in planned.children:
        if child is not planned.topology_cm:
            out += await ctx.steps.run(_apply(ctx.kube, child, ctx.spec.drift_policy), default=[])
    return out


async def _runtime_drift(ctx: Context, obs: Observed, children: list[DriftEntry]) -> list[DriftEntry]:
    """Drift sources "image" (digests of one revision) and "process" (each worker's /config env), with the
    ``pdstack_config_drift`` gauges of all three sources and a ConfigDrift Event per new line (children drift has
    its own: the condition's transition). Returns the image entries, then the process entries."""
    process = await _process_drift(ctx, obs.views) if ctx.router is not None else []
    image = drift.image_drift(obs.live)
    for source, n in (("children", len(drift.lines(children))), ("process", len(process)), ("image", len(image))):
        metrics.CONFIG_DRIFT.labels(ctx.namespace, ctx.name, source).set(n)
    lines = drift.message_lines(process) + drift.message_lines(image)
    new_lines = sorted(set(lines) - set(ctx.state.posted_drift))
    ctx.state.posted_drift = tuple(lines)
    if new_lines:
        await ctx.events("Warning", "ConfigDrift", "; ".join(new_lines)[:900])
    return image + process


async def _engine_mappings(ctx: Context) -> None:
    """Engines sglang and vllm, once per revision each: Event ``WatchdogMapping`` naming the ``spec.watchdog``
    fields the engine enforces (and through which of its settings) and those it does not; with a ``spec.kernel``
    knob set, Event ``KernelMapping`` naming the knobs rendered to the engine's own flags and those it has none
    for. Warning when anything declared is not enforced."""
    mappings = (("WatchdogMapping", watchdog_mapping(ctx.spec)), ("KernelMapping", kernel_mapping(ctx.spec)))
    for reason, mapping in mappings:
        if mapping is None or ctx.state.posted_mappings.get(reason) == ctx.revision:
            continue
        ctx.state.posted_mappings[reason] = ctx.revision
        ctx.say(logging.WARNING if mapping.unenforced else logging.INFO, f"revision {ctx.revision}: {mapping.message}")
        await ctx.events("Warning" if mapping.unenforced else "Normal", reason, mapping.message)


async def _process_drift(ctx: Context, views: list[Any]) -> list[DriftEntry]:
    """Drift source "process": every ready worker's ``/config`` env against the env its role declares,
    at most every ``process_drift_s`` (between sweeps, the last sweep's entries). An unreadable
    ``/config`` is no evidence either way and gives no entry."""
    cfg, state = ctx.config, ctx.state
    if cfg.process_drift_s <= 0:
        return []
    last = state.process_sweep
    if last is not None and time.monotonic() - last[0] < cfg.process_drift_s:
        return last[1]
    declared = {role: {e["name"]: e.get("value", e.get("valueFrom")) for e in worker_env(ctx.spec, role)}
                for role in ("prefill", "decode")}
    workers = [v for v in views if v.ready and v.ip and not v.terminating]
    port = cfg.evidence_port(ctx.spec)
    configs = await asyncio.gather(*(ctx.router.get_json(f"http://{v.ip}:{port}/config")  # type: ignore
                                     for v in workers))
    entries: list[DriftEntry] = []
    for v, c in zip(workers, configs):
        env = (c or {}).get("env") or {}
        reported = env.get("process_env")
        if not isinstance(reported, dict):
            continue
        allow = tuple(env.get("report_env") or ())
        entries += drift.process_env_drift(declared[v.role], reported, allow, drift.PRESENCE_ONLY, pod=v.name)
    state.process_sweep = (time.monotonic(), entries)
    return entries


def _stall_sweep_on(ctx: Context, obs: Observed) -> bool:
    """Stall detection runs this reconcile: it is on, and there are routers to ask (and a client to ask them with)."""
    return bool(ctx.drains and ctx.config.stall_check_s > 0 and obs.router_ips and ctx.router is not None)


async def _stall_sweep(ctx: Context, obs: Observed) -> list[stall.Evidence] | None:
    """Stall detection (``stall.evaluate`` decides), at most every ``stall_check_s``: every router's
    ``/debug/requests`` (its rows and its workers') and each ready worker's ``/metrics``. A Warning Event
    ``Stalled`` and a log line when a pair turns stalled (once per episode: the status remembers it);
    ``pdstack_pair_stalled`` per pair. None: no router answered. Run only when :func:`_stall_sweep_on`."""
    cfg, http, last = ctx.config, ctx.router, ctx.state.stall_sweep
    if last is not None and time.monotonic() - last[0] < cfg.stall_check_s:
        return list(last[1].values())
    workers = [v for v in obs.views if v.ready and v.ip and not v.terminating]
    docs, texts = await asyncio.gather(
        asyncio.gather(*(http.debug_requests(ip, obs.token) for ip in obs.router_ips)),
        asyncio.gather(*(http.get_text(f"http://{v.ip}:{cfg.evidence_port(ctx.spec)}/metrics") for v in workers)))
    if not any(docs):
        return None
    at = time.monotonic()
    rows, unreachable = stall.rows_by_pair(d for d in docs if d)
    before = last[1] if last is not None else {}
    out: dict[int, stall.Evidence] = {}
    for k in sorted(set(range(ctx.spec.pairs)) | set(rows)):
        mine = [(v, t) for v, t in zip(workers, texts) if v.pair == k]
        seen = stall.observe(k, at, rows.get(k, ()), [t for _, t in mine],
                             [t for v, t in mine if v.role == "decode"], unreachable.get(k, ()))
        out[k] = stall.evaluate(before[k].observation if k in before else None, seen, ctx.spec.stall.seconds)
    ctx.state.stall_sweep = (at, out)
    was = {e.get("pair") for e in (ctx.old_status.get("stalls") or []) if isinstance(e, Mapping)}
    for k, e in out.items():
        metrics.PAIR_STALLED.labels(ctx.namespace, ctx.name, str(k)).set(int(e.stalled))
        if e.stalled and k not in was:
            ctx.say(logging.WARNING, e.reason)
            await ctx.events("Warning", "Stalled", e.reason)
    metrics.forget_pairs(ctx.namespace, ctx.name, keep=tuple(out))
    return list(out.values())


def _pair_metrics(ctx: Context, plan_: Plan) -> None:
    for s in plan_.pairs:
        if s.recovered_after_s is not None:
            metrics.PAIR_RECOVERY.labels(ctx.namespace, ctx.name).observe(s.recovered_after_s)
    metrics.PAIRS_READY.labels(ctx.namespace, ctx.name).set(sum(1 for s in plan_.pairs if s.ready))
    metrics.PAIRS_DESIRED.labels(ctx.namespace, ctx.name).set(ctx.spec.pairs)


# ---------------------------------------------------------------- report
async def report(ctx: Context, planned: Planned, acted: Acted, t0: float) -> float | None:
    """Write the status (the one writer), the Events it calls for; return the requeue delay."""
    old, safety, plan_ = ctx.old_status, acted.safety, planned.plan
    facts = Facts(generation=int(ctx.body["metadata"].get("generation", 0) or 0), desired_revision=ctx.revision,
                  router_ready=acted.router_ready, unschedulable_message=acted.unschedulable, drift=acted.drift,
                  rejections=ctx.steps.rejections, topology_version=planned.topology["generation"],
                  selector=f"{LABEL_DEPLOYMENT}={ctx.name},{LABEL_COMPONENT}=worker",
                  canary=safety.canary, canary_failed=safety.canary_failed,
                  last_known_good=safety.last_known_good, auto_rollback=safety.auto_rollback)
    new = with_stalls(build_status(old, plan_, facts, ctx.now), old, acted.stalls, ctx.now)
    old_conds = _conditions(old)
    if acted.unschedulable and old_conds.get("Progressing", {}).get("reason") != "Unschedulable":
        await ctx.events("Warning", "Unschedulable", acted.unschedulable)
    rejections = ctx.steps.rejections
    if rejections and old_conds.get("ApiRejected", {}).get("message") != "; ".join(rejections):
        for line in rejections:
            ctx.say(logging.WARNING, f"rejected: {line}")
            await ctx.events("Warning", "ApiRejected", line)
            metrics.RECONCILE_ERRORS.labels(ctx.namespace, ctx.name, "ApiRejected").inc()
    await _write_status(ctx.kube, ctx.body, new)
    metrics.RECONCILE_DURATION.labels(ctx.namespace, ctx.name).observe(time.perf_counter() - t0)
    return _requeue(ctx, plan_.requeue_after, acted, new["conditions"][0]["status"] == "True")


def _requeue(ctx: Context, after: float | None, acted: Acted, ready: bool) -> float | None:
    """The delay before the next reconcile: the plan's, the canary's or soak's, the drift and stall timers."""
    cfg = ctx.config
    timers = [acted.safety.wait,
              cfg.process_drift_s if cfg.process_drift_s > 0 and ctx.router is not None else None,
              cfg.stall_check_s if acted.stall_due else None]
    for t in timers:
        if t is not None:
            after = min(after or t, t)
    if ctx.steps.rejections:
        return 2.0 if after is None else min(after, 2.0)  # retry; fixing RBAC recovers
    if not ready and after is None:
        return 10.0  # not ready yet: look again even if no event arrives
    return after


async def _write_status(kube: Kube, body: Mapping[str, Any], new: dict[str, Any]) -> None:
    """Status subresource, resourceVersion precondition; on 409 re-read and retry (we are its one writer)."""
    url = path(API, KIND, body["metadata"]["namespace"], body["metadata"]["name"])
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
