"""HA: two ``python -m pdoperator`` processes with distinct kopf peering priorities against the emulator.

Each process authenticates with its own token, so the emulator knows who wrote what. The
higher-priority one acts; the other only heartbeats. SIGKILL the active one: the standby resumes
within the stated bound (the peering lifetime, here 6 s, plus one reconcile) and repairs a
co-restart. The killed one comes back: the standby pauses again. At no moment are there two live
pods for one (pair, role).
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path

import kmock
import pytest
import yaml

from pdop_harness import IMAGE, NS, PODS, eventually, manifest
from pdop_k8s_emulator import Kubelet, PDEmulator, R

PEERINGS = R("kopf.dev", "v1", "kopfpeerings")
PDDS = R("pdstack.io", "v1alpha1", "pddeployments")
LIFETIME_S = 6
TAKEOVER_BOUND_S = LIFETIME_S + 10  # lifetime after the last heartbeat, plus a reconcile on a loaded machine
WRITES = {"create", "patch", "update", "delete"}

pytestmark = pytest.mark.slow


def kubeconfig(tmp: Path, url: str, token: str) -> str:
    path = tmp / f"kubeconfig-{token}"
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "emu",
        "clusters": [{"name": "emu", "cluster": {"server": url}}],
        "users": [{"name": "u", "user": {"token": token}}],
        "contexts": [{"name": "emu", "context": {"cluster": "emu", "user": "u", "namespace": NS}}]}))
    return str(path)


async def spawn(cfg: str, priority: int, log: Path) -> asyncio.subprocess.Process:
    env = dict(os.environ, KUBECONFIG=cfg, PDSTACK_OPERATOR_METRICS_PORT="0",
               PDSTACK_OPERATOR_PEERING_LIFETIME_S=str(LIFETIME_S), PDSTACK_OPERATOR_PEERING_SETTLE_S="3")
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "pdoperator", "-n", NS, "--priority", str(priority), "--liveness", "",
        env=env, stdout=open(log, "wb"), stderr=asyncio.subprocess.STDOUT)


def api_time(ts: float) -> str:
    """kopf's peering ``lastseen`` format (ISO, UTC)."""
    import datetime
    return datetime.datetime.fromtimestamp(ts, tz=datetime.timezone.utc).isoformat()[:19]


def pauses(log: Path) -> int:
    """How often this replica's kopf logged that it pauses in favour of a higher-priority peer (it logs a pause
    that ends its activity; a replica paused from its start, for a peer it saw first, logs none)."""
    return log.read_text(errors="replace").count("Pausing operations in favour of")


def heartbeat(api: PDEmulator, priority: int) -> str:
    """``lastseen`` of the replica with this peering priority ('' before its first heartbeat)."""
    peers = (api.read(PEERINGS, NS, "pdstack-operator") or {}).get("status") or {}
    return max((p.get("lastseen", "") for p in peers.values() if p and p.get("priority") == priority), default="")


async def heartbeats(api: PDEmulator, priority: int, n: int = 2) -> None:
    """Return after ``n`` more heartbeats of that replica (one a second here): its process ran meanwhile, so a
    check that follows sees what it did in that time, however starved of CPU the machine is."""
    for i in range(n):
        last = heartbeat(api, priority)
        await eventually(lambda: heartbeat(api, priority) > last, timeout=30,
                         what=f"heartbeat {i + 1}/{n} of the priority-{priority} replica")


def writes_by(api: PDEmulator, user: str, since: float = 0.0) -> list[tuple]:
    return [r for r in api.request_log if r[0] == user and r[1] in WRITES and r[3] != "kopfpeerings"
            and r[5] >= since]


def max_live_per_role(api: PDEmulator, name: str) -> int:
    """Replay the pod log: the most live (not terminating) pods one (pair, role) ever had at once."""
    live: dict[str, tuple[str, str]] = {}
    worst = 0
    for _, ev in api._log.get(PODS, []):
        meta = ev["object"]["metadata"]
        if meta.get("labels", {}).get("pdstack.io/deployment") != name:
            continue
        if ev["type"] == "DELETED" or meta.get("deletionTimestamp"):
            live.pop(meta["name"], None)
        else:
            live[meta["name"]] = (meta["labels"]["pdstack.io/pair"], meta["labels"]["pdstack.io/role"])
        counts: dict[tuple[str, str], int] = {}
        for key in live.values():
            counts[key] = counts.get(key, 0) + 1
        worst = max([worst, *counts.values()])
    return worst


async def test_standby_takes_over_within_the_bound_and_never_duplicates_pods(tmp_path):
    procs: list[asyncio.subprocess.Process] = []
    async with PDEmulator(tokens={"token-a": "op-a", "token-b": "op-b"}) as api, kmock.Server(api) as server:
        api.seed(PEERINGS, NS, {"metadata": {"name": "pdstack-operator"}})  # the chart creates it
        url = str(server.url).rstrip("/")
        kubelet = Kubelet(api, images=[IMAGE])
        kubelet.add_node("gpu-a", 8)
        try:
            async with kubelet:
                a = await spawn(kubeconfig(tmp_path, url, "token-a"), 100, tmp_path / "a.log")
                procs.append(a)
                # the standby joins once the active one has heartbeated (see docs/operator.md: replicas started
                # at the same instant can both act until their first peering read)
                await eventually(lambda: (api.read(PEERINGS, NS, "pdstack-operator") or {}).get("status"),
                                 timeout=30, what="active replica heartbeat")
                b = await spawn(kubeconfig(tmp_path, url, "token-b"), 50, tmp_path / "b.log")
                procs.append(b)
                await eventually(lambda: len(api.read(PEERINGS, NS, "pdstack-operator")["status"]) == 2,
                                 timeout=30, what="standby heartbeat")
                api._create(PDDS, NS, manifest("ha", pairs=2))

                def ready() -> bool:
                    pdd = api.read(PDDS, NS, "ha") or {}
                    return any(cnd["type"] == "Ready" and cnd["status"] == "True"
                               for cnd in (pdd.get("status") or {}).get("conditions", []))
                await eventually(ready, timeout=60, what="Ready (active replica)")
                await heartbeats(api, 50)  # the standby runs on, and stays out
                assert writes_by(api, "op-a"), "the priority-100 replica did not act"
                assert writes_by(api, "op-b") == [], f"the standby wrote: {writes_by(api, 'op-b')[:3]}"
                peers = api.read(PEERINGS, NS, "pdstack-operator")["status"]
                assert sorted(p["priority"] for p in peers.values()) == [50, 100]

                # kill the active replica, then break a pair: only the standby can repair it
                a.send_signal(signal.SIGKILL)
                await a.wait()
                killed = time.time()
                victim = next(p for p in api.select(PODS, NS, "pdstack.io/deployment=ha")
                              if p["metadata"]["labels"]["pdstack.io/pair"] == "0"
                              and p["metadata"]["labels"]["pdstack.io/role"] == "decode")["metadata"]["name"]
                kubelet.restart_container(NS, victim)
                await eventually(lambda: writes_by(api, "op-b", killed), timeout=TAKEOVER_BOUND_S + 20,
                                 what="the standby acting")
                took = writes_by(api, "op-b", killed)[0][5] - killed
                await eventually(lambda: api.read(PODS, NS, victim) is None and ready(), timeout=60,
                                 what="co-restart repaired by the new active replica")
                assert took <= TAKEOVER_BOUND_S, f"takeover took {took:.1f}s > {TAKEOVER_BOUND_S}s"
                assert writes_by(api, "op-a", killed + 0.5) == []

                # the priority-100 replica comes back: the standby pauses (its daemons are stopped) and A acts
                paused = pauses(tmp_path / "b.log")
                a2 = await spawn(kubeconfig(tmp_path, url, "token-a"), 100, tmp_path / "a2.log")
                procs.append(a2)
                back = time.time()

                def a_heartbeat() -> bool:
                    peers = (api.read(PEERINGS, NS, "pdstack-operator") or {}).get("status") or {}
                    return any(p and p.get("priority") == 100 and p.get("lastseen", "") >= api_time(back)
                               for p in peers.values())
                await eventually(a_heartbeat, timeout=30, what="A's heartbeat")
                await eventually(lambda: pauses(tmp_path / "b.log") > paused, timeout=30,
                                 what="the standby reading it and pausing again")
                quiet = time.time()
                victim = next(p for p in api.select(PODS, NS, "pdstack.io/deployment=ha")
                              if p["metadata"]["labels"]["pdstack.io/pair"] == "1")["metadata"]["name"]
                kubelet.restart_container(NS, victim)
                await eventually(lambda: api.read(PODS, NS, victim) is None and ready(), timeout=60,
                                 what="co-restart repaired by A")
                assert writes_by(api, "op-b", quiet) == [], "the paused standby still wrote"
                assert writes_by(api, "op-a", quiet), "the returning priority-100 replica did not act"
                assert max_live_per_role(api, "ha") == 1, "two live pods for one (pair, role)"
                print(f"standby took over {took:.1f}s after SIGKILL of the active replica "
                      f"(peering lifetime {LIFETIME_S}s)")
        finally:
            for p in procs:
                if p.returncode is None:
                    p.send_signal(signal.SIGTERM)
                    try:
                        await asyncio.wait_for(p.wait(), 20)
                    except asyncio.TimeoutError:
                        p.kill()
                        await p.wait()


async def test_replicas_started_together_never_both_reconcile(tmp_path):
    """Both start at the same instant, a PDDeployment already waiting: only the priority-100 one writes."""
    procs: list[asyncio.subprocess.Process] = []
    async with PDEmulator(tokens={"token-a": "op-a", "token-b": "op-b"}) as api, kmock.Server(api) as server:
        api.seed(PEERINGS, NS, {"metadata": {"name": "pdstack-operator"}})
        url = str(server.url).rstrip("/")
        kubelet = Kubelet(api, images=[IMAGE])
        kubelet.add_node("gpu-a", 8)
        api._create(PDDS, NS, manifest("twin", pairs=2))
        try:
            async with kubelet:
                procs += await asyncio.gather(spawn(kubeconfig(tmp_path, url, "token-b"), 50, tmp_path / "b.log"),
                                              spawn(kubeconfig(tmp_path, url, "token-a"), 100, tmp_path / "a.log"))

                def ready() -> bool:
                    pdd = api.read(PDDS, NS, "twin") or {}
                    return any(cnd["type"] == "Ready" and cnd["status"] == "True"
                               for cnd in (pdd.get("status") or {}).get("conditions", []))
                await eventually(ready, timeout=60, what="Ready")
                await heartbeats(api, 50)  # the standby runs on, and stays out
                # kopf's own finalizer patch on the PDDeployment may come from both (idempotent); the operator's
                # writes (children, status, pods) only from the active replica
                ours = [r for r in writes_by(api, "op-b") if r[3] != "pddeployments"]
                assert ours == [], f"the standby reconciled: {ours[:5]}"
                assert writes_by(api, "op-a")
                assert max_live_per_role(api, "twin") == 1
        finally:
            for p in procs:
                if p.returncode is None:
                    p.send_signal(signal.SIGTERM)
                    try:
                        await asyncio.wait_for(p.wait(), 20)
                    except asyncio.TimeoutError:
                        p.kill()
                        await p.wait()
