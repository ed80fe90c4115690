"""Operator process settings: read once, typed, one prefix (``PDSTACK_OPERATOR_``) plus CLI flags."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

from .pairs import DRAIN_CONFIRM_TIMEOUT_S, LOST_NODE_MARGIN_S
from .spec import HTTP_PORT

PREFIX = "PDSTACK_OPERATOR_"


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
    worker_port: int = HTTP_PORT  # where worker pods serve /config
    stall_check_s: float = 15.0  # read the routers' /debug/requests and workers' /metrics this often; 0 = off

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
            stall_check_s=get("STALL_CHECK_S", 15.0, float),
        )
