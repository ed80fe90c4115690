"""The real kopf operator (pdoperator.shell.handlers) against the API emulator over HTTP on loopback."""

from __future__ import annotations

import time

import pytest
import yaml
from prometheus_client import REGISTRY, generate_latest

from pdop_harness import NS, PODS, PDDS, R, eventually, manifest

SERVICES = R("", "v1", "services")
CONFIGMAPS = R("", "v1", "configmaps")
SECRETS = R("", "v1", "secrets")
DEPLOYMENTS = R("apps", "v1", "deployments")
REVISIONS = R("apps", "v1", "controllerrevisions")
NETPOLS = R("networking.k8s.io", "v1", "networkpolicies")
PDBS = R("policy", "v1", "poddisruptionbudgets")
CHILD_RESOURCES = (PODS, SERVICES, CONFIGMAPS, SECRETS, DEPLOYMENTS, REVISIONS, NETPOLS, PDBS)


def children(c, name):
    return [o for res in CHILD_RESOURCES for o in c.api.select(res, NS, f"pdstack.io/deployment={name}")]


def topology(c, name):
    cm = c.api.read(CONFIGMAPS, NS, f"{name}-topology")
    return yaml.safe_load(cm["data"]["topology.yaml"]) if cm else None


def is_ready(c, name):
    return c.condition(name, "Ready").get("status") == "True"


def metric(name, **labels):
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def test_two_pairs_all_children_exist_and_ready_within_5s_of_pods_ready(operator):
    c = operator
    c.kubelet.auto_ready = False
    c.apply(manifest("alpha", pairs=2))
    await eventually(lambda: len(c.pods("alpha")) == 4 and all(p.get("status", {}).get("phase") == "Running"
                                                               for p in c.pods("alpha")), what="4 running pods")
    expected = sorted(["Pod"] * 4 + ["Service", "Service", "ConfigMap", "Secret", "Secret", "Deployment",
                                     "ControllerRevision", "NetworkPolicy", "PodDisruptionBudget"])
    await eventually(lambda: sorted(o["kind"] for o in children(c, "alpha")) == expected, what="every child")
    owner_uid = c.pdd("alpha")["metadata"]["uid"]
    for obj in children(c, "alpha"):
        assert [r["uid"] for r in obj["metadata"]["ownerReferences"]] == [owner_uid], obj["metadata"]["name"]
    roles = sorted((p["metadata"]["labels"]["pdstack.io/pair"], p["metadata"]["labels"]["pdstack.io/role"])
                   for p in c.pods("alpha"))
    assert roles == [("0", "decode"), ("0", "prefill"), ("1", "decode"), ("1", "prefill")]
    await eventually(lambda: c.condition("alpha", "Ready").get("reason") == "PairsNotReady", what="status written")
    assert not is_ready(c, "alpha")

    t0 = time.monotonic()
    for p in c.pods("alpha"):
        c.kubelet.set_ready(NS, p["metadata"]["name"], True)
    c.kubelet.auto_ready = True
    await eventually(lambda: is_ready(c, "alpha"), timeout=5.0, what="Ready within 5 s of the pods")
    elapsed = time.monotonic() - t0
    st = c.pdd("alpha")["status"]
    assert st["phase"] == "Ready" and st["readyPairs"] == 2
    assert st["currentRevision"] == st["updateRevision"]
    assert st["observedGeneration"] == c.pdd("alpha")["metadata"]["generation"]
    topo = await eventually(lambda: (t := topology(c, "alpha")) and all(p["ready"] for p in t["pairs"]) and t)
    assert topo["revision"] == st["updateRevision"]
    ips = {p["metadata"]["labels"]["pdstack.io/pair"] + p["metadata"]["labels"]["pdstack.io/role"]: p["status"]["podIP"]
           for p in c.pods("alpha")}
    assert topo["pairs"][1]["prefill"] == {"url": f"http://{ips['1prefill']}:8000", "bootstrap_host": ips["1prefill"],
                                           "bootstrap_port": 8998}
    assert topo["pairs"][1]["decode"] == {"url": f"http://{ips['1decode']}:8000"}
    print(f"Ready {elapsed:.3f}s after the simulated pods became ready")
    # one writer: every status version in the object's history has exactly the operator's own fields
    # (kopf stores no handler progress or results there)
    ours = {"phase", "observedGeneration", "currentRevision", "updateRevision", "readyPairs", "pairs", "conditions",
            "topologyVersion", "replicas", "selector"}  # replicas + selector: the scale subresource
    statuses = [v["status"] for v in c.api.history(PDDS, NS, "alpha") if v and "status" in v]
    assert statuses and all(set(st) == ours for st in statuses)
    assert metric("pdstack_operator_pairs_ready", namespace=NS, deployment="alpha") == 2


async def _ready_pairs(c, name, pairs=2):
    c.apply(manifest(name, pairs=pairs))
    await eventually(lambda: is_ready(c, name), what=f"{name} Ready")
    return {k: c.pair_pods(name, k) for k in range(pairs)}


@pytest.mark.parametrize("role,fault,reason", [
    ("decode", "restart", "ContainerRestart"),
    ("prefill", "delete", "PodDeleted"),
    ("decode", "oom", "OOMKilled"),
    ("prefill", "evict", "Evicted"),
])
async def test_fault_in_pair_1_co_restarts_both_pods_of_pair_1_only(operator, role, fault, reason):
    c = operator
    name = f"co-{fault}"
    before = await _ready_pairs(c, name)
    old1 = {r: p["metadata"]["name"] for r, p in before[1].items()}
    old0 = {r: (p["metadata"]["name"], p["metadata"]["uid"]) for r, p in before[0].items()}
    victim = old1[role]
    if fault == "restart":
        c.kubelet.restart_container(NS, victim)
    elif fault == "oom":
        c.kubelet.restart_container(NS, victim, oom=True)
    elif fault == "evict":
        c.kubelet.evict(NS, victim)
    else:
        c.delete(PODS, victim)

    def recreated():
        now = c.pair_pods(name, 1)
        return (set(now) == {"prefill", "decode"}
                and all(now[r]["metadata"]["name"] != old1[r] for r in now) and now)
    new1 = await eventually(recreated, what="both pods of pair 1 recreated")
    # both old pods of pair 1 are gone, including the healthy survivor
    for r, old in old1.items():
        assert c.api.read(PODS, NS, old) is None, f"old {r} pod {old} still exists"
    # the two new pods were created together, at one revision, with one incarnation suffix
    assert len({p["metadata"]["labels"]["pdstack.io/revision"] for p in new1.values()}) == 1
    assert len({p["metadata"]["name"].rsplit("-", 1)[1] for p in new1.values()}) == 1
    # pair 0 untouched: same pods, never restarted or rewritten by the operator
    now0 = c.pair_pods(name, 0)
    assert {r: (p["metadata"]["name"], p["metadata"]["uid"]) for r, p in now0.items()} == old0

    await eventually(lambda: is_ready(c, name), what="Ready again after the co-restart")
    st = c.pdd(name)["status"]
    assert st["pairs"][1]["restarts"] == 1 and st["pairs"][1]["lastCoRestart"]["reason"] == reason
    assert st["pairs"][0]["restarts"] == 0 and "lastCoRestart" not in st["pairs"][0]
    events = c.events(name, "CoRestart")
    assert len(events) == 1 and events[0]["type"] == "Warning"
    assert "pair 1 co-restarted" in events[0]["message"] and reason in events[0]["message"]
    # the event names the pods involved: the faulty one, or (deleted) the survivor it took down
    assert victim in events[0]["message"] or (fault == "delete" and f"{role} pod gone" in events[0]["message"]
                                              and old1["decode"] in events[0]["message"])
    assert metric("pdstack_operator_co_restarts_total", namespace=NS, deployment=name, reason=reason) == 1
    assert metric("pdstack_operator_pair_recovery_seconds_count", namespace=NS, deployment=name) == 1
    assert f'pdstack_operator_co_restarts_total{{deployment="{name}",namespace="{NS}",reason="{reason}"}} 1.0' \
        in generate_latest(REGISTRY).decode()

    # the router was told: some topology version had pair 1 not ready while pair 0 stayed ready
    versions = [yaml.safe_load(v["data"]["topology.yaml"]) for v in c.api.history(CONFIGMAPS, NS, f"{name}-topology")
                if v is not None]
    assert any(not t["pairs"][1]["ready"] and t["pairs"][0]["ready"] for t in versions)
    assert all(t["pairs"][0]["ready"] for t in versions if t["pairs"][1]["ready"])


def _replay_pod_events(c, name, since_rv):
    """Pod states after each pod event since ``since_rv``: {pod name: (pair, revision, ready)}."""
    live: dict[str, tuple[str, str, bool]] = {}
    snapshots = []
    for rv, ev in c.api._log.get(PODS, []):
        obj = ev["object"]
        labels = obj["metadata"].get("labels", {})
        if labels.get("pdstack.io/deployment") != name:
            continue
        n = obj["metadata"]["name"]
        if ev["type"] == "DELETED":
            live.pop(n, None)
        else:
            ready = any(x.get("type") == "Ready" and x.get("status") == "True"
                        for x in obj.get("status", {}).get("conditions", []))
            live[n] = (labels["pdstack.io/pair"], labels["pdstack.io/revision"], ready)
        if rv > since_rv:
            snapshots.append(dict(live))
    return snapshots


async def test_decode_env_change_rolls_out_pair_by_pair_never_mixing_revisions(operator):
    c = operator
    name = "roll"
    await _ready_pairs(c, name, pairs=3)
    old_rev = c.pdd(name)["status"]["currentRevision"]
    since = c.api._last_rv
    c.patch_spec(name, {"decode": {"resources": {"gpus": 1}, "env": [{"name": "SGLANG_SM120_MMA_TARGET_CTAS",
                                                                      "value": "512"}]}})

    def rolled():
        st = c.pdd(name)["status"]
        return (st["updateRevision"] != old_rev and st["currentRevision"] == st["updateRevision"]
                and is_ready(c, name) and st)
    st = await eventually(rolled, timeout=20, what="rollout complete")
    assert st["observedGeneration"] == 2
    for p in c.pods(name):
        env = {e["name"]: e["value"] for e in p["spec"]["containers"][0]["env"]}
        if p["metadata"]["labels"]["pdstack.io/role"] == "decode":
            assert env["SGLANG_SM120_MMA_TARGET_CTAS"] == "512"
        else:
            assert "SGLANG_SM120_MMA_TARGET_CTAS" not in env
        assert p["metadata"]["labels"]["pdstack.io/revision"] == st["updateRevision"]

    snaps = _replay_pod_events(c, name, since)
    assert snaps, "no pod events recorded during the rollout"
    for snap in snaps:
        pairs: dict[str, set[str]] = {}
        ready: dict[str, int] = {}
        for pair, rev, rdy in snap.values():
            pairs.setdefault(pair, set()).add(rev)
            ready[pair] = ready.get(pair, 0) + int(rdy)
        assert all(len(revs) == 1 for revs in pairs.values()), f"mixed revisions in a pair: {snap}"
        unavailable = [k for k in ("0", "1", "2") if ready.get(k, 0) < 2]
        assert len(unavailable) <= 1, f"more than maxUnavailablePairs=1 pairs down at once: {snap}"
    rolled_pairs = sorted(int(e["message"].split()[1]) for e in c.events(name, "RollingOut"))
    assert rolled_pairs == [0, 1, 2]  # each pair replaced exactly once
    # pair by pair: the first replaced pair was ready at the new revision before the next went down
    first_down = {}
    new_ready = {}
    for i, snap in enumerate(snaps):
        for k in ("0", "1", "2"):
            revs = {rev for pair, rev, _ in snap.values() if pair == k}
            rdy = sum(1 for pair, rev, r in snap.values() if pair == k and r and rev == st["updateRevision"])
            if k not in first_down and old_rev not in revs:
                first_down[k] = i
            if k not in new_ready and rdy == 2:
                new_ready[k] = i
    ks = sorted(first_down, key=first_down.get)
    assert len(ks) == 3
    for a, b in zip(ks, ks[1:]):
        assert new_ready[a] < first_down[b], f"pair {b} went down before pair {a} was ready again"
    assert metric("pdstack_operator_rollout_pairs_total", namespace=NS, deployment=name) == 3
    assert metric("pdstack_operator_co_restarts_total", namespace=NS, deployment=name, reason="ContainerRestart") == 0


async def test_too_few_gpus_reports_unschedulable_with_requested_and_allocatable(operator):
    c = operator
    name = "big"
    c.kubelet.add_node("cpu-only", 0, {"pdstack.io/gpu": "none"})
    c.api._create(PODS, NS, {"metadata": {"name": "someone-else"}, "spec": {"nodeName": "gpu-b", "containers": [
        {"name": "x", "resources": {"requests": {"nvidia.com/gpu": "2"}}}]}})
    c.apply(manifest(name, pairs=2, gpus=8, placement={"nodeSelector": {"pdstack.io/gpu": "h100"}}))

    def unschedulable():
        cond = c.condition(name, "Progressing")
        return cond.get("reason") == "Unschedulable" and cond
    cond = await eventually(unschedulable, what="Progressing=False/Unschedulable")
    assert cond["status"] == "False"
    msg = cond["message"]
    assert ("requests 32 nvidia.com/gpu in total, 16 allocatable on 2 node(s) matching nodeSelector "
            "{'pdstack.io/gpu': 'h100'} (2 held by other workloads)") in msg, msg
    assert "Insufficient nvidia.com/gpu" in msg
    assert c.pdd(name)["status"]["phase"] == "Pending"
    assert c.events(name, "Unschedulable")
    # the scheduler placed what fits: one 8-GPU pod on the free node; gpu-b has only 6 free
    running = [p for p in c.pods(name) if p.get("status", {}).get("phase") == "Running"]
    assert len(running) == 1 and running[0]["spec"]["nodeName"] == "gpu-a"
    assert all(p["spec"].get("nodeName") != "cpu-only" for p in c.pods(name))


async def test_invalid_spec_reason_appears_in_a_condition_and_recovers_when_fixed(operator):
    c = operator
    name = "bad"
    body = manifest(name, pairs=1)
    body["spec"]["decode"]["env"] = [{"name": "PDRT_MAX_KV_SPLITS", "value": "8"}]
    c.apply(body)

    def stalled():
        cond = c.condition(name, "Stalled")
        return cond.get("status") == "True" and cond
    cond = await eventually(stalled, what="Stalled=True")
    assert cond["reason"] == "InvalidSpec"
    assert "spec.decode.env[0].name='PDRT_MAX_KV_SPLITS' is set by the operator; set spec.kernel.maxKVSplits" \
        in cond["message"]
    assert c.condition(name, "Ready")["reason"] == "InvalidSpec"
    assert c.pdd(name)["status"]["phase"] == "Invalid"
    assert c.pods(name) == []
    events = c.events(name, "InvalidSpec")
    assert len(events) == 1 and "PDRT_MAX_KV_SPLITS" in events[0]["message"]

    c.patch_spec(name, {"decode": {"env": None}, "kernel": {"maxKVSplits": 8}})
    await eventually(lambda: is_ready(c, name), what="Ready after the fix")
    assert c.condition(name, "Stalled")["status"] == "False"
    env = {e["name"]: e["value"] for e in c.pair_pods(name, 0)["decode"]["spec"]["containers"][0]["env"]}
    assert env["PDRT_MAX_KV_SPLITS"] == "8"


async def test_deleting_the_pddeployment_deletes_every_child(operator):
    c = operator
    name = "gone"
    await _ready_pairs(c, name)
    assert len(children(c, name)) == 13  # 4 pods, 2 services, 2 secrets (KV, router admin), router, ...
    c.delete(PDDS, name)
    await eventually(lambda: c.pdd(name) is None, what="PDDeployment gone (finalizer released)")
    await eventually(lambda: children(c, name) == [], what="every child gone")


async def test_hand_edits_of_children_are_reported_as_drift_then_reverted(operator):
    c = operator
    name = "drifty"
    await _ready_pairs(c, name, pairs=1)
    svc = c.api.read(SERVICES, NS, f"{name}-router")
    svc["spec"]["ports"][0]["targetPort"] = 9999
    c.api._store(SERVICES, NS, f"{name}-router", svc, manager="kubectl-edit")  # as `kubectl edit` does

    def drifted():
        cond = c.condition(name, "ConfigDrift")
        return cond.get("status") == "True" and cond
    cond = await eventually(drifted, what="ConfigDrift=True")
    assert cond["reason"] == "Drifted" and f"Service/{name}-router: spec.ports[0].targetPort" in cond["message"]
    assert c.api.read(SERVICES, NS, f"{name}-router")["spec"]["ports"][0]["targetPort"] == 9999  # Report leaves it

    # the topology is operator-owned live state: a hand edit is reverted even under Report
    cm = c.api.read(CONFIGMAPS, NS, f"{name}-topology")
    cm["data"]["topology.yaml"] = "version: 1\npairs: []\n"
    c.api._store(CONFIGMAPS, NS, f"{name}-topology", cm, manager="kubectl-edit")
    await eventually(lambda: (t := topology(c, name)) and len(t["pairs"]) == 1, what="topology restored")
    assert c.api.read(SERVICES, NS, f"{name}-router")["spec"]["ports"][0]["targetPort"] == 9999

    c.patch_spec(name, {"drift": {"policy": "Revert"}})
    await eventually(lambda: c.condition(name, "ConfigDrift").get("status") == "False", what="drift reverted")
    assert c.api.read(SERVICES, NS, f"{name}-router")["spec"]["ports"][0]["targetPort"] == 8000
    # a drift-policy change is not a new revision: no pod was replaced
    assert c.events(name, "RollingOut") == []


async def test_api_errors_are_counted_and_retried_until_ready(operator):
    c = operator
    name = "flaky"
    c.api.inject_fault("PATCH", "pods", times=1)  # the first prefill create (an apply) fails
    c.api.inject_fault("PATCH", "pods", skip=1, times=1)  # the next prefill goes through, its decode fails
    c.apply(manifest(name, pairs=1))
    await eventually(lambda: is_ready(c, name), what="Ready despite failing pod creation")
    errors = metric("pdstack_operator_reconcile_errors_total", namespace=NS, deployment=name, error="ApiRejected")
    assert errors == 2
    assert metric("pdstack_operator_reconcile_duration_seconds_count", namespace=NS, deployment=name) >= 1
    # a failed create leaves no half pair behind (rolled back), so no co-restart was ever needed
    assert sorted(c.pair_pods(name, 0)) == ["decode", "prefill"] and len(c.pods(name)) == 2
    assert c.events(name, "CoRestart") == []
    created = [ev["object"]["metadata"]["name"] for _, ev in c.api._log[PODS] if ev["type"] == "ADDED"]
    deleted = [ev["object"]["metadata"]["name"] for _, ev in c.api._log[PODS] if ev["type"] == "DELETED"]
    assert len(created) == 3 and len(deleted) == 1 and deleted[0] in created[:1]  # the orphan prefill


async def test_repeated_faults_back_off_exponentially(operator):
    c = operator
    name = "loop"
    # backoff 0.2 s doubling; the streak resets after maxSeconds ready, so the cap is far above the three backoffs:
    # with the harness's 2 s, a loaded host that took 2 s from "ready" to the next fault's decision reset it
    c.apply(manifest(name, pairs=1, coRestart={"policy": "Pair", "backoff": {"initialSeconds": 0.2, "maxSeconds": 60}}))
    await eventually(lambda: is_ready(c, name), what=f"{name} Ready")
    for n in (1, 2, 3):
        victim = c.pair_pods(name, 0)["decode"]["metadata"]["name"]
        c.kubelet.restart_container(NS, victim)
        await eventually(lambda: c.api.read(PODS, NS, victim) is None, what=f"co-restart #{n}")
        await eventually(lambda: is_ready(c, name) and c.pdd(name)["status"]["pairs"][0]["restarts"] == n
                         and c.pdd(name)["status"]["pairs"][0]["ready"], what=f"ready after co-restart #{n}")
    st = c.pdd(name)["status"]["pairs"][0]
    assert st["restarts"] == 3 and st["backoffStreak"] == 3
    messages = [m for _, m in sorted((e["metadata"]["creationTimestamp"], e["message"])
                                     for e in c.events(name, "CoRestart"))]
    assert [m.split("after ")[1].split(" backoff")[0] for m in messages] == ["0.2s", "0.4s", "0.8s"]
    # each new incarnation was created no sooner than its backoff after the co-restart deleted the old pods
    # (the backoff runs from the decision, which precedes the delete requests by a few ms; the deletion is
    # the request, i.e. the deletionTimestamp, not the kubelet's later confirmation)
    log = c.api._log[PODS]
    first_delete, gaps = None, []
    for rv, ev in log:
        deleting = ev["type"] == "DELETED" or (ev["type"] == "MODIFIED"
                                               and ev["object"]["metadata"].get("deletionTimestamp"))
        if deleting and first_delete is None:
            first_delete = rv
        elif ev["type"] == "ADDED" and first_delete is not None:
            gaps.append(c.api.event_times[rv] - c.api.event_times[first_delete])
            first_delete = None
    assert len(gaps) == 3, gaps
    # half the backoff at least: an immediate recreate takes a few ms, while on a loaded host (load 8) the delete
    # requests reached the API server up to 0.15 s after the decision the backoff runs from
    for gap, backoff in zip(gaps, (0.2, 0.4, 0.8)):
        assert gap >= backoff / 2, (gaps, backoff)
    assert metric("pdstack_operator_co_restarts_total", namespace=NS, deployment=name, reason="ContainerRestart") == 3


async def test_scaling_adds_and_removes_whole_pairs_without_a_rollout(operator):
    c = operator
    name = "scale"
    before = await _ready_pairs(c, name, pairs=2)
    rev = c.pdd(name)["status"]["currentRevision"]
    c.patch_spec(name, {"pairs": 3})
    await eventually(lambda: is_ready(c, name) and c.pdd(name)["status"]["readyPairs"] == 3, what="3 pairs")
    c.patch_spec(name, {"pairs": 1})
    await eventually(lambda: len(c.pods(name)) == 2 and is_ready(c, name)
                     and len(c.pdd(name)["status"]["pairs"]) == 1, what="1 pair")
    st = c.pdd(name)["status"]
    assert st["currentRevision"] == st["updateRevision"] == rev  # scaling is not a new revision
    assert {p["metadata"]["name"] for p in c.pods(name)} == {p["metadata"]["name"] for p in before[0].values()}
    assert [p["index"] for p in topology(c, name)["pairs"]] == [0]
    assert c.events(name, "RollingOut") == [] and c.events(name, "CoRestart") == []


async def test_python_m_pdoperator_process_reconciles_against_the_emulator(cluster):
    """The shipped entry point, as a real process: apply, reach Ready, exit cleanly on SIGTERM."""
    import asyncio
    import os
    import signal
    import sys

    from pdop_harness import KUBECONFIG

    env = dict(os.environ, KUBECONFIG=KUBECONFIG, PDSTACK_OPERATOR_METRICS_PORT="0")
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "pdoperator", "--standalone", "--liveness", "", "--verbose",
                                                env=env, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.STDOUT)
    try:
        cluster.apply(manifest("proc", pairs=1))
        await eventually(lambda: is_ready(cluster, "proc") or proc.returncode is not None, timeout=60,
                         what="Ready via python -m pdoperator")
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
        out, _ = await asyncio.wait_for(proc.communicate(), timeout=30)
        assert is_ready(cluster, "proc"), out.decode()[-3000:]
    assert proc.returncode == 0, out.decode()[-2000:]


async def test_graceful_pod_termination_pair_is_recreated_only_after_both_old_pods_are_gone(operator):
    """As on a real cluster, deleted pods linger (terminating) for a grace period."""
    c = operator
    c.api.pod_grace_s = 0.3
    name = "grace"
    before = await _ready_pairs(c, name)
    old1 = {p["metadata"]["name"] for p in before[1].values()}
    since = c.api._last_rv
    c.kubelet.restart_container(NS, before[1]["prefill"]["metadata"]["name"])
    await eventually(lambda: (names := {p["metadata"]["name"] for p in c.pair_pods(name, 1).values()})
                     and not names & old1 and len(names) == 2, what="pair 1 recreated")
    await eventually(lambda: is_ready(c, name), what="Ready again")
    # at no moment did an old pod of pair 1 coexist with a new one
    live: set[str] = set()
    for rv, ev in c.api._log[PODS]:
        meta = ev["object"]["metadata"]
        if meta["labels"].get("pdstack.io/pair") != "1" or meta["labels"].get("pdstack.io/deployment") != name:
            continue
        (live.discard if ev["type"] == "DELETED" else live.add)(meta["name"])
        if rv > since:
            assert not (live & old1 and live - old1), f"old and new pods of pair 1 overlap: {live}"
    assert c.pdd(name)["status"]["pairs"][1]["lastCoRestart"]["reason"] == "ContainerRestart"
    assert len(c.events(name, "CoRestart")) == 1  # the terminating survivor did not count as a second fault
