"""rbac.py is exact: the operator never needs more, and never holds a verb it does not use.

One integration scenario against the strict emulator (RBAC from rbac.py enforced, every request
recorded): create, rollout with history pruning, co-restart, drift, a lost node, an unschedulable
scale-up, HA peering heartbeats, deletion. Every object written is also checked with
``kubernetes-validate`` against the Kubernetes 1.29 and 1.33 schemas.
"""

from __future__ import annotations

import kubernetes_validate
import pytest

from pdop_harness import NS, PDDS, PODS, eventually, manifest
from pdop_k8s_emulator import R
from pdoperator.core import rbac

SERVICES = R("", "v1", "services")


def ready(c, name):
    return c.condition(name, "Ready").get("status") == "True"


async def _scenario(c) -> None:
    name = "full"
    c.kubelet.add_node("gpu-c", 8, {"pdstack.io/gpu": "h100"})
    # soakSeconds 1: the revision becomes known-good (its ControllerRevision annotated) within the scenario
    c.apply(manifest(name, pairs=2, gpus=4, revisionHistoryLimit=1, rollout={"soakSeconds": 1}))
    await eventually(lambda: ready(c, name), timeout=30, what="create -> Ready")
    # rollout (and the old ControllerRevision pruned: revisionHistoryLimit 1)
    rev = c.pdd(name)["status"]["currentRevision"]
    c.patch_spec(name, {"decode": {"resources": {"gpus": 4}, "env": [{"name": "X", "value": "1"}]}})
    await eventually(lambda: ready(c, name) and c.pdd(name)["status"]["currentRevision"] != rev, timeout=40,
                     what="rollout done")
    # known-good after the 1 s soak: its ControllerRevision gets the pdstack.io/known-good-since annotation
    await eventually(lambda: c.pdd(name)["status"].get("lastKnownGoodRevision") == c.pdd(name)["status"][
        "currentRevision"], timeout=15, what="known-good")
    # co-restart
    victim = c.pair_pods(name, 0)["decode"]["metadata"]["name"]
    c.kubelet.restart_container(NS, victim)
    await eventually(lambda: c.api.read(PODS, NS, victim) is None and ready(c, name), timeout=30, what="co-restart")
    # drift (reported)
    svc = c.api.read(SERVICES, NS, f"{name}-router")
    svc["spec"]["ports"][0]["targetPort"] = 9000
    c.api._store(SERVICES, NS, f"{name}-router", svc, manager="kubectl-edit")
    await eventually(lambda: c.condition(name, "ConfigDrift").get("status") == "True", what="drift")
    # lost node
    pods = c.pair_pods(name, 1)
    node = pods["decode"]["spec"]["nodeName"]
    c.kubelet.node_down(node)
    for p in pods.values():
        c.api._delete(PODS, NS, p["metadata"]["name"], grace=1)
    await eventually(lambda: c.events(name, "ForceDeleted") and ready(c, name), timeout=30, what="lost node")
    # unschedulable scale-up (node list for the message)
    c.patch_spec(name, {"pairs": 4})
    await eventually(lambda: c.condition(name, "Progressing").get("reason") == "Unschedulable", timeout=30,
                     what="Unschedulable")
    # deletion: kopf releases its finalizer, the children go with the owner
    c.delete(PDDS, name)
    await eventually(lambda: c.pdd(name) is None, timeout=30, what="deleted")


async def test_every_request_is_granted_and_every_grant_is_used(strict_operator):
    c = strict_operator
    await _scenario(c)
    granted = rbac.NAMESPACED_RULES + rbac.CLUSTER_RULES
    denied = sorted({r for r in c.api.requests if not rbac.allows(granted, r[0], r[1], r[2])})
    assert denied == [], f"requests rbac.py does not grant: {denied}"
    assert all(ns == NS for verb, group, res, ns in c.api.requests if res not in ("nodes",)), \
        "a namespaced operator made a cluster-wide request"
    used = {(verb, group, res) for verb, group, res, _ in c.api.requests}
    unused = [(verb, group, res) for rule in granted for group in rule["apiGroups"] for res in rule["resources"]
              for verb in rule["verbs"] if (verb, group, res) not in used]
    assert unused == [], f"rbac.py grants verbs the operator never used: {unused}"
    assert not any(res == "secrets" and verb in ("list", "watch") for verb, _, res, _ in c.api.requests)

    # every object the operator wrote is valid for Kubernetes 1.29 and 1.33
    checked = 0
    for body in c.api.written:
        if "_patch" in body or body.get("kind") in (None, "PDDeployment", "KopfPeering") or "apiVersion" not in body:
            continue
        for version in ("1.29.0", "1.33.0"):
            try:
                kubernetes_validate.validate(body, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                pytest.fail(f"{body['kind']}/{body['metadata'].get('name')} invalid for {version}: {e}")
        checked += 1
    kinds = {b.get("kind") for b in c.api.written}
    assert {"Pod", "Service", "Deployment", "ConfigMap", "Secret", "NetworkPolicy", "PodDisruptionBudget",
            "ControllerRevision", "Event"} <= kinds, kinds
    assert checked > 20


def test_kubernetes_validate_rejects_what_a_server_would():
    """The schema check above can fail: a misspelt field and a wrong type are caught, for both versions."""
    for version in ("1.29.0", "1.33.0"):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "x"},
                                          "spec": {"containers": [{"name": "c", "image": "i", "imagePullPolicy": 3}]}},
                                         version, strict=True)
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "x"},
                                          "spec": {"prots": []}}, version, strict=True)
