"""Drain before delete, end to end: the operator, the emulator, a REAL router and REAL workers on loopback.

Each worker pod the emulator schedules is a real ``pdrt serve`` process (tiny random model) started
from the pod's own rendered command on its own loopback address (``127.0.<net>.<n>:8000``, the pod
IP), Ready when its ``/health`` answers, and sent SIGTERM when the pod gets a deletion timestamp.
The router is a real ``pdrt serve --role router`` on the router pod's IP; its topology file is
written once and never refreshed (a slow ConfigMap volume): it learns every change from the
operator's pushes. Under steady client traffic, through a rollout of both pairs and a co-restart:

* every DELETE of a worker pod finds the router's ``/config`` already showing that pair draining, through a
  rollout, a co-restart and ``kubectl scale`` (scale-subresource patches) 2 -> 1 -> 3 -> 1;
* no client request fails.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import os
import random
import signal
import subprocess
import sys
import time
from typing import Any

import httpx
import kmock
import pytest
import yaml

from pdop_harness import IMAGE, NS, PODS, Cluster, eventually, manifest, running_operator, write_kubeconfig
from pdop_k8s_emulator import Kubelet, PDEmulator, R

SECRETS = R("", "v1", "secrets")
CONFIGMAPS = R("", "v1", "configmaps")
PORT = 8000  # every pod serves on its own IP, as in a cluster
WORKER_ARGS = ["--num-blocks", "256", "--block-size", "16", "--max-num-seqs", "16"]

pytestmark = pytest.mark.slow


class ProcessKubelet(Kubelet):
    """A kubelet whose worker pods are real processes: started from the pod's command, stopped by SIGTERM."""

    def __init__(self, api: PDEmulator, net: int, log_dir: str) -> None:
        super().__init__(api, images=[IMAGE])
        self.net, self.log_dir = net, log_dir
        self._hosts = itertools.count(10)
        self.procs: dict[str, subprocess.Popen] = {}
        self.sigterm_at: dict[str, float] = {}
        self._tasks: set[asyncio.Task] = set()

    def _next_ip(self) -> str:
        return f"127.0.{self.net}.{next(self._hosts)}"

    def _start(self, pod: dict[str, Any]) -> None:
        name = pod["metadata"]["name"]
        self.not_ready.add(name)  # Ready only when the process answers /health
        super()._start(pod)
        pod = self.api.read(PODS, NS, name)
        ip = pod["status"]["podIP"]
        ctr = pod["spec"]["containers"][0]
        cmd = self.worker_argv(list(ctr["command"]), ip)
        secret = self.api.read(SECRETS, NS, pod["spec"]["volumes"][0]["secret"]["secretName"])
        token_file = os.path.join(self.log_dir, f"{name}.token")
        with open(token_file, "w") as fh:
            fh.write(base64.b64decode(secret["data"]["token"]).decode())
        env = {k: v for k, v in os.environ.items() if not k.startswith("PDRT_")}
        env.update({e["name"]: e["value"] for e in ctr.get("env", [])})
        env.update(PDRT_KV_AUTH_TOKEN_FILE=token_file, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        log = open(os.path.join(self.log_dir, f"{name}.log"), "wb")
        self.procs[name] = subprocess.Popen([sys.executable, "-m", "pdruntime.server", *cmd[1:]], env=env,
                                            stdout=log, stderr=subprocess.STDOUT)
        self.ready_when_healthy(name, f"http://{ip}:{PORT}")

    def ready_when_healthy(self, name: str, url: str) -> None:
        """Mark pod ``name`` Ready once ``url``/health answers 200 (in the background, while its process lives)."""
        task = asyncio.get_running_loop().create_task(self._ready_when_healthy(name, url))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def worker_argv(self, cmd: list[str], ip: str) -> list[str]:
        """The ``pdrt serve`` line this pod's rendered command runs as here: on its pod IP, on this host's CPU."""
        assert cmd[:2] == ["pdrt", "serve"], cmd
        cmd[cmd.index("--host") + 1] = ip
        cmd[cmd.index("--device") + 1] = "cpu"  # the emulated nodes' "GPUs" are this host's CPU
        return cmd

    async def _ready_when_healthy(self, name: str, url: str) -> None:
        async with httpx.AsyncClient() as http:
            while self.procs[name].poll() is None and name not in self.sigterm_at:
                try:
                    if (await http.get(url + "/health", timeout=2)).status_code == 200:
                        self.set_ready(NS, name, True)
                        return
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.2)

    def _finish_termination(self, pod: dict[str, Any]) -> None:
        name = pod["metadata"]["name"]
        proc = self.procs.get(name)
        if proc is None:
            return super()._finish_termination(pod)
        if name not in self.sigterm_at:
            self.sigterm_at[name] = time.monotonic()
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        if proc.poll() is None and time.monotonic() - self.sigterm_at[name] > 30:
            proc.kill()
        if proc.poll() is not None:
            self.api._remove(PODS, NS, name)

    def stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


class Traffic:
    """``clients`` agents, each sending short completions back to back through the router."""

    def __init__(self, url: str, clients: int = 2) -> None:
        self.url, self.clients = url, clients
        self.ok = 0
        self.failures: list[str] = []
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    async def _agent(self, i: int) -> None:
        async with httpx.AsyncClient(timeout=60) as http:
            n = 0
            while not self._stop.is_set():
                n += 1
                body = {"model": "tiny", "prompt": f"agent {i} round {n}", "max_tokens": 4}
                try:
                    r = await http.post(self.url + "/v1/completions", json=body)
                    if r.status_code == 200:
                        self.ok += 1
                    else:
                        self.failures.append(f"{r.status_code}: {r.text[:200]}")
                except httpx.HTTPError as e:
                    self.failures.append(repr(e))

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._agent(i)) for i in range(self.clients)]

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)


async def test_pairs_drain_in_the_router_before_their_pods_are_deleted(tmp_path):
    from pdruntime.model.testing import write_tiny_checkpoint

    model = write_tiny_checkpoint(str(tmp_path / "tiny"))
    net = random.randint(100, 250)  # a loopback /24 of our own: pods bind 127.0.<net>.<n>:8000
    router_ip = f"127.0.{net}.2"
    checks: list[tuple[str, int, list[int], int]] = []  # (pod, pair, router draining, router topology version)
    router_proc = None
    admin: dict[str, str] = {}  # the router-admin bearer header, once the operator has generated the Secret
    async with PDEmulator() as api, kmock.Server(api) as server:
        write_kubeconfig(str(server.url).rstrip("/"))
        kubelet = ProcessKubelet(api, net, str(tmp_path))
        kubelet.add_node("gpu-a", 8)

        def on_pod_delete(ns: str, name: str) -> None:
            pod = api.read(PODS, ns, name)
            if not pod or pod["metadata"]["labels"].get("pdstack.io/component") != "worker":
                return
            cfg = httpx.get(f"http://{router_ip}:{PORT}/config", headers=admin, timeout=5).json()
            checks.append((name, int(pod["metadata"]["labels"]["pdstack.io/pair"]), cfg["draining"],
                           cfg["topology_version"]))
        api.on_pod_delete = on_pod_delete
        try:
            async with kubelet:
                c = Cluster(api, kubelet, str(server.url))
                async with running_operator(c):
                    body = manifest("drain", pairs=2, gpus=1, rollout={"drainSeconds": 5, "maxUnavailablePairs": 1},
                                    model={"source": model, "servedName": "tiny"})
                    for role in ("prefill", "decode"):
                        body["spec"][role]["args"] = WORKER_ARGS
                    c.apply(body)
                    secret = await eventually(lambda: api.read(SECRETS, NS, "drain-router-admin"), what="admin secret")
                    cm = await eventually(lambda: api.read(CONFIGMAPS, NS, "drain-topology"), what="topology")
                    topo_file = tmp_path / "topology.yaml"  # the ConfigMap volume, as mounted; never refreshed
                    topo_file.write_text(cm["data"]["topology.yaml"])
                    # the router pod mounts only the router-admin Secret, never the KV-transfer one
                    admin_file = tmp_path / "router-admin.token"
                    admin_file.write_text(base64.b64decode(secret["data"]["token"]).decode())
                    admin["Authorization"] = f"Bearer {admin_file.read_text()}"
                    env = {k: v for k, v in os.environ.items() if not k.startswith("PDRT_")}
                    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
                    router_proc = subprocess.Popen(
                        [sys.executable, "-m", "pdruntime.server", "serve", "--role", "router", "--host", router_ip,
                         "--port", str(PORT), "--topology-file", str(topo_file),
                         "--admin-token-file", str(admin_file)], env=env,
                        stdout=open(tmp_path / "router.log", "wb"), stderr=subprocess.STDOUT)
                    kubelet.router_ip = router_ip  # the router Deployment's pod: this process
                    await eventually(lambda: c.condition("drain", "Ready").get("status") == "True", timeout=240,
                                     interval=0.2, what="Ready with 4 real workers")
                    url = f"http://{router_ip}:{PORT}"
                    await eventually(lambda: httpx.get(url + "/health", timeout=5).status_code == 200, timeout=60,
                                     what="router healthy")
                    cfg = httpx.get(url + "/config", headers=admin, timeout=5).json()
                    assert cfg["topology_version"] > yaml.safe_load(cm["data"]["topology.yaml"])["generation"]

                    traffic = Traffic(url)
                    traffic.start()
                    await eventually(lambda: traffic.ok >= 5, timeout=60, what="traffic flowing")
                    # 1. rollout of both pairs
                    rev = c.pdd("drain")["status"]["currentRevision"]
                    c.patch_spec("drain", {"decode": {"resources": {"gpus": 1}, "args": WORKER_ARGS,
                                                      "env": [{"name": "ROLLOUT", "value": "2"}]}})
                    await eventually(lambda: (st := c.pdd("drain")["status"])["currentRevision"] != rev
                                     and st["currentRevision"] == st["updateRevision"]
                                     and c.condition("drain", "Ready").get("status") == "True",
                                     timeout=300, interval=0.2, what="rollout done")
                    served_after_rollout = traffic.ok
                    # 2. co-restart of pair 0 (its decode container restarted)
                    victim = c.pair_pods("drain", 0)["decode"]["metadata"]["name"]
                    kubelet.restart_container(NS, victim)
                    await eventually(lambda: api.read(PODS, NS, victim) is None
                                     and c.condition("drain", "Ready").get("status") == "True",
                                     timeout=240, interval=0.2, what="co-restart done")
                    await eventually(lambda: traffic.ok >= served_after_rollout + 5, timeout=60,
                                     what="traffic after the co-restart")
                    # 3. `kubectl scale pdd drain --replicas N` (the scale subresource): 2 -> 1 -> 3 -> 1
                    scale_url = f"{str(server.url).rstrip('/')}/apis/pdstack.io/v1alpha1/namespaces/{NS}/" \
                                "pddeployments/drain/scale"
                    for n in (1, 3, 1):
                        async with httpx.AsyncClient() as http:  # the emulator serves on this event loop
                            r = await http.patch(scale_url, content=json.dumps({"spec": {"replicas": n}}), timeout=10,
                                                 headers={"Content-Type": "application/merge-patch+json"})
                        assert r.status_code == 200 and r.json()["spec"]["replicas"] == n, r.text
                        before = traffic.ok
                        await eventually(lambda: (st := c.pdd("drain")["status"]).get("replicas") == n
                                         and st["readyPairs"] == n and len(st["pairs"]) == n
                                         and len(c.pods("drain")) == 2 * n
                                         and c.condition("drain", "Ready").get("status") == "True",
                                         timeout=240, interval=0.2, what=f"scaled to {n}")
                        await eventually(lambda: traffic.ok >= before + 3, timeout=60, what=f"traffic at {n}")
                    await traffic.stop()
        finally:
            kubelet.stop_all()
            if router_proc is not None and router_proc.poll() is None:
                router_proc.kill()
                router_proc.wait(10)

    assert traffic.failures == [], traffic.failures[:5]
    assert len(checks) >= 6 + 2 + 4, checks  # 4 pods rolled + 2 co-restarted + 2 and 4 scaled down
    for pod, pair, draining, version in checks:
        assert pair in draining, f"pod {pod} of pair {pair} deleted while the router (version {version}) " \
                                 f"showed draining={draining}"
    print(f"{traffic.ok} requests served, 0 failed; {len(checks)} pod deletions, each after the router "
          f"showed its pair draining")
