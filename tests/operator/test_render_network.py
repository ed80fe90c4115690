"""What the operator renders for the network and for disruptions, judged by the NetworkPolicy evaluator (netpol.py)
on the rendered objects: the operator's drift and stall reads (each worker's /config and /metrics, by pod IP) and
Prometheus' scrapes are admitted; the deployment's own pods keep their ports; nobody else gets in. The PDB lets an
unhealthy pod be evicted (issue 19, defects 2 and 8)."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from netpol import Cluster, Endpoint, connection_allowed, pod_endpoint
from pdoperator.core.config import OperatorConfig
from pdoperator.core.render import HTTP_PORT, Owner, PolicyPeers, render
from pdoperator.core.spec import AGENT_PORT, BOOTSTRAP_PORT, parse_spec

GOLDEN = Path(__file__).resolve().parent / "golden"
OWNER = Owner("llm", "serving", "uid-1")
OP_NS = "pdstack-system"
OP_LABELS = {"app.kubernetes.io/name": "pdstack-operator", "app.kubernetes.io/instance": "pd"}
CHART_PEERS = PolicyPeers(
    operator=({"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": OP_NS}},
               "podSelector": {"matchLabels": OP_LABELS}},),
    prometheus=({"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}},))
OPERATOR = Endpoint("10.244.0.5", OP_NS, OP_LABELS, name="pd-pdstack-7d9-abcde")
PROMETHEUS = Endpoint("10.244.0.9", "monitoring", {"app.kubernetes.io/name": "prometheus"}, name="prometheus-0")
STRANGER = Endpoint("10.244.7.7", "other", {"app": "curl"}, name="curl")
OP_NEIGHBOUR = Endpoint("10.244.0.6", OP_NS, {"app": "something-else"}, name="neighbour")


def _stack(peers: PolicyPeers, engine: str = "pdrt"):
    """(cluster, workers, router) of one rendered 2-pair PDDeployment, pods given IPs as a kubelet would."""
    raw = {"image": "rt:1", "pairs": 2, "engine": engine, "model": {"source": "/m"},
           **({"runtimeImage": "rt:1"} if engine != "pdrt" else {})}
    objs = render(parse_spec(raw, name=OWNER.name), OWNER, "rev1", kv_token="t", peers=peers)
    workers = []
    for i, o in enumerate(o for o in objs if o["kind"] == "Pod"):
        workers.append(pod_endpoint({**o, "status": {"podIP": f"10.244.1.{10 + i}"}}))
    dep = next(o for o in objs if o["kind"] == "Deployment")
    router = pod_endpoint({"metadata": {"name": "llm-router-abc", "namespace": OWNER.namespace,
                                        "labels": dep["spec"]["template"]["metadata"]["labels"]},
                           "spec": dep["spec"]["template"]["spec"], "status": {"podIP": "10.244.1.2"}})
    policies = [o for o in objs if o["kind"] == "NetworkPolicy"]
    assert len(policies) == 1 and len(workers) == 4
    return Cluster(policies, {}), workers, router


def _todays_policy() -> dict:
    """The NetworkPolicy today's operator renders (the cpu-demo golden), moved to this test's deployment."""
    objs = [o for o in yaml.safe_load_all((GOLDEN / "cpu-demo.yaml").read_text()) if o]
    (pol,) = [o for o in objs if o["kind"] == "NetworkPolicy"]
    text = yaml.safe_dump(pol).replace(f"pdstack.io/deployment: {pol['metadata']['labels']['pdstack.io/deployment']}",
                                       f"pdstack.io/deployment: {OWNER.name}")
    out = yaml.safe_load(text)
    out["metadata"]["namespace"] = OWNER.namespace
    return out


def test_operator_drift_and_stall_reads_are_denied_today_and_admitted_now():
    """The operator reads every worker's /config (process drift) and /metrics (stalls, canary) by pod IP
    (reconcile: http://<pod IP>:<worker_port>/config and /metrics). Under today's policy an enforcing CNI drops
    them; with the chart's peers the same reads are admitted, and only those."""
    old_cluster, workers, router = _stack(PolicyPeers())
    old_cluster = Cluster([_todays_policy()], {})
    cfg = OperatorConfig()
    for w in workers:
        v = connection_allowed(old_cluster, OPERATOR, w, cfg.worker_port)
        assert not v, f"today: operator -> {w.name}:{cfg.worker_port} should be dropped: {v.reason}"
        assert not connection_allowed(old_cluster, PROMETHEUS, w, HTTP_PORT)
    new_cluster, workers, router = _stack(CHART_PEERS)
    for w in workers:
        for src in (OPERATOR, PROMETHEUS):
            v = connection_allowed(new_cluster, src, w, cfg.worker_port)
            assert v, f"{src.name} -> {w.name}:{cfg.worker_port} (/config, /metrics): {v.reason}"
            assert not connection_allowed(new_cluster, src, w, BOOTSTRAP_PORT), "KV bootstrap stays private"
        for src in (STRANGER, OP_NEIGHBOUR):
            assert not connection_allowed(new_cluster, src, w, HTTP_PORT), src.name
        assert connection_allowed(new_cluster, router, w, HTTP_PORT)  # the router dispatches
        assert connection_allowed(new_cluster, workers[0], w, BOOTSTRAP_PORT)  # KV transfer inside the deployment
    # the router's /config and /debug/requests (stall rows): the router is not isolated
    assert connection_allowed(new_cluster, OPERATOR, router, cfg.router_port)


def test_the_peers_come_from_the_environment_and_default_to_the_operators_namespace():
    env = {"PDSTACK_OPERATOR_NETWORK_PEERS":
           '{"operator": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ops"}}}], '
           '"prometheus": [{"ipBlock": {"cidr": "192.168.0.0/16"}}]}'}
    peers = OperatorConfig.from_environ(env).network_peers
    cluster, workers, _ = _stack(peers)
    assert connection_allowed(cluster, Endpoint("10.9.9.9", "ops", {}, name="x"), workers[0], HTTP_PORT)
    assert connection_allowed(cluster, Endpoint("192.168.3.4"), workers[0], HTTP_PORT)  # a scraper outside
    assert not connection_allowed(cluster, Endpoint("172.16.0.1"), workers[0], HTTP_PORT)
    # unset: the operator's own namespace ($POD_NAMESPACE), no Prometheus
    peers = OperatorConfig.from_environ({"POD_NAMESPACE": OP_NS}).network_peers
    cluster, workers, _ = _stack(peers)
    assert connection_allowed(cluster, OPERATOR, workers[0], HTTP_PORT)
    assert not connection_allowed(cluster, PROMETHEUS, workers[0], HTTP_PORT)
    assert OperatorConfig.from_environ({}).network_peers == PolicyPeers()


@pytest.mark.parametrize("raw", ['{"operator": {}}', '[1]', '{"operator": [{"bogus": 1}]}', "not json",
                                 '{"scrapers": []}'])
def test_bad_peers_are_refused_with_what_is_accepted(raw):
    with pytest.raises(SystemExit, match="accepted"):
        OperatorConfig.from_environ({"PDSTACK_OPERATOR_NETWORK_PEERS": raw})


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_engine_workers_keep_their_runtime_ports_among_themselves_only(engine):
    cluster, workers, router = _stack(CHART_PEERS, engine=engine)
    assert connection_allowed(cluster, workers[0], workers[1], 40000)  # ZMQ / transfer engine / NIXL's UCX
    assert not connection_allowed(cluster, router, workers[1], 40000)
    assert not connection_allowed(cluster, OPERATOR, workers[1], 40000)
    assert connection_allowed(cluster, OPERATOR, workers[1], HTTP_PORT)
    # the agent: /config and /metrics for the operator, /debug/requests for the router
    assert connection_allowed(cluster, OPERATOR, workers[1], AGENT_PORT)
    assert connection_allowed(cluster, router, workers[1], AGENT_PORT)
    if engine == "vllm":  # NIXL's side channel: between workers only
        assert connection_allowed(cluster, workers[0], workers[1], 5600)
        assert not connection_allowed(cluster, router, workers[1], 5600)


def test_rendered_policy_and_budget_are_valid_kubernetes():
    objs = render(parse_spec({"image": "rt:1", "pairs": 2}, name="llm"), OWNER, "r", kv_token="t", peers=CHART_PEERS)
    for o in objs:
        if o["kind"] in ("NetworkPolicy", "PodDisruptionBudget"):
            for version in ("1.29.0", "1.33.0"):
                kubernetes_validate.validate(o, version, strict=True)


def test_pdb_always_allows_evicting_unhealthy_pods():
    """Defect 8: under the default (IfHealthyBudget) one crash-looping pair holds the budget and blocks every node
    drain; AlwaysAllow lets a pod that is not Ready be evicted (it serves nothing)."""
    objs = render(parse_spec({"image": "rt:1", "pairs": 3}, name="llm"), OWNER, "r", kv_token="t")
    (pdb,) = [o for o in objs if o["kind"] == "PodDisruptionBudget"]
    assert pdb["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
    assert pdb["spec"]["minAvailable"] == 5
