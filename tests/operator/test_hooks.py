"""The chart's hooks (``python -m pdoperator.hooks``) against the emulator and the real operator (issue 19, defects 4
and 7).

``helm uninstall`` runs pre-delete hooks to completion, then deletes the release's objects in one pass: the
operator's Deployment and RBAC go with the example PDDeployment, which still carries the operator's finalizer, so
nobody releases it and it stays Terminating (the e2e teardown's ``--wait`` hangs). The pre-delete hook deletes
the release's PDDeployments while the operator still runs and waits until they are gone; after it, nothing the
one pass deletes is left Terminating."""

from __future__ import annotations

import asyncio
import os
import sys
from typing import Any

import pytest
import yaml

from pdop_harness import KUBECONFIG, NS, PDDS, eventually, manifest, running_operator
from pdoperator import hooks

RELEASE_LABELS = {"app.kubernetes.io/instance": "pd", "app.kubernetes.io/managed-by": "Helm"}
SELECTOR = ",".join(f"{k}={v}" for k, v in RELEASE_LABELS.items())


def _example() -> dict[str, Any]:
    body = manifest("demo", pairs=1)
    body["metadata"]["labels"] = dict(RELEASE_LABELS)
    return body


async def _hook(*args: str) -> tuple[int, str]:
    env = dict(os.environ, KUBECONFIG=KUBECONFIG)
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "pdoperator.hooks", *args, env=env,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    out, _ = await asyncio.wait_for(proc.communicate(), timeout=90)
    return proc.returncode, out.decode()


async def _ready_example(c) -> None:
    c.apply(_example())
    await eventually(lambda: c.condition("demo", "Ready").get("status") == "True", timeout=30, what="example Ready")
    assert c.pdd("demo")["metadata"].get("finalizers"), "the operator's finalizer is on it"


async def test_without_the_hook_uninstall_leaves_the_example_terminating(cluster):
    """What helm's one pass does without the hook: the operator is gone when the example's deletion comes."""
    async with running_operator(cluster, clusterwide=False, namespaces=(NS,)) as c:
        await _ready_example(c)
    c.delete(PDDS, "demo")  # the operator (Deployment, RBAC) went in the same pass
    await asyncio.sleep(1.0)
    left = c.pdd("demo")
    assert left is not None and left["metadata"].get("deletionTimestamp") and left["metadata"]["finalizers"]


async def test_the_pre_delete_hook_deletes_the_example_while_the_operator_runs(cluster):
    async with running_operator(cluster, clusterwide=False, namespaces=(NS,)) as c:
        await _ready_example(c)
        other = manifest("users-own", pairs=1)  # not the release's: a user's PDDeployment is left alone
        c.apply(other)
        rc, out = await _hook("delete-pddeployments", "-n", NS, "-l", SELECTOR, "--timeout", "60")
        assert rc == 0, out
        assert "deleted PDDeployment default/demo" in out and "no PDDeployment of the release is left" in out
        assert c.pdd("demo") is None  # gone before helm deletes anything else
        assert c.pdd("users-own") is not None and not c.pdd("users-own")["metadata"].get("deletionTimestamp")
    # helm's pass now deletes the operator; nothing of the release is Terminating
    assert [p["metadata"]["name"] for p in c.api.select(PDDS, NS) if p["metadata"].get("deletionTimestamp")] == []


async def test_the_pre_delete_hook_says_what_is_left_when_nobody_releases_the_finalizer(cluster):
    cluster.apply(_example())
    await eventually(lambda: cluster.pdd("demo"), what="stored")
    body = cluster.pdd("demo")
    body["metadata"]["finalizers"] = ["pdstack.io/operator"]
    cluster.api._store(PDDS, NS, "demo", body)  # as if an operator had taken it, then died
    rc, out = await _hook("delete-pddeployments", "-n", NS, "-l", SELECTOR, "--timeout", "2")
    assert rc == 1
    assert "still there after 2s: default/demo (finalizers ['pdstack.io/operator'])" in out
    assert "is the operator running?" in out


class _FakeKube:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    async def request(self, method: str, url_path: str, **kw: Any) -> Any:
        self.calls.append((method, url_path, kw))
        return kw.get("body")


async def test_apply_crd_is_a_forced_server_side_apply_of_the_chart_file():
    from pathlib import Path

    crd = yaml.safe_load((Path(__file__).resolve().parents[2] / "crds" / "pddeployment.yaml").read_text())
    kube = _FakeKube()
    await hooks.apply_crd(kube, crd)  # type: ignore[arg-type]
    ((method, url, kw),) = kube.calls
    assert method == "PATCH"
    assert url == "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/pddeployments.pdstack.io"
    assert kw["content_type"] == "application/apply-patch+yaml"
    assert kw["query"] == {"fieldManager": "pdstack-chart", "force": "true"} and kw["body"] == crd
    with pytest.raises(ValueError, match="accepted: a CustomResourceDefinition"):
        await hooks.apply_crd(kube, {"kind": "ConfigMap", "metadata": {"name": "x"}})  # type: ignore[arg-type]


async def test_apply_crd_against_the_test_cluster_when_it_serves_crds(cluster, tmp_path):
    """Live where the emulator serves apiextensions.k8s.io (the test cluster); skipped, saying so, where not."""
    from pathlib import Path

    import httpx

    async with httpx.AsyncClient() as http:
        r = await http.get(cluster.url.rstrip("/") + "/apis/apiextensions.k8s.io/v1", timeout=10)
    if r.status_code != 200 or "customresourcedefinitions" not in r.text:
        pytest.skip("this emulator serves no apiextensions.k8s.io/v1 CustomResourceDefinitions yet")

    src = Path(__file__).resolve().parents[2] / "crds" / "pddeployment.yaml"
    rc, out = await _hook("apply-crd", str(src))
    assert rc == 0, out
    assert "applied CustomResourceDefinition pddeployments.pdstack.io" in out


async def test_apply_crd_process_sends_one_forced_server_side_apply(tmp_path):
    """The hook as the Job runs it (a process, credentials from a kubeconfig) against a recording API stub: one
    PATCH of the chart's CRD, as apply-patch+yaml, force, field manager pdstack-chart; exit 0 and one line."""
    from pathlib import Path

    from aiohttp import web

    seen: list[tuple[str, str, dict, str, Any]] = []

    async def handle(request: web.Request) -> web.Response:
        body = await request.json()
        seen.append((request.method, request.path, dict(request.query), request.content_type, body))
        return web.json_response(body)

    app = web.Application()
    app.router.add_route("PATCH", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "stub",
        "clusters": [{"name": "stub", "cluster": {"server": f"http://127.0.0.1:{port}"}}],
        "users": [{"name": "hook", "user": {"token": "hook-token"}}],
        "contexts": [{"name": "stub", "context": {"cluster": "stub", "user": "hook"}}]}))
    src = Path(__file__).resolve().parents[2] / "charts" / "pdstack" / "crds" / "pddeployment.yaml"
    try:
        env = dict(os.environ, KUBECONFIG=str(kubeconfig))
        env.pop("KUBERNETES_SERVICE_HOST", None)
        proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "pdoperator.hooks", "apply-crd", str(src),
                                                    env=env, stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.STDOUT)
        out, _ = await asyncio.wait_for(proc.communicate(), timeout=60)
    finally:
        await runner.cleanup()
    assert proc.returncode == 0, out.decode()
    ((method, url, query, ctype, body),) = seen
    assert method == "PATCH" and url.endswith("/customresourcedefinitions/pddeployments.pdstack.io")
    assert query == {"fieldManager": "pdstack-chart", "force": "true"} and ctype == "application/apply-patch+yaml"
    assert body == yaml.safe_load(src.read_text())
    assert "applied CustomResourceDefinition pddeployments.pdstack.io (versions ['v1alpha1'])" in out.decode()
