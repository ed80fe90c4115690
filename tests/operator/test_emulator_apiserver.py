"""The API server surface real clients depend on, table-tested piece by piece (the real-client matrix in
tests/cluster runs the real binaries over the same pieces): discovery, OpenAPI, Table, dryRun, field
validation, PUT semantics, CRDs (status, validation, pruning, defaulting, CEL, deletion), strategic merge
patch, protobuf bodies, SSAR, RBAC from stored objects."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import aiohttp
import kmock
import pytest
import yaml

import emu_apiext as apiext
import emu_catalog as cat
import emu_protobuf
import emu_rbac
import emu_smp
from pdop_k8s_emulator import PDEmulator, R
from pdoperator.core.spec import SpecError, parse_spec

ROOT = Path(__file__).resolve().parents[2]
CRD = yaml.safe_load((ROOT / "crds" / "pddeployment.yaml").read_text())
SCHEMA = CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
PDD_PATH = "/apis/pdstack.io/v1alpha1/namespaces/default/pddeployments"
CM_PATH = "/api/v1/namespaces/default/configmaps"


@pytest.fixture
async def http():
    async with PDEmulator() as emu, kmock.Server(emu) as server:
        async with aiohttp.ClientSession(str(server.url)) as session:
            session.emu = emu  # type: ignore[attr-defined]
            yield session


async def call(http, method, path, body=None, ctype="application/json", params=None, accept="application/json"):
    data = body if isinstance(body, bytes) else None if body is None else json.dumps(body)
    async with http.request(method, path, data=data, params=params,
                            headers={"Content-Type": ctype, "Accept": accept}) as r:
        raw = await r.read()
        try:
            return r.status, json.loads(raw), r.headers
        except ValueError:
            return r.status, raw, r.headers


def pdd(name="x", **spec):
    return {"apiVersion": "pdstack.io/v1alpha1", "kind": "PDDeployment", "metadata": {"name": name},
            "spec": {"image": "img:1", **spec}}


# ---------------------------------------------------------------- discovery and OpenAPI
async def test_discovery_documents_have_the_real_shapes(http):
    _, api, _ = await call(http, "GET", "/api")
    assert api["kind"] == "APIVersions" and api["versions"] == ["v1"] and api["serverAddressByClientCIDRs"]
    _, core, _ = await call(http, "GET", "/api/v1")
    assert core["groupVersion"] == "v1"
    pods = next(r for r in core["resources"] if r["name"] == "pods")
    assert pods["shortNames"] == ["po"] and pods["categories"] == ["all"] and pods["singularName"] == "pod"
    evict = next(r for r in core["resources"] if r["name"] == "pods/eviction")
    assert (evict["group"], evict["version"], evict["kind"]) == ("policy", "v1", "Eviction")
    _, groups, _ = await call(http, "GET", "/apis")
    names = {g["name"] for g in groups["groups"]}
    assert {"apps", "apiextensions.k8s.io", "rbac.authorization.k8s.io", "authorization.k8s.io",
            "pdstack.io"} <= names
    _, pdstack, _ = await call(http, "GET", "/apis/pdstack.io/v1alpha1")
    main = next(r for r in pdstack["resources"] if r["name"] == "pddeployments")
    assert main["shortNames"] == ["pdd"] and main["categories"] == ["pdstack"]
    assert (await call(http, "GET", "/apis/nope.example/v1"))[0] == 404


async def test_openapi_v3_lets_kubectl_leave_validation_to_the_server(http):
    _, index, _ = await call(http, "GET", "/openapi/v3")
    url = index["paths"]["apis/pdstack.io/v1alpha1"]["serverRelativeURL"]
    assert url.startswith("/openapi/v3/apis/pdstack.io/v1alpha1?hash=")
    _, doc, _ = await call(http, "GET", url)
    patch = doc["paths"]["/apis/pdstack.io/v1alpha1/namespaces/{namespace}/pddeployments/{name}"]["patch"]
    assert patch["x-kubernetes-group-version-kind"] == {"group": "pdstack.io", "version": "v1alpha1",
                                                        "kind": "PDDeployment"}
    assert {"fieldValidation", "dryRun", "fieldManager", "force"} <= {p["name"] for p in patch["parameters"]}
    schema = doc["components"]["schemas"]["io.pdstack.v1alpha1.PDDeployment"]
    assert schema["properties"]["spec"]["properties"]["pairs"]["minimum"] == 0
    assert schema["properties"]["metadata"]["$ref"].endswith("ObjectMeta")
    _, core, _ = await call(http, "GET", index["paths"]["api/v1"]["serverRelativeURL"])
    containers = core["components"]["schemas"]["io.k8s.api.core.v1.PodSpec"]["properties"]["containers"]
    assert containers["x-kubernetes-patch-merge-key"] == "name" and containers["type"] == "array"


async def test_openapi_v2_is_served_as_json_and_as_gnostic_protobuf(http):
    _, doc, _ = await call(http, "GET", "/openapi/v2")
    assert doc["swagger"] == "2.0" and "io.k8s.api.core.v1.Pod" in doc["definitions"]
    status, body, headers = await call(http, "GET", "/openapi/v2",
                                       accept="application/com.github.proto-openapi.spec.v2@v1.0+protobuf")
    assert status == 200 and headers["Content-Type"].startswith(emu_protobuf.OPENAPI_V2_PROTOBUF)
    assert body[:5] == b"\n\x032.0"  # field 1 (swagger) = "2.0"
    assert b"io.k8s.api.core.v1.Pod" in body and b"io.pdstack.v1alpha1.PDDeployment" in body


async def test_tables_carry_the_crds_printer_columns(http):
    await call(http, "POST", PDD_PATH, pdd(pairs=3))
    table_accept = "application/json;as=Table;v=v1;g=meta.k8s.io,application/json"
    _, table, _ = await call(http, "GET", PDD_PATH, accept=table_accept)
    assert table["kind"] == "Table"
    assert [c["name"] for c in table["columnDefinitions"]] == ["Name", "Pairs", "Ready", "Revision", "Drift",
                                                               "Phase", "Age"]
    assert [c["priority"] for c in table["columnDefinitions"]][5] == 1
    cells = table["rows"][0]["cells"]
    assert cells[:2] == ["x", 3] and cells[2] is None and cells[-1].endswith("s")
    assert table["rows"][0]["object"]["kind"] == "PartialObjectMetadata"


# ---------------------------------------------------------------- writes
async def test_dry_run_admits_and_returns_but_stores_nothing(http):
    emu = http.emu
    status, obj, _ = await call(http, "POST", PDD_PATH, pdd(), params={"dryRun": "All"})
    assert status == 201 and obj["spec"]["pairs"] == 1 and emu.read(R("pdstack.io", "v1alpha1", "pddeployments"),
                                                                      "default", "x") is None
    await call(http, "POST", PDD_PATH, pdd())
    rv = emu._last_rv
    status, obj, _ = await call(http, "PATCH", f"{PDD_PATH}/x", {"spec": {"pairs": 7}},
                                ctype="application/merge-patch+json", params={"dryRun": "All"})
    assert status == 200 and obj["spec"]["pairs"] == 7
    assert emu._last_rv == rv and (await call(http, "GET", f"{PDD_PATH}/x"))[1]["spec"]["pairs"] == 1
    assert (await call(http, "DELETE", f"{PDD_PATH}/x", params={"dryRun": "All"}))[0] == 200
    assert (await call(http, "GET", f"{PDD_PATH}/x"))[0] == 200


async def test_field_validation_strict_refuses_warn_warns_and_unknown_fields_are_dropped(http):
    body = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c"}, "data": {"k": "v"}, "dataz": 1}
    status, obj, _ = await call(http, "POST", CM_PATH, body, params={"fieldValidation": "Strict"})
    assert status == 400 and 'strict decoding error: unknown field "dataz"' in obj["message"]
    status, obj, headers = await call(http, "POST", CM_PATH, body)
    assert status == 201 and "dataz" not in obj
    assert headers.getall("Warning") == ['299 - "unknown field \\"dataz\\""']
    status, obj, _ = await call(http, "POST", PDD_PATH, {**pdd(), "spec": {"image": "i", "pairz": 2}},
                                params={"fieldValidation": "Strict"})
    assert status == 400 and 'unknown field "spec.pairz"' in obj["message"]


async def test_put_without_resource_version_is_unconditional_for_built_ins_not_for_custom_resources(http):
    await call(http, "POST", CM_PATH, {"metadata": {"name": "c"}, "data": {"k": "v"}})
    status, obj, _ = await call(http, "PUT", f"{CM_PATH}/c", {"metadata": {"name": "c"}, "data": {"k": "w"}})
    assert status == 200 and obj["data"] == {"k": "w"}
    await call(http, "POST", PDD_PATH, pdd())
    status, obj, _ = await call(http, "PUT", f"{PDD_PATH}/x", pdd(pairs=2))
    assert status == 422 and "metadata.resourceVersion" in obj["message"]


async def test_custom_resources_are_defaulted_pruned_validated_and_cel_checked(http):
    status, obj, _ = await call(http, "POST", PDD_PATH, {**pdd(), "spec": {"image": "i", "bogus": 1,
                                                                             "prefill": {"replicas": 2}}})
    assert status == 201 and "bogus" not in obj["spec"] and obj["spec"]["pairs"] == 1  # pruned, defaulted
    assert obj["spec"]["prefill"]["replicas"] == 2 and obj["spec"]["engine"] == "pdrt"  # kept, defaulted
    status, obj, _ = await call(http, "PATCH", f"{PDD_PATH}/x", {"spec": {"pairs": -5}},
                                ctype="application/merge-patch+json")
    assert status == 422 and obj["details"]["causes"][0]["field"] == "spec.pairs"
    assert obj["message"] == ('PDDeployment.pdstack.io "x" is invalid: spec.pairs: Invalid value: -5: spec.pairs '
                              "in body should be greater than or equal to 0")
    bad = pdd("tp", prefill={"tensorParallelSize": 2, "resources": {"gpus": 2}})
    status, obj, _ = await call(http, "POST", PDD_PATH, bad)
    assert status == 422 and obj["details"]["causes"][0]["field"] == "spec"
    assert "spec.prefill and spec.decode must have the same tensor-parallel size" in obj["message"]
    status, obj, _ = await call(http, "PATCH", f"{PDD_PATH}/x", {"spec": {"pairs": 2}},
                                ctype="application/strategic-merge-patch+json")
    assert status == 415  # no strategic merge patch for custom resources


async def test_a_crd_is_stored_established_served_and_deleting_it_deletes_its_objects(http):
    crd = {"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
           "metadata": {"name": "widgets.example.com"},
           "spec": {"group": "example.com", "scope": "Namespaced",
                    "names": {"plural": "widgets", "singular": "widget", "kind": "Widget", "shortNames": ["wd"]},
                    "versions": [{"name": "v1", "served": True, "storage": True,
                                  "subresources": {"scale": {"specReplicasPath": ".spec.size",
                                                             "statusReplicasPath": ".status.size"}},
                                  "schema": {"openAPIV3Schema": {"type": "object", "properties": {
                                      "spec": {"type": "object", "properties": {"size": {"type": "integer"}},
                                               "x-kubernetes-validations": [
                                                   {"rule": "self.size <= 10", "message": "at most 10"}]}}}}}]}}
    status, stored, _ = await call(http, "POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", crd)
    assert status == 201
    assert {c["type"]: c["status"] for c in stored["status"]["conditions"]} == {"NamesAccepted": "True",
                                                                                "Established": "True"}
    path = "/apis/example.com/v1/namespaces/default/widgets"
    assert (await call(http, "POST", path, {"metadata": {"name": "w"}, "spec": {"size": 3}}))[0] == 201
    status, obj, _ = await call(http, "POST", path, {"metadata": {"name": "big"}, "spec": {"size": 11}})
    assert status == 422 and "at most 10" in obj["message"]
    status, scale, _ = await call(http, "GET", f"{path}/w/scale")
    assert status == 200 and scale["spec"]["replicas"] == 3  # the scale subresource read from the CRD
    bad = copy.deepcopy(crd)
    bad["metadata"]["name"] = "gadgets.example.com"
    bad["spec"]["names"] = {"plural": "gadgets", "kind": "Gadget"}
    bad["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["x-kubernetes-validations"] = [{"rule": "self.a =="}]
    status, obj, _ = await call(http, "POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", bad)
    assert status == 422 and "compilation failed" in obj["message"]
    assert (await call(http, "DELETE", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/"
                                       "widgets.example.com"))[0] == 200
    assert (await call(http, "GET", path))[0] == 404


async def test_protobuf_bodies_of_typed_clients_are_decoded(http):
    meta = emu_protobuf._s(1, "s1") + emu_protobuf._ld(11, emu_protobuf._s(1, "owner") + emu_protobuf._s(2, "helm"))
    entry = emu_protobuf._s(1, "release") + emu_protobuf._ld(2, b"\x00\xffbinary")
    secret = emu_protobuf._ld(1, meta) + emu_protobuf._ld(2, entry) + emu_protobuf._s(3, "helm.sh/release.v1")
    tm = emu_protobuf._s(1, "v1") + emu_protobuf._s(2, "Secret")
    body = emu_protobuf.MAGIC + emu_protobuf._ld(1, tm) + emu_protobuf._ld(2, secret)
    status, obj, _ = await call(http, "POST", "/api/v1/namespaces/default/secrets", body,
                                ctype="application/vnd.kubernetes.protobuf")
    assert status == 201 and obj["metadata"]["labels"] == {"owner": "helm"}
    assert obj["data"]["release"] == "AP9iaW5hcnk=" and obj["type"] == "helm.sh/release.v1"


async def test_self_subject_access_review_and_self_subject_review(http):
    review = {"apiVersion": "authorization.k8s.io/v1", "kind": "SelfSubjectAccessReview",
              "spec": {"resourceAttributes": {"verb": "create", "resource": "pods", "namespace": "default"}}}
    status, obj, _ = await call(http, "POST", "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews", review)
    assert status == 201 and obj["status"]["allowed"] is True
    status, obj, _ = await call(http, "POST", "/apis/authentication.k8s.io/v1/selfsubjectreviews",
                                {"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"})
    assert status == 201 and obj["status"]["userInfo"]["username"] == "anonymous"


# ---------------------------------------------------------------- pure pieces
def _defs_for(kind_def):
    r = next(r for r in cat.BUILTINS if r.definition == kind_def)
    return cat.schema_of(r)


@pytest.mark.parametrize("patch,expect", [
    ({"spec": {"template": {"spec": {"containers": [{"name": "b", "image": "b:2"}]}}}},
     [("a", "a:1"), ("b", "b:2")]),
    ({"spec": {"template": {"spec": {"containers": [{"name": "c", "image": "c:1"}]}}}},
     [("a", "a:1"), ("b", "b:1"), ("c", "c:1")]),
    ({"spec": {"template": {"spec": {"containers": [{"name": "a", "$patch": "delete"}]}}}}, [("b", "b:1")]),
    ({"spec": {"template": {"spec": {"containers": [{"name": "z", "image": "z"}, {"$patch": "replace"}]}}}},
     [("z", "z")]),
    ({"spec": {"template": {"spec": {"$setElementOrder/containers": [{"name": "b"}, {"name": "a"}],
                                     "containers": [{"name": "a", "image": "a:9"}]}}}}, [("b", "b:1"), ("a", "a:9")]),
])
def test_strategic_merge_patch_merges_lists_by_their_patch_merge_key(patch, expect):
    schema, defs = _defs_for("io.k8s.api.apps.v1.Deployment")
    containers = [{"name": "a", "image": "a:1"}, {"name": "b", "image": "b:1"}]
    live = {"spec": {"template": {"spec": {"containers": containers}}}}
    out = emu_smp.apply_patch(live, patch, schema, defs)
    assert [(c["name"], c["image"]) for c in out["spec"]["template"]["spec"]["containers"]] == expect


def test_strategic_merge_patch_retain_keys_null_deletes_and_primitive_lists():
    schema, defs = _defs_for("io.k8s.api.apps.v1.Deployment")
    live = {"spec": {"strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1}}, "replicas": 2,
                     "template": {"spec": {"containers": [{"name": "a", "args": ["x", "y"]}]}}}}
    out = emu_smp.apply_patch(live, {"spec": {"strategy": {"$retainKeys": ["type"], "type": "Recreate"},
                                              "replicas": None}}, schema, defs)
    assert out["spec"]["strategy"] == {"type": "Recreate"} and "replicas" not in out["spec"]
    out = emu_smp.apply_patch(live, {"spec": {"template": {"spec": {"containers": [{"name": "a", "args": ["z"]}]}}}},
                              schema, defs)
    assert out["spec"]["template"]["spec"]["containers"][0]["args"] == ["z"]  # atomic list: replaced
    assert live["spec"]["replicas"] == 2  # the original is not modified


@pytest.mark.parametrize("prefill,decode,same", [
    ({}, {}, True),
    ({"resources": {"gpus": 2}}, {"resources": {"gpus": 2}}, True),
    ({"resources": {"gpus": 2}}, {"resources": {"gpus": 1}}, False),
    ({"tensorParallelSize": 2, "resources": {"gpus": 4}}, {"resources": {"gpus": 2}}, True),
    ({"tensorParallelSize": 1, "resources": {"gpus": 4}}, {"resources": {"gpus": 4}}, False),
    ({"resources": {"gpus": 1}}, {}, True),
    ({"tensorParallelSize": 2, "resources": {"gpus": 2}}, {}, False),
])
def test_the_crds_cel_tp_rule_agrees_with_the_operators_spec_error(prefill, decode, same):
    spec = {"image": "i", "prefill": copy.deepcopy(prefill), "decode": copy.deepcopy(decode)}
    obj = {"spec": spec}
    apiext.apply_defaults(obj, SCHEMA, {})
    cel = [c for c in apiext.validate(obj, SCHEMA, {}) if "tensor-parallel" in c.message]
    try:
        parse_spec(spec)
        operator_ok = True
    except SpecError as e:
        operator_ok = "tensor-parallel size" not in str(e)
    assert (not cel) is same and operator_ok is same


def test_every_list_in_the_crd_declares_its_list_type():
    missing = []

    def walk(node, path):
        if isinstance(node, dict):
            if node.get("type") == "array" and "x-kubernetes-list-type" not in node:
                missing.append(path)
            for k, v in node.items():
                walk(v, f"{path}.{k}")
    walk(SCHEMA, "openAPIV3Schema")
    assert missing == []
    assert apiext.compile_errors(SCHEMA) == []


def test_stored_rbac_decisions():
    store = {"roles": [{"metadata": {"name": "r", "namespace": "a"},
                        "rules": [{"apiGroups": [""], "resources": ["pods", "pods/status"], "verbs": ["get"]},
                                  {"apiGroups": ["apps"], "resources": ["deployments"], "verbs": ["*"],
                                   "resourceNames": ["web"]}]}],
             "clusterroles": [{"metadata": {"name": "nodes"}, "rules": [{"apiGroups": [""], "resources": ["nodes"],
                                                                        "verbs": ["list"]}]}],
             "rolebindings": [{"metadata": {"name": "b", "namespace": "a"},
                               "roleRef": {"kind": "Role", "name": "r"},
                               "subjects": [{"kind": "ServiceAccount", "name": "op", "namespace": "ns"}]}],
             "clusterrolebindings": [{"metadata": {"name": "cb"}, "roleRef": {"kind": "ClusterRole", "name": "nodes"},
                                      "subjects": [{"kind": "Group", "name": "system:serviceaccounts:ns"}]}]}
    op = emu_rbac.User.of("system:serviceaccount:ns:op")
    assert emu_rbac.allowed(op, "get", "", "pods", "a", "p", store)
    assert emu_rbac.allowed(op, "get", "", "pods/status", "a", "p", store)
    assert not emu_rbac.allowed(op, "get", "", "pods", "b", "p", store)  # another namespace
    assert not emu_rbac.allowed(op, "list", "", "pods", "a", None, store)
    assert emu_rbac.allowed(op, "delete", "apps", "deployments", "a", "web", store)
    assert not emu_rbac.allowed(op, "delete", "apps", "deployments", "a", "other", store)
    assert emu_rbac.allowed(op, "list", "", "nodes", None, None, store)  # through its group
    assert not emu_rbac.allowed(emu_rbac.User.of("someone"), "list", "", "nodes", None, None, store)
    assert emu_rbac.allowed(emu_rbac.User.of("root", ["system:masters"]), "delete", "x", "y", None, None, store)


async def test_status_writes_are_validated_and_unchanged_invalid_values_ratchet(http):
    http.emu.validate_status = True
    await call(http, "POST", PDD_PATH, pdd())
    bad = {"status": {"conditions": [{"type": "Ready", "status": "Maybe"}]}}
    status, obj, _ = await call(http, "PATCH", f"{PDD_PATH}/x/status", bad, ctype="application/merge-patch+json")
    assert status == 422 and "status.conditions[0].status: Unsupported value" in obj["message"]
    dup = {"status": {"conditions": [{"type": "Ready", "status": "True"}, {"type": "Ready", "status": "False"}]}}
    status, obj, _ = await call(http, "PATCH", f"{PDD_PATH}/x/status", dup, ctype="application/merge-patch+json")
    assert status == 422 and "Duplicate value" in obj["message"]  # x-kubernetes-list-type: map, keyed by type
    # the CRD tightens pairs to at most 0: the stored pairs 1 is now invalid, and ratchets while unchanged
    emu = http.emu
    crd = emu.read(R("apiextensions.k8s.io", "v1", "customresourcedefinitions"), None, "pddeployments.pdstack.io")
    crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["pairs"]["maximum"] = 0
    emu._store(R("apiextensions.k8s.io", "v1", "customresourcedefinitions"), None, "pddeployments.pdstack.io", crd)
    ok = {"status": {"conditions": [{"type": "Ready", "status": "True"}]}}
    assert (await call(http, "PATCH", f"{PDD_PATH}/x/status", ok, ctype="application/merge-patch+json"))[0] == 200
    status, obj, _ = await call(http, "PATCH", f"{PDD_PATH}/x", {"spec": {"pairs": 2}},
                                ctype="application/merge-patch+json")
    assert status == 422 and "less than or equal to 0" in obj["message"]


async def test_namespaces_get_a_default_service_account_and_pods_need_theirs(http):
    assert (await call(http, "POST", "/api/v1/namespaces", {"metadata": {"name": "team"}}))[0] == 201
    status, sa, _ = await call(http, "GET", "/api/v1/namespaces/team/serviceaccounts/default")
    assert status == 200
    pod = {"metadata": {"name": "p"}, "spec": {"serviceAccountName": "missing",
                                               "containers": [{"name": "c", "image": "i:1"}]}}
    status, obj, _ = await call(http, "POST", "/api/v1/namespaces/team/pods", pod)
    assert status == 403 and obj["message"] == ('pods "p" is forbidden: error looking up service account '
                                                'team/missing: serviceaccount "missing" not found')
    del pod["spec"]["serviceAccountName"]
    status, obj, _ = await call(http, "POST", "/api/v1/namespaces/team/pods", pod)
    assert status == 201 and obj["spec"]["serviceAccountName"] == "default"
    status, log, _ = await call(http, "GET", "/api/v1/namespaces/team/pods/p/log")
    assert status == 200 and log == b""


async def test_deleting_a_namespace_deletes_its_objects_first(http):
    await call(http, "POST", "/api/v1/namespaces", {"metadata": {"name": "gone"}})
    await call(http, "POST", "/api/v1/namespaces/gone/configmaps", {"metadata": {"name": "a"}})
    await call(http, "POST", "/api/v1/namespaces/gone/configmaps", {"metadata": {"name": "held",
                                                                               "finalizers": ["x/y"]}})
    status, ns, _ = await call(http, "DELETE", "/api/v1/namespaces/gone")
    assert status == 200 and ns["status"]["phase"] == "Terminating"  # held by the finalizer of "held"
    assert (await call(http, "GET", "/api/v1/namespaces/gone/configmaps/a"))[0] == 404
    status, obj, _ = await call(http, "POST", "/api/v1/namespaces/gone/configmaps", {"metadata": {"name": "b"}})
    assert status == 403 and "because it is being terminated" in obj["message"]
    await call(http, "PATCH", "/api/v1/namespaces/gone/configmaps/held", {"metadata": {"finalizers": None}},
               ctype="application/merge-patch+json")
    assert (await call(http, "GET", "/api/v1/namespaces/gone"))[0] == 404
