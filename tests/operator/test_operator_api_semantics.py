"""The operator against the strict emulator: what a real API server does, and what the operator makes of it.

No false drift after defaulting / omitempty / canonical quantities; a hand edit names its field;
a 403 is named in a condition and an Event and blocks nothing else; a pod stuck Terminating on a
lost node is force-deleted after its bound; evictions respect pairs; Pod Security ``restricted``.
"""

from __future__ import annotations

import base64
import json

import aiohttp
import pytest
from kmock._internal.k8s import KubernetesError
from prometheus_client import REGISTRY

from pdop_harness import IMAGE, NS, PODS, eventually, manifest
from pdop_k8s_emulator import NODES, R

SERVICES = R("", "v1", "services")
CONFIGMAPS = R("", "v1", "configmaps")
DEPLOYMENTS = R("apps", "v1", "deployments")
NAMESPACES = R("", "v1", "namespaces")


def ready(c, name):
    return c.condition(name, "Ready").get("status") == "True"


def reconciles(name):
    return REGISTRY.get_sample_value("pdstack_operator_reconcile_duration_seconds_count",
                                     {"namespace": NS, "deployment": name}) or 0.0


async def test_steady_state_has_no_false_drift_and_a_kubectl_edit_names_the_field(strict_operator):
    c = strict_operator
    quantities = {"requests": {"cpu": "0.5", "memory": "1024Mi"}, "limits": {"cpu": 1, "memory": "2Gi"}}
    # a fractional number is no int-or-string: the CRD's quantity fields refuse it at admission, as a real
    # apiextensions server does (a YAML `cpu: 0.5` must be quoted in a PDDeployment)
    with pytest.raises(KubernetesError, match='requests.cpu in body must be of type integer,string: "number"'):
        c.apply(manifest("steady", pairs=1, router={"resources": {"requests": {"cpu": 0.5}}}))
    c.apply(manifest("steady", pairs=1, prefill={"resources": {"gpus": 1, **quantities}},
                     router={"resources": {"requests": {"cpu": "0.5", "memory": "1024Mi"}}}))
    # sglang's router renders `env: []`, which a real server omits from what it returns
    c.apply(manifest("sgl", pairs=1, engine="sglang", model={"source": "/models/m"}, runtimeImage=IMAGE,
                     router={"kind": "sglang"}))
    # vLLM with the agent sidecar (shareProcessNamespace, a valueFrom env, a second container) and pdstack's router
    c.apply(manifest("vl", pairs=1, engine="vllm", model={"source": "/models/m"}, runtimeImage=IMAGE))
    for name in ("steady", "sgl", "vl"):
        await eventually(lambda: ready(c, name), timeout=30, what=f"{name} Ready")
    # the server did rewrite what was applied: these would all read as drift under a value comparison
    pod = c.pair_pods("steady", 0)["prefill"]
    assert pod["spec"]["containers"][0]["resources"]["requests"]["cpu"] == "500m"
    assert pod["spec"]["containers"][0]["resources"]["requests"]["memory"] == "1Gi"
    assert pod["spec"]["containers"][0]["terminationMessagePath"] == "/dev/termination-log"
    assert "env" not in c.api.read(DEPLOYMENTS, NS, "sgl-router")["spec"]["template"]["spec"]["containers"][0]
    router = c.api.read(DEPLOYMENTS, NS, "steady-router")["spec"]["template"]["spec"]["containers"][0]
    assert router["resources"]["requests"] == {"cpu": "500m", "memory": "1Gi"}

    # three detection intervals: three more full reconciles while steady, ConfigDrift False in every one
    for name in ("steady", "sgl", "vl"):
        for i in range(3):
            before = reconciles(name)
            pdd = c.pdd(name)
            pdd["metadata"].setdefault("annotations", {})["test/poke"] = str(i)
            c.api._store(R("pdstack.io", "v1alpha1", "pddeployments"), NS, name, pdd, manager="kubectl")
            await eventually(lambda: reconciles(name) > before, what=f"{name} reconcile #{i + 1}")
        history = [v["status"] for v in c.api.history(R("pdstack.io", "v1alpha1", "pddeployments"), NS, name)
                   if v and v.get("status")]
        drift = [cnd for st in history for cnd in st["conditions"] if cnd["type"] == "ConfigDrift"]
        assert drift and all(cnd["status"] == "False" for cnd in drift), drift

    # a `kubectl edit` of a field the operator owns: drift, naming the field
    dep = c.api.read(DEPLOYMENTS, NS, "steady-router")
    dep["spec"]["replicas"] = 3
    c.api._store(DEPLOYMENTS, NS, "steady-router", dep, manager="kubectl-edit")
    cond = await eventually(lambda: (x := c.condition("steady", "ConfigDrift")).get("status") == "True" and x,
                            what="ConfigDrift=True")
    assert cond["message"] == "Deployment/steady-router: spec.replicas", cond


@pytest.mark.parametrize("verb", ["create", "patch"])  # creating a pod by server-side apply needs both
async def test_a_403_on_pod_create_is_named_other_children_still_created_and_fixing_rbac_recovers(strict_operator,
                                                                                                  verb):
    c = strict_operator
    c.api.revoke("", "pods", verb)
    c.apply(manifest("denied", pairs=1))

    def rejected():
        cond = c.condition("denied", "ApiRejected")
        return cond.get("status") == "True" and cond
    cond = await eventually(rejected, timeout=20, what="ApiRejected=True")
    msg = cond["message"]
    assert msg.startswith("apply pods/denied-0-prefill-") and "HTTP 403" in msg, msg
    assert f'cannot {verb} resource "pods" in API group "" in the namespace "default"' in msg, msg
    events = c.events("denied", "ApiRejected")
    assert events and events[0]["type"] == "Warning"
    assert "pods/denied-0-prefill-" in events[0]["message"] and "forbidden" in events[0]["message"]
    # the rejection blocked nothing else
    assert c.api.read(DEPLOYMENTS, NS, "denied-router") is not None
    assert c.api.read(SERVICES, NS, "denied-router") is not None
    assert c.api.read(SERVICES, NS, "denied-workers") is not None
    assert c.api.read(CONFIGMAPS, NS, "denied-topology") is not None
    assert c.pods("denied") == []

    c.api.grant({"apiGroups": [""], "resources": ["pods"], "verbs": [verb]})  # fix the Role; no restart
    await eventually(lambda: ready(c, "denied"), timeout=30, what="Ready after the RBAC fix")
    assert c.condition("denied", "ApiRejected")["status"] == "False"


async def test_a_pod_stuck_terminating_on_a_lost_node_is_force_deleted_after_the_bound(strict_operator):
    c = strict_operator
    c.kubelet.add_node("gpu-c", 8, {"pdstack.io/gpu": "h100"})
    c.apply(manifest("lost", pairs=2, gpus=4))  # 8 GPUs per pair: one pair per node
    await eventually(lambda: ready(c, "lost"), timeout=30, what="Ready")
    victim = c.pair_pods("lost", 1)
    node = victim["decode"]["spec"]["nodeName"]
    assert victim["prefill"]["spec"]["nodeName"] == node
    c.kubelet.node_down(node)
    # the node lifecycle controller evicts the pods of a lost node; its kubelet never confirms
    for pod in victim.values():
        c.api._delete(PODS, NS, pod["metadata"]["name"], grace=1)
    old = {p["metadata"]["name"] for p in victim.values()}
    await eventually(lambda: all(c.api.read(PODS, NS, n)["metadata"].get("deletionTimestamp") for n in old),
                     what="pods Terminating")

    def back():
        now = c.pair_pods("lost", 1)
        return set(now) == {"prefill", "decode"} and not {p["metadata"]["name"] for p in now.values()} & old
    await eventually(back, timeout=30, what="pair 1 recreated")
    await eventually(lambda: ready(c, "lost"), timeout=30, what="Ready again")
    assert all(p["spec"]["nodeName"] != node for p in c.pair_pods("lost", 1).values())
    events = c.events("lost", "ForceDeleted")
    assert {e["message"].split("force-deleted pod ")[1].split(",")[0] for e in events} == old
    assert all(f"lost node {node}" in e["message"] for e in events)
    # not before the bound: deletion deadline (grace 1 s) + margin (1 s in the tests)
    for n in old:
        versions = [v for v in c.api.history(PODS, NS, n) if v]
        deadline = versions[-1]["metadata"]["deletionTimestamp"]
        gone_rv = max(rv for rv, ev in c.api._log[PODS] if ev["type"] == "DELETED" and
                      ev["object"]["metadata"]["name"] == n)
        import datetime
        dl = datetime.datetime.fromisoformat(deadline.replace("Z", "+00:00")).timestamp()
        wall_gone = c.api.wall_times[gone_rv]
        assert wall_gone >= dl + 1.0 - 0.05, (n, wall_gone - dl)
    assert c.api.read(NODES, None, node)["status"]["conditions"][0]["status"] == "Unknown"


async def test_evictions_never_take_two_pairs_down(operator):
    c = operator
    c.apply(manifest("evict", pairs=2))
    await eventually(lambda: ready(c, "evict"), timeout=30, what="Ready")
    p0 = c.pair_pods("evict", 0)["decode"]["metadata"]["name"]
    p1 = c.pair_pods("evict", 1)["prefill"]["metadata"]["name"]

    async with aiohttp.ClientSession(c.url) as http:
        async def evict(pod):
            body = {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": pod, "namespace": NS}}
            async with http.post(f"/api/v1/namespaces/{NS}/pods/{pod}/eviction", data=json.dumps(body),
                                 headers={"Content-Type": "application/json"}) as r:
                return r.status, await r.json()

        assert (await evict(p0))[0] == 201  # kubectl drain on node A
        status, body = await evict(p1)  # and on node B, while pair 0 is down
        assert status == 429, body
        assert body["message"] == "Cannot evict pod as it would violate the pod's disruption budget."
        assert c.api.read(PODS, NS, p1)["metadata"].get("deletionTimestamp") is None
        # still refused while pair 0 is co-restarting (its new pods not Ready yet)
        await eventually(lambda: c.pdd("evict")["status"]["pairs"][0]["restarts"] == 1, what="pair 0 co-restart")
        assert not c.pdd("evict")["status"]["pairs"][0]["ready"]
        assert (await evict(p1))[0] == 429
        await eventually(lambda: ready(c, "evict"), timeout=30, what="pair 0 back")
        assert (await evict(p1))[0] == 201  # budget back: the drain may proceed


@pytest.mark.parametrize("override", [False, True], ids=["secure-defaults", "overridden-to-privileged"])
async def test_workers_and_router_against_pod_security_restricted(cluster, override):
    """As rendered, worker and router pods pass Pod Security ``restricted``; overriding a default away fails."""
    from pdoperator.cli.kubectl_pd import render_manifest

    ns = cluster.api.read(NAMESPACES, None, NS)
    ns["metadata"]["labels"] = {"pod-security.kubernetes.io/enforce": "restricted"}
    cluster.api._store(NAMESPACES, None, NS, ns)
    body = manifest("psa", pairs=1)
    if override:
        body["spec"]["podTemplate"] = {"securityContext": {"allowPrivilegeEscalation": True,
                                                           "capabilities": {"drop": []}}}
    children = render_manifest(body)
    pods = [o for o in children if o["kind"] == "Pod"]
    router = next(o for o in children if o["kind"] == "Deployment")
    router_pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "psa-router-x", "namespace": NS},
                  "spec": router["spec"]["template"]["spec"]}
    async with aiohttp.ClientSession(cluster.url) as http:
        for pod in pods + [router_pod]:
            pod = json.loads(json.dumps(pod))
            pod["metadata"].pop("ownerReferences", None)
            async with http.post(f"/api/v1/namespaces/{NS}/pods", data=json.dumps(pod),
                                 headers={"Content-Type": "application/json"}) as r:
                body = await r.json()
            if not override:
                assert r.status == 201, body
            else:
                assert r.status == 403, body
                assert 'violates PodSecurity "restricted:latest"' in body["message"]
                for check in ("allowPrivilegeEscalation != false", "unrestricted capabilities"):
                    assert check in body["message"], body["message"]


async def test_the_operators_own_errors_are_posted_as_events(operator):
    c = operator
    c.apply(manifest("oops", pairs=1))
    await eventually(lambda: ready(c, "oops"), timeout=30, what="Ready")
    # the reconcile's own worker-pod list fails once (not the router-pod list, which is an isolated step)
    c.api.inject_fault("GET", "pods", times=1, status=500, selector="component=worker")
    pdd = c.pdd("oops")
    pdd["metadata"].setdefault("annotations", {})["test/poke"] = "1"
    c.api._store(R("pdstack.io", "v1alpha1", "pddeployments"), NS, "oops", pdd, manager="kubectl")
    events = await eventually(lambda: [e for e in c.api.select(R("", "v1", "events"), NS)
                                       if e.get("reason") == "ReconcileError"], timeout=20, what="ReconcileError Event")
    assert events[0]["involvedObject"]["name"] == "oops"
    assert "list pods: HTTP 500" in events[0]["message"] and "injected fault" in events[0]["message"]
    await eventually(lambda: ready(c, "oops"), timeout=30, what="Ready after the retry")


async def test_status_goes_through_the_subresource_with_a_precondition_and_is_retried_on_conflict(operator):
    c = operator
    c.apply(manifest("cas", pairs=1))
    await eventually(lambda: ready(c, "cas"), timeout=30, what="Ready")
    c.api.inject_fault("PATCH", "pddeployments/status", times=1, status=409)
    since = len(c.api.request_log)
    c.kubelet.set_ready(NS, c.pair_pods("cas", 0)["decode"]["metadata"]["name"], False)
    await eventually(lambda: c.condition("cas", "Ready").get("reason") == "PairsNotReady", timeout=20,
                     what="status written despite the conflict")
    status_writes = [r for r in c.api.request_log[since:] if r[3] == "pddeployments/status"]
    assert len(status_writes) >= 2  # the 409, then the retry
    assert [r for r in c.api.request_log if r[3] == "pddeployments" and r[1] == "patch"
            and r[5] >= status_writes[0][5]] == []  # never through the main resource
    assert not [e for e in c.api.select(R("", "v1", "events"), NS) if e.get("reason") == "ReconcileError"]


async def test_watches_carry_server_side_label_selectors(strict_operator):
    c = strict_operator
    c.apply(manifest("sel", pairs=1))
    await eventually(lambda: ready(c, "sel"), timeout=30, what="Ready")
    children = [(plural, ns, sel) for plural, ns, sel in c.api.watch_selectors
                if plural in ("pods", "services", "configmaps", "deployments")]
    assert {p for p, _, _ in children} == {"pods", "services", "configmaps", "deployments"}
    assert all(sel == "pdstack.io/deployment" and ns == NS for _, ns, sel in children), children


async def test_secure_defaults_admitted_under_restricted_and_secret_env_stays_a_reference(strict_operator):
    """The operator in a namespace enforcing Pod Security ``restricted``: every pod it creates is admitted and
    the deployment gets Ready; the value of the Secret behind a ``secretKeyRef`` env var appears in no object
    but the Secret itself (pods, router, ControllerRevision, status, Events)."""
    c = strict_operator
    value = "hf_LiveSecretValue_9f8e7d6c5b4a"
    ns = c.api.read(NAMESPACES, None, NS)
    ns["metadata"]["labels"] = {"pod-security.kubernetes.io/enforce": "restricted"}
    c.api._store(NAMESPACES, None, NS, ns)
    c.api.seed(R("", "v1", "secrets"), NS, {"apiVersion": "v1", "kind": "Secret",
                                              "metadata": {"name": "hf-token", "namespace": NS},
                                              "stringData": {"token": value}})
    env = [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token"}}}]
    body = manifest("sec", pairs=2)
    for role in ("prefill", "decode", "router"):
        body["spec"].setdefault(role, {})["env"] = env
    c.apply(body)
    await eventually(lambda: ready(c, "sec"), timeout=30, what="Ready under Pod Security restricted")
    encoded = base64.b64encode(value.encode()).decode()  # the server stores stringData base64-encoded in data
    holders = [(r, n) for (r, _, n), o in c.api.objects.items()
               if not o.deleted and (value in json.dumps(o.raw) or encoded in json.dumps(o.raw))]
    assert [n for _, n in holders] == ["hf-token"], holders
    revs = c.api.select(R("apps", "v1", "controllerrevisions"), NS)
    assert revs and all(r["data"]["config"]["decode"]["env"]["HF_TOKEN"] == {"valueFrom": env[0]["valueFrom"]}
                        for r in revs)
