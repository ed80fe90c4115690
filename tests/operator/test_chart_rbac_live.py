"""The chart's RBAC, as ``helm template`` renders it, is what the operator runs under (issue 19, defect 3).

Cluster-wide HA (``operator.clusterWide=true``, ``operator.replicas=2``) peers through a ClusterKopfPeering: the
chart's ClusterRole must grant ``clusterkopfpeerings`` (generated from ``pdoperator.core.rbac.cluster_wide_rules()``,
as the namespaced rules are), or kopf's heartbeats are 403s, retried forever.
"""

from __future__ import annotations

import copy
import subprocess
from pathlib import Path

import pytest
import yaml

from pdop_harness import NS, eventually, manifest, running_operator
from pdop_k8s_emulator import R
from pdoperator.core import rbac

ROOT = Path(__file__).resolve().parents[2]
HELM = ROOT / ".tools" / "bin" / "helm"
CLUSTER_PEERINGS = R("kopf.dev", "v1", "clusterkopfpeerings")


def chart_cluster_roles(*sets: str) -> dict[str, list[dict]]:
    if not HELM.exists():
        pytest.skip("helm not installed: `make tools` installs it into .tools/bin")
    cmd = [str(HELM), "template", "pd", str(ROOT / "charts" / "pdstack"), "--namespace", "pdstack-system"]
    for s in sets:
        cmd += ["--set", s]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return {o["metadata"]["name"]: o["rules"] for o in yaml.safe_load_all(out.stdout)
            if o and o["kind"] == "ClusterRole"}


async def test_cluster_wide_ha_runs_under_the_charts_cluster_role(cluster):
    roles = chart_cluster_roles("operator.clusterWide=true", "operator.replicas=2")
    granted = roles["pd-pdstack"] + roles["pd-pdstack-cluster"]
    cluster.api.rbac = []  # no Role anywhere: cluster-wide mode has only the ClusterRoles
    cluster.api.cluster_rbac = copy.deepcopy(granted)
    cluster.api.seed(CLUSTER_PEERINGS, None, {"metadata": {"name": "pdstack-operator"}})  # templates/peering.yaml
    async with running_operator(cluster, clusterwide=True, peering="pdstack-operator", priority=100) as c:
        c.apply(manifest("cw", pairs=1))

        def heartbeat_and_ready():
            peering = c.api.read(CLUSTER_PEERINGS, None, "pdstack-operator")
            return bool((peering or {}).get("status")) and c.condition("cw", "Ready").get("status") == "True"

        await eventually(heartbeat_and_ready, timeout=30, what="a ClusterKopfPeering heartbeat and Ready")
    denied = sorted({r for r in c.api.requests if not rbac.allows(granted, r[0], r[1], r[2])})
    assert denied == [], f"requests the chart's ClusterRoles do not grant: {denied}"
    assert any(res == "clusterkopfpeerings" and verb == "patch" for verb, _, res, _ in c.api.requests)
    assert not any(res == "kopfpeerings" for _, _, res, _ in c.api.requests)  # cluster-wide: no namespaced peering


def test_cluster_wide_rules_are_the_namespaced_ones_with_peering_cluster_scoped():
    by_res = {tuple(r["resources"]): r for r in rbac.cluster_wide_rules()}
    assert ("clusterkopfpeerings",) in by_res and ("kopfpeerings",) not in by_res
    assert [r for r in rbac.cluster_wide_rules() if "kopf.dev" not in r["apiGroups"]] == \
        [r for r in rbac.NAMESPACED_RULES if "kopf.dev" not in r["apiGroups"]]
    assert NS == "default"
