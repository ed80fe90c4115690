"""The operator logs in the way kubectl does: every standard kubeconfig style, and in-cluster with rotation.

The emulator serves HTTPS with its own CA and demands credentials (401 otherwise): bearer tokens,
or a client certificate signed by its CA. For each style the real operator (kopf + the
``kubernetes_asyncio`` client) starts, and reconciles a PDDeployment to Ready:

* CA data inline (``certificate-authority-data``, the kind/minikube style kopf's own login rejects)
  with a bearer token;
* a client certificate and key, inline data;
* an exec credential plugin (a small script printing an ExecCredential, as EKS/GKE plugins do);
* in-cluster: service-account token file + CA file, and the token rotated mid-run (old one revoked).
"""

from __future__ import annotations

import base64
import os
import shutil
import ssl
import subprocess
import sys
from pathlib import Path

import aiohttp.test_utils
import kmock
import pytest
import yaml

from pdop_harness import IMAGE, KUBECONFIG, NS, Cluster, eventually, manifest, running_operator
from pdop_k8s_emulator import Kubelet, PDEmulator


pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI (certificates)")


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    """A CA, a server certificate for 127.0.0.1 and a client certificate (CN=op-cert), all via openssl."""
    d = tmp_path_factory.mktemp("pki")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt", "-days", "1",
             "-subj", "/CN=emu-ca", cwd=d)
    (d / "server.ext").write_text("subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n")
    (d / "client.ext").write_text("extendedKeyUsage=clientAuth\n")
    for who, cn in (("server", "127.0.0.1"), ("client", "op-cert")):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{who}.key", "-out", f"{who}.csr",
                 "-subj", f"/CN={cn}", cwd=d)
        _openssl("x509", "-req", "-in", f"{who}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{who}.crt", "-days", "1", "-extfile", f"{who}.ext", cwd=d)
    return d


def _tls_server_cls(ctx: ssl.SSLContext) -> type:
    class TLSServer(aiohttp.test_utils.RawTestServer):
        async def start_server(self, loop=None, **kw):  # noqa: ANN001
            return await super().start_server(loop=loop, ssl=ctx, **kw)
    return TLSServer


def _b64(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


def _write(cluster_cfg: dict, user: dict) -> None:
    Path(KUBECONFIG).write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "emu",
        "clusters": [{"name": "emu", "cluster": cluster_cfg}], "users": [{"name": "u", "user": user}],
        "contexts": [{"name": "emu", "context": {"cluster": "emu", "user": "u", "namespace": NS}}]}))


async def _reconciles(c: Cluster, name: str) -> None:
    c.apply(manifest(name, pairs=1))
    await eventually(lambda: c.condition(name, "Ready").get("status") == "True", timeout=30, what=f"{name} Ready")


@pytest.fixture
async def tls_cluster(pki):
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(pki / "server.crt", pki / "server.key")
    ctx.load_verify_locations(pki / "ca.crt")
    ctx.verify_mode = ssl.CERT_OPTIONAL  # a client certificate is one way to authenticate, tokens another
    async with PDEmulator(tokens={"token-1": "op-token"}) as api, \
            kmock.Server(api, server_cls=_tls_server_cls(ctx)) as server:
        api.client_cert_users.add("op-cert")
        kubelet = Kubelet(api, images=[IMAGE])
        kubelet.add_node("gpu-a", 8)
        async with kubelet:
            url = str(server.url).rstrip("/")
            assert url.startswith("https://127.0.0.1:")
            yield Cluster(api, kubelet, url)


def _users(c: Cluster) -> set[str]:
    return {r[0] for r in c.api.request_log}


async def test_ca_data_inline_and_a_token(tls_cluster, pki):
    c = tls_cluster
    _write({"server": c.url, "certificate-authority-data": _b64(pki / "ca.crt")}, {"token": "token-1"})
    async with running_operator(c):
        await _reconciles(c, "ca-data")
    assert _users(c) == {"op-token"}
    # kubectl-pd's cluster commands use the same client and credentials
    import asyncio
    import io

    from pdoperator.cli import kubectl_pd as cli
    out = io.StringIO()
    assert await asyncio.to_thread(cli.main, ["status", "ca-data", "-n", NS], out) == 0
    text = out.getvalue()
    assert text.startswith(f"PDDeployment {NS}/ca-data: phase Ready, ready pairs 1/1") and "Ready=True" in text
    out = io.StringIO()
    assert await asyncio.to_thread(cli.main, ["revisions", "ca-data"], out) == 0  # the context's namespace
    rows = out.getvalue().splitlines()
    assert rows[0].split()[:2] == ["NUMBER", "REVISION"] and len(rows) == 2 and rows[1].split()[0] == "1"
    c.api.tokens = {}  # revoked: the CLI says so instead of a traceback
    assert await asyncio.to_thread(cli.main, ["status", "ca-data", "-n", NS], io.StringIO()) == 2


async def test_client_certificate(tls_cluster, pki):
    c = tls_cluster
    _write({"server": c.url, "certificate-authority": str(pki / "ca.crt")},
           {"client-certificate-data": _b64(pki / "client.crt"), "client-key-data": _b64(pki / "client.key")})
    async with running_operator(c):
        await _reconciles(c, "cert")
    assert _users(c) == {"op-cert"}


async def test_exec_credential_plugin(tls_cluster, pki, tmp_path):
    c = tls_cluster
    plugin = tmp_path / "cred-plugin.py"
    calls = tmp_path / "calls"
    plugin.write_text(
        "import json, sys\n"
        f"open({str(calls)!r}, 'a').write('x')\n"
        "print(json.dumps({'apiVersion': 'client.authentication.k8s.io/v1beta1', 'kind': 'ExecCredential',"
        " 'status': {'token': 'token-1'}}))\n")
    _write({"server": c.url, "certificate-authority-data": _b64(pki / "ca.crt")},
           {"exec": {"apiVersion": "client.authentication.k8s.io/v1beta1", "command": sys.executable,
                     "args": [str(plugin)], "interactiveMode": "Never"}})
    async with running_operator(c):
        await _reconciles(c, "exec")
    assert calls.read_text()  # the plugin really ran
    assert _users(c) == {"op-token"}


async def test_in_cluster_with_a_token_rotated_mid_run(tls_cluster, pki, tmp_path, monkeypatch):
    c = tls_cluster
    sa = tmp_path / "serviceaccount"
    sa.mkdir()
    (sa / "token").write_text("token-1")
    (sa / "ca.crt").write_bytes((pki / "ca.crt").read_bytes())
    port = c.url.rsplit(":", 1)[1]
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", port)
    monkeypatch.setenv("PDSTACK_SA_DIR", str(sa))
    monkeypatch.delenv("KUBECONFIG", raising=False)
    async with running_operator(c):
        await _reconciles(c, "incluster")
        # the kubelet rotates the projected token; the API server stops accepting the old one
        (sa / "token").write_text("token-2")
        c.api.tokens = {"token-2": "op-token-2"}
        c.api.close_watches()  # kopf's streams reconnect: with the old token they get 401 and re-login
        c.patch_spec("incluster", {"pairs": 2})
        await eventually(lambda: c.condition("incluster", "Ready").get("status") == "True"
                         and c.pdd("incluster")["status"]["readyPairs"] == 2, timeout=40,
                         what="reconciled with the rotated token")
    assert "op-token-2" in _users(c)
    writes_after = [r for r in c.api.request_log if r[0] == "op-token-2" and r[1] in ("create", "patch")]
    assert writes_after, "no write with the rotated token"
    assert os.environ.get("KUBECONFIG") is None


def test_missing_credentials_say_what_was_tried(tmp_path, capsys):
    import io

    from pdoperator.cli import kubectl_pd as cli
    assert cli.main(["status", "x", "--kubeconfig", str(tmp_path / "nope")], io.StringIO()) == 2
    err = capsys.readouterr().err
    assert "no usable Kubernetes credentials: kubeconfig" in err and "nope" in err
    assert "accepted: a kubeconfig ($KUBECONFIG, --kubeconfig, ~/.kube/config) or a pod with a service account" in err
