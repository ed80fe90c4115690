"""The Helm chart: lint, render with every supported values file, and check what it renders.

Runs the real helm (``make tools``); rendered objects are validated with kubernetes-validate against
the Kubernetes 1.29 and 1.33 schemas, the example PDDeployment against the CRD and the operator's spec.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from shipping import CHART, ROOT, VALUES_FILES, by_kind, is_hook, one, render, run, tool, values_id

K8S_VERSIONS = ("1.29", "1.33")
# kinds kubernetes-validate has no schema for: checked below by other means
CUSTOM_KINDS = {"PDDeployment", "PodMonitor", "ServiceMonitor", "PrometheusRule", "CustomResourceDefinition",
                "KopfPeering", "ClusterKopfPeering"}  # kopf.dev peering objects: schema-less status (crds/kopf-peering.yaml)
ALL_ON = ["monitoring.serviceMonitor.enabled=true", "monitoring.podMonitor.enabled=true",
          "monitoring.prometheusRule.enabled=true", "monitoring.grafanaDashboard.enabled=true",
          "example.enabled=true"]


@pytest.mark.parametrize("values", VALUES_FILES, ids=values_id)
def test_helm_lint_strict(values: Path | None) -> None:
    cmd = [tool("helm"), "lint", str(CHART), "--strict"] + (["-f", str(values)] if values else [])
    out = run(cmd)
    assert out.returncode == 0, f"helm lint {values_id(values)} failed:\n{out.stdout}\n{out.stderr}"
    assert "0 chart(s) failed" in out.stdout


def test_three_values_files_at_least() -> None:
    assert len(VALUES_FILES) >= 3, VALUES_FILES


@pytest.mark.parametrize("values", VALUES_FILES, ids=values_id)
def test_rendered_objects_validate_against_kubernetes_schemas(values: Path | None) -> None:
    objs = render(values)
    checked = 0
    for obj in objs:
        if obj["kind"] in CUSTOM_KINDS:
            continue
        for version in K8S_VERSIONS:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                pytest.fail(f"{obj['kind']}/{obj['metadata']['name']} is invalid for Kubernetes {version}: {e.message} "
                            f"at {list(e.path)}")
        checked += 1
    assert checked >= 6, f"only {checked} built-in objects rendered"


@pytest.mark.parametrize("values", VALUES_FILES, ids=values_id)
def test_every_object_has_release_labels(values: Path | None) -> None:
    for obj in render(values):
        if obj["kind"] == "CustomResourceDefinition":
            continue
        labels = obj["metadata"].get("labels") or {}
        where = f"{obj['kind']}/{obj['metadata']['name']}"
        assert labels.get("app.kubernetes.io/instance") == "pd", where
        assert labels.get("app.kubernetes.io/managed-by") == "Helm", where
        assert labels.get("app.kubernetes.io/part-of") == "pdstack", where
        assert labels.get("helm.sh/chart") == "pdstack-0.1.0", where


def test_crd_in_chart_is_the_repository_crd() -> None:
    chart_crd = (CHART / "crds" / "pddeployment.yaml").read_text()
    repo_crd = (ROOT / "crds" / "pddeployment.yaml").read_text()
    assert chart_crd == repo_crd, "charts/pdstack/crds/pddeployment.yaml differs: cp crds/pddeployment.yaml charts/pdstack/crds/"


def test_default_install_kinds() -> None:
    objs = render(lifecycle_hooks=True)
    kinds = sorted(o["kind"] for o in objs if not is_hook(o))
    # CRDs: PDDeployment, and kopf's KopfPeering + ClusterKopfPeering (used when operator.replicas > 1)
    assert kinds == sorted(["CustomResourceDefinition"] * 3 + ["ServiceAccount", "Role", "RoleBinding", "ClusterRole",
                            "ClusterRoleBinding", "Deployment", "Service", "NetworkPolicy", "NetworkPolicy"])
    # hooks: the CRD upgrade (pre-install, pre-upgrade); no `helm test` pod without the example (nothing to test)
    assert sorted(o["kind"] for o in objs if is_hook(o)) == ["ClusterRole", "ClusterRoleBinding", "ConfigMap", "Job",
                                                             "ServiceAccount"]


def test_operator_deployment_hardened_and_probed() -> None:
    dep = one(render(), "Deployment")
    pod = dep["spec"]["template"]["spec"]
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"]["type"] == "Recreate"
    psc = pod["securityContext"]
    assert psc["runAsNonRoot"] is True and psc["runAsUser"] == 10001 and psc["seccompProfile"]["type"] == "RuntimeDefault"
    (c,) = pod["containers"]
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert {"name": "tmp", "mountPath": "/tmp"} in c["volumeMounts"]  # writable HOME/caches on a RO root
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"metrics": 8080, "health": 8081}
    assert "--liveness=http://0.0.0.0:8081/healthz" in c["args"] and "--standalone" in c["args"]
    assert "--namespace=pdstack-system" in c["args"]
    assert c["resources"]["requests"] and c["resources"]["limits"]["memory"]
    assert {"name": "PDSTACK_OPERATOR_METRICS_PORT", "value": "8080"} in c["env"]
    assert pod["serviceAccountName"] == one(render(), "ServiceAccount")["metadata"]["name"]
    assert c["image"] == "ghcr.io/pdstack/operator:0.1.0"


def test_operator_args_parse_with_the_operators_parser() -> None:
    """The chart's args are accepted by pdoperator's own argparse (one component parsed by the other)."""
    from unittest import mock

    import pdoperator.__main__ as entry

    for values in VALUES_FILES:
        c = one(render(values), "Deployment")["spec"]["template"]["spec"]["containers"][0]
        assert "command" not in c  # the image's ENTRYPOINT (python -m pdoperator) takes these args
        env = {"POD_NAME": "pd-pdstack-operator-5d9f7c-abcde"}  # the downward API's metadata.name
        assert {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}} in c["env"]
        with mock.patch("kopf.run") as kopf_run, mock.patch("logging.basicConfig"), mock.patch.dict("os.environ", env):
            entry.main(c["args"])  # argparse exits (SystemExit) on an argument it does not know
        kw = kopf_run.call_args.kwargs
        assert kw["liveness_endpoint"] == "http://0.0.0.0:8081/healthz"
        replicas = one(render(values), "Deployment")["spec"]["replicas"]
        if replicas == 1:
            assert kw["standalone"] is True and "priority" not in kw
        else:  # HA: kopf peering, each pod its own priority
            assert kw["standalone"] is False and kw["peering_name"] == "pdstack-operator" and kw["priority"] > 0
        if values is not None and "clusterwide" in values.name:
            assert kw["clusterwide"] is True and kw["namespaces"] == []
        else:
            assert kw["clusterwide"] is False and kw["namespaces"], kw


def test_watch_namespaces_and_digest_and_cluster_wide() -> None:
    objs = render(None, "operator.watchNamespaces={a,b}")
    roles = by_kind(objs, "Role")
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["a", "b"]
    assert sorted(b["metadata"]["namespace"] for b in by_kind(objs, "RoleBinding")) == ["a", "b"]
    args = one(objs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=a" in args and "--namespace=b" in args
    cw = render(ROOT / "charts/pdstack/ci/clusterwide-values.yaml")
    assert not by_kind(cw, "Role") and not by_kind(cw, "RoleBinding")
    assert not any(a.startswith("--namespace") for a in one(cw, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"])
    image = one(cw, "Deployment")["spec"]["template"]["spec"]["containers"][0]["image"]
    assert image.startswith("registry.example.com/pdstack/operator@sha256:")


@pytest.mark.parametrize("bad, complaint", [
    ("operator.uid=0", "minimum"),
    ("operator.clusterWide=yes", "boolean"),
    ("monitoring.prometheusRule.kvTransferStuck.for=5minutes", "pattern"),
    ("operator.bogus=1", "additional properties"),
    ("example.name=Not_A_Name", "pattern"),
])
def test_schema_rejects_bad_values(bad: str, complaint: str) -> None:
    out = run([tool("helm"), "template", "pd", str(CHART), "--set", bad])
    assert out.returncode != 0, f"--set {bad} was accepted"
    assert complaint in out.stderr.lower(), out.stderr


def test_monitors_rules_dashboard_toggle() -> None:
    assert not {o["kind"] for o in render()} & {"PodMonitor", "ServiceMonitor", "PrometheusRule", "ConfigMap"}
    objs = render(None, *ALL_ON)
    sm, pm, pr = one(objs, "ServiceMonitor"), one(objs, "PodMonitor"), one(objs, "PrometheusRule")
    for o in (sm, pm, pr):
        assert o["apiVersion"] == "monitoring.coreos.com/v1"
    assert sm["spec"]["endpoints"][0]["port"] == "metrics"
    assert sm["spec"]["selector"]["matchLabels"] == one(objs, "Deployment")["spec"]["selector"]["matchLabels"]
    assert one(objs, "Service")["spec"]["ports"][0]["targetPort"] == "metrics"
    ep = pm["spec"]["podMetricsEndpoints"][0]
    assert ep["port"] == "http" and ep["path"] == "/metrics"
    assert pm["spec"]["namespaceSelector"] == {"matchNames": ["pdstack-system"]}
    # the PodMonitor selects the pods the operator renders (workers and router)
    sel = pm["spec"]["selector"]
    assert sel["matchLabels"] == {"app.kubernetes.io/name": "pdstack"}
    assert sel["matchExpressions"] == [{"key": "pdstack.io/component", "operator": "In", "values": ["worker", "router"]}]
    cw = render(ROOT / "charts/pdstack/ci/clusterwide-values.yaml", "monitoring.podMonitor.enabled=true")
    assert one(cw, "PodMonitor")["spec"]["namespaceSelector"] == {"any": True}
    cm = one(objs, "ConfigMap")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    dash = json.loads(cm["data"]["pdstack.json"])
    titles = " | ".join(p["title"] for p in dash["panels"])
    for needle in ("stage", "Watchdog", "KV transfer speed", "Queue depth", "co-restarts", "drift"):
        assert needle.lower() in titles.lower(), f"dashboard lacks a {needle!r} panel: {titles}"


def _matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for e in selector.get("matchExpressions") or []:
        assert e["operator"] == "In", e
        if labels.get(e["key"]) not in e["values"]:
            return False
    return True


def test_podmonitor_and_scrape_policy_select_the_pods_the_operator_renders() -> None:
    """Selectors are checked against pdoperator.core.render's real output for the example, not a copy of its labels."""
    from pdoperator.core.render import Owner, render as render_children
    from pdoperator.core.spec import parse_spec

    objs = render(ROOT / "charts/pdstack/ci/monitoring-values.yaml")
    pdd = one(objs, "PDDeployment")
    children = render_children(parse_spec(pdd["spec"], name="demo"), Owner("demo", "default", "uid"), "rev", kv_token="t")
    workers = [c["metadata"]["labels"] for c in children if c["kind"] == "Pod"]
    router = [c["spec"]["template"]["metadata"]["labels"] for c in children if c["kind"] == "Deployment"]
    assert len(workers) == 2 and len(router) == 1
    pm = one(objs, "PodMonitor")["spec"]["selector"]
    assert all(_matches(pm, labels) for labels in workers + router)
    scrape = [p for p in by_kind(objs, "NetworkPolicy") if p["metadata"]["name"].endswith("scrape-workers")][0]
    assert all(_matches(scrape["spec"]["podSelector"], labels) for labels in workers)
    assert not any(_matches(scrape["spec"]["podSelector"], labels) for labels in router)  # router stays open to clients
    worker_port = {p["containerPort"] for c in children if c["kind"] == "Pod" for p in c["spec"]["containers"][0]["ports"]
                   if p["name"] == "http"}
    assert worker_port == {scrape["spec"]["ingress"][0]["ports"][0]["port"]}


def test_network_policies() -> None:
    objs = render(None, "operator.watchNamespaces={a,b}")
    pols = {(p["metadata"]["namespace"], p["metadata"]["name"]): p for p in by_kind(objs, "NetworkPolicy")}
    op = pols[("pdstack-system", "pd-pdstack")]
    assert op["spec"]["podSelector"]["matchLabels"] == one(objs, "Deployment")["spec"]["selector"]["matchLabels"]
    ports = sorted(p["port"] for rule in op["spec"]["ingress"] for p in rule["ports"])
    assert ports == [8080, 8081]
    for ns in ("a", "b"):
        w = pols[(ns, "pd-pdstack-scrape-workers")]
        assert w["spec"]["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "pdstack", "pdstack.io/component": "worker"}
        assert [p["port"] for p in w["spec"]["ingress"][0]["ports"]] == [8000]
    assert not by_kind(render(None, "networkPolicy.enabled=false"), "NetworkPolicy")


def _crd_schema() -> dict[str, Any]:
    crd = yaml.safe_load((ROOT / "crds" / "pddeployment.yaml").read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1alpha1"]
    return version["schema"]["openAPIV3Schema"]


def test_example_pddeployment_is_valid() -> None:
    """The example validates against the CRD's schema and the operator's own spec parser."""
    from pdoperator.core import spec as pdspec

    objs = render(ROOT / "charts/pdstack/ci/monitoring-values.yaml")
    pdd = one(objs, "PDDeployment")
    jsonschema.validate(pdd, _crd_schema())
    assert pdd["spec"]["image"] == "registry.example.com/pdstack/runtime:0.1.0"
    assert pdd["metadata"]["namespace"] == "default"
    pdspec.parse_spec(pdd["spec"], name=pdd["metadata"]["name"])  # raises SpecError when invalid
    out = run([str(ROOT / ".venv/bin/kubectl-pd"), "validate", "-"], input=yaml.safe_dump(pdd))
    assert out.returncode == 0, f"kubectl-pd validate rejected the example:\n{out.stdout}{out.stderr}"
    assert "nvidia.com/gpu" not in json.dumps(pdd)  # CPU mode: schedulable on kind


def test_helm_test_hook_sends_a_chat_completion_through_the_router() -> None:
    objs = render(ROOT / "charts/pdstack/ci/kind-values.yaml")
    pod = one(objs, "Pod")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    (c,) = pod["spec"]["containers"]
    env = {e["name"]: e["value"] for e in c["env"]}
    assert env["ROUTER_URL"] == "http://demo-router.pdstack-system.svc:8000"
    assert "/v1/chat/completions" in c["command"][-1]
    assert c["image"] == "pdstack-runtime:dev" and c["securityContext"]["readOnlyRootFilesystem"] is True
    compile(c["command"][-1], "helm-test", "exec")  # the inline script is valid Python
    # the router Service it targets is the one the operator renders for the example
    from pdoperator.core.render import router_name
    assert env["ROUTER_URL"].startswith(f"http://{router_name('demo')}.")


def test_notes_render() -> None:
    out = run([tool("helm"), "install", "pd", str(CHART), "--dry-run", "--namespace", "x",
               "-f", str(CHART / "ci/monitoring-values.yaml")])
    assert out.returncode == 0, out.stderr
    notes = out.stdout[out.stdout.index("NOTES:"):]
    assert "port-forward svc/demo-router" in notes and "helm test pd -n x" in notes
    # the curl it prints is a request the router accepts: it names the model (the router requires it)
    body = json.loads(re.search(r"-d '(\{.*\})'", notes).group(1))
    assert body["model"] == "SmolLM2-135M-Instruct" and body["messages"][0]["role"] == "user"


def test_monitoring_objects_validate_against_prometheus_operator_schemas() -> None:
    """PodMonitor, ServiceMonitor and PrometheusRule against validators generated from the Prometheus
    Operator's CRDs (@kubernetes-models/prometheus-operator, installed by `make tools`)."""
    node_dir = ROOT / ".tools" / "node"
    if not (node_dir / "node_modules" / "@kubernetes-models" / "prometheus-operator").exists() or not shutil.which("node"):
        pytest.skip("node or @kubernetes-models/prometheus-operator missing: `make tools` installs the models")
    script = node_dir / "validate_monitoring.mjs"
    shutil.copy(Path(__file__).with_name("validate_monitoring.mjs"), script)
    for values in VALUES_FILES:
        objs = [o for o in render(values, *ALL_ON) if o["apiVersion"] == "monitoring.coreos.com/v1"]
        assert {o["kind"] for o in objs} == {"PodMonitor", "ServiceMonitor", "PrometheusRule"}
        out = run(["node", str(script)], input=json.dumps(objs), cwd=node_dir)
        assert out.returncode == 0, f"{values_id(values)}: invalid Prometheus Operator objects:\n{out.stdout}{out.stderr}"
    # the validator does reject a wrong type (so a pass above means something)
    bad = [dict(objs[0], spec={"selector": {}, "podMetricsEndpoints": [{"port": 8000}]}, kind="PodMonitor")]
    out = run(["node", str(script)], input=json.dumps(bad), cwd=node_dir)
    assert out.returncode == 1 and "port must be string" in out.stdout, out.stdout + out.stderr


def test_ha_replicas_peer_with_distinct_priorities_in_each_watched_namespace() -> None:
    """operator.replicas > 1: kopf peering objects where the operator watches, and a priority per pod name."""
    from unittest import mock

    import pdoperator.__main__ as entry

    objs = render(ROOT / "charts/pdstack/ci/ha-values.yaml")
    assert one(objs, "Deployment")["spec"]["replicas"] == 2
    peerings = by_kind(objs, "KopfPeering")
    assert sorted(p["metadata"]["namespace"] for p in peerings) == ["llm-a", "llm-b"]
    assert {p["metadata"]["name"] for p in peerings} == {"pdstack-operator"}
    cw = render(ROOT / "charts/pdstack/ci/clusterwide-values.yaml", "operator.replicas=2")
    assert [p["metadata"]["name"] for p in by_kind(cw, "ClusterKopfPeering")] == ["pdstack-operator"]
    assert not by_kind(render(), "KopfPeering")  # one standalone replica: no peering
    prios = set()
    for pod in ("pd-pdstack-operator-5d9f7c-abcde", "pd-pdstack-operator-5d9f7c-fghij"):
        with mock.patch("kopf.run") as kopf_run, mock.patch("logging.basicConfig"), \
                mock.patch.dict("os.environ", {"POD_NAME": pod}):
            entry.main(["--priority=auto", "-n", "llm-a"])
        prios.add(kopf_run.call_args.kwargs["priority"])
    assert len(prios) == 2 and all(0 < p < 2 ** 31 for p in prios)
    with mock.patch.dict("os.environ", {"POD_NAME": ""}), pytest.raises(SystemExit):
        entry.main(["--priority=auto"])  # argparse: 'auto' needs $POD_NAME
