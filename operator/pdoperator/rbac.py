"""The least-privilege RBAC rules the operator needs: the one source the chart's Role must equal.

Each rule is a standard ``rbac.authorization.k8s.io/v1`` PolicyRule. ``NAMESPACED_RULES`` go into a
Role in every watched namespace (or a ClusterRole in cluster-wide mode); ``CLUSTER_RULES`` are for
cluster-scoped objects and always need a ClusterRole. Two tests hold this honest:

* the operator's integration runs against the emulator record every request it makes, and every
  recorded (verb, group, resource) is granted here and every verb granted here was used;
* the chart's rendered RBAC (``helm template``) grants exactly these rules.

Change the operator's API calls and this file together.
"""

from __future__ import annotations

from typing import Any

PolicyRule = dict[str, Any]

NAMESPACED_RULES: list[PolicyRule] = [
    {"apiGroups": ["pdstack.io"], "resources": ["pddeployments"], "verbs": ["get", "list", "watch", "patch"]},
    {"apiGroups": ["pdstack.io"], "resources": ["pddeployments/status"], "verbs": ["patch"]},
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch", "create", "delete"]},
    {"apiGroups": [""], "resources": ["services", "configmaps"], "verbs": ["get", "list", "watch", "create", "patch"]},
    {"apiGroups": [""], "resources": ["secrets"], "verbs": ["get", "create"]},
    {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]},
    {"apiGroups": ["apps"], "resources": ["deployments"], "verbs": ["get", "list", "watch", "create", "patch"]},
    {"apiGroups": ["apps"], "resources": ["controllerrevisions"], "verbs": ["list", "create", "delete"]},
    {"apiGroups": ["networking.k8s.io"], "resources": ["networkpolicies"], "verbs": ["get", "create", "patch"]},
    {"apiGroups": ["policy"], "resources": ["poddisruptionbudgets"], "verbs": ["get", "create", "patch"]},
]

CLUSTER_RULES: list[PolicyRule] = [
    {"apiGroups": [""], "resources": ["nodes"], "verbs": ["list"]},
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
