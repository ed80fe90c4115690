"""Canary catches a bad knob, end to end: the operator, the emulator, a REAL router and REAL pdrt workers
(tiny model) on loopback, as in test_drain_before_delete.py.

A new revision sets the incident's knob (``kernel.decodeTargetCTAs: 512``) and the runtime's test-only
fault knob ``PDRT_FAULT_DECODE_STALL_AFTER=1`` on decode: every request after the first on a keep-alive
connection stalls, so one-shot probes pass. With ``rollout.canary`` the revision goes to pair 1 only
(the highest index), out of normal traffic; the multi-round agent probe, pinned to pair 1 through the
router, hangs in round 2. Then: ``CanaryFailed`` names round 2 and the knob diff, a Warning Event
carries the same, pair 1 returns to the old revision, and pair 0's pods never carry the new revision
label (every pod the emulator ever created is checked).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import random
import subprocess
import sys
from typing import Any, AsyncIterator

import httpx
import kmock
import pytest

from pdop_harness import NS, PODS, Cluster, eventually, manifest, running_operator, write_kubeconfig
from pdop_k8s_emulator import PDEmulator, R
from test_drain_before_delete import PORT, WORKER_ARGS, ProcessKubelet

pytestmark = pytest.mark.slow
SECRETS = R("", "v1", "secrets")
CONFIGMAPS = R("", "v1", "configmaps")
FAULT = "PDRT_FAULT_DECODE_STALL_AFTER"


def pods_ready(c: Cluster, name: str, n: int) -> bool:
    pods = [p for p in c.pods(name) if not p["metadata"].get("deletionTimestamp")]
    return len(pods) == n and all(any(x["type"] == "Ready" and x["status"] == "True"
                                      for x in p["status"].get("conditions", [])) for p in pods)


@contextlib.asynccontextmanager
async def live_stack(tmp_path: Any, name: str, *, pairs: int = 2, **spec: Any) -> AsyncIterator[tuple[Cluster, str]]:
    """The operator against the emulator, every worker pod a real ``pdrt serve`` process and the router a
    real ``pdrt serve --role router`` on the router pod's IP. Yields (cluster, router URL) once Ready."""
    from pdruntime.model.testing import write_tiny_checkpoint

    model = write_tiny_checkpoint(str(tmp_path / "tiny"))
    net = random.randint(100, 250)
    router_ip = f"127.0.{net}.2"
    router_proc = None
    async with PDEmulator() as api, kmock.Server(api) as server:
        write_kubeconfig(str(server.url).rstrip("/"))
        kubelet = ProcessKubelet(api, net, str(tmp_path))
        kubelet.add_node("gpu-a", 8)
        try:
            async with kubelet:
                c = Cluster(api, kubelet, str(server.url))
                async with running_operator(c):
                    body = manifest(name, pairs=pairs, gpus=1, model={"source": model, "servedName": "tiny"}, **spec)
                    for role in ("prefill", "decode"):
                        body["spec"][role]["args"] = WORKER_ARGS
                    c.apply(body)
                    secret = await eventually(lambda: api.read(SECRETS, NS, f"{name}-router-admin"), what="secret")
                    cm = await eventually(lambda: api.read(CONFIGMAPS, NS, f"{name}-topology"), what="topology")
                    topo_file = tmp_path / "topology.yaml"
                    topo_file.write_text(cm["data"]["topology.yaml"])
                    admin_file = tmp_path / "router-admin.token"
                    admin_file.write_text(base64.b64decode(secret["data"]["token"]).decode())
                    env = {k: v for k, v in os.environ.items() if not k.startswith("PDRT_")}
                    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
                    router_proc = subprocess.Popen(
                        [sys.executable, "-m", "pdruntime.server", "serve", "--role", "router", "--host", router_ip,
                         "--port", str(PORT), "--topology-file", str(topo_file),
                         "--admin-token-file", str(admin_file)], env=env,
                        stdout=open(tmp_path / "router.log", "wb"), stderr=subprocess.STDOUT)
                    kubelet.router_ip = router_ip
                    await eventually(lambda: c.condition(name, "Ready").get("status") == "True", timeout=240,
                                     interval=0.2, what=f"Ready with {2 * pairs} real workers")
                    url = f"http://{router_ip}:{PORT}"
                    await eventually(lambda: httpx.get(url + "/health", timeout=5).status_code == 200, timeout=60,
                                     what="router healthy")
                    yield c, url
        finally:
            kubelet.stop_all()
            if router_proc is not None and router_proc.poll() is None:
                router_proc.kill()
                router_proc.wait(10)


def revisions_ever(c: Cluster, name: str, pair: int) -> set[str]:
    """The revision label of every pod of ``pair`` the API ever stored (the emulator's event log)."""
    return {ev["object"]["metadata"]["labels"]["pdstack.io/revision"] for _, ev in c.api._log[PODS]
            if ev["object"]["metadata"]["labels"].get("pdstack.io/deployment") == name
            and ev["object"]["metadata"]["labels"].get("pdstack.io/pair") == str(pair)}


async def test_canary_catches_a_bad_knob_and_the_other_pair_never_gets_it(tmp_path):
    name = "can"
    canary = {"agents": 2, "rounds": 3, "roundTimeoutSeconds": 10, "maxTokens": 4}
    async with live_stack(tmp_path, name, rollout={"drainSeconds": 5, "canary": canary}) as (c, url):
        old = c.pdd(name)["status"]["currentRevision"]
        decode = dict(c.pdd(name)["spec"]["decode"])
        decode["env"] = [{"name": FAULT, "value": "1"}]
        c.patch_spec(name, {"kernel": {"decodeTargetCTAs": 512}, "decode": decode})
        new = await eventually(lambda: (u := c.pdd(name)["status"].get("updateRevision")) != old and u,
                               what="new revision")
        probing = await eventually(lambda: (c.pdd(name)["status"].get("canary") or {}).get("phase") == "Probing"
                                   and c.pdd(name)["status"]["canary"], timeout=150, interval=0.2,
                                   what="canary pair 1 at the new revision, probing")
        assert probing["pair"] == 1 and probing["revision"] == new and probing["fromRevision"] == old
        cond = await eventually(lambda: (x := c.condition(name, "CanaryFailed")).get("status") == "True" and x,
                                timeout=120, interval=0.2, what="CanaryFailed")
        msg = cond["message"]
        assert msg.startswith(f"revision {new} failed its canary on pair 1: round 2: "), msg
        assert "hung" in msg, msg
        assert f"decode.env.{FAULT}: <unset> -> 1" in msg and "decode.env.PDRT_DECODE_TARGET_CTAS: <unset> -> 512" \
            in msg, msg
        assert c.condition(name, "Progressing")["reason"] == "CanaryFailed"
        events = c.events(name, "CanaryFailed")
        assert len(events) == 1 and events[0]["type"] == "Warning" and "round 2" in events[0]["message"] \
            and f"{FAULT}: <unset> -> 1" in events[0]["message"], events
        st = c.pdd(name)["status"]["canary"]
        assert st["phase"] == "Failed" and st["evidence"].startswith("round 2: ")

        # the canary pair comes back at the old revision; the rollout stops there
        await eventually(lambda: {p["index"]: p["revision"] for p in c.pdd(name)["status"]["pairs"]} == {0: old, 1: old}
                         and pods_ready(c, name, 4), timeout=120, interval=0.2, what="pair 1 back at the old revision")
        await asyncio.sleep(3)  # a few more reconciles: nobody moves to the failed revision again
        assert revisions_ever(c, name, 0) == {old}, "pair 0 received the canary revision"
        assert revisions_ever(c, name, 1) == {old, new}
        assert c.pdd(name)["status"]["updateRevision"] == new  # the spec still asks for it
        # normal traffic keeps flowing through the router meanwhile
        r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2}, timeout=30)
        assert r.status_code == 200, r.text
        print(f"CanaryFailed: {msg}")
        print(f"probe rounds: {st.get('rounds')}")
