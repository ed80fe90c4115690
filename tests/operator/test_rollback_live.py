"""Auto-rollback, end to end with real processes (router + pdrt workers on loopback, as test_canary_live.py).

The first revision soaks (``rollout.soakSeconds: 2``) and becomes lastKnownGood. A spec change adds the
runtime's test-only fault knob ``PDRT_FAULT_DECODE_STALL_AFTER=1`` to decode (no canary): it rolls out,
then a plain multi-round client (requests in a row on one connection) hangs on its second served request. The operator's
stall detection sets ``Stalled``; with ``rollout.autoRollback`` and the stall inside
``rollbackWindowSeconds`` of the revision change, the spec is patched back to lastKnownGood, a Warning
Event ``AutoRollback`` names the knob it reverted, and the pairs return to the known-good revision.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from pdop_harness import eventually
from live_stack import live_stack, pods_ready
from test_canary_live import FAULT

pytestmark = pytest.mark.slow


async def test_a_stall_after_a_revision_change_rolls_back_to_last_known_good(tmp_path, monkeypatch):
    pytest.importorskip("pdoperator.core.stall", reason="stall detection (stall11, condition Stalled) is not on this "
                                                   "branch yet")
    monkeypatch.setenv("PDSTACK_OPERATOR_STALL_CHECK_S", "1")  # the stall sweep: every second, not every 15
    name = "auto"
    rollout = {"drainSeconds": 2, "soakSeconds": 2, "autoRollback": True, "rollbackWindowSeconds": 600}
    async with live_stack(tmp_path, name, pairs=1, rollout=rollout, stall={"seconds": 3}) as (c, url, _):
        good = c.pdd(name)["status"]["currentRevision"]
        await eventually(lambda: c.pdd(name)["status"].get("lastKnownGoodRevision") == good, timeout=30,
                         interval=0.2, what="first revision known-good")
        decode = dict(c.pdd(name)["spec"]["decode"])
        decode["env"] = [{"name": FAULT, "value": "1"}]
        c.patch_spec(name, {"decode": decode})  # (it may soak before the agents arrive: known-good, then stalls)
        bad = await eventually(lambda: (st := c.pdd(name)["status"]).get("currentRevision") not in (None, good)
                               and st["currentRevision"] == st["updateRevision"] and pods_ready(c, name, 2)
                               and st["currentRevision"], timeout=150, interval=0.2, what="the knob rolled out")

        answers: list[int] = []  # each round's status: the failure message shows what the agent met

        async def multi_round_client() -> None:  # an agent: round after round on one keep-alive connection
            # Rounds go on until one hangs (cancelled below): under load the router may still be learning the
            # new pair when the pods are Ready, and a round it refuses (503) must not use up the agent.
            async with httpx.AsyncClient(timeout=300) as http:
                for n in range(1000):
                    r = await http.post(url + "/v1/completions",
                                        json={"model": "tiny", "prompt": f"round {n}", "max_tokens": 4})
                    answers.append(r.status_code)
                    if r.status_code != 200:
                        await asyncio.sleep(0.2)
        agent = asyncio.create_task(multi_round_client())
        try:
            stalled = await eventually(lambda: (x := c.condition(name, "Stalled")).get("status") == "True" and x,
                                       timeout=60, interval=0.2, what="Stalled")
            events = await eventually(lambda: c.events(name, "AutoRollback"), timeout=30, interval=0.2,
                                      what="AutoRollback Event")
        except AssertionError:
            for e in c.events(name):
                print("EVENT", e["reason"], e["message"][:300])
            print("AGENT rounds answered:", answers, "done:", agent.done())
            raise
        finally:
            agent.cancel()
        assert len(events) == 1 and events[0]["type"] == "Warning", events
        msg = events[0]["message"]
        assert f"revision {bad}" in msg and f"last known-good revision {good}" in msg, msg
        assert f"decode.env.{FAULT}: <unset> -> 1" in msg, msg
        # the Event is posted by the reconcile's act phase, the status written by its report phase just after
        st = await eventually(lambda: (x := c.pdd(name)["status"]).get("autoRollback") and x, timeout=10,
                              interval=0.1, what="status.autoRollback")
        assert st["autoRollback"]["from"] == bad and st["autoRollback"]["to"] == good
        assert "env" not in c.pdd(name)["spec"]["decode"]  # the spec is the known-good one again
        print(f"Stalled: {stalled['message']}")
        print(f"AutoRollback: {msg}")
        assert stalled["status"] == "True"
        await eventually(lambda: (s := c.pdd(name)["status"])["currentRevision"] == good
                         and s["updateRevision"] == good and pods_ready(c, name, 2), timeout=150, interval=0.2,
                         what="pairs back at the known-good revision")
        assert len(c.events(name, "AutoRollback")) == 1  # once
