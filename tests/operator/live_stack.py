"""The operator against the emulator with REAL processes: every worker pod a ``pdrt serve`` (tiny model) on
its own loopback IP (test_drain_before_delete.ProcessKubelet), the router Deployment's pod a real
``pdrt serve --role router`` started from the ConfigMap and Secret the operator wrote. Shared by the live
canary, rollback and stall tests."""

from __future__ import annotations

import base64
import contextlib
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any, AsyncIterator

import httpx
import kmock
import yaml

from pdop_harness import NS, Cluster, eventually, manifest, running_operator, write_kubeconfig
from pdop_k8s_emulator import DEPLOYMENTS, PDEmulator, R
from test_drain_before_delete import PORT, WORKER_ARGS, ProcessKubelet

SECRETS = R("", "v1", "secrets")
CONFIGMAPS = R("", "v1", "configmaps")


#: the rendered router flags whose values are this host's (its pod IP, its mounted files), not the spec's
HOST_FLAGS = ("--host", "--port", "--topology-file", "--admin-token-file")


def spec_flags(rendered: list[str]) -> list[str]:
    """The rendered router command's flags after ``pdrt serve --role router``, less :data:`HOST_FLAGS` (each with
    its value): what the spec chose (routing policy, worker protocol, ...)."""
    assert rendered[:4] == ["pdrt", "serve", "--role", "router"], rendered
    out, rest = [], rendered[4:]
    while rest:
        flag, *rest = rest
        if flag in HOST_FLAGS:
            rest = rest[1:]
        else:
            out.append(flag)
    return out


def start_router(ip: str, topology: dict[str, Any], token: str, log_dir: Path,
                 rendered: list[str] | None = None) -> subprocess.Popen:
    """A real ``pdrt serve --role router`` on ``ip:8000`` (the router pod's IP), guarded by ``token``, with the
    spec's flags of the ``rendered`` router command when given."""
    topo, tok = log_dir / f"topology-{ip}.yaml", log_dir / f"router-admin-{ip}.token"
    topo.write_text(yaml.safe_dump(topology))
    tok.write_text(token)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDRT_")}
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, "-m", "pdruntime.server", "serve", "--role", "router", "--host", ip,
                             "--port", str(PORT), "--topology-file", str(topo), "--admin-token-file", str(tok),
                             *spec_flags(rendered or ["pdrt", "serve", "--role", "router"])],
                            env=env, stdout=open(log_dir / f"router-{ip}.log", "wb"), stderr=subprocess.STDOUT)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait(10)


def pods_ready(c: Cluster, name: str, n: int) -> bool:
    pods = [p for p in c.pods(name) if not p["metadata"].get("deletionTimestamp")]
    return len(pods) == n and all(any(x["type"] == "Ready" and x["status"] == "True"
                                      for x in (p.get("status") or {}).get("conditions", [])) for p in pods)


@contextlib.asynccontextmanager
async def live_stack(tmp_path: Path, name: str, *, pairs: int = 2, decode_env: list[dict[str, str]] | None = None,
                     kubelet_cls: type[ProcessKubelet] = ProcessKubelet, worker_args: list[str] = WORKER_ARGS,
                     **spec: Any) -> AsyncIterator[tuple[Cluster, str, ProcessKubelet]]:
    """A PDDeployment ``name`` of ``pairs`` real pairs under the real operator (extra ``spec`` fields and decode
    env as given; ``kubelet_cls`` starts the worker processes from their pods' commands, ``worker_args`` are both
    roles' engine args); the router runs the spec's flags of its rendered Deployment. Yields (cluster, router URL, kubelet) once it is
    Ready and the router answers /health."""
    from pdruntime.model.testing import write_tiny_checkpoint

    model = write_tiny_checkpoint(str(tmp_path / "tiny"))
    net = random.randint(100, 250)
    router_ip = f"127.0.{net}.2"
    router = None
    async with PDEmulator() as api, kmock.Server(api) as server:
        write_kubeconfig(str(server.url).rstrip("/"))
        kubelet = kubelet_cls(api, net, str(tmp_path))
        kubelet.add_node("gpu-a", 8)
        try:
            async with kubelet:
                c = Cluster(api, kubelet, str(server.url))
                async with running_operator(c):
                    body = manifest(name, pairs=pairs, gpus=1, model={"source": model, "servedName": "tiny"}, **spec)
                    for role in ("prefill", "decode"):
                        body["spec"][role]["args"] = list(worker_args)
                    if decode_env:
                        body["spec"]["decode"]["env"] = decode_env
                    c.apply(body)
                    secret = await eventually(lambda: api.read(SECRETS, NS, f"{name}-router-admin"), what="secret")
                    cm = await eventually(lambda: api.read(CONFIGMAPS, NS, f"{name}-topology"), what="topology")
                    deploy = await eventually(lambda: api.read(DEPLOYMENTS, NS, f"{name}-router"), what="router")
                    router = start_router(router_ip, yaml.safe_load(cm["data"]["topology.yaml"]),
                                          base64.b64decode(secret["data"]["token"]).decode(), tmp_path,
                                          deploy["spec"]["template"]["spec"]["containers"][0]["command"])
                    kubelet.router_ip = router_ip  # the router Deployment's pod: this process
                    await eventually(lambda: c.condition(name, "Ready").get("status") == "True", timeout=240,
                                     interval=0.2, what=f"Ready with {2 * pairs} real workers")
                    url = f"http://{router_ip}:{PORT}"
                    await eventually(lambda: httpx.get(url + "/health", timeout=5).status_code == 200, timeout=60,
                                     what="router healthy")
                    yield c, url, kubelet
        finally:
            kubelet.stop_all()
            if router is not None:
                stop(router)
