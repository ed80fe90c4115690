"""Engines sglang and vllm under the real operator, with real processes (the operator, the emulator, loopback).

Every worker pod is two processes on the pod's own loopback IP, both started from the pod as the operator rendered
it: its engine container's command line run by a fake engine (tests/support/fake_engine.py: the same launch words
and flags, an engine-shaped ``/metrics``), and its ``pdstack-agent`` container's ``pdrt agent`` command, for real.
The pod is Ready when the agent's ``/health`` says it found the engine process.

* process drift: the decode engine process sees a variable no spec declares (as a mutating webhook injects it:
  ``SGLANG_SM120_MMA_TARGET_CTAS``, the incident's knob; ``VLLM_ATTENTION_BACKEND``); the operator's drift sweep reads
  each agent's ``/config`` on the agent port and shows ``ConfigDrift`` source ``process`` naming it, on the decode
  pod only, for engine sglang and engine vllm;
* stall (both engines): the operator's stall sweep reads each agent's ``/metrics`` and the router's
  ``/debug/requests``. The router is pdstack's own, started from its rendered Deployment (``--worker-protocol
  sglang|vllm --worker-agent-port 8090``): it merges the agents' ``/debug/requests`` rows per pair; the stall
  verdict, its Event and the status come from the operator's own code. A decode engine with running requests and a
  frozen generation counter is ``Stalled`` in ``decode/running``; when the counter moves again the condition
  clears.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import random
import sys
from pathlib import Path
from typing import Any, AsyncIterator

import httpx
import kmock
import pytest

import yaml

from emu_kubelet import DEPLOYMENTS
from fake_engine import FakeEngine
from live_stack import CONFIGMAPS, SECRETS, start_router, stop
from pdop_harness import IMAGE, NS, PODS, Cluster, eventually, manifest, running_operator, write_kubeconfig
from pdop_k8s_emulator import Kubelet, PDEmulator
from pdoperator.core.spec import AGENT_PORT, HTTP_PORT
from pdruntime.env import REPORTED_PREFIXES
from test_drain_before_delete import ProcessKubelet

ROOT = Path(__file__).resolve().parents[2]
INJECTED = {"sglang": ("SGLANG_SM120_MMA_TARGET_CTAS", "512"), "vllm": ("VLLM_ATTENTION_BACKEND", "FLASHINFER")}


class AgentKubelet(ProcessKubelet):
    """Worker pods as (fake engine, real ``pdrt agent``) on the pod IP; decode engines see ``inject``."""

    def __init__(self, api: PDEmulator, net: int, log_dir: str) -> None:
        super().__init__(api, net, log_dir)
        self.inject: dict[str, str] = {}
        self.engines: dict[str, FakeEngine] = {}
        self.agents: dict[str, Any] = {}

    def _start(self, pod: dict[str, Any]) -> None:
        import subprocess

        name = pod["metadata"]["name"]
        self.not_ready.add(name)  # Ready only when the agent has found the engine
        Kubelet._start(self, pod)  # the emulated kubelet's part: Running, an IP (not ProcessKubelet's pdrt serve)
        pod = self.api.read(PODS, NS, name)
        ip, role = pod["status"]["podIP"], pod["metadata"]["labels"]["pdstack.io/role"]
        engine_c, agent_c = pod["spec"]["containers"][:2]
        assert agent_c["name"] == "pdstack-agent", [c["name"] for c in pod["spec"]["containers"]]
        engine = pod["metadata"]["annotations"]["pdstack.io/engine"]
        env = {k: v for k, v in os.environ.items() if not k.startswith(REPORTED_PREFIXES + ("VLLM_",))}
        for e in engine_c.get("env", []):
            if "value" in e:
                env[e["name"]] = e["value"]
            else:  # the one reference the operator renders for an engine: the pod's IP
                assert e["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}, e
                env[e["name"]] = ip
        if role == "decode":
            env.update(self.inject)
        words = list(engine_c["command"])
        words = words[1:] if words[0] == "python" else words  # "python -m sglang.launch_server": the script is python
        words[words.index("--host") + 1] = ip
        eng = FakeEngine(Path(self.log_dir), engine, ip, HTTP_PORT, words=words, env=env, tag=name)
        if role == "prefill":
            eng.set(running=0, gen=10)  # idle: only decode holds running requests here
        self.engines[name] = eng
        self.procs[name] = eng.start()
        cmd = list(agent_c["command"])
        assert cmd[:2] == ["pdrt", "agent"] and [p["containerPort"] for p in agent_c["ports"]] == [AGENT_PORT]
        cmd[cmd.index("--host") + 1] = ip
        cmd[cmd.index("--engine-url") + 1] = eng.url
        # every pod's engine runs on this one host: find this pod's (a pod's own PID namespace would hold only it)
        cmd.append(f"--process-match=--host {ip} --port {HTTP_PORT}")
        agent_env = {**os.environ, "PYTHONPATH": f"{ROOT / 'runtime'}:{ROOT / 'operator'}"}
        log = open(os.path.join(self.log_dir, f"{name}-agent.log"), "wb")
        self.agents[name] = subprocess.Popen([sys.executable, "-m", "pdruntime.cli", *cmd[1:]], env=agent_env,
                                             stdout=log, stderr=subprocess.STDOUT)
        self.ready_when_healthy(name, f"http://{ip}:{AGENT_PORT}")

    def _finish_termination(self, pod: dict[str, Any]) -> None:
        super()._finish_termination(pod)
        agent = self.agents.get(pod["metadata"]["name"])
        if agent is not None and agent.poll() is None:
            agent.kill()

    def stop_all(self) -> None:
        super().stop_all()
        for agent in self.agents.values():
            if agent.poll() is None:
                agent.kill()
                agent.wait(10)


def ready_pods(c: Cluster, name: str, n: int) -> list[dict[str, Any]] | None:
    pods = [p for p in c.pods(name) if not p["metadata"].get("deletionTimestamp")]
    ok = len(pods) == n and all(any(x["type"] == "Ready" and x["status"] == "True"
                                    for x in (p.get("status") or {}).get("conditions", [])) for p in pods)
    return pods if ok else None


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@contextlib.asynccontextmanager
async def engine_stack(tmp_path: Path, name: str, engine: str, *, inject: tuple[str, str] | None = None,
                       router: bool = False, **spec: Any) -> AsyncIterator[tuple[Cluster, AgentKubelet]]:
    """One pair of ``engine`` workers under the real operator; yields once both pods are Ready."""
    net = random.randint(100, 250)
    router_proc = None
    async with PDEmulator() as api, kmock.Server(api) as server:
        write_kubeconfig(str(server.url).rstrip("/"))
        kubelet = AgentKubelet(api, net, str(tmp_path))
        kubelet.add_node("gpu-a", 8)
        kubelet.inject = dict([inject]) if inject else {}
        router_ip = f"127.0.{net}.2"
        try:
            async with kubelet:
                c = Cluster(api, kubelet, str(server.url))
                async with running_operator(c):
                    c.apply(manifest(name, pairs=1, gpus=1, engine=engine, runtimeImage=IMAGE,
                                     model={"source": "/models/m", "servedName": "m"}, **spec))
                    if router:  # pdstack's router from what the operator wrote: its Deployment, ConfigMap, Secret
                        secret = await eventually(lambda: api.read(SECRETS, NS, f"{name}-router-admin"), what="secret")
                        cm = await eventually(lambda: api.read(CONFIGMAPS, NS, f"{name}-topology"), what="topology")
                        deploy = await eventually(lambda: api.read(DEPLOYMENTS, NS, f"{name}-router"), what="router")
                        cmd = deploy["spec"]["template"]["spec"]["containers"][0]["command"]
                        assert cmd[cmd.index("--worker-protocol") + 1] == engine, cmd
                        router_proc = start_router(router_ip, yaml.safe_load(cm["data"]["topology.yaml"]),
                                                   base64.b64decode(secret["data"]["token"]).decode(), tmp_path, cmd)
                        # its pod appears (Ready) once the process listens: the pod's event starts the reconcile that
                        # pushes the topology with the ready pair to it. A pod Ready before the process listened lost
                        # that push, and the router served no pair until an unrelated reconcile ~30 s later. (/metrics:
                        # its /health waits for a ready pair, which only that push brings)
                        url = f"http://{router_ip}:{HTTP_PORT}/metrics"
                        await eventually(lambda: _answers(url), timeout=60, interval=0.1, what="router listening")
                        kubelet.router_ip = router_ip
                    await eventually(lambda: ready_pods(c, name, 2), timeout=60, interval=0.2,
                                     what=f"both {engine} pods Ready (their agents found the engines)")
                    yield c, kubelet
        finally:
            kubelet.stop_all()
            if router_proc is not None:
                stop(router_proc)


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
async def test_injected_env_in_the_engine_process_is_config_drift_from_the_agent(tmp_path, monkeypatch, engine):
    monkeypatch.setenv("PDSTACK_OPERATOR_PROCESS_DRIFT_S", "1")
    var, value = INJECTED[engine]
    async with engine_stack(tmp_path, f"inj-{engine}", engine, inject=(var, value),
                            kernel={"decodeTargetCTAs": 256}) as (c, _):  # a knob neither engine has
        name = f"inj-{engine}"
        by_role = {p["metadata"]["labels"]["pdstack.io/role"]: p["metadata"]["name"] for p in c.pods(name)}

        def drifted():
            cond = c.condition(name, "ConfigDrift")
            return cond.get("status") == "True" and var in cond.get("message", "") and cond
        cond = await eventually(drifted, timeout=30, interval=0.2, what="ConfigDrift from the engine process")
        # exactly the injected variable, on the decode pod only: the prefill engine runs as declared
        assert cond["message"].split("; ") == [f"process: Pod/{by_role['decode']}: {var}={value} (not declared)"]
        drift = c.pdd(name)["status"].get("drift") or []
        assert [(d["source"], d["object"], d["field"], d["seen"]) for d in drift] == [
            ("process", f"Pod/{by_role['decode']}", var, value)]
        events = await eventually(lambda: c.events(name, "ConfigDrift"), timeout=10, what="Event")
        assert var in events[0]["message"] and by_role["decode"] in events[0]["message"]
        mapping = await eventually(lambda: c.events(name, "WatchdogMapping"), timeout=10, what="WatchdogMapping")
        assert mapping[0]["type"] == "Warning" and f"engine {engine}" in mapping[0]["message"]
        kernel = await eventually(lambda: c.events(name, "KernelMapping"), timeout=10, what="KernelMapping")
        assert kernel[0]["type"] == "Warning" and f"not enforced by {engine}: spec.kernel.decodeTargetCTAs=256; " \
            in kernel[0]["message"]


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
async def test_frozen_generation_is_stalled_by_the_operators_sweep_then_clears(tmp_path, monkeypatch, engine):
    monkeypatch.setenv("PDSTACK_OPERATOR_STALL_CHECK_S", "1")
    name = f"stall-{engine}"
    async with engine_stack(tmp_path, name, engine, router=True, stall={"seconds": 2}) as (c, kubelet):
        decode = c.pair_pods(name, 0)["decode"]["metadata"]["name"]

        def stalled():  # with the rate measured: the first look has no earlier counter to rate against
            cond = c.condition(name, "Stalled")
            return cond.get("status") == "True" and "0 tokens/s" in cond.get("message", "") and cond
        cond = await eventually(stalled, timeout=60, interval=0.2, what="Stalled from the agent's evidence, 0 tokens/s")
        msg = cond["message"]
        assert msg.startswith(f"pair 0 stalled in decode/running: request {engine}-decode-running made no progress "
                              "for"), msg
        assert "0 tokens/s" in msg, msg  # the engine's generation_tokens_total held still (the agent's pdrt_...)
        assert c.pdd(name)["status"]["stalls"][0]["stage"] == "decode/running"
        events = await eventually(lambda: c.events(name, "Stalled"), timeout=10, what="Stalled Event")
        assert events[0]["type"] == "Warning"

        async def generate() -> None:  # the engine generates again: its counter moves on every look
            for gen in range(50, 10**6, 5):
                kubelet.engines[decode].set(running=2, gen=gen)
                await asyncio.sleep(0.2)
        task = asyncio.create_task(generate())
        try:
            def cleared():
                cond = c.condition(name, "Stalled")
                return cond.get("status") == "False" and cond
            cond = await eventually(cleared, timeout=30, interval=0.2, what="Stalled False once tokens move")
            assert cond["message"] == "no stalled pair" and "stalls" not in c.pdd(name)["status"]
            assert len(c.events(name, "Stalled")) == 1
        finally:
            task.cancel()
