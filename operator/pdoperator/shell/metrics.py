"""Operator metrics (prometheus-client), served on /metrics by ``handlers.startup``.

Names use the ``pdstack_operator_`` prefix; docs/operator.md lists each with its meaning.
"""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, start_http_server

RECONCILE_DURATION = Histogram(
    "pdstack_operator_reconcile_duration_seconds",
    "Wall time of one PDDeployment reconcile (list pods, plan, act, write status).",
    ["namespace", "deployment"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
RECONCILE_ERRORS = Counter(
    "pdstack_operator_reconcile_errors_total",
    "Reconciles that raised (API errors, unexpected exceptions); invalid specs are not errors.",
    ["namespace", "deployment", "error"],
)
CO_RESTARTS = Counter(
    "pdstack_operator_co_restarts_total",
    "Pair co-restarts (both pods of a pair deleted and recreated), by trigger.",
    ["namespace", "deployment", "reason"],
)
PAIR_RECOVERY = Histogram(
    "pdstack_operator_pair_recovery_seconds",
    "Time from a co-restart decision until both pods of the pair are ready again.",
    ["namespace", "deployment"],
    buckets=(0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800),
)
PAIRS_READY = Gauge(
    "pdstack_operator_pairs_ready",
    "Pairs whose prefill and decode pods are both ready (at any revision).",
    ["namespace", "deployment"],
)
PAIRS_DESIRED = Gauge(
    "pdstack_operator_pairs_desired",
    "spec.pairs of the PDDeployment.",
    ["namespace", "deployment"],
)
ROLLOUT_PAIRS = Counter(
    "pdstack_operator_rollout_pairs_total",
    "Pairs replaced by a rollout to a new revision.",
    ["namespace", "deployment"],
)

CONFIG_DRIFT = Gauge(
    "pdstack_config_drift",
    "Differences between what a PDDeployment declares and what runs, by source: children (live objects "
    "edited by someone else), image (pods of one revision running different digests: a moved tag) or "
    "process (the env a worker process reports at /config).",
    ["namespace", "deployment", "source"],
)
DRIFT_SOURCES = ("children", "image", "process")

PAIR_STALLED = Gauge(
    "pdstack_pair_stalled",
    "1 while a pair is Stalled: live requests and one made no progress, or waited before decode, for "
    "spec.stall.seconds (operator/pdoperator/stall.py); 0 otherwise.",
    ["namespace", "deployment", "pair"],
)


def serve(port: int, registry: CollectorRegistry = REGISTRY) -> None:
    """Expose /metrics on ``port`` (0 = do not serve)."""
    if port:
        start_http_server(port, registry=registry)


def forget(namespace: str, deployment: str) -> None:
    """Drop the per-deployment gauges of a deleted PDDeployment (counters stay, as Prometheus expects)."""
    for gauge in (PAIRS_READY, PAIRS_DESIRED):
        try:
            gauge.remove(namespace, deployment)
        except KeyError:
            pass
    for source in DRIFT_SOURCES:
        try:
            CONFIG_DRIFT.remove(namespace, deployment, source)
        except KeyError:
            pass
    forget_pairs(namespace, deployment, keep=())


def forget_pairs(namespace: str, deployment: str, keep: tuple[int, ...]) -> None:
    """Drop the per-pair series of pairs not in ``keep`` (scaled down, or the deployment deleted)."""
    for labels in [s.labels for m in PAIR_STALLED.collect() for s in m.samples]:
        if (labels["namespace"], labels["deployment"]) == (namespace, deployment) and int(labels["pair"]) not in keep:
            try:
                PAIR_STALLED.remove(namespace, deployment, labels["pair"])
            except KeyError:
                pass
