"""pairs: observed worker pods -> actions. The co-restart and rollout planner (pure).

Rules (DESIGN.md, "Operator"):

* A PD pair restarts together. When any pod of pair k had a container restart, was deleted,
  evicted, OOM-killed or failed, every live pod of pair k is deleted and the pair is created
  again, after an exponential backoff (capped) counted over consecutive co-restarts. A
  decode-only or prefill-only restart never happens under ``coRestart.policy: Pair``.
* Spec changes roll out pair by pair: a ready pair at an old revision is replaced only while
  fewer than ``maxUnavailablePairs`` pairs are unavailable. A pair's pods are always created
  together at one revision, so prefill and decode of a pair never run different revisions.
  ``targets`` (from :mod:`canary`) may hold a pair at another revision than the spec's: during a
  canary every pair but the canary keeps the old revision, also when it is recreated.
* A pod whose declared fields someone else edited (``reverts``, under ``drift.policy: Revert``) is
  not patched back in place (most pod fields are immutable): its whole pair is co-restarted.

* Drain before delete: a pair about to lose its pods (co-restart, rollout, scale-down) is first
  marked draining in the router topology. Its pods are deleted only once every router runs a
  topology version that shows it draining, and its in-flight requests finished (or
  ``rollout.drainSeconds`` passed). With no router pod to ask, nothing routes to the pair and it
  goes at once; a router that never answers holds it at most ``drainSeconds + confirm timeout``.
* Lost nodes: a pod still Terminating past its deletion deadline plus a margin, on a node that is
  NotReady or gone, is force-deleted (its kubelet will never confirm), so the pair can come back.

The planner sees each reconcile's snapshot (pods listed fresh from the API) plus the per-pair
memory kept in ``status.pairs`` and returns what to do; the kopf shell executes it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Sequence

from .render import AGENT_CONTAINER, LABEL_MEMBER, LABEL_PAIR, LABEL_REVISION, LABEL_ROLE, ROLES, slot_name
from .spec import GPU_RESOURCE, CoRestartSpec

# co-restart reasons (also the `reason` label of pdstack_operator_co_restarts_total)
EVICTED = "Evicted"
OOM_KILLED = "OOMKilled"
FAILED = "Failed"
CONTAINER_RESTART = "ContainerRestart"
POD_DELETED = "PodDeleted"
MIXED_REVISION = "MixedRevision"
DRIFT_REVERTED = "DriftReverted"  # a pod field edited by someone else, under drift.policy Revert
REASONS = (EVICTED, OOM_KILLED, FAILED, CONTAINER_RESTART, POD_DELETED, MIXED_REVISION, DRIFT_REVERTED)

TERMINATING_RECHECK_S = 2.0  # poll while our deletions drain (pod events usually come first)


@dataclass(frozen=True)
class PodView:
    """What the planner needs to know about one worker pod."""

    name: str
    pair: int
    role: str
    revision: str
    phase: str = "Pending"
    ready: bool = False
    restarts: int = 0  # sum of container restartCount
    terminating: bool = False
    evicted: bool = False
    oom_killed: bool = False
    unschedulable: str | None = None  # the scheduler's message when PodScheduled=False/Unschedulable
    ip: str | None = None
    gpus: int = 0
    node: str | None = None
    uid: str | None = None
    delete_deadline: float | None = None  # epoch seconds: deletionTimestamp (request time + grace period)
    member: int = 0  # which prefill (or decode) of its group: 0..replicas-1

    @property
    def slot(self) -> str:
        """The pod's place in its group: ``prefill``, ``decode`` (member 0), ``decode-1``, ..."""
        return slot_name(self.role, self.member)


def pod_ready(pod: Mapping[str, Any]) -> bool:
    """The pod's ``Ready`` condition is True (the one readiness rule: workers, routers, ``kubectl pd``)."""
    conds = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conds)


def pod_view(pod: Mapping[str, Any]) -> PodView | None:
    """Project an API Pod onto :class:`PodView`; None for pods that are not pdstack workers."""
    meta = pod.get("metadata", {})
    labels = meta.get("labels", {}) or {}
    try:
        pair = int(labels[LABEL_PAIR])
        role = labels[LABEL_ROLE]
        member = int(labels.get(LABEL_MEMBER, 0))
    except (KeyError, ValueError):
        return None
    if role not in ROLES:
        return None
    status = pod.get("status", {}) or {}
    conds = {c.get("type"): c for c in status.get("conditions", []) or []}
    # the agent sidecar holds no KV state: its restart (or OOM) is no reason to co-restart the pair
    statuses = [cs for cs in status.get("containerStatuses", []) or [] if cs.get("name") != AGENT_CONTAINER]
    oom = any(
        (cs.get(key, {}) or {}).get("terminated", {}).get("reason") == "OOMKilled"
        for cs in statuses for key in ("state", "lastState")
    )
    sched = conds.get("PodScheduled", {})
    unschedulable = (sched.get("message") or "Unschedulable") if sched.get("reason") == "Unschedulable" else None
    gpus = 0
    for c in pod.get("spec", {}).get("containers", []) or []:
        gpus += int((c.get("resources", {}) or {}).get("requests", {}).get(GPU_RESOURCE, 0) or 0)
    return PodView(
        name=meta.get("name", ""),
        pair=pair,
        role=role,
        revision=labels.get(LABEL_REVISION, ""),
        phase=status.get("phase", "Pending") or "Pending",
        ready=pod_ready(pod),
        restarts=sum(int(cs.get("restartCount", 0) or 0) for cs in statuses),
        terminating=bool(meta.get("deletionTimestamp")),
        evicted=status.get("reason") == "Evicted",
        oom_killed=oom,
        unschedulable=unschedulable,
        ip=status.get("podIP"),
        gpus=gpus,
        node=(pod.get("spec", {}) or {}).get("nodeName"),
        uid=meta.get("uid"),
        delete_deadline=parse_iso(meta.get("deletionTimestamp")),
        member=member,
    )


def parse_iso(value: Any) -> float | None:
    """An RFC 3339 timestamp (``2026-12-01T12:00:00Z``) -> epoch seconds; None when absent or malformed."""
    if not value or not isinstance(value, str):
        return None
    import datetime
    try:
        return datetime.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


@dataclass(frozen=True)
class PairMemory:
    """Per-pair facts that outlive pods (kept in status.pairs[k]); times are epoch seconds."""

    restarts: int = 0  # co-restarts of this pair, ever
    streak: int = 0  # consecutive co-restarts without a stable ready period (drives backoff)
    last_co_restart_at: float | None = None
    last_co_restart_reason: str | None = None
    ready_since: float | None = None
    recovering: bool = False  # co-restarted and not ready since (time to recover = ready - last_co_restart_at)
    drain_started_at: float | None = None  # the planner decided to drain this pair
    drain_version: int | None = None  # the topology version that first showed it draining (set by the shell)
    drain_confirmed_at: float | None = None  # every router ran >= drain_version


@dataclass(frozen=True)
class RouterView:
    """What the routers of one deployment report at ``/config`` (the shell reads every router pod)."""

    present: bool = False  # at least one running router pod to ask
    version: int | None = None  # the lowest topology version the routers run; None: some did not answer
    inflight: Mapping[int, int] = field(default_factory=dict)  # pair -> requests in flight, summed


# ---------------------------------------------------------------- actions
@dataclass(frozen=True)
class CoRestart:
    pair: int
    reason: str
    pods: tuple[str, ...]  # every live pod of the pair: all are deleted
    detail: str


@dataclass(frozen=True)
class RolloutPair:
    pair: int
    from_revision: str
    to_revision: str
    pods: tuple[str, ...]


@dataclass(frozen=True)
class CreatePods:
    pair: int
    revision: str
    roles: tuple[str, ...]  # every slot of the group (render.group_slots), except under coRestart.policy=Never


@dataclass(frozen=True)
class DeletePods:
    pair: int
    pods: tuple[str, ...]
    reason: str  # ScaleDown | Duplicate | Failed (policy Never)


@dataclass(frozen=True)
class DrainPair:
    """Mark the pair draining in the topology; its pods go once the routers confirm (a later reconcile)."""

    pair: int
    reason: str  # what the deletion will be: a co-restart reason, Rollout, ScaleDown
    waiting_for: str  # publish | router | inflight


@dataclass(frozen=True)
class ForceDelete:
    """The pod's node is lost: its kubelet will never confirm the deletion (grace period 0)."""

    pair: int
    pod: str
    node: str | None
    overdue_s: float


Action = CoRestart | RolloutPair | CreatePods | DeletePods | DrainPair | ForceDelete

DRAIN_RECHECK_S = 0.25  # poll the routers while a drain waits on them
DRAIN_CONFIRM_TIMEOUT_S = 30.0  # a router that never confirms holds a pair at most drainSeconds + this
LOST_NODE_MARGIN_S = 30.0  # past the deletion deadline, before a pod on a lost node is force-deleted


@dataclass(frozen=True)
class PairState:
    index: int
    revision: str | None  # the revision its live pods run (one per pair, by construction)
    ready: bool
    phase: str  # Ready | Starting | Unschedulable | CoRestarting | BackingOff | RollingOut | Terminating | Creating
    memory: PairMemory
    recovered_after_s: float | None = None  # set on the reconcile a pair turns ready after being down
    hosts: tuple[str | None, str | None] = (None, None)  # (prefill IP, decode IP) of member 0
    draining: bool = False
    members: Mapping[str, str | None] = field(default_factory=dict)  # slot -> pod IP, every live member


@dataclass(frozen=True)
class Plan:
    actions: tuple[Action, ...]
    pairs: tuple[PairState, ...]
    requeue_after: float | None = None
    unschedulable: tuple[PodView, ...] = field(default=())
    unconfirmed_drains: tuple[int, ...] = ()  # deleted after the router never confirmed (Event-worthy)
    retiring: tuple[PairState, ...] = ()  # pairs beyond spec.pairs still draining (topology + status memory)

    @property
    def co_restarts(self) -> tuple[CoRestart, ...]:
        return tuple(a for a in self.actions if isinstance(a, CoRestart))


def _trigger(live: Sequence[PodView], slots: Sequence[str] = ROLES,
             revert: str | None = None) -> tuple[str, str] | None:
    """(reason, detail) if this group must co-restart, judged from its live pods (``revert``: drift to undo)."""
    for reason, hit in ((EVICTED, lambda p: p.evicted), (OOM_KILLED, lambda p: p.oom_killed),
                        (FAILED, lambda p: p.phase == "Failed"), (CONTAINER_RESTART, lambda p: p.restarts > 0)):
        for p in live:
            if hit(p):
                detail = f"{p.slot} pod {p.name}" + (f" restarted {p.restarts}x" if p.restarts else "")
                return reason, detail
    roles = {p.slot for p in live}
    if live and roles != set(slots):
        missing = sorted(set(slots) - roles)
        return POD_DELETED, f"{'/'.join(missing)} pod gone while {'/'.join(sorted(roles))} survived"
    revisions = {p.revision for p in live}
    if len(revisions) > 1:
        return MIXED_REVISION, f"pods run revisions {sorted(revisions)}"
    if revert:
        return DRIFT_REVERTED, revert
    return None


def _role_order(p: PodView) -> tuple[int, int, str]:
    return ROLES.index(p.role), p.member, p.name


def _min(a: float | None, b: float | None) -> float | None:
    if a is None:
        return b
    if b is None:
        return a
    return min(a, b)


def _drain_gate(k: int, mem: PairMemory, router: RouterView, drain_s: float, now: float,
                confirm_timeout_s: float = DRAIN_CONFIRM_TIMEOUT_S) -> tuple[str, PairMemory, float | None]:
    """May pair ``k``'s pods be deleted now? ``go`` | ``go-unconfirmed`` | what the drain waits for.

    Returns (verdict, memory with the drain bookkeeping, recheck delay).
    """
    if not router.present:
        return "go", mem, None
    started = mem.drain_started_at if mem.drain_started_at is not None else now
    mem = replace(mem, drain_started_at=started)
    if mem.drain_version is None:
        return "publish", mem, DRAIN_RECHECK_S
    if router.version is not None and router.version >= mem.drain_version:
        confirmed = mem.drain_confirmed_at if mem.drain_confirmed_at is not None else now
        mem = replace(mem, drain_confirmed_at=confirmed)
        left = confirmed + drain_s - now
        if router.inflight.get(k, 0) == 0 or left <= 0:
            return "go", mem, None
        return "inflight", mem, min(DRAIN_RECHECK_S, left)
    left = started + drain_s + confirm_timeout_s - now
    if left <= 0:
        return "go-unconfirmed", mem, None
    return "router", mem, min(DRAIN_RECHECK_S, left)


def _undrained(mem: PairMemory) -> PairMemory:
    return replace(mem, drain_started_at=None, drain_version=None, drain_confirmed_at=None)


@dataclass(frozen=True)
class PlanInput:
    """Everything one plan of one deployment's worker pods depends on. ``pairs`` is the number of groups,
    ``slots`` the members of each (render.group_slots: one prefill + one decode by default); a group restarts
    whole. ``targets``: pair -> the revision it should run (default: ``desired_revision``); ``reverts``: pair ->
    the drifted pod fields to undo by a co-restart."""

    desired_revision: str
    pairs: int
    policy: CoRestartSpec
    max_unavailable: int
    pods: Sequence[PodView]
    memory: Mapping[int, PairMemory]
    now: float
    router: RouterView = RouterView()
    drain_s: float = 30.0
    lost_nodes: frozenset[str] = frozenset()
    lost_node_margin_s: float = LOST_NODE_MARGIN_S
    drain_confirm_timeout_s: float = DRAIN_CONFIRM_TIMEOUT_S
    slots: tuple[str, ...] = ROLES
    targets: Mapping[int, str] | None = None
    reverts: Mapping[int, str] | None = None

    def want(self, k: int) -> str:
        """The revision pair ``k`` should run."""
        return (self.targets or {}).get(k, self.desired_revision)


class _Planning:
    """One plan in the making: the actions, pair states and requeue collected by :func:`plan_pairs`' steps."""

    def __init__(self, inp: PlanInput) -> None:
        self.inp = inp
        self.actions: list[Action] = []
        self.states: dict[int, PairState] = {}
        self.retiring: list[PairState] = []
        self.unconfirmed: list[int] = []
        self.requeue: float | None = None
        self.by_pair: dict[int, list[PodView]] = {}
        for p in inp.pods:
            self.by_pair.setdefault(p.pair, []).append(p)

    def wait(self, delay: float | None) -> None:
        self.requeue = _min(self.requeue, delay)

    def gate(self, k: int, mem: PairMemory) -> tuple[bool, PairMemory]:
        """True: delete now (memory cleared of the drain). False: keep draining (action + requeue added)."""
        inp = self.inp
        verdict, mem, delay = _drain_gate(k, mem, inp.router, inp.drain_s, inp.now, inp.drain_confirm_timeout_s)
        if verdict.startswith("go"):
            if verdict == "go-unconfirmed":
                self.unconfirmed.append(k)
            return True, _undrained(mem)
        self.wait(delay)
        return False, mem

    def result(self) -> Plan:
        inp = self.inp
        unsched = tuple(p for p in inp.pods if p.unschedulable and not p.terminating and p.pair < inp.pairs)
        return Plan(tuple(self.actions), tuple(self.states[k] for k in range(inp.pairs)), self.requeue, unsched,
                    tuple(self.unconfirmed), tuple(self.retiring))


def plan_pairs(inp: PlanInput) -> Plan:
    """Decide the actions for one reconcile of the worker pods (see the module's rules)."""
    pl = _Planning(inp)
    _force_deletes(pl)
    _scale_down(pl)
    for k in range(inp.pairs):
        _plan_group(pl, k)
    _rollout(pl)
    return pl.result()


def _force_deletes(pl: _Planning) -> None:
    """Lost nodes: a terminating pod whose kubelet will never confirm is force-deleted after the bound."""
    inp = pl.inp
    for p in inp.pods:
        if p.terminating and p.node in inp.lost_nodes and p.delete_deadline is not None:
            overdue = inp.now - (p.delete_deadline + inp.lost_node_margin_s)
            if overdue >= 0:
                pl.actions.append(ForceDelete(p.pair, p.name, p.node, overdue + inp.lost_node_margin_s))
            else:
                pl.wait(-overdue)


def _scale_down(pl: _Planning) -> None:
    """Pairs beyond spec.pairs go, whole, after a drain."""
    for k in sorted(k for k in pl.by_pair if k >= pl.inp.pairs):
        live_k = sorted((p for p in pl.by_pair[k] if not p.terminating), key=_role_order)
        names = tuple(sorted(p.name for p in live_k))
        if not names:
            continue
        go, mem = pl.gate(k, pl.inp.memory.get(k, PairMemory()))
        hosts = _hosts(live_k)
        if go:
            pl.actions.append(DeletePods(k, names, "ScaleDown"))
        else:
            pl.actions.append(DrainPair(k, "ScaleDown", "router"))
        pl.retiring.append(PairState(k, live_k[0].revision, False, "Draining", mem, hosts=hosts, draining=True,
                                     members=_members(live_k)))


def _plan_group(pl: _Planning, k: int) -> None:
    """Group ``k`` within spec.pairs: co-restart, create, or record how it stands."""
    inp = pl.inp
    mem = inp.memory.get(k, PairMemory())
    all_pods = sorted(pl.by_pair.get(k, []), key=_role_order)
    live = [p for p in all_pods if not p.terminating]
    # duplicates of one role (e.g. a create retried after a timeout): keep the newest-named one
    seen: dict[str, PodView] = {}
    for p in live:
        if p.slot not in inp.slots:  # a member beyond the group's replicas (scaled down): goes with no co-restart
            pl.actions.append(DeletePods(k, (p.name,), "ScaleDown"))
            continue
        if p.slot in seen:
            pl.actions.append(DeletePods(k, (seen[p.slot].name,), "Duplicate"))
        seen[p.slot] = p
    live = list(seen.values())
    trig = _trigger(live, inp.slots, (inp.reverts or {}).get(k))
    if trig and inp.policy.policy == "Pair":
        _co_restart(pl, k, mem, live, trig)
        return
    hosts = (seen["prefill"].ip if "prefill" in seen else None, seen["decode"].ip if "decode" in seen else None)
    if trig and inp.policy.policy == "Never" and live:
        # opt-out: replace only what is broken or missing, one side at a time (documented as unsafe);
        # container restarts are left to the kubelet
        broken = tuple(p.name for p in live if p.evicted or p.phase == "Failed")
        missing = tuple(r for r in inp.slots if r not in seen)
        if broken:
            pl.actions.append(DeletePods(k, broken, FAILED))
        if missing:
            pl.actions.append(CreatePods(k, live[0].revision, missing))
        if broken or missing:
            pl.states[k] = PairState(k, None, False, "Starting", replace(mem, ready_since=None), hosts=hosts)
            return
    if not live:
        _empty_group(pl, k, mem, all_pods)
        return
    _group_state(pl, k, mem, live, hosts)


def _co_restart(pl: _Planning, k: int, mem: PairMemory, live: list[PodView], trig: tuple[str, str]) -> None:
    """A PD group restarts together: drain first, then delete every live pod (recreated after the backoff)."""
    inp = pl.inp
    hosts = _hosts(live)
    members = _members(live)
    reason, detail = trig
    go, gmem = pl.gate(k, mem)
    if not go:
        pl.actions.append(DrainPair(k, reason, "router"))
        pl.states[k] = PairState(k, live[0].revision, False, "Draining", replace(gmem, ready_since=None),
                                 hosts=hosts, draining=True, members=members)
        return
    mem = gmem
    stable = mem.ready_since is not None and inp.now - mem.ready_since >= inp.policy.backoff_max_s
    streak = (0 if stable else mem.streak) + 1
    new_mem = replace(mem, restarts=mem.restarts + 1, streak=streak, last_co_restart_at=inp.now,
                      last_co_restart_reason=reason, ready_since=None, recovering=True)
    pl.actions.append(CoRestart(k, reason, tuple(p.name for p in live), detail))
    # still draining in the topology until its pods are gone (the router must not pick it up again)
    pl.states[k] = PairState(k, None, False, "CoRestarting", new_mem, hosts=hosts, draining=True, members=members)
    pl.wait(max(inp.policy.backoff(streak), 0.05))


def _empty_group(pl: _Planning, k: int, mem: PairMemory, all_pods: list[PodView]) -> None:
    """No live pod: wait for our deletions, then the backoff, then create the whole group."""
    inp = pl.inp
    mem = _undrained(mem)
    if all_pods:  # our deletions still draining: the router keeps the pair as draining
        pl.states[k] = PairState(k, None, False, "Terminating", mem, hosts=_hosts(all_pods), draining=True,
                                 members=_members(all_pods))
        pl.wait(TERMINATING_RECHECK_S)
        return
    if mem.last_co_restart_at is not None:
        wait = mem.last_co_restart_at + inp.policy.backoff(mem.streak) - inp.now
        if wait > 0:
            pl.states[k] = PairState(k, None, False, "BackingOff", mem)
            pl.wait(wait)
            return
    pl.actions.append(CreatePods(k, inp.want(k), inp.slots))
    pl.states[k] = PairState(k, inp.want(k), False, "Creating", mem)


def _group_state(pl: _Planning, k: int, mem: PairMemory, live: list[PodView],
                 hosts: tuple[str | None, str | None]) -> None:
    """A complete group: Ready, Starting, Unschedulable, or still Draining for a rollout."""
    inp = pl.inp
    members = _members(live)
    revision = live[0].revision
    if mem.drain_started_at is not None and revision != inp.want(k):
        # a rollout drain in progress: the pair is out of service already
        pl.states[k] = PairState(k, revision, False, "Draining", replace(mem, ready_since=None), hosts=hosts,
                                 draining=True, members=members)
        return
    mem = _undrained(mem)
    if all(p.ready and p.phase == "Running" for p in live):
        recovered = (inp.now - mem.last_co_restart_at
                     if mem.recovering and mem.last_co_restart_at is not None else None)
        new_mem = replace(mem, ready_since=mem.ready_since if mem.ready_since is not None else inp.now,
                          recovering=False)
        pl.states[k] = PairState(k, revision, True, "Ready", new_mem, recovered_after_s=recovered, hosts=hosts,
                                 members=members)
    else:
        phase = "Unschedulable" if any(p.unschedulable for p in live) else "Starting"
        pl.states[k] = PairState(k, revision, False, phase, replace(mem, ready_since=None), hosts=hosts,
                                 members=members)


def _rollout(pl: _Planning) -> None:
    """Replace pairs at an old revision, never more than maxUnavailable pairs down at once."""
    inp, states = pl.inp, pl.states
    budget = inp.max_unavailable - sum(1 for s in states.values() if not s.ready)
    for k in range(inp.pairs):
        s = states[k]
        if s.revision is None or s.revision == inp.want(k) or s.phase not in (
                "Ready", "Starting", "Unschedulable", "Draining"):
            continue
        if s.phase == "Draining" and any(isinstance(a, DrainPair) and a.pair == k for a in pl.actions):
            continue  # draining for a co-restart: that comes first
        if s.ready:
            if budget <= 0:
                continue
            budget -= 1
        names = tuple(p.name for p in sorted(pl.by_pair.get(k, []), key=_role_order) if not p.terminating)
        go, mem = pl.gate(k, s.memory)
        if go:
            pl.actions.append(RolloutPair(k, s.revision, inp.want(k), names))
            states[k] = replace(s, ready=False, phase="RollingOut", draining=True,
                                memory=replace(mem, ready_since=None))
        else:
            pl.actions.append(DrainPair(k, "Rollout", "router"))
            states[k] = replace(s, ready=False, phase="Draining", draining=True,
                                memory=replace(mem, ready_since=None))


def _hosts(live: Sequence[PodView]) -> tuple[str | None, str | None]:
    by_slot = {p.slot: p.ip for p in live}
    return by_slot.get("prefill"), by_slot.get("decode")


def _members(live: Sequence[PodView]) -> dict[str, str | None]:
    return {p.slot: p.ip for p in sorted(live, key=_role_order)}


def _pod_gpu_requests(pod: Mapping[str, Any]) -> int:
    return sum(int((c.get("resources", {}) or {}).get("requests", {}).get(GPU_RESOURCE, 0) or 0)
               for c in pod.get("spec", {}).get("containers", []) or [])


def unschedulable_message(*, requested_gpus: int, pods: Sequence[PodView], nodes: Sequence[Mapping[str, Any]],
                          node_selector: Mapping[str, str], deployment: str | None = None,
                          all_pods: Sequence[Mapping[str, Any]] = ()) -> str:
    """``Progressing/Unschedulable`` message: GPUs requested vs allocatable on matching nodes.

    ``all_pods`` (every pod in the cluster, optional) adds how many of those GPUs other workloads hold.
    """
    matching = [n for n in nodes
                if all((n.get("metadata", {}).get("labels", {}) or {}).get(k) == v for k, v in node_selector.items())]
    allocatable = sum(int((n.get("status", {}).get("allocatable", {}) or {}).get(GPU_RESOURCE, 0) or 0)
                      for n in matching)
    names_on = {n.get("metadata", {}).get("name") for n in matching}
    others = sum(_pod_gpu_requests(p) for p in all_pods
                 if p.get("spec", {}).get("nodeName") in names_on
                 and (p.get("status", {}) or {}).get("phase") not in ("Succeeded", "Failed")
                 and (p.get("metadata", {}).get("labels", {}) or {}).get("pdstack.io/deployment") != deployment)
    pending_gpus = sum(p.gpus for p in pods)
    names = ", ".join(sorted(p.name for p in pods)[:4]) + (" ..." if len(pods) > 4 else "")
    sched = pods[0].unschedulable if pods else ""
    where = f"on {len(matching)} node(s)" + (f" matching nodeSelector {dict(node_selector)}" if node_selector else "")
    held = f" ({others} held by other workloads)" if others else ""
    return (f"{len(pods)} worker pod(s) cannot be scheduled ({names}; {pending_gpus} {GPU_RESOURCE} pending): "
            f"the deployment requests {requested_gpus} {GPU_RESOURCE} in total, {allocatable} allocatable "
            f"{where}{held}. Scheduler: {sched}")
