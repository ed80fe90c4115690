"""The canary's wiring in the operator, fast: the real operator against the emulator, a REAL router process
(topology pushes and ``/config`` read-backs, so the canary flag must reach it before the probe starts), and
emulated workers (no model). The probe itself is replaced by a recorder that answers a given report: what
the operator does with a failed or a clean probe is what is tested here (the real probe against real
workers is test_canary_live.py).

* fail: only pair 1 (the highest) ever runs the new revision, the topology marks it ``canary: true`` while it
  is on trial, the probe is pinned to it through the router with the admin token, then CanaryFailed, a
  Warning Event with the evidence and the knob diff, pair 1 back at the old revision, pair 0 never touched;
* pass: pair 0 follows, the canary flag is cleared, currentRevision moves;
* a new spec change after a failure starts over.
"""

from __future__ import annotations

import asyncio
import base64
import os
import random
import subprocess
import sys
from typing import Any

import httpx
import pytest
import yaml

from pdop_harness import NS, PODS, eventually, manifest, more_reconciles, running_operator
from pdop_k8s_emulator import R
from pdoperator.safety import rollout as safety

from test_canary import CLEAN, HANG

SECRETS = R("", "v1", "secrets")
CONFIGMAPS = R("", "v1", "configmaps")
CANARY = {"agents": 2, "rounds": 3, "roundTimeoutSeconds": 10, "maxTokens": 4}


class Probe:
    """Stands in for ``_canary_probe``: records each call and answers ``report`` (what the probe would)."""

    def __init__(self, report: dict[str, Any], delay_s: float = 0.2) -> None:
        self.report, self.delay_s = report, delay_s
        self.calls: list[tuple[str, dict[str, str], Any]] = []

    async def __call__(self, http: Any, url: str, headers: dict[str, str], spec: Any, metrics_urls: list[str]):
        self.calls.append((url, dict(headers), spec.rollout.canary))
        await asyncio.sleep(self.delay_s)
        return self.report, 0


def revisions_ever(c, name: str, pair: int) -> set[str]:
    return {ev["object"]["metadata"]["labels"].get("pdstack.io/revision") for _, ev in c.api._log[PODS]
            if ev["object"]["metadata"]["labels"].get("pdstack.io/deployment") == name
            and ev["object"]["metadata"]["labels"].get("pdstack.io/pair") == str(pair)}


def canary_flags(c, name: str) -> list[tuple[int, ...]]:
    """Every published topology: the indexes it marked canary."""
    out = []
    for v in c.api.history(CONFIGMAPS, NS, f"{name}-topology"):
        if v:
            doc = yaml.safe_load(v["data"]["topology.yaml"])
            out.append(tuple(p["index"] for p in doc["pairs"] if p.get("canary")))
    return out


@pytest.fixture
async def with_router(cluster, tmp_path):
    """A real router process on the router pod's IP; started once the operator made its admin Secret."""
    c = cluster
    ip = f"127.0.{random.randint(100, 250)}.2"
    c.kubelet.router_ip = ip
    procs: list[subprocess.Popen] = []

    async def start(name: str) -> str:
        secret = await eventually(lambda: c.api.read(SECRETS, NS, f"{name}-router-admin"), what="admin secret")
        cm = await eventually(lambda: c.api.read(CONFIGMAPS, NS, f"{name}-topology"), what="topology")
        (tmp_path / "topology.yaml").write_text(cm["data"]["topology.yaml"])
        token = base64.b64decode(secret["data"]["token"]).decode()
        (tmp_path / "admin.token").write_text(token)
        env = {k: v for k, v in os.environ.items() if not k.startswith("PDRT_")}
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "pdruntime.server", "serve", "--role", "router", "--host", ip, "--port", "8000",
             "--topology-file", str(tmp_path / "topology.yaml"), "--admin-token-file", str(tmp_path / "admin.token")],
            env=env, stdout=open(tmp_path / "router.log", "wb"), stderr=subprocess.STDOUT))
        return token
    try:
        yield c, ip, start
    finally:
        for p in procs:
            p.kill()
            p.wait(10)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


async def _deploy(c, start, name: str) -> tuple[str, str]:
    c.apply(manifest(name, pairs=2, rollout={"canary": CANARY, "drainSeconds": 1}))
    token = await start(name)
    st = await eventually(lambda: (s := c.pdd(name).get("status") or {}).get("phase") == "Ready" and s, timeout=30,
                          what="Ready")
    return st["currentRevision"], token


def pairs_at(c, name: str) -> dict[int, str]:
    return {p["index"]: p["revision"] for p in c.pdd(name)["status"]["pairs"]}


async def test_a_failed_canary_rolls_back_its_pair_and_stops_the_rollout(with_router, monkeypatch):
    c, ip, start = with_router
    probe = Probe(HANG)
    monkeypatch.setattr(safety, "_canary_probe", probe)
    async with running_operator(c):
        name = "cf"
        old, token = await _deploy(c, start, name)
        c.patch_spec(name, {"kernel": {"decodeTargetCTAs": 512}})
        cond = await eventually(lambda: (x := c.condition(name, "CanaryFailed")).get("status") == "True" and x,
                                timeout=30, what="CanaryFailed")
        new = c.pdd(name)["status"]["updateRevision"]
        assert cond["message"] == (f"revision {new} failed its canary on pair 1: round 2: agent 1 hung at stage "
                                   f"decode, 10.0s old: no byte for 10.0s; tried: decode.env.PDRT_DECODE_TARGET_CTAS: "
                                   f"<unset> -> 512"), cond
        assert len(probe.calls) == 1
        url, headers, spec = probe.calls[0]
        assert url == f"http://{ip}:8000" and headers == {"X-PDStack-Pair": "1", "X-PDStack-Admin-Token": token}
        assert (spec.agents, spec.rounds, spec.round_timeout_s, spec.max_tokens) == (2, 3, 10.0, 4)
        events = c.events(name, "CanaryFailed")
        assert len(events) == 1 and events[0]["type"] == "Warning" and "round 2" in events[0]["message"] \
            and "PDRT_DECODE_TARGET_CTAS: <unset> -> 512" in events[0]["message"]
        await eventually(lambda: pairs_at(c, name) == {0: old, 1: old} and c.condition(name, "Ready")["status"]
                         == "False" and len(c.pods(name)) == 4 and all(
                             p["status"].get("phase") == "Running" for p in c.pods(name)), timeout=30,
                         what="pair 1 back at the old revision")
        await more_reconciles(c, name, 3)  # nobody moves to the failed revision again
        assert revisions_ever(c, name, 0) == {old}
        assert revisions_ever(c, name, 1) == {old, new}
        assert pairs_at(c, name) == {0: old, 1: old} and len(probe.calls) == 1
        flags = canary_flags(c, name)
        assert (1,) in flags and flags[-1] == () and all(f in ((), (1,)) for f in flags), flags
        assert c.condition(name, "Progressing")["reason"] == "CanaryFailed"

        # a new spec change starts over (and this one passes)
        probe.report = CLEAN
        c.patch_spec(name, {"kernel": {"decodeTargetCTAs": 256}})
        newer = await eventually(lambda: (u := c.pdd(name)["status"]["updateRevision"]) not in (old, new) and u,
                                 what="newer revision")
        await eventually(lambda: pairs_at(c, name) == {0: newer, 1: newer}
                         and c.pdd(name)["status"]["currentRevision"] == newer
                         and c.condition(name, "Ready")["status"] == "True", timeout=40, what="newer everywhere")
        assert c.condition(name, "CanaryFailed")["status"] == "False"
        assert c.pdd(name)["status"]["canary"]["phase"] == "Passed"
        assert [e["reason"] for e in c.events(name) if e["reason"].startswith("Canary")].count("CanaryPassed") == 1
        assert canary_flags(c, name)[-1] == ()
        assert revisions_ever(c, name, 0) == {old, newer}  # pair 0 only after the canary passed


async def test_a_passed_canary_promotes_to_every_pair(with_router, monkeypatch):
    c, ip, start = with_router
    probe = Probe(CLEAN)
    monkeypatch.setattr(safety, "_canary_probe", probe)
    async with running_operator(c):
        name = "cp"
        old, _ = await _deploy(c, start, name)
        c.patch_spec(name, {"decode": {"resources": {"gpus": 1}, "env": [{"name": "X", "value": "1"}]}})
        new = await eventually(lambda: (u := c.pdd(name)["status"]["updateRevision"]) != old and u, what="new")
        # pair 0 does not move before the probe has passed
        probing = await eventually(lambda: (x := c.pdd(name)["status"].get("canary") or {}).get("phase") in (
            "Probing", "Passed") and x, timeout=60, what="probing")  # generous: a hang, not a slow host
        assert probing["pair"] == 1 and pairs_at(c, name)[0] == old
        await eventually(lambda: c.pdd(name)["status"]["currentRevision"] == new
                         and c.condition(name, "Ready")["status"] == "True", timeout=40, what="promoted")
        assert len(probe.calls) == 1 and c.events(name, "CanaryPassed")
        first_new_pair0 = min(rv for rv, ev in c.api._log[PODS] if ev["type"] == "ADDED"
                              and ev["object"]["metadata"]["labels"].get("pdstack.io/pair") == "0"
                              and ev["object"]["metadata"]["labels"].get("pdstack.io/revision") == new)
        passed_at = min(rv for rv, ev in c.api._log[R("", "v1", "events")] if ev["type"] == "ADDED"
                        and ev["object"]["reason"] == "CanaryPassed")
        assert int(passed_at) < int(first_new_pair0)


async def test_a_canary_pair_that_crashes_at_the_new_revision_fails_the_canary(with_router, monkeypatch):
    c, ip, start = with_router
    probe = Probe(CLEAN, delay_s=60)  # it would pass, but not before the crash
    monkeypatch.setattr(safety, "_canary_probe", probe)
    async with running_operator(c):
        name = "cc"
        old, _ = await _deploy(c, start, name)
        c.patch_spec(name, {"kernel": {"maxKVSplits": 16}})
        new = await eventually(lambda: (u := c.pdd(name)["status"]["updateRevision"]) != old and u, what="new")
        # the canary pair's decode at the new revision restarts (a crash) before the probe judged it
        victim = await eventually(lambda: (p := c.pair_pods(name, 1).get("decode")) is not None
                                  and p["metadata"]["labels"]["pdstack.io/revision"] == new
                                  and (p.get("status") or {}).get("phase") == "Running" and p["metadata"]["name"],
                                  timeout=20, what="canary decode pod running at the new revision")
        c.kubelet.restart_container(NS, victim)
        cond = await eventually(lambda: (x := c.condition(name, "CanaryFailed")).get("status") == "True" and x,
                                timeout=30, what="CanaryFailed")
        assert "pair 1 co-restarted (ContainerRestart) while on trial" in cond["message"], cond
        await eventually(lambda: pairs_at(c, name) == {0: old, 1: old}, timeout=30, what="pair 1 back at old")
        assert revisions_ever(c, name, 0) == {old}
