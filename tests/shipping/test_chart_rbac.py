"""The chart's RBAC grants exactly operator/pdoperator/core/rbac.py: nothing less, nothing more.

rbac.py is kept equal to the requests the operator really makes (recorded against the emulator by the
operator suite); here the chart's rendered Role/ClusterRole (``helm template``) is compared with it,
verb by verb. On a mismatch the message lists each extra and missing grant and how to re-sync
(``.venv/bin/python tests/shipping/sync_rbac.py``).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Iterable

import pytest

from pdoperator.core import rbac
from shipping import CHART, ROOT, by_kind, render

Grant = tuple[str, str, str]  # (apiGroup, resource, verb)


def grants(rules: Iterable[dict[str, Any]]) -> set[Grant]:
    out: set[Grant] = set()
    for r in rules:
        assert not r.get("resourceNames") and not r.get("nonResourceURLs"), r
        for g in r["apiGroups"]:
            for res in r["resources"]:
                for v in r["verbs"]:
                    out.add((g, res, v))
    return out


def diff_message(where: str, granted: set[Grant], wanted: set[Grant]) -> str:
    fmt = lambda g: f"{g[2]:<7} {g[0] or 'core'}/{g[1]}"  # noqa: E731
    lines = [f"{where} does not grant exactly pdoperator.core.rbac:"]
    lines += [f"  + {fmt(g)}   (granted by the chart, not used by the operator)" for g in sorted(granted - wanted)]
    lines += [f"  - {fmt(g)}   (used by the operator, missing from the chart)" for g in sorted(wanted - granted)]
    lines.append("Fix: .venv/bin/python tests/shipping/sync_rbac.py   (rewrites charts/pdstack/files/rbac-rules.yaml)")
    return "\n".join(lines)


def assert_exact(where: str, rules: list[dict[str, Any]], wanted: list[dict[str, Any]]) -> None:
    granted, want = grants(rules), grants(wanted)
    assert granted == want, diff_message(where, granted, want)


def _bindings_ok(objs: list[dict[str, Any]], binding_kind: str, role_kind: str) -> None:
    sa = by_kind(objs, "ServiceAccount")[0]["metadata"]
    for b in by_kind(objs, binding_kind):
        assert b["roleRef"]["kind"] in (role_kind, "ClusterRole")
        assert b["subjects"] == [{"kind": "ServiceAccount", "name": sa["name"], "namespace": sa["namespace"]}]


@pytest.mark.parametrize("sets, namespaces", [((), ["pdstack-system"]),
                                              (("operator.watchNamespaces={serving,batch}",), ["batch", "serving"])])
def test_namespaced_roles_grant_exactly_the_operators_rules(sets: tuple[str, ...], namespaces: list[str]) -> None:
    objs = render(None, *sets)
    roles = by_kind(objs, "Role")
    assert sorted(r["metadata"]["namespace"] for r in roles) == namespaces  # one Role per watched namespace
    for role in roles:
        assert_exact(f"Role {role['metadata']['namespace']}/{role['metadata']['name']}", role["rules"],
                     rbac.NAMESPACED_RULES)
    (cluster,) = by_kind(objs, "ClusterRole")  # cluster-scoped objects only
    assert_exact(f"ClusterRole {cluster['metadata']['name']}", cluster["rules"], rbac.CLUSTER_RULES)
    for b in by_kind(objs, "RoleBinding"):
        assert b["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": roles[0]["metadata"]["name"]}
    _bindings_ok(objs, "RoleBinding", "Role")
    _bindings_ok(objs, "ClusterRoleBinding", "ClusterRole")


def test_cluster_wide_mode_grants_the_same_rules_cluster_wide() -> None:
    """Cluster-wide mode: the namespaced rules in one ClusterRole, with kopf's peering cluster-scoped
    (ClusterKopfPeering, what HA uses there), generated from pdoperator.core.rbac.cluster_wide_rules()."""
    objs = render(ROOT / "charts/pdstack/ci/clusterwide-values.yaml")
    assert not by_kind(objs, "Role")
    crs = {c["metadata"]["name"]: c for c in by_kind(objs, "ClusterRole")}
    assert set(crs) == {"pd-pdstack", "pd-pdstack-cluster"}
    assert_exact("ClusterRole pd-pdstack", crs["pd-pdstack"]["rules"], rbac.cluster_wide_rules())
    assert {("kopf.dev", "clusterkopfpeerings", v) for v in ("list", "watch", "patch")} <= \
        grants(crs["pd-pdstack"]["rules"]), "cluster-wide HA heartbeats into a ClusterKopfPeering"
    assert_exact("ClusterRole pd-pdstack-cluster", crs["pd-pdstack-cluster"]["rules"], rbac.CLUSTER_RULES)
    _bindings_ok(objs, "ClusterRoleBinding", "ClusterRole")


def test_no_wildcards_and_no_secret_listing() -> None:
    for values in (None, ROOT / "charts/pdstack/ci/clusterwide-values.yaml"):
        for role in by_kind(render(values), "Role") + by_kind(render(values), "ClusterRole"):
            for g, res, v in grants(role["rules"]):
                assert "*" not in (g, res, v), role
                assert not (res == "secrets" and v in ("list", "watch")), f"{role['metadata']['name']} lists Secrets"


def test_the_comparison_catches_an_over_grant(tmp_path: Path) -> None:
    """A chart that grants one verb more than rbac.py fails, and the message names that verb."""
    import shipping

    chart = tmp_path / "pdstack"
    shutil.copytree(CHART, chart)
    rules = chart / "files" / "rbac-rules.yaml"
    rules.write_text(rules.read_text().replace("resources: [secrets], verbs: [get, create]",
                                               "resources: [secrets], verbs: [get, create, list]"))
    orig = shipping.CHART
    shipping.CHART = chart
    try:
        (role,) = by_kind(render(), "Role")
    finally:
        shipping.CHART = orig
    with pytest.raises(AssertionError) as err:
        assert_exact("Role x", role["rules"], rbac.NAMESPACED_RULES)
    assert "+ list    core/secrets" in str(err.value)
    assert "sync_rbac.py" in str(err.value)


def test_chart_rules_file_is_in_sync_with_rbac_py() -> None:
    import subprocess
    import sys

    out = subprocess.run([sys.executable, str(ROOT / "tests/shipping/sync_rbac.py"), "--check"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, "charts/pdstack/files/rbac-rules.yaml differs from pdoperator.core.rbac:\n" + out.stdout
