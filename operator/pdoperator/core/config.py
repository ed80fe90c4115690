"""Operator process settings: read once, typed, one prefix (``PDSTACK_OPERATOR_``) plus CLI flags."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

from .pairs import DRAIN_CONFIRM_TIMEOUT_S, LOST_NODE_MARGIN_S
from .render import PolicyPeers
from .spec import AGENT_PORT, HTTP_PORT, PDSpec

PREFIX = "PDSTACK_OPERATOR_"
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"  # the API server sets it on every namespace


def network_peers(raw: str | None, namespace: str | None) -> PolicyPeers:
    """``PDSTACK_OPERATOR_NETWORK_PEERS``: JSON ``{"operator": [peer...], "prometheus": [peer...]}`` of
    NetworkPolicyPeer objects (what the chart renders from its ``networkPolicy`` values). Unset: the operator's
    own namespace (``$POD_NAMESPACE``, when it runs in a pod) and no Prometheus."""
    if raw in (None, ""):
        own = ({"namespaceSelector": {"matchLabels": {NAMESPACE_NAME_LABEL: namespace}}},) if namespace else ()
        return PolicyPeers(operator=own)
    try:
        doc = json.loads(raw)
    except ValueError as e:
        raise SystemExit(f"{PREFIX}NETWORK_PEERS is not JSON ({e}); accepted: "
                         '{"operator": [NetworkPolicyPeer...], "prometheus": [NetworkPolicyPeer...]}') from None
    if not isinstance(doc, dict):
        raise SystemExit(f"{PREFIX}NETWORK_PEERS={raw!r} is invalid; accepted: "
                         '{"operator": [NetworkPolicyPeer...], "prometheus": [NetworkPolicyPeer...]}')
    out: dict[str, tuple[dict[str, Any], ...]] = {}
    keys = ("namespaceSelector", "podSelector", "ipBlock")
    for role in ("operator", "prometheus"):
        peers = doc.get(role, [])
        if not isinstance(peers, list) or not all(isinstance(x, dict) and x and set(x) <= set(keys) for x in peers):
            raise SystemExit(f"{PREFIX}NETWORK_PEERS.{role}={peers!r} is invalid; accepted: a list of "
                             "NetworkPolicyPeer objects, each with namespaceSelector, podSelector and/or ipBlock")
        out[role] = tuple(peers)
    if set(doc) - {"operator", "prometheus"}:
        raise SystemExit(f"{PREFIX}NETWORK_PEERS has keys {sorted(set(doc) - {'operator', 'prometheus'})}; "
                         "accepted: operator, prometheus")
    return PolicyPeers(**out)


@dataclass(frozen=True)
class OperatorConfig:
    metrics_port: int = 8080
    router_port: int = HTTP_PORT  # where router pods serve /config and /admin/topology
    lost_node_margin_s: float = LOST_NODE_MARGIN_S  # past a pod's deletion deadline on a lost node
    drain_confirm_timeout_s: float = DRAIN_CONFIRM_TIMEOUT_S
    peering_lifetime_s: int = 15  # a silent peer counts as dead after this (HA takeover bound, see docs)
    peering_settle_s: float = 3.0  # after a start with peering: let peers started with us heartbeat first
    router_timeout_s: float = 2.0  # one /config or push request to a router pod
    cluster_pod_read: bool = False  # rbac.OPTIONAL_RULES granted: count GPUs other workloads hold
    process_drift_s: float = 60.0  # read each ready worker's /config this often (drift source "process"); 0 = off
    worker_port: int = HTTP_PORT  # where pdrt worker pods serve /config
    agent_port: int = AGENT_PORT  # where the agent beside an SGLang or vLLM worker serves it
    stall_check_s: float = 15.0  # read the routers' /debug/requests and workers' /metrics this often; 0 = off
    # admitted to the workers' http port by each PDDeployment's NetworkPolicy (the operator itself, Prometheus)
    network_peers: PolicyPeers = field(default_factory=PolicyPeers)

    def evidence_port(self, spec: PDSpec) -> int:
        """Where a worker of ``spec`` serves /config, /metrics and /debug/requests in pdrt's shapes: pdrt's own
        port, or the agent sidecar's (engines sglang, vllm)."""
        return self.agent_port if spec.has_agent else self.worker_port

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> "OperatorConfig":
        env = os.environ if environ is None else environ

        def get(name: str, default: float, conv: type) -> float:
            raw = env.get(PREFIX + name)
            if raw in (None, ""):
                return default
            try:
                return conv(raw)
            except ValueError:
                raise SystemExit(f"{PREFIX}{name}={raw!r} is invalid; accepted: a {conv.__name__}") from None

        return cls(
            metrics_port=int(get("METRICS_PORT", 8080, int)),
            router_port=int(get("ROUTER_PORT", HTTP_PORT, int)),
            lost_node_margin_s=get("LOST_NODE_MARGIN_S", LOST_NODE_MARGIN_S, float),
            drain_confirm_timeout_s=get("DRAIN_CONFIRM_TIMEOUT_S", DRAIN_CONFIRM_TIMEOUT_S, float),
            peering_lifetime_s=int(get("PEERING_LIFETIME_S", 15, int)),
            peering_settle_s=get("PEERING_SETTLE_S", 3.0, float),
            router_timeout_s=get("ROUTER_TIMEOUT_S", 2.0, float),
            cluster_pod_read=env.get(PREFIX + "CLUSTER_POD_READ", "0") == "1",
            process_drift_s=get("PROCESS_DRIFT_S", 60.0, float),
            worker_port=int(get("WORKER_PORT", HTTP_PORT, int)),
            agent_port=int(get("AGENT_PORT", AGENT_PORT, int)),
            stall_check_s=get("STALL_CHECK_S", 15.0, float),
            network_peers=network_peers(env.get(PREFIX + "NETWORK_PEERS"), env.get("POD_NAMESPACE")),
        )
