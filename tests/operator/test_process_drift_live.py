"""Drift source "process" end to end: real worker processes on loopback, one of which sees an env var
no spec declares (as a mutating webhook or a node agent would inject it). The operator reads each
worker's /config on its drift timer and shows ConfigDrift with source "process" naming the variable."""

from __future__ import annotations

import os
import random
from typing import Any

import kmock
import pytest
from prometheus_client import REGISTRY

from pdop_harness import NS, Cluster, eventually, manifest, running_operator, write_kubeconfig
from pdop_k8s_emulator import PDEmulator
from test_drain_before_delete import WORKER_ARGS, ProcessKubelet

pytestmark = pytest.mark.slow
INJECTED = ("SGLANG_SM120_MMA_TARGET_CTAS", "512")


class InjectingKubelet(ProcessKubelet):
    """Decode pods' processes see ``INJECTED`` in their environment; prefill pods do not."""

    def _start(self, pod: dict[str, Any]) -> None:
        if pod["metadata"]["labels"].get("pdstack.io/role") != "decode":
            return super()._start(pod)
        os.environ[INJECTED[0]] = INJECTED[1]  # ProcessKubelet hands the test's environ to the process
        try:
            super()._start(pod)
        finally:
            del os.environ[INJECTED[0]]


async def test_injected_env_shows_config_drift_from_the_process(tmp_path, monkeypatch):
    from pdruntime.model.testing import write_tiny_checkpoint

    monkeypatch.setenv("PDSTACK_OPERATOR_PROCESS_DRIFT_S", "1")
    model = write_tiny_checkpoint(str(tmp_path / "tiny"))
    net = random.randint(100, 250)
    async with PDEmulator() as api, kmock.Server(api) as server:
        write_kubeconfig(str(server.url).rstrip("/"))
        kubelet = InjectingKubelet(api, net, str(tmp_path))
        kubelet.add_node("gpu-a", 8)
        try:
            async with kubelet:
                c = Cluster(api, kubelet, str(server.url))
                async with running_operator(c):
                    body = manifest("inj", pairs=1, gpus=1, model={"source": model, "servedName": "tiny"})
                    for role in ("prefill", "decode"):
                        body["spec"][role]["args"] = WORKER_ARGS
                    c.apply(body)
                    pods = await eventually(lambda: len(ps := [p for p in c.pods("inj") if any(
                        x["type"] == "Ready" and x["status"] == "True" for x in (p.get("status") or {}).get("conditions", []))]) == 2
                        and ps, timeout=240, interval=0.2, what="both real workers ready")
                    by_role = {p["metadata"]["labels"]["pdstack.io/role"]: p["metadata"]["name"] for p in pods}

                    def drifted():
                        cond = c.condition("inj", "ConfigDrift")
                        return cond.get("status") == "True" and INJECTED[0] in cond.get("message", "") and cond
                    cond = await eventually(drifted, timeout=30, interval=0.2, what="ConfigDrift from the process")
                    lines = cond["message"].split("; ")
                    # exactly the injected variable, on the decode pod only: the prefill process runs as declared
                    assert lines == [f"process: Pod/{by_role['decode']}: {INJECTED[0]}={INJECTED[1]} (not declared)"]
                    assert REGISTRY.get_sample_value("pdstack_config_drift", {
                        "namespace": NS, "deployment": "inj", "source": "process"}) == 1
                    import asyncio
                    import io
                    import json

                    from pdoperator import cli
                    out = io.StringIO()
                    assert await asyncio.to_thread(cli.main, ["drift", "inj", "-o", "json"], out) == 1
                    assert json.loads(out.getvalue())["lines"] == [{"source": "process", "drift": lines[0].removeprefix(
                        "process: ")}]
                    events = await eventually(lambda: c.events("inj", "ConfigDrift"), timeout=10, what="Event")
                    assert INJECTED[0] in events[0]["message"] and by_role["decode"] in events[0]["message"]
        finally:
            kubelet.stop_all()
