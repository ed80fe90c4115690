"""Drift source "process" end to end: real worker processes on loopback, one of which sees an env var
no spec declares (as a mutating webhook or a node agent would inject it). The operator reads each
worker's /config on its drift timer and shows ConfigDrift with source "process" naming the variable."""

from __future__ import annotations

import asyncio
import io
import json
import os
from typing import Any

import pytest
from prometheus_client import REGISTRY

from live_stack import live_stack
from pdop_harness import NS, eventually
from pdoperator.cli import kubectl_pd as cli
from test_drain_before_delete import ProcessKubelet

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
    monkeypatch.setenv("PDSTACK_OPERATOR_PROCESS_DRIFT_S", "1")
    async with live_stack(tmp_path, "inj", pairs=1, kubelet_cls=InjectingKubelet) as (c, _, _):
        by_role = {p["metadata"]["labels"]["pdstack.io/role"]: p["metadata"]["name"] for p in c.pods("inj")}

        def drifted():
            cond = c.condition("inj", "ConfigDrift")
            return cond.get("status") == "True" and INJECTED[0] in cond.get("message", "") and cond
        cond = await eventually(drifted, timeout=30, interval=0.2, what="ConfigDrift from the process")
        lines = cond["message"].split("; ")
        # exactly the injected variable, on the decode pod only: the prefill process runs as declared
        assert lines == [f"process: Pod/{by_role['decode']}: {INJECTED[0]}={INJECTED[1]} (not declared)"]
        assert REGISTRY.get_sample_value("pdstack_config_drift", {
            "namespace": NS, "deployment": "inj", "source": "process"}) == 1
        out = io.StringIO()
        assert await asyncio.to_thread(cli.main, ["drift", "inj", "-o", "json"], out) == 1
        assert json.loads(out.getvalue())["lines"] == [{"source": "process", "drift": lines[0].removeprefix(
            "process: ")}]
        events = await eventually(lambda: c.events("inj", "ConfigDrift"), timeout=10, what="Event")
        assert INJECTED[0] in events[0]["message"] and by_role["decode"] in events[0]["message"]
