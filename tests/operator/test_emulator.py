"""The API emulator's own semantics, over HTTP: the operator tests are only as good as these."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import kmock
import pytest

from pdop_k8s_emulator import Kubelet, PDEmulator, R, parse_selector, selector_matches

PODS = R("", "v1", "pods")
CMS = R("", "v1", "configmaps")
PDDS = R("pdstack.io", "v1alpha1", "pddeployments")
MERGE = {"Content-Type": "application/merge-patch+json"}


class Api:
    """The emulator plus an HTTP client to it (the emulator is a slotted attrs class)."""

    def __init__(self, emu: PDEmulator, http: aiohttp.ClientSession):
        self.emu, self.http = emu, http

    def __getattr__(self, name):
        return getattr(self.emu, name)


@pytest.fixture
async def api():
    async with PDEmulator() as emu, kmock.Server(emu) as server:
        async with aiohttp.ClientSession(str(server.url)) as http:
            yield Api(emu, http)


async def call(api, method, path, body=None, headers=None, params=None):
    async with api.http.request(method, path, data=None if body is None else json.dumps(body),
                                headers=headers or {"Content-Type": "application/json"}, params=params) as r:
        return r.status, await r.json()


def cm(name, labels=None, owner=None):
    meta = {"name": name, "labels": labels or {}}
    if owner:
        meta["ownerReferences"] = [{"apiVersion": "v1", "kind": "ConfigMap", "name": owner["metadata"]["name"],
                                    "uid": owner["metadata"]["uid"]}]
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": {"k": "v"}}


@pytest.mark.parametrize("selector,labels,ok", [
    ("a=1", {"a": "1"}, True), ("a==1", {"a": "2"}, False), ("a!=1", {}, True), ("a!=1", {"a": "1"}, False),
    ("a in (1, 2)", {"a": "2"}, True), ("a notin (1,2)", {"a": "3"}, True), ("a notin (1,2)", {"a": "1"}, False),
    ("a", {"a": ""}, True), ("!a", {"a": "x"}, False), ("a=1,b in (x,y),!c", {"a": "1", "b": "y"}, True),
    ("pdstack.io/pair=1,pdstack.io/role=decode", {"pdstack.io/pair": "1", "pdstack.io/role": "prefill"}, False),
])
def test_label_selector_semantics(selector, labels, ok):
    assert selector_matches(parse_selector(selector), labels) is ok


async def test_list_with_label_selector_and_bad_selector(api):
    for name, labels in (("a", {"app": "x", "tier": "1"}), ("b", {"app": "x"}), ("c", {"app": "y"})):
        assert (await call(api, "POST", "/api/v1/namespaces/default/configmaps", cm(name, labels)))[0] == 201
    status, body = await call(api, "GET", "/api/v1/namespaces/default/configmaps", params={"labelSelector": "app=x,!tier"})
    assert status == 200 and [i["metadata"]["name"] for i in body["items"]] == ["b"]
    status, body = await call(api, "GET", "/api/v1/configmaps", params={"labelSelector": "app in (x)"})
    assert sorted(i["metadata"]["name"] for i in body["items"]) == ["a", "b"]
    status, body = await call(api, "GET", "/api/v1/configmaps", params={"labelSelector": "app in x"})
    assert status == 400 and "unable to parse" in body["message"]


async def test_metadata_and_resource_version_conflicts(api):
    status, obj = await call(api, "POST", "/api/v1/namespaces/default/configmaps", cm("c"))
    meta = obj["metadata"]
    assert status == 201 and meta["uid"] and meta["creationTimestamp"] and meta["generation"] == 1
    rv = meta["resourceVersion"]
    assert (await call(api, "POST", "/api/v1/namespaces/default/configmaps", cm("c")))[0] == 409
    # a write carrying the current resourceVersion wins; a stale one gets 409 Conflict
    status, new = await call(api, "PATCH", "/api/v1/namespaces/default/configmaps/c",
                             {"metadata": {"resourceVersion": rv}, "data": {"k": "2"}}, MERGE)
    assert status == 200 and int(new["metadata"]["resourceVersion"]) > int(rv)
    status, err = await call(api, "PATCH", "/api/v1/namespaces/default/configmaps/c",
                             {"metadata": {"resourceVersion": rv}, "data": {"k": "3"}}, MERGE)
    assert status == 409 and err["reason"] == "Conflict" and "has been modified" in err["message"]
    put = dict(new, data={"k": "4"})
    assert (await call(api, "PUT", "/api/v1/namespaces/default/configmaps/c", put))[0] == 200
    assert (await call(api, "PUT", "/api/v1/namespaces/default/configmaps/c", put))[0] == 409  # rv now stale
    # no-op writes do not bump the resourceVersion
    cur = api.read(CMS, "default", "c")
    status, same = await call(api, "PATCH", "/api/v1/namespaces/default/configmaps/c", {"data": {"k": "4"}}, MERGE)
    assert same["metadata"]["resourceVersion"] == cur["metadata"]["resourceVersion"]
    # ownerReferences must carry a uid (the kubernetes client rejects them otherwise)
    bad = cm("d")
    bad["metadata"]["ownerReferences"] = [{"apiVersion": "v1", "kind": "ConfigMap", "name": "c"}]
    assert (await call(api, "POST", "/api/v1/namespaces/default/configmaps", bad))[0] == 422


async def test_status_subresource_and_generation(api):
    body = {"apiVersion": "pdstack.io/v1alpha1", "kind": "PDDeployment", "metadata": {"name": "p"},
            "spec": {"image": "a"}, "status": {"phase": "ignored on create"}}
    base = "/apis/pdstack.io/v1alpha1/namespaces/default/pddeployments"
    status, obj = await call(api, "POST", base, body)
    assert status == 201 and "status" not in obj and obj["metadata"]["generation"] == 1
    # main resource: spec changes bump generation; status in the body is ignored
    _, obj = await call(api, "PATCH", f"{base}/p", {"spec": {"image": "b"}, "status": {"phase": "x"}}, MERGE)
    assert obj["metadata"]["generation"] == 2 and "status" not in obj
    # metadata-only change: same generation
    _, obj = await call(api, "PATCH", f"{base}/p", {"metadata": {"annotations": {"a": "1"}}}, MERGE)
    assert obj["metadata"]["generation"] == 2
    # /status: only status changes, generation untouched
    _, obj = await call(api, "PATCH", f"{base}/p/status", {"status": {"phase": "Ready"}, "spec": {"image": "c"}}, MERGE)
    assert obj["status"] == {"phase": "Ready"} and obj["spec"]["image"] == "b" and obj["metadata"]["generation"] == 2


async def test_finalizers_and_ownerreference_cascade(api):
    _, parent = await call(api, "POST", "/api/v1/namespaces/default/configmaps", cm("parent"))
    _, child = await call(api, "POST", "/api/v1/namespaces/default/configmaps", cm("child", owner=parent))
    await call(api, "POST", "/api/v1/namespaces/default/configmaps", cm("grandchild", owner=child))
    await call(api, "POST", "/api/v1/namespaces/default/configmaps", cm("unrelated"))
    await call(api, "PATCH", "/api/v1/namespaces/default/configmaps/parent",
               {"metadata": {"finalizers": ["x/y"]}}, MERGE)
    status, obj = await call(api, "DELETE", "/api/v1/namespaces/default/configmaps/parent")
    assert status == 200 and obj["metadata"]["deletionTimestamp"]  # held by its finalizer
    assert api.read(CMS, "default", "child") is not None
    await call(api, "PATCH", "/api/v1/namespaces/default/configmaps/parent", {"metadata": {"finalizers": None}}, MERGE)
    names = [o["metadata"]["name"] for o in api.select(CMS, "default")]
    assert names == ["unrelated"]  # parent released, children and grandchildren collected
    assert (await call(api, "DELETE", "/api/v1/namespaces/default/configmaps/parent"))[0] == 404


async def test_watch_resumes_from_resource_version_filters_and_times_out(api):
    await call(api, "POST", "/api/v1/namespaces/default/configmaps", cm("before", {"w": "1"}))
    status, listing = await call(api, "GET", "/api/v1/configmaps")
    rv = listing["metadata"]["resourceVersion"]
    await call(api, "POST", "/api/v1/namespaces/default/configmaps", cm("after", {"w": "1"}))
    await call(api, "POST", "/api/v1/namespaces/default/configmaps", cm("other", {"w": "2"}))
    params = {"watch": "true", "resourceVersion": rv, "labelSelector": "w=1", "timeoutSeconds": "1"}
    events = []
    async with api.http.get("/api/v1/configmaps", params=params) as resp:
        async def later():
            await asyncio.sleep(0.1)
            await call(api, "PATCH", "/api/v1/namespaces/default/configmaps/after", {"data": {"k": "z"}}, MERGE)
        task = asyncio.create_task(later())
        async for line in resp.content:
            if line.strip():
                events.append(json.loads(line))
        await task
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [("ADDED", "after"), ("MODIFIED", "after")]


async def test_discovery_declares_verbs_and_status_subresources(api):
    _, core = await call(api, "GET", "/api/v1")
    by_name = {r["name"]: r for r in core["resources"]}
    assert {"namespaces", "pods", "pods/status", "events", "nodes"} <= set(by_name)
    assert {"list", "watch", "patch", "create", "delete"} <= set(by_name["pods"]["verbs"])
    _, group = await call(api, "GET", "/apis/pdstack.io/v1alpha1")
    # the CRD's subresources, as the real server lists them (status and scale)
    assert {r["name"] for r in group["resources"]} == {"pddeployments", "pddeployments/status",
                                                       "pddeployments/scale"}
    assert core["groupVersion"] == "v1" and by_name["pods"]["shortNames"] == ["po"]


async def test_kubelet_schedules_gpus_starts_restarts_and_evicts(api):
    kubelet = Kubelet(api.emu, auto_ready=True)
    kubelet.add_node("n1", 8)

    def gpu_pod(name, gpus):
        return {"metadata": {"name": name}, "spec": {"containers": [
            {"name": "c", "resources": {"requests": {"nvidia.com/gpu": str(gpus)}}}]}}

    for name, gpus in (("a", 4), ("b", 4), ("c", 4)):
        api._create(PODS, "default", gpu_pod(name, gpus))
    kubelet.step()
    kubelet.step()
    a, b, c = (api.read(PODS, "default", n) for n in "abc")
    assert a["spec"]["nodeName"] == b["spec"]["nodeName"] == "n1"
    assert a["status"]["phase"] == "Running" and a["status"]["podIP"] and kubelet._is_ready(a)
    cond = c["status"]["conditions"][0]
    assert c["status"]["phase"] == "Pending" and cond["reason"] == "Unschedulable"
    assert "1 Insufficient nvidia.com/gpu" in cond["message"]
    kubelet.restart_container("default", "a", oom=True)
    cs = api.read(PODS, "default", "a")["status"]["containerStatuses"][0]
    assert cs["restartCount"] == 1 and cs["lastState"]["terminated"]["reason"] == "OOMKilled"
    kubelet.evict("default", "b")
    b = api.read(PODS, "default", "b")
    assert b["status"]["phase"] == "Failed" and b["status"]["reason"] == "Evicted"
    kubelet.step()  # the evicted pod's GPUs are free again: c fits now
    kubelet.step()
    assert api.read(PODS, "default", "c")["status"]["phase"] == "Running"
    kubelet.set_ready("default", "c", False)
    kubelet.step()
    assert not kubelet._is_ready(api.read(PODS, "default", "c"))
