"""Each strict behaviour of the emulator, alone, against what a real API server is recorded to do.

Sources of the expected values: ``k8s.io/apimachinery/pkg/api/resource/quantity_test.go``
(TestQuantityParseEmit, TestQuantityString's alternates), ``pkg/apis/core/v1/defaults.go``
(SetDefaults_Pod/Container/Probe/Service), the DefaultTolerationSeconds admission plugin, the
server-side apply conflict message (``Apply failed with N conflict(s)``), the eviction API's
429 message, Pod Security Admission's ``restricted`` wording, and the watch cache's
``too old resource version`` 410.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import kmock
import pytest

import emu_semantics as sem
from pdop_harness import NS, eventually, manifest
from pdop_k8s_emulator import Kubelet, PDEmulator, R

PODS = R("", "v1", "pods")
CMS = R("", "v1", "configmaps")
DEPLOYMENTS = R("apps", "v1", "deployments")
PDDS = R("pdstack.io", "v1alpha1", "pddeployments")
APPLY = "application/apply-patch+yaml"


# ---------------------------------------------------------------- canonical quantities (quantity_test.go)
@pytest.mark.parametrize("given,canonical", [
    ("1Ki", "1Ki"), ("1Mi", "1Mi"), ("1Gi", "1Gi"), ("1024Mi", "1Gi"), ("1000M", "1G"), (".001Ki", "1024m"),
    (".000001Ki", "1024u"), (".000000001Ki", "1024n"), (".000000000001Ki", "2n"),  # TestQuantityParseEmit
    ("307200Ki", "300Mi"), ("5000m", "5"), ("0.5", "500m"), ("0.001T", "1G"), ("1000u", "1m"), ("1.08", "1080m"),
    ("1080000000n", "1080m"), ("1025", "1025"), (".001e12", "1e9"), ("0.001e0", "1e-3"),  # TestQuantityString
    (0.5, "500m"), (1, "1"), ("1536Mi", "1536Mi"), ("2Gi", "2Gi"), ("0", "0"),
])
def test_canonical_quantities_match_apimachinery(given, canonical):
    assert sem.canonical_quantity(given) == canonical


def test_an_invalid_quantity_is_rejected():
    with pytest.raises(ValueError, match="quantities must match the regular expression"):
        sem.canonical_quantity("1.1.M")


# ---------------------------------------------------------------- defaulting + omitempty (defaults.go)
def test_pod_defaults_and_dropped_empty_fields():
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "labels": {}},
           "spec": {"containers": [{"name": "c", "image": "img:1", "env": [], "args": [],
                                    "ports": [{"containerPort": 80}],
                                    "readinessProbe": {"httpGet": {"path": "/h", "port": 80}},
                                    "resources": {"limits": {"cpu": "0.5", "memory": "1024Mi"}}}],
                    "volumes": [{"name": "s", "secret": {"secretName": "x"}}]}}
    out = sem.normalize("Pod", pod)
    spec, c = out["spec"], out["spec"]["containers"][0]
    assert (spec["restartPolicy"], spec["terminationGracePeriodSeconds"], spec["dnsPolicy"], spec["schedulerName"],
            spec["securityContext"], spec["serviceAccountName"], spec["enableServiceLinks"]) == \
        ("Always", 30, "ClusterFirst", "default-scheduler", {}, "default", True)
    assert {t["key"]: t["tolerationSeconds"] for t in spec["tolerations"]} == {
        "node.kubernetes.io/not-ready": 300, "node.kubernetes.io/unreachable": 300}
    assert (c["terminationMessagePath"], c["terminationMessagePolicy"], c["imagePullPolicy"]) == \
        ("/dev/termination-log", "File", "IfNotPresent")
    assert c["ports"] == [{"containerPort": 80, "protocol": "TCP"}]
    assert c["readinessProbe"] == {"httpGet": {"path": "/h", "port": 80, "scheme": "HTTP"}, "timeoutSeconds": 1,
                                   "periodSeconds": 10, "successThreshold": 1, "failureThreshold": 3}
    # requests default to limits; quantities canonical
    assert c["resources"] == {"limits": {"cpu": "500m", "memory": "1Gi"}, "requests": {"cpu": "500m", "memory": "1Gi"}}
    assert "env" not in c and "args" not in c and "labels" not in out["metadata"]  # omitempty
    assert spec["volumes"][0]["secret"]["defaultMode"] == 420
    assert sem.normalize("Pod", {"spec": {"containers": [{"name": "c", "image": "img"}]}})["spec"][
        "containers"][0]["imagePullPolicy"] == "Always"  # no tag means :latest


def test_service_and_deployment_defaults():
    svc = sem.normalize("Service", {"spec": {"ports": [{"name": "http", "port": 80}]}})["spec"]
    assert (svc["type"], svc["sessionAffinity"], svc["ports"]) == \
        ("ClusterIP", "None", [{"name": "http", "port": 80, "protocol": "TCP", "targetPort": 80}])
    dep = sem.normalize("Deployment", {"spec": {"template": {"spec": {"containers": [{"name": "c", "image": "i:1"}]}}}})
    assert (dep["spec"]["replicas"], dep["spec"]["revisionHistoryLimit"], dep["spec"]["progressDeadlineSeconds"]) == \
        (1, 10, 600)
    assert dep["spec"]["strategy"]["rollingUpdate"] == {"maxUnavailable": "25%", "maxSurge": "25%"}
    assert "serviceAccountName" not in dep["spec"]["template"]["spec"]  # admission defaults apply to pods only


def test_secret_string_data_is_stored_as_data():
    out = sem.normalize("Secret", {"metadata": {"name": "s"}, "stringData": {"token": "abc"}})
    assert out["data"] == {"token": "YWJj"} and "stringData" not in out and out["type"] == "Opaque"


# ---------------------------------------------------------------- over HTTP
@pytest.fixture
async def api():
    async with PDEmulator() as emu, kmock.Server(emu) as server:
        async with aiohttp.ClientSession(str(server.url)) as http:
            yield emu, http


async def call(http, method, path, body=None, ctype="application/json", params=None):
    async with http.request(method, path, data=None if body is None else json.dumps(body),
                            headers={"Content-Type": ctype}, params=params) as r:
        return r.status, await r.json()


def cm(data, **meta):
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c", **meta}, "data": data}


async def test_server_side_apply_owns_fields_and_reports_conflicts(api):
    emu, http = api
    url = f"/api/v1/namespaces/{NS}/configmaps/c"
    st, obj = await call(http, "PATCH", url, cm({"a": "1", "b": "2"}), APPLY, {"fieldManager": "op"})
    assert st == 201 or st == 200, obj
    mf = {e["manager"]: e for e in obj["metadata"]["managedFields"]}
    assert mf["op"]["operation"] == "Apply" and mf["op"]["fieldsV1"] == {"f:data": {"f:a": {}, "f:b": {}}}
    # an Update by someone else takes ownership of what it changed
    obj["data"]["a"] = "9"
    st, obj = await call(http, "PUT", url, obj, params={"fieldManager": "kubectl-edit"})
    mf = {e["manager"]: e for e in obj["metadata"]["managedFields"]}
    assert mf["kubectl-edit"]["fieldsV1"] == {"f:data": {"f:a": {}}} and mf["op"]["fieldsV1"] == {"f:data": {"f:b": {}}}
    # applying the old value without force: a conflict, worded as the API server words it
    st, err = await call(http, "PATCH", url, cm({"a": "1", "b": "2"}), APPLY, {"fieldManager": "op"})
    assert st == 409 and err["message"] == 'Apply failed with 1 conflict(s):\n- conflict with "kubectl-edit": .data.a'
    # force takes it back; a field the applier no longer declares (and nobody else owns) is removed
    st, obj = await call(http, "PATCH", url, cm({"a": "1"}), APPLY, {"fieldManager": "op", "force": "true"})
    assert st == 200 and obj["data"] == {"a": "1"}
    assert [e["manager"] for e in obj["metadata"]["managedFields"]] == ["op"]
    # applying the same again changes nothing (no new resourceVersion)
    rv = obj["metadata"]["resourceVersion"]
    st, obj = await call(http, "PATCH", url, cm({"a": "1"}), APPLY, {"fieldManager": "op", "force": "true"})
    assert obj["metadata"]["resourceVersion"] == rv
    st, err = await call(http, "PATCH", url, cm({"a": "1"}), APPLY)
    assert st == 422 and "fieldManager" in err["message"]


async def test_status_subresource_and_generation(api):
    emu, http = api
    body = manifest("g", pairs=1)
    body["status"] = {"phase": "Made-up"}
    st, obj = await call(http, "POST", f"/apis/pdstack.io/v1alpha1/namespaces/{NS}/pddeployments", body)
    assert st == 201 and "status" not in obj and obj["metadata"]["generation"] == 1  # status ignored on create
    url = f"/apis/pdstack.io/v1alpha1/namespaces/{NS}/pddeployments/g"
    merge = "application/merge-patch+json"
    st, obj = await call(http, "PATCH", url + "/status", {"status": {"phase": "Ready"}, "spec": {"pairs": 9}}, merge)
    assert obj["status"] == {"phase": "Ready"} and obj["spec"]["pairs"] == 1 and obj["metadata"]["generation"] == 1
    st, obj = await call(http, "PATCH", url, {"metadata": {"labels": {"x": "y"}}}, merge)
    assert obj["metadata"]["generation"] == 1  # metadata changes do not bump generation
    st, obj = await call(http, "PATCH", url, {"spec": {"pairs": 2}, "status": {"phase": "X"}}, merge)
    assert obj["metadata"]["generation"] == 2 and obj["status"] == {"phase": "Ready"}
    st, err = await call(http, "PATCH", url + "/status", {"metadata": {"resourceVersion": "1"},
                                                          "status": {"phase": "Stale"}}, merge)
    assert st == 409 and "the object has been modified" in err["message"]


async def test_rbac_denies_a_missing_verb_and_records_every_request(api):
    emu, http = api
    emu.rbac = [{"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get", "create"]}]
    st, _ = await call(http, "POST", f"/api/v1/namespaces/{NS}/configmaps", cm({"a": "1"}))
    assert st == 201
    st, err = await call(http, "DELETE", f"/api/v1/namespaces/{NS}/configmaps/c")
    assert st == 403 and err["message"] == ('configmaps is forbidden: User "system:serviceaccount:pdstack:'
                                            'pdstack-operator" cannot delete resource "configmaps" in API group "" '
                                            'in the namespace "default"')
    st, _ = await call(http, "GET", f"/api/v1/namespaces/{NS}/pods")
    assert st == 403
    emu.grant({"apiGroups": [""], "resources": ["configmaps"], "verbs": ["delete"]})
    assert (await call(http, "DELETE", f"/api/v1/namespaces/{NS}/configmaps/c"))[0] == 200
    assert emu.requests == [("create", "", "configmaps", NS), ("delete", "", "configmaps", NS),
                            ("list", "", "pods", NS), ("delete", "", "configmaps", NS)]


def _pod(name, labels, ready=True):
    return {"metadata": {"name": name, "labels": labels},
            "spec": {"nodeName": "n", "terminationGracePeriodSeconds": 5, "containers": [{"name": "c", "image": "i:1"}]},
            "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


async def test_eviction_honours_the_disruption_budget_and_termination_is_graceful(api):
    emu, http = api
    for i in range(3):
        emu.seed(PODS, NS, _pod(f"w{i}", {"app": "w"}))
    emu.seed(R("policy", "v1", "poddisruptionbudgets"), NS,
             {"metadata": {"name": "b"}, "spec": {"minAvailable": 2, "selector": {"matchLabels": {"app": "w"}}}})

    async def evict(name):
        body = {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": name, "namespace": NS}}
        return await call(http, "POST", f"/api/v1/namespaces/{NS}/pods/{name}/eviction", body)
    assert (await evict("w0"))[0] == 201
    pod = emu.read(PODS, NS, "w0")
    assert pod["metadata"]["deletionTimestamp"] and pod["metadata"]["deletionGracePeriodSeconds"] == 5
    st, err = await evict("w1")
    assert st == 429 and err["reason"] == "TooManyRequests"
    assert err["message"] == "Cannot evict pod as it would violate the pod's disruption budget."
    # graceful: the pod stays (Terminating) until its kubelet confirms; grace 0 removes it at once
    assert emu.read(PODS, NS, "w0") is not None
    assert (await call(http, "DELETE", f"/api/v1/namespaces/{NS}/pods/w0", {"gracePeriodSeconds": 0}))[0] == 200
    assert emu.read(PODS, NS, "w0") is None
    # the kubelet confirms a graceful delete once the container exited
    emu.pod_grace_s = 0.2
    kubelet = Kubelet(emu)
    async with kubelet:
        await call(http, "DELETE", f"/api/v1/namespaces/{NS}/pods/w2")
        assert emu.read(PODS, NS, "w2")["metadata"]["deletionTimestamp"]
        await eventually(lambda: emu.read(PODS, NS, "w2") is None, timeout=5, what="kubelet confirms")


async def test_pod_security_restricted_only_on_labelled_namespaces(api):
    emu, http = api
    bad = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"},
           "spec": {"containers": [{"name": "c", "image": "i:1"}],
                    "volumes": [{"name": "h", "hostPath": {"path": "/"}}]}}
    assert (await call(http, "POST", f"/api/v1/namespaces/{NS}/pods", bad))[0] == 201  # unlabelled: admitted
    emu.seed(R("", "v1", "namespaces"), None, {"metadata": {"name": "secure", "labels": {
        "pod-security.kubernetes.io/enforce": "restricted"}}})
    st, err = await call(http, "POST", "/api/v1/namespaces/secure/pods", bad)
    assert st == 403
    assert err["message"].startswith('pods "p" is forbidden: violates PodSecurity "restricted:latest": ')
    assert "restricted volume types (volumes 'h' use restricted volume types)" in err["message"]
    assert 'allowPrivilegeEscalation != false (container "c" must set securityContext.allowPrivilegeEscalation=false)' \
        in err["message"]


async def test_a_watch_from_before_compaction_answers_410_gone(api):
    emu, http = api
    await call(http, "POST", f"/api/v1/namespaces/{NS}/configmaps", cm({"a": "1"}))
    old = emu._last_rv
    await call(http, "PATCH", f"/api/v1/namespaces/{NS}/configmaps/c", {"data": {"a": "2"}},
               "application/merge-patch+json")
    emu.compact()
    async with http.get(f"/api/v1/namespaces/{NS}/configmaps", params={"watch": "true",
                                                                       "resourceVersion": str(old)}) as r:
        lines = [json.loads(line) for line in (await r.read()).splitlines() if line.strip()]
    assert r.status == 200 and len(lines) == 1 and lines[0]["type"] == "ERROR"
    assert lines[0]["object"]["code"] == 410 and lines[0]["object"]["reason"] == "Expired"
    assert lines[0]["object"]["message"].startswith(f"too old resource version: {old}")


async def test_kopf_resumes_after_410_gone(operator):
    """The operator's watches hit compaction (410), re-list, and keep reacting: a co-restart still happens."""
    c = operator
    c.apply(manifest("gone", pairs=1))
    await eventually(lambda: c.condition("gone", "Ready").get("status") == "True", what="Ready")
    c.api.compact()
    c.api.close_watches()
    await eventually(lambda: c.api.gone_served > 0, timeout=20, what="a watch answered 410")
    victim = c.pair_pods("gone", 0)["decode"]["metadata"]["name"]
    c.kubelet.restart_container(NS, victim)
    await eventually(lambda: c.api.read(PODS, NS, victim) is None, timeout=20, what="co-restart after the 410")
    await eventually(lambda: c.condition("gone", "Ready").get("status") == "True", what="Ready again")
    await asyncio.sleep(0)
