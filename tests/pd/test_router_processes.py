"""The router on several processes (``--router-processes N``; runtime/pdruntime/server/router/processes.py).

In-process: two :class:`Router` objects joined over real Unix sockets in a temporary folder, as two processes are:
the admission bounds split, a breaker that trips in one trips in the other, a topology push relayed, ``/config``,
``/debug/requests`` and ``/metrics`` answered for both, a process that starts late taking the newest topology.
Then a real ``pdrt serve --role router --router-processes 2`` in front of scripted workers: one port, both processes
serving it, a killed process restarted with the pushed topology, SIGTERM stopping them all."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdruntime.env import RuntimeEnv
from pdruntime.server.metrics import Metrics
from pdruntime.server.router.app import Router, RouterConfig
from pdruntime.server.router.processes import (BUILDING, MAX_PROCESSES, SUN_PATH_MAX, Peers, check_count, exposition,
                                                families, merge, socket_path, sockets_folder)
from pdruntime.server.openai.schemas import ApiError
from pdruntime.server.router.reply import EdgeCall, LiveRequest
from pdruntime.server.router.topology import parse_topology
from pdruntime.util import h1

sys.path.insert(0, os.path.dirname(__file__))
from pd_harness import base_env, free_port, spawn, wait_for, wait_healthy  # noqa: E402
import test_router_server  # noqa: E402

workers = test_router_server.workers  # its scripted workers fixture (one pair for this module)

pytestmark = pytest.mark.timeout(120)

TOKEN = "processes-admin-token"
BODY = {"model": "tiny", "prompt": "Say hi", "max_tokens": 1}


def _topology(generation: int, *, draining: bool = False) -> dict:
    return {"version": 1, "revision": f"g{generation}", "generation": generation, "pairs": [
        {"index": 0, "ready": not draining, "draining": draining,
         "prefill": {"url": "http://127.0.0.1:1", "bootstrap_port": 8998}, "decode": {"url": "http://127.0.0.1:2"}}]}


# ---- the metrics of several processes ----------------------------------------------------------------
def _filled(m: Metrics, n: int) -> Metrics:
    m.requests.labels("router", "a", "ok").inc(n)
    m.e2e.labels("router").observe(0.02 * n)
    m.live.labels("router").set(n)
    m.circuit_open.labels("0").set(n % 2)
    m.oldest_age.labels("router", "streaming").set(1.5 * n)
    return m


def test_merged_metrics_are_what_one_process_with_both_processes_counts_would_expose():
    """Counters and histograms add up, counts kept in gauges (live requests) add up, states and ages (a breaker open,
    the oldest request's age) are the maximum: byte for byte what one registry holding those values renders."""
    one, two = _filled(Metrics("router"), 3), _filled(Metrics("router"), 4)
    want = Metrics("router")
    want.requests.labels("router", "a", "ok").inc(7)
    want.e2e.labels("router").observe(0.06)
    want.e2e.labels("router").observe(0.08)
    want.live.labels("router").set(7)
    want.circuit_open.labels("0").set(1)
    want.oldest_age.labels("router", "streaming").set(6.0)
    merged = exposition(merge([families(one.registry), families(two.registry)]))
    assert merged == want.render()
    parsed = {f.name: f for f in text_string_to_metric_families(merged.decode())}
    assert parsed["pdrt_e2e_latency_seconds"].samples[-2].value == 2  # _count, through the real parser


def test_the_process_count_is_checked_against_the_admission_bound(tmp_path):
    with pytest.raises(ValueError, match=r"--router-processes 0 is not accepted; accepted: 1\.\.64"):
        check_count(0, 32, 8000)
    with pytest.raises(ValueError, match=r"--router-processes 4 needs --max-pending-per-pair >= 4"):
        check_count(4, 2, 8000)
    with pytest.raises(ValueError, match=r"--router-processes 2 needs a fixed --port"):
        check_count(2, 32, 0)
    check_count(1, 1, 0)
    out = subprocess.run([sys.executable, "-m", "pdruntime.server", "serve", "--role", "router", "--prefill",
                          "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2", "--router-processes", "4",
                          "--max-pending-per-pair", "2"], capture_output=True, text=True, timeout=60, env=base_env())
    assert out.returncode == 2
    assert "--router-processes 4 needs --max-pending-per-pair >= 4" in out.stderr


# ---- two routers joined as sibling processes --------------------------------------------------------
def _router(folder: str, index: int, generation: int = 1) -> Router:
    cfg = RouterConfig(admin_token=TOKEN, max_pending_per_pair=32, max_queued_requests=100, breaker_threshold=2)
    return Router(RuntimeEnv(), topology=parse_topology(_topology(generation)), config=cfg,
                  peers=Peers(index, 2, folder))


@pytest.fixture
def siblings(tmp_path):
    folder = str(tmp_path)
    loop = asyncio.new_event_loop()
    routers = [_router(folder, 0), _router(folder, 1)]
    for r in routers:
        loop.run_until_complete(r.join_peers())
    yield loop, routers
    for r in routers:
        loop.run_until_complete(r.peers.close())
    loop.close()


def test_sibling_processes_split_the_admission_bounds(siblings):
    _, (a, b) = siblings
    assert (a.admission.max_pending, a.admission.max_queued) == (16, 50) == (b.admission.max_pending,
                                                                              b.admission.max_queued)
    assert a.config()["router"]["max_pending_per_pair_per_process"] == 16


def test_a_breaker_that_trips_in_one_process_trips_in_its_siblings(siblings):
    """Two requests through process 0 to a pair whose workers refuse connections (threshold 2): its breaker opens,
    and process 1, which sent the pair nothing, rests it too."""
    loop, (a, b) = siblings

    async def fail_twice() -> list[int]:
        a.client, a.models = h1.Client(timeout=5.0), {"tiny": {"model_name": "tiny"}}
        statuses = []
        try:
            for _ in range(2):
                try:
                    await a.completion(EdgeCall(False, {}, json.dumps(BODY).encode(), ("127.0.0.1", 5000)))
                except ApiError as exc:
                    statuses.append(exc.status)
        finally:
            await a.client.aclose()
        for _ in range(100):
            if b.picker.states[0].breaker.opened_at is not None:
                break
            await asyncio.sleep(0.02)
        return statuses

    assert b.picker.states[0].breaker.allows(time.monotonic())
    assert loop.run_until_complete(fail_twice()) == [502, 502]
    assert a.picker.states[0].breaker.state(time.monotonic()) == "open"
    assert b.picker.states[0].breaker.state(time.monotonic()) == "open"
    assert not b.picker.eligible(time.monotonic())


def test_a_topology_push_reaches_every_process_before_it_is_answered(siblings):
    loop, (a, b) = siblings

    async def push(doc: dict) -> httpx.Response:
        transport = httpx.ASGITransport(app=a.build_app(), client=("127.0.0.1", 5000))
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
            return await client.post("/admin/topology", json=doc, headers={"Authorization": f"Bearer {TOKEN}"})

    r = loop.run_until_complete(push(_topology(5, draining=True)))
    assert r.status_code == 200, r.text
    assert r.json()["processes"] == {"count": 2, "behind": []}
    assert b.topology.generation == 5 and b.topology.draining() == [0]


def test_config_and_debug_requests_answer_for_every_process(siblings):
    """The operator deletes a drained pair once every router's ``topology_version`` shows it draining and its
    ``inflight_by_pair`` is empty: with several processes both must cover all of them."""
    loop, (a, b) = siblings
    b.live["r1"] = LiveRequest("r1", "agent", None, time.monotonic(), stage="streaming", pair=0)
    b.topology_source.offer(parse_topology(_topology(3, draining=True)), "test")  # a ran 1, b runs 3 now
    cfg = loop.run_until_complete(a.router_config())
    assert cfg["inflight_by_pair"] == {"0": 1}
    assert cfg["topology_version"] == 1  # the lowest: process 0 has not seen generation 3
    assert cfg["draining"] == []  # drained only where every process has it draining
    assert cfg["processes"]["topology_versions"] == {"0": 1, "1": 3}

    async def debug() -> dict:
        a.client = h1.Client(timeout=5.0)  # the workers' rows: these workers refuse at once
        try:
            return await a.debug_requests()
        finally:
            await a.client.aclose()

    dbg = loop.run_until_complete(debug())
    assert [(row["id"], row["process"]) for row in dbg["requests"]] == [("r1", 1)]
    assert dbg["live"] == 1

    loop.run_until_complete(b.peers.close())  # a process that does not answer: nothing can be confirmed
    cfg = loop.run_until_complete(a.router_config())
    assert cfg["topology_version"] == -1 and cfg["processes"]["unanswered"] == [1]
    assert "router processes that did not answer: 1" in loop.run_until_complete(debug())["verdict"]


def test_a_process_that_starts_late_runs_the_newest_topology_its_siblings_run(siblings, tmp_path):
    loop, (a, b) = siblings
    a.topology_source.offer(parse_topology(_topology(9)), "push")
    loop.run_until_complete(b.peers.close())  # process 1 exits; it starts again below
    b.metrics.requests.labels("router", "a", "ok").inc(5)
    loop.run_until_complete(b._peer_metrics(None))  # a scrape: b leaves its counts for a successor
    late = _router(str(tmp_path), 1, generation=2)
    loop.run_until_complete(late.join_peers())
    try:
        assert late.topology.generation == 9
        late.metrics.requests.labels("router", "a", "ok").inc(2)
        fams = {f[0]: f for f in loop.run_until_complete(late._peer_metrics(None))}
        assert [v for name, labels, v in fams["pdrt_requests"][4] if labels["outcome"] == "ok"] == [7]
        assert all(v == 0 for _, _, v in fams["pdrt_live_requests"][4])  # a gauge is not carried on
    finally:
        loop.run_until_complete(late.peers.close())


# ---- a real router on two processes -----------------------------------------------------------------
def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as fh:
        return [int(c) for c in fh.read().split()]


def test_two_router_processes_serve_one_port_as_one_router(workers, tmp_path):
    prefill, decode, loop = workers
    (tmp_path / "token").write_text(TOKEN)
    port = free_port()
    p = spawn("router", ["--role", "router", "--port", str(port), "--prefill", f"http://127.0.0.1:{prefill.port}",
                         "--decode", f"http://127.0.0.1:{decode.port}", "--bootstrap-ports", "1",
                         "--admin-token-file", str(tmp_path / "token"), "--router-processes", "2"],
              base_env(), str(tmp_path), port)
    admin = {"Authorization": f"Bearer {TOKEN}"}
    try:
        wait_healthy([p], timeout=60)
        wait_for(lambda: len(_children(p.popen.pid)) == 2, 30, "two router processes")
        wait_for(lambda: httpx.get(p.url + "/config", headers=admin, timeout=10).json()["processes"]["unanswered"]
                 == [], 30, "both processes answering")

        # requests held by decode on 16 connections: the kernel spreads the connections over both processes
        decode.hold = "before"
        loop.call_soon_threadsafe(decode.release.clear)
        seen = decode.generates
        conns = []
        for _ in range(16):
            s = socket.create_connection(("127.0.0.1", port), timeout=30)
            body = json.dumps(BODY).encode()
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n%b" % (len(body), body))
            conns.append(s)
        wait_for(lambda: decode.generates >= seen + 16, 30, "16 requests at decode")
        rows = httpx.get(p.url + "/debug/requests", headers=admin, timeout=10).json()["requests"]
        assert len(rows) == 16 and {r["process"] for r in rows} == {0, 1}
        inflight = httpx.get(p.url + "/config", headers=admin, timeout=10).json()["inflight_by_pair"]
        assert inflight == {"0": 16}
        decode.hold = None
        loop.call_soon_threadsafe(decode.release.set)
        for s in conns:
            assert s.recv(65536).startswith(b"HTTP/1.1 200 ")
            s.close()
        # every process's requests in every scrape, whichever process answers it
        for _ in range(6):
            text = httpx.get(p.url + "/metrics", timeout=10).text
            ok = [line for line in text.splitlines() if line.startswith("pdrt_requests_total{") and 'outcome="ok"' in line]
            assert len(ok) == 1 and float(ok[0].rsplit(" ", 1)[1]) == 16

        # a push reaches both; a killed process is restarted and runs the pushed topology again
        doc = {"version": 1, "revision": "pushed", "generation": 4, "pairs": [
            {"index": 0, "prefill": {"url": f"http://127.0.0.1:{prefill.port}", "bootstrap_port": 1},
             "decode": {"url": f"http://127.0.0.1:{decode.port}"}}]}
        r = httpx.post(p.url + "/admin/topology", json=doc, headers=admin, timeout=10)
        assert r.status_code == 200 and r.json()["processes"] == {"count": 2, "behind": []}
        victim = _children(p.popen.pid)[0]
        os.kill(victim, signal.SIGKILL)
        wait_for(lambda: victim not in _children(p.popen.pid) and len(_children(p.popen.pid)) == 2, 30,
                 "the killed process restarted")
        wait_for(lambda: httpx.get(p.url + "/config", headers=admin, timeout=10).json()["processes"]
                 ["topology_versions"] == {"0": 4, "1": 4}, 30, "both processes on generation 4")
        for _ in range(8):
            assert httpx.post(p.url + "/v1/completions", json=BODY, timeout=30).status_code == 200
        # the restarted process carries on from what its predecessor had counted at the last scrape (the scrapes
        # above): the router's counter never falls, which Prometheus would read as a reset of all 24
        text = httpx.get(p.url + "/metrics", timeout=10).text
        ok = [line for line in text.splitlines() if line.startswith("pdrt_requests_total{") and 'outcome="ok"' in line]
        assert float(ok[0].rsplit(" ", 1)[1]) == 24

        kids = _children(p.popen.pid)
        p.popen.send_signal(signal.SIGTERM)
        assert p.popen.wait(30) == 0
        for kid in kids:
            assert not os.path.exists(f"/proc/{kid}") or open(f"/proc/{kid}/stat").read().split()[2] == "Z"
    finally:
        decode.hold = None
        loop.call_soon_threadsafe(decode.release.set)
        p.stop()


def test_the_crd_router_processes_field_renders_the_flag_and_leaves_revisions_alone():
    from pdoperator.core.render import Owner, router_command
    from pdoperator.core.revisions import revision_hash
    from pdoperator.core.spec import SpecError, parse_spec

    with pytest.raises(SpecError) as err:
        parse_spec({"image": "img", "router": {"processes": 0}})
    assert err.value.problems == ["spec.router.processes=0 is invalid; accepted: an integer in [1, 64]"]
    with pytest.raises(SpecError, match=r"spec.router.processes=2 is pdstack's router's; accepted with router kind "
                                        r"'sglang': 1"):
        parse_spec({"image": "img", "engine": "sglang", "model": {"source": "m"}, "runtimeImage": "pdrt:1",
                    "router": {"kind": "sglang", "processes": 2}})
    plain = parse_spec({"image": "img"})
    two = parse_spec({"image": "img", "router": {"processes": 2}})
    assert revision_hash(two) == revision_hash(plain)  # a router setting never rolls the pairs
    owner = Owner("llm", "ns", "uid")
    command = router_command(two, owner)
    assert command == router_command(plain, owner) + ["--router-processes", "2"]
    from pdruntime.cli import build_parser  # the runtime's own parser takes what the operator renders
    assert build_parser().parse_args(command[1:]).router_processes == 2


def test_the_sockets_folder_is_one_whose_socket_paths_fit_a_unix_address(tmp_path, monkeypatch):
    """A pod's TMPDIR can sit deep in a host folder (the test cluster mounts a pod's /tmp so): a socket path there
    passes the 107 bytes a Unix address holds, and the processes could not listen. The folder then goes to /tmp."""
    deep = tmp_path / ("d" * 100)
    deep.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    folder = sockets_folder()
    try:
        assert folder.startswith("/tmp/pdrt-router-") and oct(os.stat(folder).st_mode & 0o777) == "0o700"
        assert len((socket_path(folder, MAX_PROCESSES - 1) + BUILDING).encode()) <= SUN_PATH_MAX == 107
    finally:
        os.rmdir(folder)
