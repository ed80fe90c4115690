"""Probes that match model loading: a load slower than liveness's window never restarts a worker; a hung
engine does. Pure (kubelet semantics over hour-long timelines) and against a real ``pdrt serve`` process."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from emu_probes import ContainerProbes, probe_ok, simulate
from pdoperator.core.render import Owner, worker_pod
from pdoperator.core.spec import parse_spec
from pdruntime.util.ports import free_port as _free_port


def _container(raw: dict | None = None, engine: str = "pdrt") -> dict:
    spec = parse_spec({"image": "x", "engine": engine, "model": {"source": "/m"}, "probes": raw or {},
                       **({"runtimeImage": "pdrt:1"} if engine != "pdrt" else {})})
    return worker_pod(spec, Owner("llm", "ns", "u"), "r", 0, "decode", "0")["spec"]["containers"][0]


# the deployment before startup probes: liveness only, 10 s x 30
LEGACY = {"livenessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 10,
                            "failureThreshold": 30}}


def loading(load_s: float, hang_at: float | None = None, busy_latency_s: float = 0.05):
    """A worker that answers 503 (or refuses) until ``load_s``, then 200; from ``hang_at`` on, never answers."""
    def health(t: float):
        if hang_at is not None and t >= hang_at:
            return None, float("inf")
        return (503 if t < load_s else 200), busy_latency_s
    return health


@pytest.mark.parametrize("load_s", [61, 900, 1700])  # all longer than liveness's window (10 s x 6 = 60 s)
def test_a_model_load_slower_than_the_liveness_window_never_restarts(load_s):
    c = _container()
    window = c["livenessProbe"]["periodSeconds"] * c["livenessProbe"]["failureThreshold"]
    assert load_s > window
    assert simulate(c, loading(load_s), horizon_s=4 * 3600) is None
    # the same load under the legacy liveness-only probe is a restart loop for loads over 300 s
    legacy = simulate(LEGACY, loading(load_s), horizon_s=4 * 3600)
    assert (legacy is not None) == (load_s > 300)


def test_a_hung_engine_is_restarted_within_the_liveness_window():
    c = _container()
    got = simulate(c, loading(120, hang_at=3000), horizon_s=4 * 3600)
    assert got is not None and got[1].startswith("liveness")
    assert 3000 < got[0] <= 3000 + 10 * 6 + 10


def test_a_load_beyond_the_startup_budget_restarts_at_the_budget():
    c = _container({"startupSeconds": 600})
    got = simulate(c, loading(10_000), horizon_s=4 * 3600)
    assert got is not None and got[1].startswith("startup") and 590 <= got[0] <= 610


def test_a_long_busy_step_does_not_trip_liveness():
    """/health is answered by the HTTP loop during a long step: slow (1.5 s) but within the probe timeout."""
    c = _container()
    assert simulate(c, loading(30, busy_latency_s=1.5), horizon_s=3600) is None


def test_sglang_health_generation_fits_the_probe_timeout():
    """SGLang's /health runs a one-token generation (seconds under load): the rendered timeout allows it."""
    c = _container(engine="sglang")
    assert c["readinessProbe"]["timeoutSeconds"] >= 10 and c["livenessProbe"]["timeoutSeconds"] >= 10
    assert simulate(c, loading(600, busy_latency_s=5.0), horizon_s=3600) is None
    assert not probe_ok(200, 5.0, _container()["livenessProbe"]["timeoutSeconds"])  # pdrt's 2 s would not




async def _run_probes(url: str, container: dict, stop: asyncio.Event, log: list) -> str | None:
    """Real-time kubelet: the rendered probes against a real process; returns the restart reason, if any."""
    cp, t0 = ContainerProbes(container, 0.0), time.monotonic()
    async with httpx.AsyncClient() as http:
        while not stop.is_set() and cp.current is not None:
            await asyncio.sleep(max(0.0, cp.next_at - (time.monotonic() - t0)))
            kind, probe = cp.current
            sent = time.monotonic()
            try:
                status = (await http.get(url + "/health", timeout=probe.timeout_s)).status_code
            except httpx.HTTPError:
                status = None
            ok = probe_ok(status, time.monotonic() - sent, probe.timeout_s)
            log.append((round(sent - t0, 2), kind, status))
            reason = cp.record(time.monotonic() - t0, ok)
            if reason:
                return reason
    return None


async def test_real_worker_load_passes_the_startup_probe_and_a_hang_trips_liveness(tmp_path):
    from pdruntime.model.testing import write_tiny_checkpoint

    model = write_tiny_checkpoint(str(tmp_path / "tiny"))
    # liveness as tight as the CRD allows (1 s x 2): the real process's load (Python + torch import + weights)
    # is far longer than that; the startup budget (120 s) covers it
    probes = {"startupSeconds": 120, "livenessPeriodSeconds": 1, "livenessFailureThreshold": 2}
    rendered = _container(probes)
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDRT_")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "pdruntime.server", "serve", "--role", "decode", "--host",
                             "127.0.0.1", "--port", str(port), "--model", model, "--device", "cpu",
                             "--num-blocks", "64", "--block-size", "16", "--max-num-seqs", "4"],
                            env=env, stdout=open(tmp_path / "w.log", "wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    stop = asyncio.Event()
    new_log: list = []
    legacy_log: list = []
    # the legacy shape (liveness only, same tight liveness) against the same process, for contrast
    legacy = {"livenessProbe": rendered["livenessProbe"]}
    try:
        new = asyncio.create_task(_run_probes(url, rendered, stop, new_log))
        old = asyncio.create_task(_run_probes(url, legacy, stop, legacy_log))
        assert "liveness" in (await asyncio.wait_for(old, 120) or "")  # liveness alone kills the loading worker
        deadline = time.monotonic() + 180
        while not any(k == "startup" and s == 200 for _, k, s in new_log):
            assert not new.done(), f"restarted during the load: {new.result()} {new_log}"
            assert time.monotonic() < deadline, new_log
            await asyncio.sleep(0.2)
        first_ok = next(t for t, k, s in new_log if s == 200)
        assert first_ok > 2, new_log  # the load outlasted liveness's 2 s window
        # liveness running on a healthy worker: three liveness rounds (past its threshold of 2), no restart
        seen = len(new_log)
        while sum(1 for _, k, _ in new_log[seen:] if k == "liveness") < 3:
            assert not new.done(), f"restarted a healthy worker: {new.result()} {new_log}"
            assert time.monotonic() < deadline, new_log
            await asyncio.sleep(0.2)
        assert not new.done(), new_log
        proc.send_signal(signal.SIGSTOP)  # a hung engine: the process no longer answers
        reason = await asyncio.wait_for(new, 60)
        assert reason and reason.startswith("liveness"), new_log
    finally:
        stop.set()
        proc.send_signal(signal.SIGCONT)
        proc.kill()
        proc.wait(10)
