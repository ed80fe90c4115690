"""Stall detection end to end: the real operator, the emulator, a REAL router and REAL workers on loopback.

With ``spec.stall.seconds: 3`` and a stall sweep every second:

* a long streaming generation's decode process is frozen (SIGSTOP) mid-stream: condition ``Stalled`` names
  the pair, the stage and the age, ``status.stalls``, one Warning Event ``Stalled`` for the episode,
  ``pdstack_pair_stalled{pair="0"} 1``; ``kubectl-pd requests`` shows the stuck stream and the frozen worker,
  ``kubectl-pd status`` the stall. After SIGCONT the stream finishes and the condition goes False;
* a decode that stalls the 2nd request of a keep-alive connection (the test-only fault knob
  ``PDRT_FAULT_DECODE_STALL_AFTER=1``: a live process, KV held, no token): ``Stalled`` names
  ``decode/running`` from the decode worker's own row; the client giving up aborts it and the condition
  goes False.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
from typing import Any

import httpx
import pytest
from prometheus_client import REGISTRY

from live_stack import live_stack
from pdop_harness import NS, Cluster, eventually, more_reconciles
from test_kubectl_pd_requests import kpd
from pdruntime.util.sse import DONE, aiter_sse

pytestmark = pytest.mark.slow
NAME = "stall"
MAX_TOKENS = 1800  # the tiny model's context is 2048: a stream long enough to be frozen mid-way


def stalled_pair() -> float | None:
    return REGISTRY.get_sample_value("pdstack_pair_stalled", {"namespace": NS, "deployment": NAME, "pair": "0"})


def stack(tmp_path: Any, decode_env: list[dict[str, str]] | None = None) -> Any:
    """One pair of real workers and a real router under the real operator; yields (cluster, router URL, kubelet)."""
    return live_stack(tmp_path, NAME, pairs=1, decode_env=decode_env, stall={"seconds": 3})


async def wait_stalled(c: Cluster) -> dict[str, Any]:
    def stalled():
        cond = c.condition(NAME, "Stalled")
        return cond.get("status") == "True" and cond
    return await eventually(stalled, timeout=60, interval=0.2, what="Stalled")


async def wait_recovered(c: Cluster) -> None:
    cond = await eventually(lambda: (x := c.condition(NAME, "Stalled")).get("status") == "False" and x,
                            timeout=30, interval=0.2, what="Stalled False after recovery")
    assert cond["message"] == "no stalled pair" and "stalls" not in c.pdd(NAME)["status"]
    assert stalled_pair() == 0 and len(c.events(NAME, "Stalled")) == 1


async def test_frozen_decode_is_stalled_then_recovers(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSTACK_OPERATOR_STALL_CHECK_S", "1")
    async with stack(tmp_path) as (c, url, kubelet):
        decode = c.pair_pods(NAME, 0)["decode"]
        pid = kubelet.procs[decode["metadata"]["name"]].pid

        stream = {"chunks": 0, "done": False}
        first = asyncio.Event()

        async def generate() -> None:
            req = {"model": "tiny", "prompt": "hello", "max_tokens": MAX_TOKENS, "ignore_eos": True,
                   "stream": True}
            async with httpx.AsyncClient(timeout=300) as http:
                async with http.stream("POST", url + "/v1/completions", json=req,
                                       headers={"X-Client-Id": "agent-7"}) as r:
                    assert r.status_code == 200, await r.aread()
                    async for ev in aiter_sse(r.aiter_lines()):
                        if ev == DONE:
                            stream["done"] = True
                        else:
                            stream["chunks"] += 1
                            first.set()

        task = asyncio.create_task(generate())
        await asyncio.wait_for(first.wait(), 60)
        os.kill(pid, signal.SIGSTOP)  # decode frozen mid-stream (a wedged kernel looks like this)
        try:
            assert not stream["done"], "the generation finished before decode was frozen"

            cond = await wait_stalled(c)
            msg = cond["message"]
            assert cond["reason"] == "PairStalled" and msg.startswith("pair 0 stalled in "), msg
            m = re.search(r"stalled in (\S+): request \S+ \(client agent-7\) made no progress for (\d+)s "
                          r"\(>= stall.seconds 3; age (\d+)s", msg)
            assert m and m.group(1) in ("router/streaming", "decode/running"), msg
            assert f"unreachable: decode http://{decode['status']['podIP']}:8000" in msg
            stalls = c.pdd(NAME)["status"]["stalls"]
            assert [(s["pair"], s["stage"]) for s in stalls] == [(0, m.group(1))]
            assert stalls[0]["oldestAgeSeconds"] >= 3 and stalls[0]["since"] == cond["lastTransitionTime"]
            assert stalled_pair() == 1
            events = await eventually(lambda: c.events(NAME, "Stalled"), timeout=10, what="Event")
            assert events[0]["type"] == "Warning" and events[0]["message"].startswith("pair 0 stalled in")

            rc, text = await kpd("requests", NAME, "-o", "json")
            report = json.loads(text)
            assert rc == 0 and report["live"] >= 1, text
            mine = [r for r in report["requests"] if r["role"] == "router"]
            assert [(r["stage"], r["client"], r["pair"]) for r in mine] == [("streaming", "agent-7", 0)]
            assert mine[0]["tokens"] >= 1 and mine[0]["idle_s"] >= 3
            assert any(u.startswith(f"decode http://{decode['status']['podIP']}:8000")
                       for u in report["unreachable"])
            rc, table = await kpd("requests", NAME)
            assert rc == 0 and "streaming" in table and "agent-7" in table
            rc, text = await kpd("status", NAME)
            assert rc == 0 and "  pair 0 since " in text and "Stalled=True PairStalled" in text
            print(f"Stalled: {msg}\n\n$ kubectl-pd requests {NAME}\n{table}\n$ kubectl-pd status {NAME}\n{text}")

            await more_reconciles(c, NAME, 3)  # more sweeps of the same episode: still one Event
            assert len(c.events(NAME, "Stalled")) == 1
            assert c.condition(NAME, "Stalled")["lastTransitionTime"] == cond["lastTransitionTime"]
        finally:
            os.kill(pid, signal.SIGCONT)
        await asyncio.wait_for(task, 180)
        assert stream["done"] and stream["chunks"] >= 2
        await wait_recovered(c)


async def test_decode_stalling_a_keep_alive_round_is_stalled_until_aborted(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSTACK_OPERATOR_STALL_CHECK_S", "1")
    async with stack(tmp_path, [{"name": "PDRT_FAULT_DECODE_STALL_AFTER", "value": "1"}]) as (c, url, kubelet):
        req = {"model": "tiny", "prompt": "round", "max_tokens": 8}
        async with httpx.AsyncClient(timeout=300) as http:  # one keep-alive connection, as an agent's
            first = await http.post(url + "/v1/completions", json=req, headers={"X-Client-Id": "agent-3"})
            assert first.status_code == 200, first.text  # round 1 passes
            second = asyncio.create_task(http.post(url + "/v1/completions", json=req,
                                                   headers={"X-Client-Id": "agent-3"}))
            try:
                cond = await wait_stalled(c)
                msg = cond["message"]
                assert msg.startswith("pair 0 stalled in decode/running: request "), msg
                assert "(client agent-3) made no progress for" in msg and ", 0 tokens)" in msg
                assert "0 tokens/s, 0 watchdog fire(s)" in msg and "unreachable" not in msg
                assert c.pdd(NAME)["status"]["stalls"][0]["stage"] == "decode/running" and stalled_pair() == 1
                rc, text = await kpd("requests", NAME, "-o", "json")
                rows = {(r["role"], r["stage"]) for r in json.loads(text)["requests"]}
                assert rc == 0 and {("router", "waiting_first_token"), ("decode", "running")} <= rows, text
            finally:
                second.cancel()  # the agent gives up: the router aborts both legs
                with contextlib.suppress(asyncio.CancelledError):
                    await second
        await wait_recovered(c)
