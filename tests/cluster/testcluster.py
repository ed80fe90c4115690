"""The test cluster: the API emulator and the simulated kubelets behind a kubeconfig, for real clients.

``make test-cluster`` (or ``python tests/cluster/testcluster.py``) starts it, prints the kubeconfig path
and keeps running until Ctrl-C; then ``kubectl`` and ``helm`` work against it with no Docker::

    export KUBECONFIG=/tmp/pdstack-test-cluster/kubeconfig
    helm install pdstack charts/pdstack -n pdstack --create-namespace
    kubectl apply -f examples/cpu-demo.yaml && kubectl get pdd -o wide

It starts bare, as a fresh cluster does: no CRDs (``helm install`` or ``kubectl apply -f crds/`` stores
them), RBAC from stored Roles and bindings (the kubeconfig's user is ``kubernetes-admin`` in
``system:masters``; :meth:`TestCluster.service_account_kubeconfig` gives a service account's credentials,
under which only the stored RBAC applies), and three nodes (two with 8 GPUs, one CPU-only).
Tests share one per module through :func:`threaded`, which runs it on its own event loop.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import os
import secrets
import ssl
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable, Iterator

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
for p in (ROOT / "tests" / "operator", ROOT / "operator", ROOT / "runtime"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import aiohttp.test_utils  # noqa: E402
import kmock  # noqa: E402
import yaml  # noqa: E402

from pdop_k8s_emulator import Kubelet, PDEmulator  # noqa: E402

ADMIN = "kubernetes-admin"


def make_pki(d: Path) -> Path:
    """A CA and a serving certificate for 127.0.0.1/localhost (openssl), as kubeadm makes for a cluster.
    TLS is not optional: client-go sends bearer tokens only over https."""
    if (d / "server.crt").exists():
        return d

    def ossl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)
    ossl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt", "-days", "30",
         "-subj", "/CN=pdstack-test-cluster-ca")
    (d / "server.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n")
    ossl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr",
         "-subj", "/CN=kube-apiserver")
    ossl("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
         "-out", "server.crt", "-days", "30", "-extfile", "server.ext")
    return d


def _tls_server_cls(ctx: ssl.SSLContext) -> type:
    class TLSServer(aiohttp.test_utils.RawTestServer):
        async def start_server(self, loop: Any = None, **kw: Any) -> None:
            return await super().start_server(loop=loop, ssl=ctx, **kw)
    return TLSServer


class TestCluster:
    """One API emulator + kubelets on loopback, with a kubeconfig for ``kubernetes-admin``."""

    __test__ = False  # not a pytest class

    def __init__(self, workdir: str | Path | None = None, *, port: int = 0, crds: tuple[Any, ...] = (),
                 kubelet: Callable[["TestCluster"], Kubelet] | None = None):
        self.dir = Path(workdir or tempfile.mkdtemp(prefix="pdstack-test-cluster-"))
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = port
        self.admin_token = secrets.token_hex(16)
        self.api = PDEmulator(crds=crds, tokens={self.admin_token: ADMIN}, stored_rbac=True, validate_status=True,
                              groups={ADMIN: ("system:masters",)})
        # ``kubelet``: another node agent (proc_kubelet.ProcessKubelet runs every pod as a local process)
        self.kubelet = kubelet(self) if kubelet else Kubelet(self.api)
        self._sa_kubeconfigs: dict[tuple[str, str], Path] = {}
        self.url = ""
        self._server: Any = None

    @property
    def kubeconfig(self) -> Path:
        return self.dir / "kubeconfig"

    def _write_kubeconfig(self, path: Path, user: str, token: str, namespace: str = "default") -> Path:
        ca = base64.b64encode((self.dir / "ca.crt").read_bytes()).decode()
        path.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "pdstack-test",
            "clusters": [{"name": "pdstack-test", "cluster": {"server": self.url,
                                                              "certificate-authority-data": ca}}],
            "users": [{"name": user, "user": {"token": token}}],
            "contexts": [{"name": "pdstack-test",
                          "context": {"cluster": "pdstack-test", "user": user, "namespace": namespace}}]}))
        return path

    def service_account_kubeconfig(self, namespace: str, name: str) -> Path:
        """A kubeconfig with a token of ``system:serviceaccount:NAMESPACE:NAME`` (as a projected token)."""
        if (namespace, name) in self._sa_kubeconfigs:
            return self._sa_kubeconfigs[(namespace, name)]
        token = secrets.token_hex(16)
        assert self.api.tokens is not None
        self.api.tokens[token] = f"system:serviceaccount:{namespace}:{name}"
        path = self._write_kubeconfig(self.dir / f"kubeconfig-{namespace}-{name}", name, token, namespace)
        self._sa_kubeconfigs[(namespace, name)] = path
        return path

    async def __aenter__(self) -> "TestCluster":
        make_pki(self.dir)
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(self.dir / "server.crt", self.dir / "server.key")
        await self.api.__aenter__()
        self._server = kmock.Server(self.api, port=self.port, server_cls=_tls_server_cls(ctx))
        await self._server.__aenter__()
        self.url = str(self._server.url).rstrip("/")
        self.kubelet.add_node("gpu-a", 8, {"pdstack.io/gpu": "h100"})
        self.kubelet.add_node("gpu-b", 8, {"pdstack.io/gpu": "h100"})
        self.kubelet.add_node("cpu-a", 0)
        await self.kubelet.__aenter__()
        self._write_kubeconfig(self.kubeconfig, ADMIN, self.admin_token)
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.kubelet.__aexit__(*exc)
        await self._server.__aexit__(*exc)
        await self.api.__aexit__(*exc)


@contextlib.contextmanager
def threaded(workdir: str | Path | None = None, **kw: Any) -> Iterator[TestCluster]:
    """A running :class:`TestCluster` (``kw``: its options) on an event loop of its own thread (for sync tests
    and subprocesses)."""
    loop = asyncio.new_event_loop()
    cluster = TestCluster(workdir, **kw)
    started = threading.Event()
    stop: asyncio.Event | None = None
    errors: list[BaseException] = []

    async def run() -> None:
        nonlocal stop
        stop = asyncio.Event()
        try:
            async with cluster:
                started.set()
                await stop.wait()
        except BaseException as e:  # noqa: BLE001 - reported to the caller
            errors.append(e)
            started.set()

    thread = threading.Thread(target=loop.run_until_complete, args=(run(),), daemon=True, name="test-cluster")
    thread.start()
    started.wait(30)
    if errors:
        raise errors[0]
    try:
        yield cluster
    finally:
        loop.call_soon_threadsafe(stop.set)  # type: ignore[union-attr]
        thread.join(10)
        loop.close()


def call_in_loop(cluster: TestCluster, fn: Any, *args: Any) -> Any:
    """Run ``fn(*args)`` on the cluster's loop (the emulator's state is only touched there)."""
    loop = cluster.kubelet._task.get_loop()  # type: ignore[union-attr]

    async def wrapped() -> Any:
        return fn(*args)
    return asyncio.run_coroutine_threadsafe(wrapped(), loop).result(10)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--port", type=int, default=int(os.environ.get("PDSTACK_TEST_CLUSTER_PORT", "0")),
                    help="port on 127.0.0.1 (default: a free one)")
    ap.add_argument("--dir", default=os.environ.get("PDSTACK_TEST_CLUSTER_DIR",
                                                    os.path.join(tempfile.gettempdir(), "pdstack-test-cluster")),
                    help="where the kubeconfig is written")
    ap.add_argument("--processes", action="store_true",
                    help="run every pod as a local process (proc_kubelet.py: the operator from the chart, the router "
                         "and workers from their pods), with pdstack-operator:dev and pdstack-runtime:dev loaded")
    args = ap.parse_args(argv)
    kubelet = None
    if args.processes:
        import random

        from proc_kubelet import DEV_IMAGES, ProcessKubelet

        def kubelet(c: TestCluster) -> Kubelet:
            return ProcessKubelet(c.api, images=DEV_IMAGES, net=random.randint(100, 250), workdir=c.dir,
                                  credentials=c.service_account_kubeconfig)

    async def serve() -> None:
        async with TestCluster(args.dir, port=args.port, kubelet=kubelet) as c:
            print(f"test cluster at {c.url}", flush=True)
            print(f"kubeconfig: {c.kubeconfig}", flush=True)
            print(f"  export KUBECONFIG={c.kubeconfig}", flush=True)
            print("  helm install pdstack charts/pdstack -n pdstack --create-namespace", flush=True)
            print("  kubectl apply -f examples/cpu-demo.yaml && kubectl get pdd -o wide", flush=True)
            if args.processes:
                print(f"  pods run as processes; their output: {c.dir / 'pods'} (and kubectl logs)", flush=True)
            print("Ctrl-C stops it.", flush=True)
            await asyncio.Event().wait()

    try:
        asyncio.run(serve())
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
