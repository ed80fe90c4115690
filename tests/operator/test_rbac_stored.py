"""The operator runs under the chart's own RBAC, stored and enforced like any object.

``helm template`` (the real binary) renders the chart; its ServiceAccount, Roles, ClusterRoles and
bindings are stored in the emulator, which then authorizes every request from those stored objects
(``stored_rbac``). The real operator, with the service account's token, reconciles a PDDeployment to
Ready and deletes it again, in namespace mode (Role per watched namespace) and in cluster-wide mode
(ClusterRole). Removing the RoleBinding takes the grants away at once, as on a real server.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import kmock
import pytest
import yaml

from pdop_harness import IMAGE, KUBECONFIG, NS, PDDS, Cluster, eventually, manifest, running_operator
from pdop_k8s_emulator import Kubelet, PDEmulator, R

ROOT = Path(__file__).resolve().parents[2]
HELM = shutil.which("helm", path=f"{ROOT / '.tools' / 'bin'}:{os.environ.get('PATH', '')}")
RELEASE_NS = "pdstack"
SA_USER = f"system:serviceaccount:{RELEASE_NS}:pdstack"
PLURALS = {"ServiceAccount": R("", "v1", "serviceaccounts"), "Namespace": R("", "v1", "namespaces"),
           "Role": R("rbac.authorization.k8s.io", "v1", "roles"),
           "RoleBinding": R("rbac.authorization.k8s.io", "v1", "rolebindings"),
           "ClusterRole": R("rbac.authorization.k8s.io", "v1", "clusterroles"),
           "ClusterRoleBinding": R("rbac.authorization.k8s.io", "v1", "clusterrolebindings")}

pytestmark = pytest.mark.skipif(HELM is None, reason="helm not installed (make tools)")


def chart_rbac(*sets: str) -> list[dict]:
    out = subprocess.run([HELM, "template", "pdstack", str(ROOT / "charts" / "pdstack"), "-n", RELEASE_NS,
                          *[a for s in sets for a in ("--set", s)]], capture_output=True, text=True, check=True)
    return [d for d in yaml.safe_load_all(out.stdout) if d and d["kind"] in PLURALS]


def _write_kubeconfig(url: str, token: str) -> None:
    Path(KUBECONFIG).write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "emu",
        "clusters": [{"name": "emu", "cluster": {"server": url}}],
        "users": [{"name": "op", "user": {"token": token}}],
        "contexts": [{"name": "emu", "context": {"cluster": "emu", "user": "op", "namespace": NS}}]}))


def _denied(api: PDEmulator) -> list[tuple]:
    return [r for r in api.denied if r[0] == SA_USER]


@pytest.mark.parametrize("clusterwide", [False, True], ids=["namespaced", "clusterwide"])
async def test_the_operator_runs_under_the_charts_stored_rbac(clusterwide):
    sets = ["operator.clusterWide=true"] if clusterwide else [f"operator.watchNamespaces={{{NS}}}"]
    objects = chart_rbac(*sets)
    assert {o["kind"] for o in objects} >= {"ServiceAccount", "ClusterRole", "ClusterRoleBinding"}
    async with PDEmulator(tokens={"admin": "kubernetes-admin", "op": SA_USER}, stored_rbac=True,
                          groups={"kubernetes-admin": ("system:masters",)}) as api, kmock.Server(api) as server:
        api.seed(PLURALS["Namespace"], None, {"metadata": {"name": RELEASE_NS}})
        for o in objects:
            api._create(PLURALS[o["kind"]], o["metadata"].get("namespace"), o, manager="helm")
        _write_kubeconfig(str(server.url).rstrip("/"), "op")
        kubelet = Kubelet(api, images=[IMAGE])  # what `kind load` put on the node
        kubelet.add_node("gpu-a", 8, {"pdstack.io/gpu": "h100"})
        async with kubelet:
            c = Cluster(api, kubelet, str(server.url))
            namespaces = () if clusterwide else (NS,)
            async with running_operator(c, clusterwide=clusterwide, namespaces=namespaces):
                c.apply(manifest("rbac", pairs=1))
                await eventually(lambda: c.condition("rbac", "Ready").get("status") == "True", timeout=30,
                                 what="Ready under the chart's RBAC")
                assert _denied(api) == [], _denied(api)
                users = {u for u, *_ in api.request_log}
                assert users == {SA_USER}, users  # every request was the operator's service account
                c.delete(PDDS, "rbac")
                await eventually(lambda: c.pdd("rbac") is None, timeout=30, what="deleted (finalizer released)")
                assert _denied(api) == [], _denied(api)
                # the stored objects are the grants: without the binding, the same requests are refused
                kind = "ClusterRoleBinding" if clusterwide else "RoleBinding"
                binding = next(o for o in objects if o["kind"] == kind and o["metadata"]["name"] == "pdstack")
                assert api.can(SA_USER, "list", "pdstack.io", "pddeployments", NS)
                api._delete(PLURALS[kind], binding["metadata"].get("namespace"), binding["metadata"]["name"])
                assert not api.can(SA_USER, "list", "pdstack.io", "pddeployments", NS)
