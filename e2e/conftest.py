"""e2e on one of two backends: kind, or the test cluster (tests/cluster) with real processes.

kind: create a cluster, load both images, ``helm install`` the chart with the example CPU PDDeployment.
Skips the whole suite, saying why, without docker + kind + kubectl + helm.

testcluster: the API emulator behind a kubeconfig, its process kubelet (tests/cluster/proc_kubelet.py) running
every pod from its rendered container: the operator from the chart's Deployment (``python -m pdoperator`` and
its args, under its service account's stored RBAC), the router and the workers from what the operator renders
(``pdrt serve ...``). ``helm install`` (hooks.upgradeCRD=false: the test cluster serves no batch/v1 Jobs, so
the CRD comes from crds/ and the example is applied with kubectl, not installed with its pre-delete hook Job),
then ``kubectl apply`` of examples/cpu-demo.yaml (namespace, image and pull policy set to the loaded ones, the router
on two processes).

Environment:
  PDSTACK_E2E_BACKEND   kind | testcluster (default: kind, which skips saying what is missing without
                        docker and kind; `make e2e-testcluster` sets testcluster)
  PDSTACK_E2E_CLUSTER   kind cluster name (default pdstack-e2e); reused when it exists
  PDSTACK_E2E_KEEP=1    keep the cluster afterwards (default: delete the cluster this run created)
  TAG                   image tag to load (default dev; built by images/build.sh --no-smoke when absent)
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import urllib.request
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

from kube import (DEMO, NAMESPACE, RELEASE, ROOT, Kubectl, backend, eventually, missing_reason, sh,  # noqa: E402
                  which)
from pdruntime.util.ports import free_port  # noqa: E402


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).resolve().parent
    mine = [i for i in items if here in Path(str(i.path)).resolve().parents]
    if not mine:
        return
    if backend() == "testcluster":
        reason = testcluster_missing_reason()
        for item in mine:
            item.add_marker(pytest.mark.e2e)
            if reason:
                item.add_marker(pytest.mark.skip(reason=reason))
        return
    reason = missing_reason()
    for item in mine:
        item.add_marker(pytest.mark.kind)
        if reason:
            item.add_marker(pytest.mark.skip(reason=reason))


def testcluster_missing_reason() -> str | None:
    absent = [n for n in ("kubectl", "helm") if which(n) is None]
    return f"the test-cluster e2e needs {' and '.join(absent)} (`make tools`)" if absent else None


@pytest.fixture(scope="session")
def kubeconfig(request: pytest.FixtureRequest) -> Iterator[Path]:
    if backend() == "testcluster":
        yield request.getfixturevalue("testcluster").kubeconfig
        return
    name = os.environ.get("PDSTACK_E2E_CLUSTER", "pdstack-e2e")
    existing = sh("kind", "get", "clusters").stdout.split()
    created = name not in existing
    if created:
        sh("kind", "create", "cluster", "--name", name, "--config", str(ROOT / "e2e/kind-cluster.yaml"),
           "--wait", "180s", timeout=900)
    tag = os.environ.get("TAG", "dev")
    images = [f"pdstack-operator:{tag}", f"pdstack-runtime:{tag}"]
    if any(sh("docker", "image", "inspect", i, check=False).returncode != 0 for i in images):
        sh(str(ROOT / "images/build.sh"), "--no-smoke", timeout=3600)
    for image in images:
        sh("kind", "load", "docker-image", image, "--name", name, timeout=900)
    tmp = Path(tempfile.mkdtemp(prefix="pdstack-e2e-"))
    path = tmp / "kubeconfig"
    path.write_text(sh("kind", "get", "kubeconfig", "--name", name).stdout)
    try:
        yield path
    finally:
        if created and os.environ.get("PDSTACK_E2E_KEEP") != "1":
            sh("kind", "delete", "cluster", "--name", name, check=False, timeout=300)


@pytest.fixture(scope="session")
def testcluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The test cluster with its process kubelet, both images "loaded" (``kind load``), each with the ENTRYPOINT
    and CMD of its Dockerfile (images/*/Dockerfile)."""
    sys.path.insert(0, str(ROOT / "tests" / "cluster"))
    from testcluster import threaded  # (first: it puts the emulator's modules on sys.path)
    from proc_kubelet import DEV_IMAGES, ProcessKubelet

    tag = os.environ.get("TAG", "dev")
    images = {ref.replace(":dev", f":{tag}"): cmd for ref, cmd in DEV_IMAGES.items()}
    work = tmp_path_factory.mktemp("test-cluster")
    net = random.randint(100, 250)  # a loopback /24 of this run's own: pods are 127.0.<net>.<n>

    def kubelet(c: Any) -> Any:
        return ProcessKubelet(c.api, images=images, net=net, workdir=work,
                              credentials=c.service_account_kubeconfig)
    with threaded(work, kubelet=kubelet) as cluster:
        try:
            yield cluster
        finally:
            print(f"test-cluster pod logs: {work / 'pods'}")


@pytest.fixture(scope="session")
def kube(kubeconfig: Path, request: pytest.FixtureRequest) -> Iterator[Kubectl]:
    """The chart installed (kind values: local images, the example PDDeployment), its pair Ready."""
    if backend() == "testcluster":
        yield from _testcluster_kube(kubeconfig)
        return
    k = Kubectl(kubeconfig, NAMESPACE)
    tag = os.environ.get("TAG", "dev")
    k.helm("upgrade", "--install", RELEASE, str(ROOT / "charts/pdstack"), "--create-namespace",
           "-f", str(ROOT / "charts/pdstack/ci/kind-values.yaml"),
           "--set", f"operator.image.tag={tag}", "--set", f"runtime.image.tag={tag}",
           "--wait", "--timeout", "10m")
    eventually(lambda: k.json("get", "pddeployment", DEMO).get("status", {}).get("phase") == "Ready",
               timeout=900, what=f"PDDeployment {DEMO} phase Ready")
    yield k
    if os.environ.get("PDSTACK_E2E_KEEP") != "1" and k.helm_status() is not None:  # test_lifecycle uninstalls
        k.helm("uninstall", RELEASE, "--wait", timeout=300)


@pytest.fixture
def router_url(kube: Kubectl, request: pytest.FixtureRequest) -> Iterator[str]:
    """kubectl port-forward to the router Service (the Service, not a pod: what clients use); on the test
    cluster, a kube-proxy for it: each connection goes to a Ready router pod as the Service resolves then."""
    if backend() == "testcluster":
        url = request.getfixturevalue("router_proxy")
        eventually(lambda: _get_json(url + "/v1/models"), timeout=120, interval=1, what="the router")
        yield url
        return
    port = free_port()
    proc = subprocess.Popen([which("kubectl"), "-n", kube.namespace, "port-forward", f"svc/{DEMO}-router",
                             f"{port}:8000"], env=kube.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        eventually(lambda: _get_json(url + "/v1/models"), timeout=60, interval=1, what="port-forward to the router")
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture(scope="session")
def router_proxy(service_address: Any) -> Iterator[str]:
    """http://127.0.0.1:PORT in front of the router Service, on a loop of its own thread (kube-proxy's part:
    a router rollout moves new connections to the new pod, as the Service's endpoints do)."""
    loop = asyncio.new_event_loop()

    async def pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            while data := await r.read(65536):
                w.write(data)
                await w.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            w.close()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        addr = await loop.run_in_executor(None, service_address, f"{DEMO}-router", 8000)
        if addr is None:  # no Ready endpoint: the connection is refused
            writer.close()
            return
        host, port = addr.rsplit(":", 1)
        try:
            up_r, up_w = await asyncio.open_connection(host, int(port))
        except OSError:
            writer.close()
            return
        await asyncio.gather(pipe(reader, up_w), pipe(up_r, writer))

    server = loop.run_until_complete(asyncio.start_server(handle, "127.0.0.1", 0))
    port = server.sockets[0].getsockname()[1]
    thread = threading.Thread(target=loop.run_forever, daemon=True, name="router-proxy")
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        loop.call_soon_threadsafe(server.close)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def _get_json(url: str) -> Any:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return json.load(r)
    except OSError:
        return None


@pytest.fixture(scope="session")
def service_address(request: pytest.FixtureRequest) -> Any:
    """testcluster: ``(name, port) -> "ip:port"`` of a Ready pod behind the Service (kube-proxy's answer), or None."""
    from testcluster import call_in_loop
    tc = request.getfixturevalue("testcluster")

    def resolve(name: str, port: int) -> str | None:
        addr = call_in_loop(tc, tc.kubelet.service_address, NAMESPACE, name, port)
        return f"{addr[0]}:{addr[1]}" if addr else None
    return resolve


def example_manifest(tag: str) -> str:
    """examples/cpu-demo.yaml as the test cluster runs it: in the release namespace, the loaded runtime image."""
    doc = yaml.safe_load((ROOT / "examples/cpu-demo.yaml").read_text())
    doc["metadata"]["namespace"] = NAMESPACE
    doc["spec"]["image"] = f"pdstack-runtime:{tag}"
    doc["spec"]["podTemplate"] = {"imagePullPolicy": "Never"}
    # the router on two processes (spec.router.processes): the operator's topology pushes, its drain reads of
    # /config (tests/test_lifecycle.py's scale), `kubectl pd requests` and the Service meet the whole router
    doc["spec"]["router"]["processes"] = 2
    return yaml.safe_dump(doc)


def _testcluster_kube(kubeconfig: Path) -> Iterator[Kubectl]:
    k = Kubectl(kubeconfig, NAMESPACE)
    tag = os.environ.get("TAG", "dev")
    k.helm("install", RELEASE, str(ROOT / "charts/pdstack"), "--create-namespace",
           "-f", str(ROOT / "charts/pdstack/ci/kind-values.yaml"),
           "--set", f"operator.image.tag={tag}", "--set", f"runtime.image.tag={tag}",
           "--set", "example.enabled=false", "--set", "hooks.upgradeCRD=false",
           "--set", f"test.router={DEMO}-router",
           "--wait", "--timeout", "5m")
    k("apply", "-f", "-", input=example_manifest(tag))
    eventually(lambda: k.json("get", "pddeployment", DEMO).get("status", {}).get("phase") == "Ready",
               timeout=420, what=f"PDDeployment {DEMO} phase Ready")
    yield k
    if os.environ.get("PDSTACK_E2E_KEEP") != "1" and k.helm_status() is not None:
        k("delete", "pddeployment", "--all", "--wait", "--timeout=120s", check=False, timeout=150)
        k.helm("uninstall", RELEASE, "--wait", timeout=300)
