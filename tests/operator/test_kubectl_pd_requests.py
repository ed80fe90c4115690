"""``kubectl-pd requests`` and ``status``, and the emulator's ``pods/proxy`` they go through.

* The emulator's pods/proxy against a real HTTP server on loopback standing in for a pod: path, query and
  headers forwarded (the caller's Authorization not: the API server consumed it), the pod's status and
  body returned; 404 unknown pod, 400 no pod IP, 503 nothing listening, 403 without ``get pods/proxy``.
* ``kubectl-pd requests`` through the emulator's pods/proxy to a REAL router process (``pdrt serve --role
  router``) holding the router-admin token: the router's verdict, its unreachable workers; exit 2 with a
  clear message for no router pod, no RBAC, a wrong token, no Secret.
* ``kubectl-pd status`` (table and json) from a PDDeployment and its pods.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import io
import json
import random
from typing import Any

import aiohttp.web
import httpx
import kmock
import pytest
import yaml

from live_stack import start_router, stop
from pdop_harness import NS, PODS, eventually, write_kubeconfig
from pdop_k8s_emulator import PDEmulator, R
from pdoperator.cli import kubectl_pd as cli
from pdoperator.core import rbac
from pdoperator.core.render import TopologyPair, topology_doc
from pdruntime.util.ports import free_port

SECRETS = R("", "v1", "secrets")
PDDS = R("pdstack.io", "v1alpha1", "pddeployments")
PORT = 8000


async def kpd(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    rc = await asyncio.to_thread(cli.main, list(argv), out)  # asyncio.run of its own, in a thread
    return rc, out.getvalue()


def pod(name: str, ip: str | None, *, port: int | None = None, labels: dict[str, str] | None = None,
        ready: bool = True) -> dict[str, Any]:
    ctr: dict[str, Any] = {"name": "c", "image": "i"}
    if port:
        ctr["ports"] = [{"containerPort": port}]
    status: dict[str, Any] = {"phase": "Running",
                              "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
    if ip:
        status["podIP"] = ip
    return {"metadata": {"name": name, "labels": labels or {}}, "spec": {"containers": [ctr], "nodeName": "n"},
            "status": status}


async def echo_server(host: str) -> tuple[aiohttp.web.AppRunner, int]:
    """A pod's HTTP server: echoes method, path, query and headers; /deny answers 401 with a body."""
    async def echo(request: aiohttp.web.Request) -> aiohttp.web.Response:
        if request.path == "/deny":
            return aiohttp.web.json_response({"error": "needs the admin token"}, status=401)
        return aiohttp.web.json_response({"method": request.method, "path": request.path,
                                          "query": request.rel_url.raw_query_string,
                                          "body": (await request.read()).decode(),
                                          "headers": {k.lower(): v for k, v in request.headers.items()}}, status=207)
    app = aiohttp.web.Application()
    app.router.add_route("*", "/{tail:.*}", echo)
    runner = aiohttp.web.AppRunner(app)
    await runner.setup()
    site = aiohttp.web.TCPSite(runner, host, 0)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]


async def test_emulator_pods_proxy_is_the_api_servers():
    async with PDEmulator() as api, kmock.Server(api) as server:
        runner, port = await echo_server("127.0.0.1")
        try:
            api.seed(PODS, NS, pod("echo", "127.0.0.1", port=port))
            api.seed(PODS, NS, pod("noip", None, port=port))
            base = f"{str(server.url).rstrip('/')}/api/v1/namespaces/{NS}/pods"
            async with httpx.AsyncClient(timeout=20) as http:
                r = await http.get(f"{base}/echo:{port}/proxy/debug/requests?x=1&y=a%20b",
                                   headers={"Authorization": "Bearer caller-k8s-token", "X-PDStack-Admin-Token": "t0k"})
                assert r.status_code == 207, r.text  # the pod's own status
                got = r.json()
                assert (got["method"], got["path"], got["query"]) == ("GET", "/debug/requests", "x=1&y=a%20b")
                assert got["headers"]["x-pdstack-admin-token"] == "t0k" and "authorization" not in got["headers"]
                r = await http.post(f"{base}/echo/proxy/v1/x", content=b'{"a": 1}')  # port: the first container port
                assert r.status_code == 207 and r.json()["body"] == '{"a": 1}' and r.json()["method"] == "POST"
                r = await http.get(f"{base}/echo:{port}/proxy/deny")
                assert r.status_code == 401 and r.json() == {"error": "needs the admin token"}
                r = await http.get(f"{base}/absent:{port}/proxy/")
                assert r.status_code == 404 and r.json()["reason"] == "NotFound"
                assert r.json()["message"] == 'pods "absent" not found'
                r = await http.get(f"{base}/noip:{port}/proxy/")
                assert r.status_code == 400 and r.json()["message"] == "address not allowed"
                r = await http.get(f"{base}/a:b:c:d/proxy/")
                assert r.status_code == 400 and "invalid pod request" in r.json()["message"]
                closed = await asyncio.to_thread(_closed_port)
                r = await http.get(f"{base}/echo:{closed}/proxy/")
                assert r.status_code == 503 and r.json()["message"].startswith("error trying to reach service")
                # RBAC: the operator's own rules do not include pods/proxy; kubectl-pd's reader needs it
                api.rbac = copy.deepcopy(rbac.NAMESPACED_RULES)
                r = await http.get(f"{base}/echo:{port}/proxy/x")
                assert r.status_code == 403 and 'cannot get resource "pods" subresource "proxy"' in r.json()["message"]
                api.grant({"apiGroups": [""], "resources": ["pods/proxy"], "verbs": ["get"]})
                assert (await http.get(f"{base}/echo:{port}/proxy/x")).status_code == 207
                assert (await http.post(f"{base}/echo:{port}/proxy/x")).status_code == 403  # POST is create
            assert ("get", "", "pods/proxy", NS) in api.requests and ("create", "", "pods/proxy", NS) in api.requests
        finally:
            await runner.cleanup()


def _closed_port() -> int:
    return free_port()  # nothing listens there


async def test_requests_through_pods_proxy_to_a_real_router(tmp_path, capsys):
    net = random.randint(100, 250)
    ip, token = f"127.0.{net}.2", "router-admin-secret-token"
    # pair 0's workers are not running: the router says so, and that nothing is live
    topo = topology_doc("r1", [TopologyPair(0, True, f"127.0.{net}.10", f"127.0.{net}.11")], 1)
    router = start_router(ip, topo, token, tmp_path)
    try:
        async with PDEmulator() as api, kmock.Server(api) as server:
            write_kubeconfig(str(server.url).rstrip("/"))
            rc, _ = await kpd("requests", "llm")
            assert rc == 2 and "no ready router pod of PDDeployment default/llm" in capsys.readouterr().err
            labels = {"pdstack.io/deployment": "llm", "pdstack.io/component": "router"}
            api.seed(PODS, NS, pod("llm-router-abc", ip, port=PORT, labels=labels))
            rc, _ = await kpd("requests", "llm")
            assert rc == 2 and "Secret default/llm-router-admin is missing" in capsys.readouterr().err
            api.seed(SECRETS, NS, {"metadata": {"name": "llm-router-admin"},
                                   "data": {"token": base64.b64encode(b"wrong").decode()}})
            await eventually(lambda: _healthy(ip), timeout=60, interval=0.2, what="router up")
            rc, _ = await kpd("requests", "llm")
            err = capsys.readouterr().err
            assert rc == 2 and "HTTP 401" in err and "admin token was not accepted" in err, err
            secret = api.read(SECRETS, NS, "llm-router-admin")
            secret["data"]["token"] = base64.b64encode(token.encode()).decode()
            api._store(SECRETS, NS, "llm-router-admin", secret)

            rc, text = await kpd("requests", "llm")
            assert rc == 0, capsys.readouterr().err
            lines = text.splitlines()
            assert lines[0] == "no live request"
            assert any(ln.startswith(f"unreachable: prefill http://127.0.{net}.10:8000") for ln in lines)
            assert lines[-1].startswith("verdict: nothing is live in the stack")
            rc, text = await kpd("requests", "llm", "-o", "json")
            report = json.loads(text)
            assert rc == 0 and report["routers"] == ["llm-router-abc"] and report["requests"] == []
            assert report["verdict"].startswith("nothing is live in the stack") and len(report["unreachable"]) == 2

            # a user with the operator's rules only (no pods/proxy): a clear 403, exit 2
            api.rbac = copy.deepcopy(rbac.NAMESPACED_RULES)
            rc, _ = await kpd("requests", "llm")
            err = capsys.readouterr().err
            assert rc == 2 and "HTTP 403" in err and "needs get on pods/proxy and on Secret llm-router-admin" in err
            assert ("get", "", "pods/proxy", NS) in api.requests
    finally:
        stop(router)


def _healthy(ip: str) -> bool:
    try:
        return httpx.get(f"http://{ip}:{PORT}/metrics", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


async def test_status_table_and_json(capsys):
    async with PDEmulator() as api, kmock.Server(api) as server:
        write_kubeconfig(str(server.url).rstrip("/"))
        rc, _ = await kpd("status", "llm")
        assert rc == 2 and "PDDeployment default/llm not found" in capsys.readouterr().err
        obj = api.seed(PDDS, NS, {"metadata": {"name": "llm"}, "spec": {"image": "i", "pairs": 2}, "status": {
            "phase": "Progressing", "readyPairs": 1, "currentRevision": "aaa111", "updateRevision": "bbb222",
            "topologyVersion": 7,
            "pairs": [{"index": 0, "revision": "aaa111", "ready": True, "phase": "Ready", "restarts": 0},
                      {"index": 1, "revision": "bbb222", "ready": False, "phase": "Starting", "restarts": 2}],
            "conditions": [
                {"type": "ConfigDrift", "status": "True", "reason": "Drifted",
                 "message": "Deployment/llm-router: spec.replicas; image: revision aaa111 container worker runs 2 "
                            "digests: sha256:a (x), sha256:b (y)"},
                {"type": "Stalled", "status": "True", "reason": "PairStalled", "message": "pair 0 stalled in x"}],
            "drift": [{"source": "children", "object": "Deployment/llm-router", "field": "spec.replicas"},
                      {"source": "image", "object": "revision aaa111", "field": "container worker",
                       "seen": "2 digests: sha256:a (x), sha256:b (y)"}],
            "stalls": [{"pair": 0, "stage": "decode/running", "oldestAgeSeconds": 80, "tokensPerSecond": 0,
                        "watchdogFires": 0, "since": "2026-12-01T12:00:00.000Z", "reason": "pair 0 stalled in x"}]}})
        owner = [{"apiVersion": "pdstack.io/v1alpha1", "kind": "PDDeployment", "name": "llm",
                  "uid": obj["metadata"]["uid"]}]
        for k, role, ready in ((0, "prefill", True), (0, "decode", True), (1, "prefill", True), (1, "decode", False)):
            p = pod(f"llm-{k}-{role}-x", f"10.0.0.{k * 2 + (role == 'decode') + 1}", ready=ready, labels={
                "pdstack.io/deployment": "llm", "pdstack.io/component": "worker", "pdstack.io/pair": str(k),
                "pdstack.io/role": role})
            p["metadata"]["ownerReferences"] = owner
            api.seed(PODS, NS, p)
        api.seed(PODS, NS, pod("stranger-0-decode", "10.0.0.9", labels={  # not owned by this PDDeployment
            "pdstack.io/deployment": "llm", "pdstack.io/component": "worker", "pdstack.io/pair": "0",
            "pdstack.io/role": "decode"}))
        rc, text = await kpd("status", "llm")
        assert rc == 0, capsys.readouterr().err
        lines = text.splitlines()
        assert lines[0] == "PDDeployment default/llm: phase Progressing, ready pairs 1/2, topology version 7"
        assert lines[1] == "revisions: current aaa111, update bbb222, last known-good -"
        assert lines[3].split() == ["GROUP", "PHASE", "READY", "REVISION", "RESTARTS", "PODS"]
        assert lines[4].split(None, 5) == ["0", "Ready", "yes", "aaa111", "0",
                                           "llm-0-prefill-x (prefill, ready), llm-0-decode-x (decode, ready)"]
        assert lines[5].split(None, 5)[:5] == ["1", "Starting", "no", "bbb222", "2"]
        assert "llm-1-decode-x (decode, running)" in lines[5] and "stranger" not in text
        assert "  children  Deployment/llm-router: spec.replicas" in lines
        assert any(ln.startswith("  image     revision aaa111 container worker runs 2 digests") for ln in lines)
        assert "  pair 0 since 2026-12-01T12:00:00.000Z: pair 0 stalled in x" in lines
        rc, text = await kpd("status", "llm", "-o", "json")
        report = json.loads(text)
        assert rc == 0 and report["revisions"] == {"current": "aaa111", "update": "bbb222", "lastKnownGood": None}
        assert [(g["index"], [p["name"] for p in g["pods"]]) for g in report["groups"]] == [
            (0, ["llm-0-prefill-x", "llm-0-decode-x"]), (1, ["llm-1-prefill-x", "llm-1-decode-x"])]
        assert [d["source"] for d in report["drift"]] == ["children", "image"]
        assert report["stalls"][0]["stage"] == "decode/running"
        # drift keeps its exit codes: 1 drift, 0 none
        rc, text = await kpd("drift", "llm", "-o", "json")
        assert rc == 1 and [d["source"] for d in json.loads(text)["lines"]] == ["children", "image"]
        rc, text = await kpd("status", "llm", "-o", "yaml")
        assert rc == 0 and yaml.safe_load(text)["topologyVersion"] == 7


@pytest.mark.parametrize("argv", [["requests"], ["status"]])
def test_usage_errors_exit_2(argv, capsys):
    assert cli.main(argv) == 2 and "the following arguments are required: name" in capsys.readouterr().err
