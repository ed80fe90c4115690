"""Table tests of the co-restart / rollout planner: each observation yields exactly the expected actions."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pdoperator.core.pairs import (CoRestart, CreatePods, DeletePods, PairMemory, PlanInput, PodView, RolloutPair,
                              plan_pairs, pod_view, unschedulable_message)
from pdoperator.core.spec import CoRestartSpec

NOW = 1000.0
PAIR = CoRestartSpec("Pair", 1.0, 300.0)
NEVER = CoRestartSpec("Never", 1.0, 300.0)
BOTH = ("prefill", "decode")


def pod(pair: int, role: str, rev: str = "r1", **kw) -> PodView:
    base = dict(name=f"d-{pair}-{role}-{rev}", pair=pair, role=role, revision=rev, phase="Running", ready=True,
                ip=f"10.0.{pair}.{1 if role == 'prefill' else 2}")
    base.update(kw)
    return PodView(**base)


def healthy(pairs=2, rev="r1"):
    return [pod(k, r, rev) for k in range(pairs) for r in BOTH]


def swap(pods, pair, role, **kw):
    return [replace(p, **kw) if (p.pair, p.role) == (pair, role) else p for p in pods]


def drop(pods, pair, role):
    return [p for p in pods if (p.pair, p.role) != (pair, role)]


def plan(pods, memory=None, *, pairs=2, policy=PAIR, max_unavailable=1, desired="r1"):
    return plan_pairs(PlanInput(desired_revision=desired, pairs=pairs, policy=policy, max_unavailable=max_unavailable,
                      pods=pods, memory=memory or {}, now=NOW))


def kinds(p):
    """Actions without free-text details, for exact comparison."""
    out = []
    for a in p.actions:
        out.append((type(a).__name__, a.pair, a.reason, a.pods) if isinstance(a, CoRestart) else a)
    return out


H = healthy()
NAMES1 = ("d-1-prefill-r1", "d-1-decode-r1")
NAMES0 = ("d-0-prefill-r1", "d-0-decode-r1")

CASES = [
    # (id, pods, memory, kwargs, expected actions)
    ("fresh: create every pair", [], {}, {}, [CreatePods(0, "r1", BOTH), CreatePods(1, "r1", BOTH)]),
    ("all healthy: nothing", H, {}, {}, []),
    ("decode restart in pair 1: co-restart pair 1 only", swap(H, 1, "decode", restarts=1), {}, {},
     [("CoRestart", 1, "ContainerRestart", NAMES1)]),
    ("prefill restart in pair 0", swap(H, 0, "prefill", restarts=2), {}, {},
     [("CoRestart", 0, "ContainerRestart", NAMES0)]),
    ("prefill deleted in pair 1: the survivor goes too", drop(H, 1, "prefill"), {}, {},
     [("CoRestart", 1, "PodDeleted", ("d-1-decode-r1",))]),
    ("prefill terminating (someone else deleted it) while decode lives", swap(H, 1, "prefill", terminating=True),
     {}, {}, [("CoRestart", 1, "PodDeleted", ("d-1-decode-r1",))]),
    ("decode OOM-killed", swap(H, 0, "decode", restarts=1, oom_killed=True), {}, {},
     [("CoRestart", 0, "OOMKilled", NAMES0)]),
    ("prefill evicted", swap(H, 1, "prefill", phase="Failed", evicted=True, ready=False), {}, {},
     [("CoRestart", 1, "Evicted", NAMES1)]),
    ("decode failed", swap(H, 1, "decode", phase="Failed", ready=False), {}, {},
     [("CoRestart", 1, "Failed", NAMES1)]),
    ("mixed revisions inside a pair", swap(H, 1, "decode", revision="r0"), {}, {},
     [("CoRestart", 1, "MixedRevision", ("d-1-prefill-r1", "d-1-decode-r1"))]),
    ("co-restart draining: wait", [p for p in H if p.pair == 0] + [replace(p, terminating=True) for p in H
                                                                  if p.pair == 1],
     {1: PairMemory(restarts=1, streak=1, last_co_restart_at=NOW - 0.1)}, {}, []),
    ("pair gone, backoff not elapsed: wait", healthy(1), {1: PairMemory(restarts=1, streak=1,
                                                                        last_co_restart_at=NOW - 0.5)}, {}, []),
    ("pair gone, backoff elapsed: recreate both", healthy(1),
     {1: PairMemory(restarts=1, streak=1, last_co_restart_at=NOW - 1.5)}, {}, [CreatePods(1, "r1", BOTH)]),
    ("not ready yet is not a fault", swap(H, 0, "decode", ready=False), {}, {}, []),
    ("scale down removes whole pairs", H + healthy(3)[4:], {}, {},
     [DeletePods(2, ("d-2-decode-r1", "d-2-prefill-r1"), "ScaleDown")]),
    ("duplicate pod of one role", H + [replace(pod(0, "prefill"), name="d-0-prefill-zz")], {}, {},
     [DeletePods(0, ("d-0-prefill-r1",), "Duplicate")]),
    ("rollout: one pair at a time (maxUnavailablePairs=1)", healthy(rev="r0"), {}, {},
     [RolloutPair(0, "r0", "r1", ("d-0-prefill-r0", "d-0-decode-r0"))]),
    ("rollout: two at a time (maxUnavailablePairs=2)", healthy(rev="r0"), {}, {"max_unavailable": 2},
     [RolloutPair(0, "r0", "r1", ("d-0-prefill-r0", "d-0-decode-r0")),
      RolloutPair(1, "r0", "r1", ("d-1-prefill-r0", "d-1-decode-r0"))]),
    ("rollout waits while the replaced pair is not ready yet",
     [pod(0, r, "r1", ready=False) for r in BOTH] + [pod(1, r, "r0") for r in BOTH], {}, {}, []),
    ("rollout continues once the replaced pair is ready",
     [pod(0, r, "r1") for r in BOTH] + [pod(1, r, "r0") for r in BOTH], {}, {},
     [RolloutPair(1, "r0", "r1", ("d-1-prefill-r0", "d-1-decode-r0"))]),
    ("an old pair that is not ready is replaced without spending the budget",
     [pod(0, r, "r0", ready=False) for r in BOTH] + [pod(1, r, "r0") for r in BOTH], {}, {},
     [RolloutPair(0, "r0", "r1", ("d-0-prefill-r0", "d-0-decode-r0"))]),
    ("co-restart wins over rollout", swap(healthy(rev="r0"), 1, "decode", restarts=1), {}, {},
     [("CoRestart", 1, "ContainerRestart", ("d-1-prefill-r0", "d-1-decode-r0"))]),
    ("policy Never: a restart is left alone", swap(H, 1, "decode", restarts=3), {}, {"policy": NEVER}, []),
    ("policy Never: only the deleted side is recreated", drop(H, 1, "prefill"), {}, {"policy": NEVER},
     [CreatePods(1, "r1", ("prefill",))]),
]


@pytest.mark.parametrize("pods,memory,kwargs,expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_planner_actions(pods, memory, kwargs, expected):
    assert kinds(plan(pods, memory, **kwargs)) == expected


def test_policy_never_keeps_a_restarted_but_ready_pair_ready():
    p = plan(swap(H, 1, "decode", restarts=3), policy=NEVER)
    assert p.actions == () and [s.phase for s in p.pairs] == ["Ready", "Ready"]
    evicted = plan(swap(H, 1, "decode", phase="Failed", evicted=True, ready=False), policy=NEVER)
    assert kinds(evicted) == [DeletePods(1, ("d-1-decode-r1",), "Failed")]


def test_co_restart_records_memory_and_requeues_after_backoff():
    p = plan(swap(H, 1, "decode", restarts=1), {1: PairMemory(restarts=2, streak=2, ready_since=NOW - 5)})
    s = p.pairs[1]
    assert (s.phase, s.ready) == ("CoRestarting", False)
    assert s.memory == PairMemory(restarts=3, streak=3, last_co_restart_at=NOW, last_co_restart_reason="ContainerRestart",
                                  ready_since=None, recovering=True)
    assert p.requeue_after == 4.0  # 1 s * 2^(3-1)
    assert p.pairs[0].phase == "Ready" and p.pairs[0].memory.restarts == 0
    assert "decode pod d-1-decode-r1 restarted 1x" in p.actions[0].detail


def test_streak_resets_after_a_stable_ready_period_and_backoff_is_capped():
    stable = plan(swap(H, 0, "decode", restarts=1), {0: PairMemory(restarts=9, streak=9, ready_since=NOW - 301)})
    assert stable.pairs[0].memory.streak == 1 and stable.requeue_after == 1.0
    flapping = plan(swap(H, 0, "decode", restarts=1), {0: PairMemory(restarts=9, streak=9, ready_since=NOW - 10)})
    assert flapping.pairs[0].memory.streak == 10 and flapping.requeue_after == 300.0


def test_backoff_wait_requeues_for_the_remaining_time():
    p = plan(healthy(1), {1: PairMemory(restarts=1, streak=2, last_co_restart_at=NOW - 0.5)})
    assert p.pairs[1].phase == "BackingOff" and p.requeue_after == pytest.approx(1.5)


def test_recovery_time_is_reported_once_when_the_pair_is_ready_again():
    mem = {1: PairMemory(restarts=1, streak=1, last_co_restart_at=NOW - 7.5, recovering=True)}
    p = plan(H, mem)
    assert p.pairs[1].recovered_after_s == pytest.approx(7.5)
    assert p.pairs[1].memory.recovering is False and p.pairs[1].memory.ready_since == NOW
    assert p.pairs[0].recovered_after_s is None


def test_pairs_report_revision_readiness_and_hosts():
    p = plan(swap(H, 1, "decode", ready=False))
    assert [(s.index, s.revision, s.ready, s.phase) for s in p.pairs] == [(0, "r1", True, "Ready"),
                                                                        (1, "r1", False, "Starting")]
    assert p.pairs[0].hosts == ("10.0.0.1", "10.0.0.2")


def test_pod_view_reads_the_api_fields_that_matter():
    raw = {"metadata": {"name": "d-0-decode-x", "labels": {"pdstack.io/pair": "0", "pdstack.io/role": "decode",
                                                         "pdstack.io/revision": "r1"}},
           "spec": {"containers": [{"resources": {"requests": {"nvidia.com/gpu": "4"}}}]},
           "status": {"phase": "Running", "podIP": "10.1.2.3",
                      "conditions": [{"type": "Ready", "status": "False"}],
                      "containerStatuses": [{"restartCount": 1, "lastState": {"terminated": {"reason": "OOMKilled"}}}]}}
    v = pod_view(raw)
    assert (v.pair, v.role, v.revision, v.restarts, v.oom_killed, v.ready, v.gpus, v.ip) == \
        (0, "decode", "r1", 1, True, False, 4, "10.1.2.3")
    evicted = pod_view({**raw, "status": {"phase": "Failed", "reason": "Evicted"}})
    assert evicted.evicted and evicted.phase == "Failed" and not evicted.oom_killed
    pending = pod_view({**raw, "status": {"phase": "Pending", "conditions": [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": "0/2 nodes"}]}})
    assert pending.unschedulable == "0/2 nodes"
    assert pod_view({"metadata": {"name": "x", "labels": {}}}) is None


def test_unschedulable_message_has_requested_and_allocatable_gpus():
    nodes = [{"metadata": {"labels": {"gpu": "h100"}}, "status": {"allocatable": {"nvidia.com/gpu": "8"}}},
             {"metadata": {"labels": {"gpu": "h100"}}, "status": {"allocatable": {"nvidia.com/gpu": "8"}}},
             {"metadata": {"labels": {"gpu": "a10"}}, "status": {"allocatable": {"nvidia.com/gpu": "4"}}}]
    pending = [pod(1, r, unschedulable="0/3 nodes are available: 3 Insufficient nvidia.com/gpu.", gpus=8,
                   phase="Pending", ready=False) for r in BOTH]
    msg = unschedulable_message(requested_gpus=32, pods=pending, nodes=nodes, node_selector={"gpu": "h100"})
    assert msg.startswith("2 worker pod(s) cannot be scheduled (d-1-decode-r1, d-1-prefill-r1; 16 nvidia.com/gpu pending)")
    assert "the deployment requests 32 nvidia.com/gpu in total, 16 allocatable on 2 node(s) matching nodeSelector" in msg
    assert msg.endswith("Scheduler: 0/3 nodes are available: 3 Insufficient nvidia.com/gpu.")
    nodes[0]["metadata"]["name"], nodes[1]["metadata"]["name"] = "n0", "n1"

    def raw(node, gpus, deployment=None, phase="Running"):
        return {"metadata": {"labels": {"pdstack.io/deployment": deployment} if deployment else {}},
                "spec": {"nodeName": node, "containers": [{"resources": {"requests": {"nvidia.com/gpu": str(gpus)}}}]},
                "status": {"phase": phase}}
    everyone = [raw("n0", 6), raw("n1", 8, deployment="d"), raw("n1", 2, phase="Failed"), raw("elsewhere", 4)]
    msg = unschedulable_message(requested_gpus=16, pods=pending, nodes=nodes, node_selector={"gpu": "h100"},
                                deployment="d", all_pods=everyone)
    assert "16 allocatable on 2 node(s) matching nodeSelector {'gpu': 'h100'} (6 held by other workloads)." in msg
    p = plan(pending + healthy(1))
    assert p.pairs[1].phase == "Unschedulable" and {v.name for v in p.unschedulable} == {v.name for v in pending}


# ---------------------------------------------------------------- drain before delete, lost nodes
from pdoperator.core.pairs import DrainPair, ForceDelete, RouterView  # noqa: E402

ROUTER_V5 = RouterView(present=True, version=5)
DRAINING = PairMemory(drain_started_at=NOW - 1.0, drain_version=5)

DRAIN_CASES = [
    # (id, pods, memory, router, expected actions)
    ("no router pod to ask: delete at once", swap(H, 1, "decode", restarts=1), {}, RouterView(),
     [("CoRestart", 1, "ContainerRestart", NAMES1)]),
    ("router present: first mark pair 1 draining", swap(H, 1, "decode", restarts=1), {}, ROUTER_V5,
     [DrainPair(1, "ContainerRestart", "router")]),
    ("published, router still on an older version: wait", swap(H, 1, "decode", restarts=1),
     {1: replace(DRAINING, drain_version=6)}, ROUTER_V5, [DrainPair(1, "ContainerRestart", "router")]),
    ("router confirmed, nothing in flight: co-restart", swap(H, 1, "decode", restarts=1), {1: DRAINING},
     ROUTER_V5, [("CoRestart", 1, "ContainerRestart", NAMES1)]),
    ("router confirmed, requests in flight: wait", swap(H, 1, "decode", restarts=1), {1: DRAINING},
     RouterView(True, 5, {1: 2}), [DrainPair(1, "ContainerRestart", "router")]),
    ("in flight past drainSeconds: delete anyway", swap(H, 1, "decode", restarts=1),
     {1: replace(DRAINING, drain_confirmed_at=NOW - 31)}, RouterView(True, 5, {1: 2}),
     [("CoRestart", 1, "ContainerRestart", NAMES1)]),
    ("router never answers: held until drainSeconds + confirm timeout", swap(H, 1, "decode", restarts=1),
     {1: replace(DRAINING, drain_started_at=NOW - 59)}, RouterView(True, None), [DrainPair(1, "ContainerRestart",
                                                                                         "router")]),
    ("router never answers, bound passed: delete", swap(H, 1, "decode", restarts=1),
     {1: replace(DRAINING, drain_started_at=NOW - 61)}, RouterView(True, None),
     [("CoRestart", 1, "ContainerRestart", NAMES1)]),
    ("rollout drains before deleting", healthy(rev="r0"), {}, ROUTER_V5, [DrainPair(0, "Rollout", "router")]),
    ("rollout: a draining pair holds the budget; confirmed -> rolled",
     healthy(rev="r0"), {0: DRAINING}, ROUTER_V5, [RolloutPair(0, "r0", "r1", ("d-0-prefill-r0", "d-0-decode-r0"))]),
    ("scale down drains first", H + healthy(3)[4:], {}, ROUTER_V5, [DrainPair(2, "ScaleDown", "router")]),
]


@pytest.mark.parametrize("pods,memory,router,expected", [c[1:] for c in DRAIN_CASES],
                         ids=[c[0] for c in DRAIN_CASES])
def test_drain_before_delete(pods, memory, router, expected):
    p = plan_pairs(PlanInput(desired_revision="r1", pairs=2, policy=PAIR, max_unavailable=1, pods=pods, memory=memory,
                   now=NOW, router=router, drain_s=30.0, drain_confirm_timeout_s=30.0))
    assert kinds(p) == expected
    for a in p.actions:  # a pair about to lose its pods is draining in the topology the same reconcile
        if isinstance(a, (DrainPair, RolloutPair)) or (isinstance(a, CoRestart)):
            states = {s.index: s for s in p.pairs + p.retiring}
            assert states[a.pair].draining and not states[a.pair].ready


def test_unconfirmed_drain_is_reported():
    p = plan_pairs(PlanInput(desired_revision="r1", pairs=2, policy=PAIR, max_unavailable=1,
                   pods=swap(H, 1, "decode", restarts=1), memory={1: replace(DRAINING, drain_started_at=NOW - 61)},
                   now=NOW, router=RouterView(True, None), drain_s=30.0, drain_confirm_timeout_s=30.0))
    assert p.unconfirmed_drains == (1,)


LOST = [replace(p, terminating=True, node="n1", delete_deadline=NOW - 10) if p.pair == 1 else p for p in H]


@pytest.mark.parametrize("lost,margin,expected", [
    (frozenset({"n1"}), 5.0, [ForceDelete(1, "d-1-prefill-r1", "n1", 10.0), ForceDelete(1, "d-1-decode-r1", "n1", 10.0)]),
    (frozenset({"n1"}), 30.0, []),  # within deadline + margin: wait (at 0 s, 600 s, 3600 s it acts once past)
    (frozenset(), 5.0, []),  # node healthy: its kubelet will confirm
], ids=["lost node past the bound: force delete", "lost node within the bound", "node ready"])
def test_lost_node(lost, margin, expected):
    p = plan_pairs(PlanInput(desired_revision="r1", pairs=2, policy=PAIR, max_unavailable=1, pods=LOST, memory={},
                             now=NOW,
                   lost_nodes=lost, lost_node_margin_s=margin))
    assert [a for a in p.actions if isinstance(a, ForceDelete)] == expected
    if not expected and lost:
        assert p.requeue_after is not None and p.requeue_after <= 20.0  # wakes up at the bound


def test_outranked_names_live_higher_priority_peers_only():
    import datetime

    from pdoperator.core.peering import outranked
    now = datetime.datetime(2026, 1, 1, 12, 0, 0, tzinfo=datetime.timezone.utc)
    status = {
        "a@host/1": {"priority": 100, "lifetime": 15, "lastseen": "2026-01-01T11:59:50+00:00"},  # alive, higher
        "c@host/3": {"priority": 200, "lifetime": 15, "lastseen": "2026-01-01T11:59:00+00:00"},  # dead
        "b@host/2": {"priority": 50, "lifetime": 15, "lastseen": "2026-01-01T11:59:59"},  # us / lower
        "gone": None,  # kopf nulls a peer it cleaned up
    }
    assert outranked(status, 50, now) == ["a@host/1"]
    assert outranked(status, 100, now) == []
    assert outranked(None, 0, now) == []


# --- per-pair targets (a canary holds the other pairs at the old revision) and drift reverts -----------------

def plan_with(pods, *, targets=None, reverts=None, memory=None, desired="r1", pairs=2):
    return plan_pairs(PlanInput(desired_revision=desired, pairs=pairs, policy=PAIR, max_unavailable=1, pods=pods,
                      memory=memory or {}, now=NOW, targets=targets, reverts=reverts))


TARGET_CASES = [
    ("canary pair 1 first: only pair 1 rolls", healthy(rev="r0"), {0: "r0", 1: "r1"}, None,
     [RolloutPair(1, "r0", "r1", ("d-1-prefill-r0", "d-1-decode-r0"))]),
    ("canary ready at r1: pair 0 stays at r0", [pod(0, r, "r0") for r in BOTH] + [pod(1, r, "r1") for r in BOTH],
     {0: "r0", 1: "r1"}, None, []),
    ("a held pair that co-restarts comes back at the old revision",
     [pod(1, r, "r1") for r in BOTH], {0: "r0", 1: "r1"}, None, [CreatePods(0, "r0", BOTH)]),
    ("canary failed: the canary pair rolls back", [pod(0, r, "r0") for r in BOTH] + [pod(1, r, "r1") for r in BOTH],
     {0: "r0", 1: "r0"}, None, [RolloutPair(1, "r1", "r0", ("d-1-prefill-r1", "d-1-decode-r1"))]),
    ("drift revert: the whole pair co-restarts", H, None, {1: "decode pod d-1-decode-r1: spec.containers[0].image"},
     [("CoRestart", 1, "DriftReverted", NAMES1)]),
    ("a real fault is named before the drift", swap(H, 1, "decode", restarts=1), None, {1: "edited"},
     [("CoRestart", 1, "ContainerRestart", NAMES1)]),
]


@pytest.mark.parametrize("pods,targets,reverts,expected", [c[1:] for c in TARGET_CASES],
                         ids=[c[0] for c in TARGET_CASES])
def test_planner_targets_and_reverts(pods, targets, reverts, expected):
    assert kinds(plan_with(pods, targets=targets, reverts=reverts)) == expected


def test_drift_revert_event_detail_names_the_field():
    p = plan_with(H, reverts={0: "decode pod d-0-decode-r1: spec.containers[0].image edited by someone else"})
    assert p.co_restarts[0].detail.endswith("spec.containers[0].image edited by someone else")
