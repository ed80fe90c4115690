"""What a real cluster would show of the chart (issue 19, defects 1, 2, 4, 6, 7, 10), checked on what helm renders.

* the runtime image flows from ``runtime.image`` through the example PDDeployment to every container the operator
  renders, the router included;
* the operator's per-PDDeployment NetworkPolicy, with the peers the chart passes it, admits the operator's reads
  and Prometheus' scrapes (cluster-wide mode too), judged by the NetworkPolicy evaluator;
* a pre-delete hook removes the example while the operator still runs; the CRD is upgraded by a pre-upgrade hook;
* ``global`` values (umbrella charts) are accepted;
* the Prometheus Operator objects need its API; ``helm test`` needs a router to test; the test pod is not the
  operator's.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from unittest import mock

import kubernetes_validate
import pytest
import yaml

from shipping import CHART, ROOT, by_kind, hook_events, one, render, run, tool

sys.path.insert(0, str(ROOT / "tests" / "operator"))
from netpol import Cluster, Endpoint, connection_allowed, pod_endpoint  # noqa: E402

MONITORING_KINDS = {"PodMonitor", "ServiceMonitor", "PrometheusRule"}


def _operator_env(objs: list[dict]) -> dict[str, str]:
    c = one(objs, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    return {e["name"]: e["value"] for e in c["env"] if "value" in e}


def _children(objs: list[dict], namespace: str, env: dict[str, str]):
    """What the operator renders for the chart's example, with the peers the chart's env gives it."""
    from pdoperator.core.config import OperatorConfig
    from pdoperator.core.render import Owner, render as render_children
    from pdoperator.core.spec import parse_spec

    pdd = one(objs, "PDDeployment")
    cfg = OperatorConfig.from_environ(env)
    return render_children(parse_spec(pdd["spec"], name=pdd["metadata"]["name"]),
                           Owner(pdd["metadata"]["name"], namespace, "uid"), "rev", kv_token="t",
                           peers=cfg.network_peers)


def test_the_runtime_image_reaches_every_container_the_operator_renders():
    """Defect 1: on kind only the loaded images run (kind-values: pdstack-runtime:dev, pullPolicy Never); the
    router must not pull a public tag the chart never named."""
    objs = render(ROOT / "charts/pdstack/ci/kind-values.yaml")
    children = _children(objs, "pdstack-system", _operator_env(objs))
    containers = [c for o in children if o["kind"] in ("Pod", "Deployment")
                  for c in o["spec"].get("template", o)["spec"]["containers"]]
    assert {c["image"] for c in containers} == {"pdstack-runtime:dev"}
    assert {c.get("imagePullPolicy") for c in containers} == {"Never"}  # runtime.image.pullPolicy flows too


def _operator_pod(objs: list[dict], namespace: str) -> Endpoint:
    dep = one(objs, "Deployment")
    return Endpoint("10.244.0.5", namespace, dep["spec"]["template"]["metadata"]["labels"], name="pd-pdstack-x")


@pytest.mark.parametrize("values, ns", [(None, "pdstack-system"),
                                        (ROOT / "charts/pdstack/ci/clusterwide-values.yaml", "any-team")])
def test_operator_reads_and_prometheus_scrapes_are_admitted_by_the_rendered_policies(values, ns):
    """Defect 2: the operator reads each worker's /config and /metrics by pod IP; Prometheus scrapes /metrics.
    Under the chart's peers (PDSTACK_OPERATOR_NETWORK_PEERS) the operator's policy admits both, in cluster-wide
    mode too (where the chart renders no scrape policy of its own); nobody else gets in."""
    objs = render(values, "example.enabled=true")
    env = _operator_env(objs)
    assert "PDSTACK_OPERATOR_NETWORK_PEERS" in env
    children = _children(objs, ns, env)
    workers = [pod_endpoint({**o, "status": {"podIP": f"10.244.1.{10 + i}"}})
               for i, o in enumerate(o for o in children if o["kind"] == "Pod")]
    policies = [o for o in children if o["kind"] == "NetworkPolicy"]
    policies += [p for p in by_kind(objs, "NetworkPolicy") if p["metadata"]["namespace"] == ns]  # chart's own
    cluster = Cluster(policies, {})
    operator = _operator_pod(objs, "pdstack-system")
    prometheus = Endpoint("10.244.0.9", "monitoring", {"app.kubernetes.io/name": "prometheus"}, name="prom")
    stranger = Endpoint("10.244.0.7", "pdstack-system", {"app": "other"}, name="other")
    for w in workers:
        assert connection_allowed(cluster, operator, w, 8000), w.name
        assert connection_allowed(cluster, prometheus, w, 8000), w.name
        assert not connection_allowed(cluster, stranger, w, 8000), w.name
        assert not connection_allowed(cluster, prometheus, w, 8998), "KV bootstrap: the deployment's pods only"


def test_network_peers_follow_the_values():
    objs = render(None, "example.enabled=true", "networkPolicy.prometheusPodSelector.matchLabels.app=prometheus",
                  "networkPolicy.operatorNamespaceSelector.matchLabels.team=platform",
                  "networkPolicy.extraWorkerPeers[0].ipBlock.cidr=192.168.0.0/16")
    children = _children(objs, "pdstack-system", _operator_env(objs))
    (w, *_) = [pod_endpoint({**o, "status": {"podIP": "10.244.1.10"}}) for o in children if o["kind"] == "Pod"]
    cluster = Cluster([o for o in children if o["kind"] == "NetworkPolicy"], {"platform-ns": {"team": "platform"}})
    op_labels = one(objs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert connection_allowed(cluster, Endpoint("10.0.0.1", "platform-ns", op_labels, name="op"), w, 8000)
    assert not connection_allowed(cluster, Endpoint("10.0.0.1", "pdstack-system", op_labels, name="op"), w, 8000)
    assert connection_allowed(cluster, Endpoint("10.0.0.2", "monitoring", {"app": "prometheus"}, name="p"), w, 8000)
    assert not connection_allowed(cluster, Endpoint("10.0.0.3", "monitoring", {"app": "grafana"}, name="g"), w, 8000)
    assert connection_allowed(cluster, Endpoint("192.168.4.4"), w, 8000)
    # the chart's own operator policy uses the same Prometheus peer
    (op_policy,) = [p for p in by_kind(objs, "NetworkPolicy") if p["metadata"]["name"] == "pd-pdstack"]
    op = _operator_pod(objs, "pdstack-system")
    cluster = Cluster([op_policy])
    assert connection_allowed(cluster, Endpoint("10.0.0.2", "monitoring", {"app": "prometheus"}, name="p"), op, 8080)
    assert not connection_allowed(cluster, Endpoint("10.0.0.3", "monitoring", {"app": "grafana"}, name="g"), op, 8080)


# ---------------------------------------------------------------- hooks: uninstall and CRD upgrade
def _hooks(objs: list[dict], event: str) -> list[dict]:
    return [o for o in objs if event in hook_events(o)]


def _hook_weight(o: dict) -> int:
    return int(o["metadata"]["annotations"].get("helm.sh/hook-weight", "0"))


def _hook_job_args(job: dict) -> list[str]:
    (c,) = job["spec"]["template"]["spec"]["containers"]
    assert c["command"] == ["python", "-m", "pdoperator.hooks"]
    return c["args"]


def test_uninstall_deletes_the_example_first_while_the_operator_still_runs():
    """Defect 4: helm uninstall deletes the operator, its RBAC and the example in one pass; the example still
    carries the operator's finalizer and stays Terminating. A pre-delete hook deletes the release's
    PDDeployments first and waits until they are gone (helm runs pre-delete hooks to completion before it deletes
    anything); its RBAC comes first (weights) and allows exactly what the hook does."""
    objs = render(ROOT / "charts/pdstack/ci/kind-values.yaml", lifecycle_hooks=True)
    pre = _hooks(objs, "pre-delete")
    (job,) = by_kind(pre, "Job")
    assert all(_hook_weight(o) < _hook_weight(job) for o in pre if o is not job)
    assert {o["kind"] for o in pre} == {"ServiceAccount", "Role", "RoleBinding", "Job"}
    for o in pre:
        assert set(o["metadata"]["annotations"]["helm.sh/hook-delete-policy"].split(",")) == {
            "before-hook-creation", "hook-succeeded"}
    args = _hook_job_args(job)
    from pdoperator.hooks import build_parser
    ns = build_parser().parse_args(args)  # one component's output parsed by the other's own parser
    pdd = one(objs, "PDDeployment")
    assert ns.command == "delete-pddeployments" and ns.namespace == [pdd["metadata"]["namespace"]]
    labels = pdd["metadata"]["labels"]
    sel = dict(kv.split("=") for kv in ns.selector.split(","))
    assert all(labels.get(k) == v for k, v in sel.items()), "the selector picks the example"
    (role,) = by_kind(pre, "Role")
    assert role["metadata"]["namespace"] == pdd["metadata"]["namespace"]
    assert role["rules"] == [{"apiGroups": ["pdstack.io"], "resources": ["pddeployments"], "verbs": ["list", "delete"]}]
    (sa,) = by_kind(pre, "ServiceAccount")
    assert job["spec"]["template"]["spec"]["serviceAccountName"] == sa["metadata"]["name"]
    assert "operator" in job["spec"]["template"]["spec"]["containers"][0]["image"]
    # nothing to delete without the example: no pre-delete hook
    assert not _hooks(render(None, lifecycle_hooks=True), "pre-delete")


def test_the_crd_is_upgraded_by_a_pre_upgrade_hook():
    """Defect 7: Helm never upgrades crds/. A pre-install/pre-upgrade hook server-side-applies the chart's own CRD
    file, with a ClusterRole limited to that one CRD; hooks.upgradeCRD=false leaves it to you."""
    objs = render(None, lifecycle_hooks=True)
    up = _hooks(objs, "pre-upgrade")
    assert {o["kind"] for o in up} == {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "ConfigMap", "Job"}
    assert all("pre-install" in hook_events(o) for o in up)  # a reinstall over a CRD left behind: Helm skips crds/
    (job,) = by_kind(up, "Job")
    assert all(_hook_weight(o) < _hook_weight(job) for o in up if o is not job)
    from pdoperator.hooks import build_parser
    ns = build_parser().parse_args(_hook_job_args(job))
    assert ns.command == "apply-crd"
    (cm,) = by_kind(up, "ConfigMap")
    mount = {m["name"]: m["mountPath"] for m in job["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]}
    assert ns.file == f"{mount['crds']}/pddeployment.yaml"
    assert cm["data"]["pddeployment.yaml"] == (CHART / "crds" / "pddeployment.yaml").read_text()
    (cr,) = by_kind(up, "ClusterRole")
    assert cr["rules"] == [{"apiGroups": ["apiextensions.k8s.io"], "resources": ["customresourcedefinitions"],
                            "resourceNames": ["pddeployments.pdstack.io"], "verbs": ["patch"]}]
    assert not _hooks(render(None, "hooks.upgradeCRD=false", lifecycle_hooks=True), "pre-upgrade")


@pytest.mark.parametrize("values", [None, ROOT / "charts/pdstack/ci/kind-values.yaml"])
def test_hook_objects_are_valid_kubernetes_and_labelled(values):
    for o in render(values, lifecycle_hooks=True):
        if not hook_events(o) - {"test"}:
            continue
        for version in ("1.29", "1.33"):
            kubernetes_validate.validate(o, version, strict=True)
        labels = o["metadata"]["labels"]
        assert labels["app.kubernetes.io/instance"] == "pd" and labels["app.kubernetes.io/name"] == "pdstack-hooks"


# ---------------------------------------------------------------- umbrella charts
def test_global_values_are_accepted(tmp_path: Path):
    """Defect 6: a parent chart passes `global` to every subchart; the schema must allow it."""
    out = run([tool("helm"), "template", "pd", str(CHART), "--set", "global.imageRegistry=registry.local"])
    assert out.returncode == 0, out.stderr
    out = run([tool("helm"), "lint", "--strict", str(CHART), "--set", "global.foo=bar"])
    assert out.returncode == 0, out.stdout + out.stderr
    parent = tmp_path / "platform"
    (parent / "charts").mkdir(parents=True)
    shutil.copytree(CHART, parent / "charts" / "pdstack")
    (parent / "Chart.yaml").write_text(yaml.safe_dump({
        "apiVersion": "v2", "name": "platform", "version": "1.0.0",
        "dependencies": [{"name": "pdstack", "version": "0.1.0", "repository": "file://charts/pdstack"}]}))
    (parent / "values.yaml").write_text(yaml.safe_dump({"global": {"imageRegistry": "registry.local"},
                                                        "pdstack": {"example": {"enabled": True}}}))
    out = run([tool("helm"), "template", "p", str(parent), "--namespace", "platform"])
    assert out.returncode == 0, out.stderr
    assert any(o and o["kind"] == "PDDeployment" for o in yaml.safe_load_all(out.stdout))
    out = run([tool("helm"), "lint", str(parent)])
    assert out.returncode == 0, out.stdout + out.stderr


# ---------------------------------------------------------------- Prometheus Operator objects, helm test
def test_prometheus_operator_objects_need_their_api():
    """Defect 10: without monitoring.coreos.com/v1 a PodMonitor is an unknown kind and `helm install` fails."""
    on = ("monitoring.podMonitor.enabled=true", "monitoring.serviceMonitor.enabled=true",
          "monitoring.prometheusRule.enabled=true")
    assert not {o["kind"] for o in render(None, *on, api_versions=())} & MONITORING_KINDS
    assert {o["kind"] for o in render(None, *on)} >= MONITORING_KINDS  # the cluster serves the API
    assert {o["kind"] for o in render(None, *on, "monitoring.crds=always", api_versions=())} >= MONITORING_KINDS
    sets = [arg for s in on for arg in ("--set", s)]
    out = run([tool("helm"), "install", "pd", str(CHART), "--dry-run", "--namespace", "x", *sets])
    assert out.returncode == 0, out.stderr
    assert "NOT rendered: this cluster does not serve monitoring.coreos.com/v1" in out.stdout


def test_helm_test_needs_a_router_and_its_pod_is_not_the_operators():
    """Defect 10: `helm test` was on by default without the example, against a router that does not exist; its
    pod carried the operator's selector labels (picked by the operator's Service and NetworkPolicy)."""
    assert not by_kind(render(), "Pod")
    assert by_kind(render(None, "test.router=my-router"), "Pod")  # your own router: still testable
    objs = render(ROOT / "charts/pdstack/ci/kind-values.yaml")
    pod = one(objs, "Pod")
    selector = one(objs, "Deployment")["spec"]["selector"]["matchLabels"]
    labels = pod["metadata"]["labels"]
    assert any(labels.get(k) != v for k, v in selector.items()), labels
    for svc in by_kind(objs, "Service"):
        assert any(labels.get(k) != v for k, v in svc["spec"]["selector"].items()), svc["metadata"]["name"]
    for pol in by_kind(objs, "NetworkPolicy"):
        sel = pol["spec"]["podSelector"].get("matchLabels", {})
        assert any(labels.get(k) != v for k, v in sel.items()), pol["metadata"]["name"]
    assert labels["app.kubernetes.io/instance"] == "pd" and labels["app.kubernetes.io/component"] == "helm-test"


def test_entry_point_parses_every_rendered_operator_command():
    """The operator's args in every supported values file still parse (the standalone default changed)."""
    import pdoperator.__main__ as entry

    for values in (None, ROOT / "charts/pdstack/ci/ha-values.yaml"):
        c = one(render(values), "Deployment")["spec"]["template"]["spec"]["containers"][0]
        with mock.patch("kopf.run") as kopf_run, mock.patch("logging.basicConfig"), \
                mock.patch.dict("os.environ", {"POD_NAME": "pd-pdstack-1"}):
            entry.main(c["args"])
        replicas = one(render(values), "Deployment")["spec"]["replicas"]
        assert kopf_run.call_args.kwargs["standalone"] is (replicas == 1)
