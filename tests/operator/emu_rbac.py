"""RBAC from stored objects (k8s.io/kubernetes/plugin/pkg/auth/authorizer/rbac), a pure decision.

A request (user, groups, verb, group, resource[/subresource], namespace, name) is allowed when a
ClusterRoleBinding grants it through its ClusterRole, or a RoleBinding in the request's namespace grants
it through its Role or ClusterRole. Subjects are ``User``, ``Group`` and ``ServiceAccount`` (the user
``system:serviceaccount:NS:NAME``); rules match ``apiGroups``, ``resources`` (``*``, ``pods/status``,
``*/scale``), ``verbs`` and ``resourceNames``. ``system:masters`` is allowed everything, as the real
server's superuser group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable


@dataclass(frozen=True)
class User:
    name: str
    groups: tuple[str, ...] = ()

    @classmethod
    def of(cls, name: str, groups: Iterable[str] = ()) -> "User":
        groups = list(groups)
        if name.startswith("system:serviceaccount:"):
            ns = name.split(":")[2]
            groups += ["system:serviceaccounts", f"system:serviceaccounts:{ns}"]
        if name != "system:anonymous":
            groups.append("system:authenticated")
        return cls(name, tuple(dict.fromkeys(groups)))


def _subject_matches(subject: dict[str, Any], user: User, binding_ns: str | None) -> bool:
    kind, name = subject.get("kind"), subject.get("name")
    if kind == "User":
        return name == user.name
    if kind == "Group":
        return name in user.groups
    if kind == "ServiceAccount":
        ns = subject.get("namespace") or binding_ns
        return user.name == f"system:serviceaccount:{ns}:{name}"
    return False


def rule_allows(rule: dict[str, Any], verb: str, group: str, resource: str, name: str | None) -> bool:
    groups, resources, verbs = rule.get("apiGroups") or [], rule.get("resources") or [], rule.get("verbs") or []
    if "*" not in groups and group not in groups:
        return False
    base, _, sub = resource.partition("/")
    if not ("*" in resources or resource in resources or (sub and f"*/{sub}" in resources)
            or (not sub and base in resources and resource == base)):
        return False
    if "*" not in verbs and verb not in verbs:
        return False
    names = rule.get("resourceNames") or []
    return not names or (name is not None and name in names)


def rules_for(user: User, namespace: str | None, store: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The rules that apply to ``user`` in ``namespace`` (None: cluster scope only)."""
    roles = {(r["metadata"].get("namespace"), r["metadata"]["name"]): r for r in store.get("roles", [])}
    cluster_roles = {r["metadata"]["name"]: r for r in store.get("clusterroles", [])}
    out: list[dict[str, Any]] = []
    for b in store.get("clusterrolebindings", []):
        if any(_subject_matches(s, user, None) for s in b.get("subjects") or []):
            role = cluster_roles.get(b["roleRef"]["name"]) if b["roleRef"].get("kind") == "ClusterRole" else None
            out += (role or {}).get("rules") or []
    for b in store.get("rolebindings", []):
        ns = b["metadata"].get("namespace")
        if namespace is None or ns != namespace:
            continue
        if not any(_subject_matches(s, user, ns) for s in b.get("subjects") or []):
            continue
        ref = b["roleRef"]
        role = cluster_roles.get(ref["name"]) if ref.get("kind") == "ClusterRole" else roles.get((ns, ref["name"]))
        out += (role or {}).get("rules") or []
    return out


def allowed(user: User, verb: str, group: str, resource: str, namespace: str | None, name: str | None,
            store: dict[str, list[dict[str, Any]]]) -> bool:
    if "system:masters" in user.groups:
        return True
    return any(rule_allows(r, verb, group, resource, name) for r in rules_for(user, namespace, store))


def forbidden_message(user: User, verb: str, group: str, resource: str, namespace: str | None,
                      name: str | None = None) -> str:
    base, _, sub = resource.partition("/")
    what = f'{base} "{name}"' if name else base
    where = f' in the namespace "{namespace}"' if namespace else " at the cluster scope"
    subres = f' subresource "{sub}"' if sub else ""
    return (f'{what} is forbidden: User "{user.name}" cannot {verb} resource "{base}"{subres} '
            f'in API group "{group}"{where}')
