"""The least-privilege RBAC rules the operator needs: the one source the chart's Role must equal.

Each rule is a standard ``rbac.authorization.k8s.io/v1`` PolicyRule. ``NAMESPACED_RULES`` go into a
Role in every watched namespace; in cluster-wide mode one ClusterRole holds :func:`cluster_wide_rules`
(the same, with kopf's peering cluster-scoped); ``CLUSTER_RULES`` are for cluster-scoped objects and
always need a ClusterRole. Two tests hold this honest:

* the operator's integration runs against the emulator record every request it makes, and every
  recorded (verb, group, resource) is granted here and every verb granted here was used;
* the chart's rendered RBAC (``helm template``) grants exactly these rules.

Change the operator's API calls and this file together.
"""

from __future__ import annotations

from typing import Any

PolicyRule = dict[str, Any]

NAMESPACED_RULES: list[PolicyRule] = [
    # kopf: watch, finalizer/annotation patches; the operator: get; status through the subresource only
    {"apiGroups": ["pdstack.io"], "resources": ["pddeployments"], "verbs": ["get", "list", "watch", "patch"]},
    {"apiGroups": ["pdstack.io"], "resources": ["pddeployments/status"], "verbs": ["patch"]},
    # children carry ownerReferences with blockOwnerDeletion (OwnerReferencesPermissionEnforcement)
    {"apiGroups": ["pdstack.io"], "resources": ["pddeployments/finalizers"], "verbs": ["update"]},
    # worker pods: server-side apply (patch, + create for a new pod), delete (drain, co-restart, force delete);
    # no get: pods are read by label-selected list/watch
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch", "create", "patch", "delete"]},
    {"apiGroups": [""], "resources": ["services", "configmaps"], "verbs": ["get", "list", "watch", "create", "patch"]},
    # the KV-transfer token: read back and created once; never listed or watched
    {"apiGroups": [""], "resources": ["secrets"], "verbs": ["get", "create"]},
    {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]},
    {"apiGroups": ["apps"], "resources": ["deployments"], "verbs": ["get", "list", "watch", "create", "patch"]},
    # revision history, its pruning, and the known-good annotation (pdstack.io/known-good-since)
    {"apiGroups": ["apps"], "resources": ["controllerrevisions"], "verbs": ["list", "create", "patch", "delete"]},
    {"apiGroups": ["networking.k8s.io"], "resources": ["networkpolicies"], "verbs": ["get", "create", "patch"]},
    {"apiGroups": ["policy"], "resources": ["poddisruptionbudgets"], "verbs": ["get", "create", "patch"]},
    # HA: kopf peering heartbeats (namespaced mode; the chart creates the KopfPeering object)
    {"apiGroups": ["kopf.dev"], "resources": ["kopfpeerings"], "verbs": ["list", "watch", "patch"]},
]

CLUSTER_RULES: list[PolicyRule] = [
    # get: is the node of a pod stuck Terminating lost?  list: GPUs allocatable for the Unschedulable message
    {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list"]},
]

# Only with --all-namespaces: peering is cluster-scoped then (HA: the chart creates the ClusterKopfPeering).
CLUSTERWIDE_RULES: list[PolicyRule] = [
    {"apiGroups": ["kopf.dev"], "resources": ["clusterkopfpeerings"], "verbs": ["list", "watch", "patch"]},
]


def cluster_wide_rules() -> list[PolicyRule]:
    """The ClusterRole of cluster-wide mode (``--all-namespaces``): the namespaced rules in every namespace, with
    kopf's peering heartbeats in the cluster-scoped ClusterKopfPeering instead of a KopfPeering per namespace."""
    return [r for r in NAMESPACED_RULES if r["resources"] != ["kopfpeerings"]] + CLUSTERWIDE_RULES

# Optional, not granted by the chart: with PDSTACK_OPERATOR_CLUSTER_POD_READ=1 and this rule, the
# Unschedulable message also says how many GPUs other workloads hold; without, that part is left out.
OPTIONAL_RULES: list[PolicyRule] = [
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]},
]


def allows(rules: list[PolicyRule], verb: str, group: str, resource: str) -> bool:
    """True when ``rules`` grant ``verb`` on ``group``/``resource`` (``resource`` may be ``pods/status``)."""
    for rule in rules:
        if group not in rule.get("apiGroups", []) and "*" not in rule.get("apiGroups", []):
            continue
        if resource not in rule.get("resources", []) and "*" not in rule.get("resources", []):
            continue
        if verb in rule.get("verbs", []) or "*" in rule.get("verbs", []):
            return True
    return False
