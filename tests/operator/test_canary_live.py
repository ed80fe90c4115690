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


import httpx
import pytest

from live_stack import live_stack, pods_ready
from pdop_harness import PODS, Cluster, eventually, more_reconciles

pytestmark = pytest.mark.slow
FAULT = "PDRT_FAULT_DECODE_STALL_AFTER"


def revisions_ever(c: Cluster, name: str, pair: int) -> set[str]:
    """The revision label of every pod of ``pair`` the API ever stored (the emulator's event log)."""
    return {ev["object"]["metadata"]["labels"]["pdstack.io/revision"] for _, ev in c.api._log[PODS]
            if ev["object"]["metadata"]["labels"].get("pdstack.io/deployment") == name
            and ev["object"]["metadata"]["labels"].get("pdstack.io/pair") == str(pair)}


async def test_canary_catches_a_bad_knob_and_the_other_pair_never_gets_it(tmp_path):
    name = "can"
    canary = {"agents": 2, "rounds": 3, "roundTimeoutSeconds": 10, "maxTokens": 4}
    async with live_stack(tmp_path, name, rollout={"drainSeconds": 5, "canary": canary}) as (c, url, _):
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
        await more_reconciles(c, name, 3)  # nobody moves to the failed revision again
        assert revisions_ever(c, name, 0) == {old}, "pair 0 received the canary revision"
        assert revisions_ever(c, name, 1) == {old, new}
        assert c.pdd(name)["status"]["updateRevision"] == new  # the spec still asks for it
        # normal traffic keeps flowing through the router meanwhile
        r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2}, timeout=30)
        assert r.status_code == 200, r.text
        print(f"CanaryFailed: {msg}")
        print(f"probe rounds: {st.get('rounds')}")
