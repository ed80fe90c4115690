"""The process kubelet (proc_kubelet.py) without a model: pods are local processes from their containers, a
Service name resolves to a Ready pod, ``kubectl logs`` reads the output, and the test cluster's CNI drops a
connection that the stored NetworkPolicies deny (the client's connect timeout fires) while it passes others."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import time

import pytest

from proc_kubelet import ProcessKubelet
from testcluster import ROOT, call_in_loop, threaded

KUBECTL = shutil.which("kubectl", path=f"{ROOT / '.tools' / 'bin'}:{os.environ.get('PATH', '')}")
pytestmark = pytest.mark.skipif(not KUBECTL, reason="kubectl not installed (make tools)")
IMAGE = "pdstack-runtime:dev"
NS = "t"
# the client: one GET with a 3-s timeout; prints what happened, exits 0 only on an answer
CLIENT = ("import os, urllib.request\n"
          "try:\n"
          "    urllib.request.urlopen(os.environ['URL'], timeout=3).read(); print('answered')\n"
          "except Exception as e:\n"
          "    print('failed:', e); raise SystemExit(1)\n")


@pytest.fixture(scope="module")
def tc(tmp_path_factory):
    work = tmp_path_factory.mktemp("proc-kubelet")

    def kubelet(c):
        return ProcessKubelet(c.api, images={IMAGE: ([], ["python"])}, net=random.randint(100, 250), workdir=work,
                              credentials=c.service_account_kubeconfig)
    with threaded(work, kubelet=kubelet) as cluster:
        yield cluster


def kubectl(tc, *args: str, stdin: str | None = None) -> str:
    p = subprocess.run([KUBECTL, "-n", NS, *args], input=stdin, capture_output=True, text=True, timeout=60,
                       env={**os.environ, "KUBECONFIG": str(tc.kubeconfig), "HOME": str(tc.dir)})
    assert p.returncode == 0, p.stderr
    return p.stdout


def pod(name: str, labels: dict, command: list[str], **spec) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": NS, "labels": labels},
            "spec": {"containers": [{"name": "c", "image": IMAGE, "imagePullPolicy": "Never", "command": command,
                                     **spec.pop("container", {})}], **spec}}


def wait_phase(tc, name: str, phases: tuple[str, ...], timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        obj = json.loads(kubectl(tc, "get", "pod", name, "-o", "json"))
        if (obj.get("status") or {}).get("phase") in phases:
            return obj
        time.sleep(0.2)
    raise AssertionError(f"pod {name} not {phases} within {timeout} s: {obj.get('status')}")


def test_pods_run_their_commands_reach_each_other_through_a_service_and_policies_drop_what_they_deny(tc):
    subprocess.run([KUBECTL, "create", "namespace", NS], capture_output=True, timeout=60,
                   env={**os.environ, "KUBECONFIG": str(tc.kubeconfig), "HOME": str(tc.dir)})
    server = pod("server", {"app": "server"}, ["python", "-m", "http.server", "8000", "--bind", "0.0.0.0"],
                 container={"ports": [{"name": "http", "containerPort": 8000}],
                            "readinessProbe": {"httpGet": {"path": "/", "port": "http"}}})
    svc = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "server", "namespace": NS},
           "spec": {"selector": {"app": "server"}, "ports": [{"port": 80, "targetPort": "http"}]}}
    kubectl(tc, "apply", "-f", "-", stdin=json.dumps({"apiVersion": "v1", "kind": "List", "items": [server, svc]}))
    deadline = time.monotonic() + 60
    while not any(c["type"] == "Ready" and c["status"] == "True" for c in
                  json.loads(kubectl(tc, "get", "pod", "server", "-o", "json")).get("status", {}).get("conditions", [])):
        assert time.monotonic() < deadline, "server pod never Ready (its readiness probe)"
        time.sleep(0.2)
    server_ip = json.loads(kubectl(tc, "get", "pod", "server", "-o", "json"))["status"]["podIP"]

    def client(name: str) -> dict:
        kubectl(tc, "apply", "-f", "-", stdin=json.dumps(pod(
            name, {"app": "client"}, ["python", "-c", CLIENT], restartPolicy="Never",
            container={"env": [{"name": "URL", "value": f"http://server.{NS}.svc:80/"}]})))
        return wait_phase(tc, name, ("Succeeded", "Failed"))

    ok = client("client-1")
    assert ok["status"]["phase"] == "Succeeded", kubectl(tc, "logs", "client-1")
    assert "answered" in kubectl(tc, "logs", "client-1")
    client_ip = ok["status"]["podIP"]
    seen = call_in_loop(tc, lambda: list(tc.kubelet.connections))
    assert (client_ip, server_ip, 8000, True) in [c[:4] for c in seen]  # the Service resolved to the pod

    deny = {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": {"name": "server-from-frontend-only", "namespace": NS},
            "spec": {"podSelector": {"matchLabels": {"app": "server"}}, "policyTypes": ["Ingress"],
                     "ingress": [{"from": [{"podSelector": {"matchLabels": {"app": "frontend"}}}]}]}}
    kubectl(tc, "apply", "-f", "-", stdin=json.dumps(deny))
    t0 = time.monotonic()
    dropped = client("client-2")
    assert dropped["status"]["phase"] == "Failed"
    log = kubectl(tc, "logs", "client-2")
    assert "timed out" in log and "dropped: ingress to t/server:8000/TCP denied" in log, log
    assert time.monotonic() - t0 >= 3  # a drop: the client waited out its own connect timeout, nothing refused it
    seen = call_in_loop(tc, lambda: list(tc.kubelet.connections))
    assert seen[-1][:4] == (dropped["status"]["podIP"], server_ip, 8000, False)
