"""The real-client matrix: the real ``kubectl`` and ``helm`` binaries and the official ``kubernetes`` client
against the test cluster (one per module). Each test reads what a user would read, so it fails when the
server lacks the feature (discovery, OpenAPI, Table, dryRun, strict validation, CEL, SSAR, protobuf ...).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from testcluster import ROOT, call_in_loop, threaded

TOOLS = ROOT / ".tools" / "bin"
KUBECTL = shutil.which("kubectl", path=f"{TOOLS}:{os.environ.get('PATH', '')}")
HELM = shutil.which("helm", path=f"{TOOLS}:{os.environ.get('PATH', '')}")
pytestmark = pytest.mark.skipif(not (KUBECTL and HELM), reason="kubectl and helm not installed (make tools)")
EXAMPLE = ROOT / "examples" / "cpu-demo.yaml"


@pytest.fixture(scope="module")
def tc(tmp_path_factory):
    with threaded(tmp_path_factory.mktemp("test-cluster")) as cluster:
        yield cluster


def run(tc, binary: str, *args: str, ok: bool = True, kubeconfig: Path | None = None,
        stdin: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "KUBECONFIG": str(kubeconfig or tc.kubeconfig), "HOME": str(tc.dir),
           "HELM_CACHE_HOME": str(tc.dir / "helm-cache"), "HELM_CONFIG_HOME": str(tc.dir / "helm-config"),
           "HELM_DATA_HOME": str(tc.dir / "helm-data")}
    p = subprocess.run([binary, *args], capture_output=True, text=True, env=env, timeout=120, input=stdin,
                       cwd=ROOT)
    if ok:
        assert p.returncode == 0, f"{binary} {' '.join(args)}\nstdout: {p.stdout}\nstderr: {p.stderr}"
    return p


def kubectl(tc, *args: str, **kw) -> subprocess.CompletedProcess:
    return run(tc, KUBECTL, *args, **kw)


def helm(tc, *args: str, **kw) -> subprocess.CompletedProcess:
    return run(tc, HELM, *args, **kw)


def wait_for(check, timeout: float = 20.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def test_api_resources_shows_core_kinds_short_names_and_the_crd(tc):
    kubectl(tc, "apply", "-f", str(ROOT / "crds" / "pddeployment.yaml"))
    out = kubectl(tc, "api-resources").stdout
    rows = {line.split()[0]: line.split() for line in out.splitlines()[1:]}
    assert rows["pods"][1:] == ["po", "v1", "true", "Pod"]
    assert rows["pddeployments"][1:] == ["pdd", "pdstack.io/v1alpha1", "true", "PDDeployment"]
    assert rows["customresourcedefinitions"][1] == "crd,crds"
    cats = kubectl(tc, "api-resources", "--categories=pdstack", "-o", "name").stdout.split()
    assert cats == ["pddeployments.pdstack.io"]
    crd = json.loads(kubectl(tc, "get", "crd", "pddeployments.pdstack.io", "-o", "json").stdout)
    assert {c["type"]: c["status"] for c in crd["status"]["conditions"]}["Established"] == "True"


def test_explain_reads_the_crd_schema_from_openapi_v3(tc):
    out = kubectl(tc, "explain", "pddeployment.spec").stdout
    assert "KIND:       PDDeployment" in out and "FIELD: spec <Object>" in out
    assert "pairs\t<integer>" in out and "image\t<string> -required-" in out
    pod = kubectl(tc, "explain", "pods.spec.containers.image").stdout
    assert "Container image name" in pod


def test_apply_client_and_server_side_then_get_wide_shows_printer_columns(tc):
    kubectl(tc, "apply", "-f", str(EXAMPLE))
    kubectl(tc, "apply", "--server-side", "--force-conflicts", "-f", str(EXAMPLE))
    lines = kubectl(tc, "get", "pdd", "-o", "wide").stdout.splitlines()
    assert lines[0].split() == ["NAME", "PAIRS", "READY", "REVISION", "DRIFT", "PHASE", "AGE"]
    assert lines[1].split()[:2] == ["demo", "1"]
    assert lines[1].split()[-1].endswith("s")  # the Age column is a duration, rendered by the server
    narrow = kubectl(tc, "get", "pdd").stdout.splitlines()[0].split()
    assert "PHASE" not in narrow  # priority 1: -o wide only
    obj = json.loads(kubectl(tc, "get", "pdd", "demo", "-o", "json", "--show-managed-fields").stdout)
    managers = {m["manager"]: m["operation"] for m in obj["metadata"]["managedFields"]}
    assert managers.get("kubectl") == "Apply" and obj["spec"]["prefill"]["replicas"] == 1  # defaulted


def test_apply_with_an_unknown_field_is_refused_by_strict_validation(tc):
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"]["pairz"] = 2
    p = kubectl(tc, "apply", "-f", "-", stdin=yaml.safe_dump(doc), ok=False)
    assert p.returncode != 0 and 'unknown field "spec.pairz"' in p.stderr


def test_an_invalid_tp_pairing_is_refused_at_admission_with_the_cel_message(tc):
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["metadata"]["name"] = "badtp"
    doc["spec"]["prefill"]["tensorParallelSize"] = 2
    doc["spec"]["prefill"]["resources"]["gpus"] = 2
    p = kubectl(tc, "apply", "-f", "-", stdin=yaml.safe_dump(doc), ok=False)
    assert p.returncode != 0
    assert 'The PDDeployment "badtp" is invalid' in p.stderr
    assert "spec: Invalid value: \"object\": spec.prefill and spec.decode must have the same tensor-parallel" \
        in p.stderr
    assert kubectl(tc, "get", "pdd", "badtp", ok=False).returncode != 0  # nothing stored


def test_patch_with_an_invalid_value_is_a_422_naming_the_field(tc):
    p = kubectl(tc, "patch", "pdd", "demo", "--type=merge", "-p", '{"spec":{"pairs":-5}}', ok=False)
    assert p.returncode != 0
    assert 'The PDDeployment "demo" is invalid: spec.pairs: Invalid value: -5: spec.pairs in body should be ' \
           "greater than or equal to 0" in p.stderr
    p = kubectl(tc, "patch", "pdd", "demo", "--type=merge", "-p", '{"spec":{"pairs":2,"bogus":1}}')
    obj = json.loads(kubectl(tc, "get", "pdd", "demo", "-o", "json").stdout)
    assert obj["spec"]["pairs"] == 2 and "bogus" not in obj["spec"]  # pruned, as apiextensions prunes


def test_diff_shows_the_change_and_persists_nothing(tc):
    before = json.loads(kubectl(tc, "get", "pdd", "demo", "-o", "json").stdout)
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"]["pairs"] = 5
    p = kubectl(tc, "diff", "-f", "-", stdin=yaml.safe_dump(doc), ok=False)
    assert p.returncode == 1, p.stderr  # 1: differences found
    assert "+  pairs: 5" in p.stdout
    after = json.loads(kubectl(tc, "get", "pdd", "demo", "-o", "json").stdout)
    assert after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"]
    assert after["spec"]["pairs"] == before["spec"]["pairs"]


def test_scale_goes_through_the_crd_scale_subresource_and_get_watch_sees_it(tc):
    out = tc.dir / "watch.out"
    env = {**os.environ, "KUBECONFIG": str(tc.kubeconfig), "HOME": str(tc.dir)}
    with out.open("w") as f:
        watcher = subprocess.Popen([KUBECTL, "get", "pdd", "-w"], env=env, stdout=f, stderr=subprocess.STDOUT)
        try:
            wait_for(lambda: "demo" in out.read_text(), what="the watch's first row")
            kubectl(tc, "scale", "pdd", "demo", "--replicas=3")
            # the watch streams Tables (printer columns), the columns in the first event only
            wait_for(lambda: any(line.split()[:2] == ["demo", "3"] for line in out.read_text().splitlines()),
                     what="the scaled row")
        finally:
            watcher.terminate()
            watcher.wait(10)
    assert out.read_text().count("PAIRS") == 1
    obj = json.loads(kubectl(tc, "get", "pdd", "demo", "-o", "json").stdout)
    assert obj["spec"]["pairs"] == 3
    scale = json.loads(kubectl(tc, "get", "--raw",
                               "/apis/pdstack.io/v1alpha1/namespaces/default/pddeployments/demo/scale").stdout)
    assert scale["kind"] == "Scale" and scale["spec"]["replicas"] == 3


def test_describe_shows_the_objects_events(tc):
    uid = json.loads(kubectl(tc, "get", "pdd", "demo", "-o", "json").stdout)["metadata"]["uid"]
    event = {"apiVersion": "v1", "kind": "Event", "metadata": {"name": "demo.1", "namespace": "default"},
             "involvedObject": {"apiVersion": "pdstack.io/v1alpha1", "kind": "PDDeployment", "name": "demo",
                                "namespace": "default", "uid": uid},
             "reason": "CoRestart", "message": "pair 0 restarted together", "type": "Normal", "count": 1,
             "firstTimestamp": "2026-01-01T00:00:00Z", "lastTimestamp": "2026-01-01T00:00:00Z",
             "source": {"component": "pdstack-operator"}}
    other = {**event, "metadata": {"name": "other.1", "namespace": "default"},
             "involvedObject": {**event["involvedObject"], "name": "other", "uid": "x"}, "reason": "Elsewhere"}
    kubectl(tc, "create", "-f", "-", stdin=json.dumps({"apiVersion": "v1", "kind": "List", "items": [event, other]}))
    out = kubectl(tc, "describe", "pdd", "demo").stdout
    events = out.split("Events:")[1]
    assert "CoRestart" in events and "pair 0 restarted together" in events
    assert "Elsewhere" not in events  # the field selector on involvedObject is applied


def test_auth_can_i_and_whoami(tc):
    assert kubectl(tc, "auth", "can-i", "create", "pods").stdout.strip() == "yes"
    who = kubectl(tc, "auth", "whoami", "-o", "json").stdout
    assert json.loads(who)["status"]["userInfo"]["username"] == "kubernetes-admin"
    sa = tc.service_account_kubeconfig("default", "viewer")
    p = kubectl(tc, "auth", "can-i", "create", "pods", kubeconfig=sa, ok=False)
    assert p.stdout.strip() == "no"
    role = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
            "metadata": {"name": "pod-creator", "namespace": "default"},
            "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["create", "get"]}]}
    binding = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
               "metadata": {"name": "viewer-pods", "namespace": "default"},
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "pod-creator"},
               "subjects": [{"kind": "ServiceAccount", "name": "viewer", "namespace": "default"}]}
    kubectl(tc, "apply", "-f", "-", stdin=json.dumps({"apiVersion": "v1", "kind": "List", "items": [role, binding]}))
    assert kubectl(tc, "auth", "can-i", "create", "pods", kubeconfig=sa).stdout.strip() == "yes"
    assert kubectl(tc, "auth", "can-i", "delete", "pods", kubeconfig=sa, ok=False).stdout.strip() == "no"
    assert kubectl(tc, "auth", "can-i", "create", "pods", "-n", "kube-system", kubeconfig=sa,
                   ok=False).stdout.strip() == "no"
    # kubectl --as: impersonation, allowed to system:masters
    assert kubectl(tc, "auth", "can-i", "create", "pods", "--as=system:serviceaccount:default:viewer").stdout \
        .strip() == "yes"
    assert kubectl(tc, "auth", "can-i", "list", "secrets", "--as=system:serviceaccount:default:viewer",
                   ok=False).stdout.strip() == "no"
    denied = kubectl(tc, "get", "secrets", kubeconfig=sa, ok=False)
    assert 'User "system:serviceaccount:default:viewer" cannot list resource "secrets"' in denied.stderr


def test_strategic_merge_patch_merges_containers_by_name_and_retains_keys(tc):
    dep = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "web", "namespace": "default"},
           "spec": {"replicas": 1, "selector": {"matchLabels": {"app": "web"}},
                    "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1}},
                    "template": {"metadata": {"labels": {"app": "web"}},
                                 "spec": {"containers": [{"name": "a", "image": "a:1"},
                                                         {"name": "b", "image": "b:1"}]}}}}
    kubectl(tc, "apply", "-f", "-", stdin=json.dumps(dep))
    kubectl(tc, "patch", "deploy", "web", "-p",
            '{"spec":{"template":{"spec":{"containers":[{"name":"b","image":"b:2"}]}}}}')
    got = json.loads(kubectl(tc, "get", "deploy", "web", "-o", "json").stdout)
    assert [(c["name"], c["image"]) for c in got["spec"]["template"]["spec"]["containers"]] == [
        ("a", "a:1"), ("b", "b:2")]
    # strategy is retainKeys: switching to Recreate drops rollingUpdate (kubectl apply sends $retainKeys)
    dep["spec"]["strategy"] = {"type": "Recreate"}
    kubectl(tc, "apply", "-f", "-", stdin=json.dumps(dep))
    got = json.loads(kubectl(tc, "get", "deploy", "web", "-o", "json").stdout)
    assert got["spec"]["strategy"] == {"type": "Recreate"}


def test_typed_clients_send_protobuf_bodies_and_the_server_reads_them(tc):
    """``kubectl create`` uses client-go's typed clientset: its bodies are protobuf, not JSON."""
    kubectl(tc, "create", "deployment", "pb", "--image=nginx:1.27", "--replicas=2")
    got = json.loads(kubectl(tc, "get", "deploy", "pb", "-o", "json").stdout)
    assert got["spec"]["replicas"] == 2 and got["spec"]["template"]["spec"]["containers"][0]["image"] == "nginx:1.27"
    assert got["spec"]["strategy"] == {"type": "RollingUpdate",
                                       "rollingUpdate": {"maxUnavailable": "25%", "maxSurge": "25%"}}
    kubectl(tc, "create", "secret", "generic", "pb", "--from-literal=k=v")
    secret = json.loads(kubectl(tc, "get", "secret", "pb", "-o", "json").stdout)
    assert secret["data"] == {"k": "dg=="} and secret["type"] == "Opaque"
    kubectl(tc, "delete", "deploy", "pb")
    assert any(c == "application/vnd.kubernetes.protobuf" for c in tc.api.content_types)


def dep_of(name: str) -> dict:
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name, "namespace": "default"},
            "spec": {"selector": {"matchLabels": {"app": name}},
                     "template": {"metadata": {"labels": {"app": name}},
                                  "spec": {"containers": [{"name": "c", "image": "c:1"}]}}}}


def test_delete_collects_the_owned_children(tc):
    kubectl(tc, "apply", "-f", "-", stdin=json.dumps(dep_of("gc")))
    owner = json.loads(kubectl(tc, "get", "deploy", "gc", "-o", "json").stdout)
    cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {
        "name": "gc-child", "namespace": "default",
        "ownerReferences": [{"apiVersion": "apps/v1", "kind": "Deployment", "name": "gc",
                             "uid": owner["metadata"]["uid"]}]}, "data": {"k": "v"}}
    kubectl(tc, "apply", "-f", "-", stdin=json.dumps(cm))
    kubectl(tc, "delete", "deploy", "gc")
    wait_for(lambda: kubectl(tc, "get", "cm", "gc-child", ok=False).returncode != 0, what="garbage collection")
    # --cascade=orphan keeps the child (its ownerReference removed); foreground deletes it before the owner
    for cascade, child_survives in (("orphan", True), ("foreground", False)):
        kubectl(tc, "apply", "-f", "-", stdin=json.dumps(dep_of("gc2")))
        owner = json.loads(kubectl(tc, "get", "deploy", "gc2", "-o", "json").stdout)
        cm["metadata"]["ownerReferences"][0].update(name="gc2", uid=owner["metadata"]["uid"])
        kubectl(tc, "apply", "-f", "-", stdin=json.dumps(cm))
        kubectl(tc, "delete", "deploy", "gc2", f"--cascade={cascade}", "--wait=true")
        child = kubectl(tc, "get", "cm", "gc-child", "-o", "json", ok=False)
        assert (child.returncode == 0) is child_survives, cascade
        if child_survives:
            assert "ownerReferences" not in json.loads(child.stdout)["metadata"]
            kubectl(tc, "delete", "cm", "gc-child")


def test_helm_install_upgrade_test_uninstall(tc):
    chart = str(ROOT / "charts" / "pdstack")
    # hooks.upgradeCRD=false: the chart's CRD-upgrade hook is a batch/v1 Job, and the test cluster serves no Jobs
    # (no Job controller); helm stores the CRD from crds/ itself on install
    helm(tc, "install", "pdstack", chart, "-n", "pdstack", "--create-namespace", "--set", "test.enabled=true",
         "--set", "test.router=demo-router",
         "--set", "hooks.upgradeCRD=false")
    status = json.loads(helm(tc, "status", "pdstack", "-n", "pdstack", "-o", "json").stdout)
    assert status["info"]["status"] == "deployed" and status["version"] == 1
    assert kubectl(tc, "get", "deploy", "pdstack", "-n", "pdstack").returncode == 0
    assert json.loads(kubectl(tc, "get", "role", "pdstack", "-n", "pdstack", "-o", "json").stdout)["rules"]
    helm(tc, "upgrade", "pdstack", chart, "-n", "pdstack", "--set", "test.enabled=true",
         "--set", "test.router=demo-router",
         "--set", "hooks.upgradeCRD=false", "--set", "operator.logLevel=debug")
    status = json.loads(helm(tc, "status", "pdstack", "-n", "pdstack", "-o", "json").stdout)
    assert status["version"] == 2
    dep = json.loads(kubectl(tc, "get", "deploy", "pdstack", "-n", "pdstack", "-o", "json").stdout)
    assert "--verbose" in dep["spec"]["template"]["spec"]["containers"][0]["args"]  # logLevel debug

    # helm test: the hook pod is created, then helm waits for it to finish. The simulated kubelet runs no
    # process, so this test plays the container's exit (0, then 1) and reads helm's verdict.
    from pdop_k8s_emulator import PODS

    def finish(phase: str):
        def go():
            pods = [p for p in tc.api.select(PODS, "pdstack") if "helm.sh/hook" in
                    (p["metadata"].get("annotations") or {})]
            for p in pods:
                if (p.get("status") or {}).get("phase") not in ("Succeeded", "Failed"):
                    p["status"] = {**(p.get("status") or {}), "phase": phase}
                    tc.api._store(PODS, "pdstack", p["metadata"]["name"], p, subresource="status")
            return pods
        return go

    import threading
    for phase, rc in (("Succeeded", 0), ("Failed", 1)):
        done = threading.Event()

        def player():
            while not done.is_set():
                if call_in_loop(tc, finish(phase)):
                    pass
                time.sleep(0.2)
        t = threading.Thread(target=player, daemon=True)
        t.start()
        p = helm(tc, "test", "pdstack", "-n", "pdstack", "--timeout", "30s", ok=False)
        done.set()
        t.join(5)
        assert p.returncode == rc, p.stdout + p.stderr
        assert f"Phase:          {phase}" in p.stdout or f"Phase:\t{phase}" in p.stdout or phase in p.stdout

    helm(tc, "uninstall", "pdstack", "-n", "pdstack", "--wait", "--timeout", "60s")
    assert kubectl(tc, "get", "deploy", "pdstack", "-n", "pdstack", ok=False).returncode != 0
    assert helm(tc, "status", "pdstack", "-n", "pdstack", ok=False).returncode != 0


def test_the_kubernetes_python_client_lists_watches_and_patches(tc):
    kubernetes = pytest.importorskip("kubernetes", reason="the official client is in the dev extra (pip install "
                                                          "-e .[dev]); this venv predates it")
    cfg = kubernetes.client.Configuration()
    kubernetes.config.load_kube_config(config_file=str(tc.kubeconfig), client_configuration=cfg)
    api = kubernetes.client.ApiClient(cfg)
    core = kubernetes.client.CoreV1Api(api)
    custom = kubernetes.client.CustomObjectsApi(api)
    assert sorted(n.metadata.name for n in core.list_node().items) == ["cpu-a", "gpu-a", "gpu-b"]
    listed = custom.list_namespaced_custom_object("pdstack.io", "v1alpha1", "default", "pddeployments")
    assert [o["metadata"]["name"] for o in listed["items"]] == ["demo"]
    rv = listed["metadata"]["resourceVersion"]
    custom.patch_namespaced_custom_object("pdstack.io", "v1alpha1", "default", "pddeployments", "demo",
                                          {"spec": {"pairs": 4}})
    w = kubernetes.watch.Watch()
    seen = []
    for ev in w.stream(custom.list_namespaced_custom_object, "pdstack.io", "v1alpha1", "default", "pddeployments",
                       resource_version=rv, timeout_seconds=2):
        seen.append((ev["type"], ev["object"]["spec"]["pairs"]))
        if ev["object"]["spec"]["pairs"] == 4:
            w.stop()
    assert ("MODIFIED", 4) in seen
    with pytest.raises(kubernetes.client.ApiException) as e:
        custom.patch_namespaced_custom_object("pdstack.io", "v1alpha1", "default", "pddeployments", "demo",
                                              {"spec": {"pairs": -1}})
    assert e.value.status == 422 and "spec.pairs" in e.value.body


async def test_the_kubernetes_asyncio_client_lists_watches_and_patches(tc):
    """The same with kubernetes_asyncio (the operator's client, generated from the same OpenAPI)."""
    from kubernetes_asyncio import client, config, watch
    cfg = client.Configuration()
    await config.load_kube_config(config_file=str(tc.kubeconfig), client_configuration=cfg)
    async with client.ApiClient(cfg) as api:
        core = client.CoreV1Api(api)
        custom = client.CustomObjectsApi(api)
        assert sorted(n.metadata.name for n in (await core.list_node()).items) == ["cpu-a", "gpu-a", "gpu-b"]
        listed = await custom.list_namespaced_custom_object("pdstack.io", "v1alpha1", "default", "pddeployments")
        assert [o["metadata"]["name"] for o in listed["items"]] == ["demo"]
        rv = listed["metadata"]["resourceVersion"]
        await custom.patch_namespaced_custom_object("pdstack.io", "v1alpha1", "default", "pddeployments", "demo",
                                                    {"spec": {"pairs": 2}},
                                                    _content_type="application/merge-patch+json")
        seen = []
        w = watch.Watch()
        async with w.stream(custom.list_namespaced_custom_object, "pdstack.io", "v1alpha1", "default",
                            "pddeployments", resource_version=rv, timeout_seconds=2) as stream:
            async for ev in stream:
                seen.append((ev["type"], ev["object"]["spec"]["pairs"]))
                if ev["object"]["spec"]["pairs"] == 2:
                    w.stop()
        assert ("MODIFIED", 2) in seen
        with pytest.raises(client.ApiException) as e:
            await custom.patch_namespaced_custom_object("pdstack.io", "v1alpha1", "default", "pddeployments",
                                                        "demo", {"spec": {"pairs": -1}},
                                                        _content_type="application/merge-patch+json")
        assert e.value.status == 422 and "spec.pairs" in e.value.body
