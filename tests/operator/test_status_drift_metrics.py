"""Status conditions, drift decisions and the operator's /metrics endpoint (pure or local)."""

from __future__ import annotations

import urllib.request

import pytest
from prometheus_client import CollectorRegistry, Counter

from pdoperator.core import drift
from pdoperator.shell import metrics
from pdoperator.core.pairs import PairMemory, PairState, Plan
from pdoperator.core.status import Facts, build_status, invalid_status, iso, memory_from_status, same_status
from pdruntime.util.ports import free_port

NOW = 1_700_000_000.0


def state(k, rev="r1", ready=True, phase="Ready", **mem):
    return PairState(k, rev, ready, phase, PairMemory(**mem))


def conds(status):
    return {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}


def test_all_ready():
    st = build_status({}, Plan((), (state(0), state(1))), Facts(3, "r1", router_ready=True), NOW)
    assert st["phase"] == "Ready" and st["observedGeneration"] == 3 and st["readyPairs"] == 2
    assert st["currentRevision"] == st["updateRevision"] == "r1"
    assert conds(st) == {"Ready": ("True", "AllPairsReady"), "Progressing": ("True", "RolloutComplete"),
                         "Degraded": ("False", "AsExpected"), "CoRestarting": ("False", "Idle"),
                         "ConfigDrift": ("False", "NoDrift"), "Stalled": ("False", "AsExpected"),
                         "ApiRejected": ("False", "AsExpected"), "CanaryFailed": ("False", "AsExpected")}


def test_api_rejections_are_a_condition_naming_verb_object_and_message():
    line = 'apply pods/x-0-prefill-abc: HTTP 403: pods is forbidden: User "u" cannot patch resource "pods"'
    st = build_status({}, Plan((), (state(0),)), Facts(1, "r1", router_ready=True, rejections=[line]), NOW)
    cond = next(c for c in st["conditions"] if c["type"] == "ApiRejected")
    assert (cond["status"], cond["reason"], cond["message"]) == ("True", "Rejected", line)


def test_co_restarting_pair_is_degraded_and_recorded():
    down = state(1, None, False, "BackingOff", restarts=1, streak=1, last_co_restart_at=NOW - 1,
                 last_co_restart_reason="OOMKilled", recovering=True)
    st = build_status({}, Plan((), (state(0), down)), Facts(1, "r1", router_ready=True), NOW)
    c = conds(st)
    assert st["phase"] == "Degraded" and c["Ready"] == ("False", "PairsNotReady")
    assert c["Degraded"] == ("True", "PairsDown") and c["CoRestarting"] == ("True", "PairCoRestart")
    assert st["pairs"][1]["lastCoRestart"] == {"time": iso(NOW - 1), "reason": "OOMKilled"}
    assert st["pairs"][1]["restarts"] == 1 and st["pairs"][1]["revision"] is None
    # and the memory round-trips through status
    assert memory_from_status(st)[1] == down.memory


def test_rollout_unschedulable_drift():
    rolling = build_status({}, Plan((), (state(0, "r2"), state(1, "r1"))), Facts(2, "r2", router_ready=True), NOW)
    assert conds(rolling)["Progressing"] == ("True", "RollingOut") and rolling["currentRevision"] is None
    uns = build_status({}, Plan((), (state(0, "r1", False, "Unschedulable"),)),
                       Facts(1, "r1", unschedulable_message="requests 32, 16 allocatable"), NOW)
    assert conds(uns)["Progressing"] == ("False", "Unschedulable") and uns["phase"] == "Pending"
    entry = drift.DriftEntry("children", "Service/x", "spec")
    dr = build_status({}, Plan((), (state(0),)), Facts(1, "r1", router_ready=True, drift=[entry]), NOW)
    assert conds(dr)["ConfigDrift"] == ("True", "Drifted")
    assert next(c for c in dr["conditions"] if c["type"] == "ConfigDrift")["message"] == "Service/x: spec"
    assert dr["drift"] == [{"source": "children", "object": "Service/x", "field": "spec", "declared": None,
                            "seen": None}]


def test_invalid_spec_status_keeps_pair_records_and_stalls():
    old = build_status({}, Plan((), (state(0),)), Facts(1, "r1", router_ready=True), NOW)
    st = invalid_status(old, Facts(2, None, spec_error="spec.pairs=-1 is invalid"), NOW + 5)
    assert st["phase"] == "Invalid" and st["pairs"] == old["pairs"] and st["observedGeneration"] == 2
    stalled = next(c for c in st["conditions"] if c["type"] == "Stalled")
    assert conds(st)["Stalled"] == ("True", "InvalidSpec") and "spec.pairs=-1" in stalled["message"]


def test_transition_times_are_kept_while_a_condition_holds_and_rewrites_are_skipped():
    first = build_status({}, Plan((), (state(0),)), Facts(1, "r1", router_ready=True), NOW)
    again = build_status(first, Plan((), (state(0),)), Facts(1, "r1", router_ready=True), NOW + 60)
    assert again == first and same_status(first, again)  # nothing to write
    flipped = build_status(first, Plan((), (state(0, ready=False, phase="Starting"),)),
                           Facts(1, "r1", router_ready=True), NOW + 60)
    times = {c["type"]: c["lastTransitionTime"] for c in flipped["conditions"]}
    assert times["Ready"] == iso(NOW + 60) and times["Stalled"] == iso(NOW)


DESIRED = {"kind": "Deployment", "metadata": {"name": "r", "labels": {"a": "b"}},
           "spec": {"replicas": 1, "template": {"spec": {"containers": [
               {"name": "router", "env": [], "resources": {"requests": {"cpu": "0.5", "memory": "1024Mi"}},
                "ports": [{"name": "http", "containerPort": 8000}]}]}}}}
OURS = {"manager": "pdstack-operator", "operation": "Apply", "fieldsV1": {"f:spec": {"f:replicas": {}}}}
EDIT_REPLICAS = {"manager": "kubectl-edit", "operation": "Update", "fieldsV1": {"f:spec": {"f:replicas": {}}}}
EDIT_PORT = {"manager": "kubectl-edit", "operation": "Update", "fieldsV1": {"f:spec": {"f:template": {"f:spec": {
    "f:containers": {'k:{"name":"router"}': {"f:ports": {'k:{"containerPort":8000,"protocol":"TCP"}': {
        "f:name": {}}}}}}}}}}
EDIT_OTHER = {"manager": "hpa", "operation": "Update", "fieldsV1": {"f:spec": {"f:minReadySeconds": {}}}}
STATUS = {"manager": "kube-controller-manager", "operation": "Update", "subresource": "status",
          "fieldsV1": {"f:status": {"f:replicas": {}}}}


def live(*managers, **spec_changes):
    obj = drift.with_hash(DESIRED)
    # what the server returns: env omitted, quantities canonical, defaults filled in
    ctr = obj["spec"]["template"]["spec"]["containers"][0]
    ctr.pop("env")
    ctr["resources"]["requests"] = {"cpu": "500m", "memory": "1Gi"}
    ctr["terminationMessagePath"] = "/dev/termination-log"
    obj["spec"].update(spec_changes)
    obj["metadata"]["managedFields"] = [OURS, *managers]
    return obj


@pytest.mark.parametrize("live_obj,policy,enforce,action,paths", [
    (None, "Report", False, "create", ()),
    (live(), "Report", False, "none", ()),  # env [] omitted, 0.5 -> 500m, 1024Mi -> 1Gi, defaults: no drift
    (live(STATUS), "Report", False, "none", ()),  # status writers are not drift
    (live(EDIT_OTHER, minReadySeconds=5), "Report", False, "none", ()),  # a field we do not declare
    (live(EDIT_REPLICAS, replicas=3), "Report", False, "report", ("spec.replicas",)),
    (live(EDIT_REPLICAS, replicas=3), "Revert", False, "revert", ("spec.replicas",)),
    (live(EDIT_REPLICAS, replicas=3), "Report", True, "revert", ("spec.replicas",)),
    (live(EDIT_PORT), "Report", False, "report", ("spec.template.spec.containers[0].ports[0].name",)),
])
def test_drift_decisions(live_obj, policy, enforce, action, paths):
    d = drift.decide(DESIRED, live_obj, policy, enforce=enforce)
    assert (d.action, d.paths) == (action, paths)


def test_desired_change_is_applied_not_reported():
    old = {"kind": "Service", "metadata": {"name": "s", "labels": {}}, "spec": {"ports": [{"port": 80}]}}
    new = {"kind": "Service", "metadata": {"name": "s", "labels": {}}, "spec": {"ports": [{"port": 81}]}}
    assert drift.decide(new, drift.with_hash(old), "Report").action == "apply"


def test_metrics_endpoint_serves_operator_metrics():
    port = free_port()
    registry = CollectorRegistry()
    Counter("pdstack_operator_probe", "probe", registry=registry).inc()
    metrics.serve(port, registry=registry)
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert "pdstack_operator_probe_total 1.0" in body
    names = {m.describe()[0].name for m in (metrics.RECONCILE_DURATION, metrics.RECONCILE_ERRORS, metrics.CO_RESTARTS,
                                            metrics.PAIR_RECOVERY, metrics.PAIRS_READY)}
    assert all(n.startswith("pdstack_operator_") for n in names)
