"""Integration: a worker dies. Each test starts its own router + pair (it kills processes)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from pd_harness import base_env, free_port, start_stack, wait_for, stop_up
from pdruntime.util.ports import free_port_block

pytestmark = pytest.mark.timeout(150)

TRANSFER_TIMEOUT_S = 3.0  # conftest TIMEOUTS


def chat(model_id, **kw):
    return {"model": model_id, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8, **kw}


def run_in_thread(fn) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def target():
        t0 = time.monotonic()
        try:
            r = fn()
            out.update(status=r.status_code, body=r.json())
        except Exception as exc:  # noqa: BLE001 - recorded for the assertion
            out["exc"] = exc
        out["elapsed"] = time.monotonic() - t0

    t = threading.Thread(target=target)
    t.start()
    return t, out


@pytest.fixture
def own_stack(tiny_model, tmp_path):
    s = start_stack(str(tmp_path), tiny_model)
    yield s
    s.stop()


def test_decode_killed_mid_transfer_prefill_frees_pages_and_client_gets_an_error(own_stack):
    s = own_stack
    model_id = httpx.get(s.router.url + "/v1/models", timeout=10).json()["data"][0]["id"]
    s.hooks(s.decode, stall_transfers=1)  # decode takes the HEADER and stops mid-transfer
    t, out = run_in_thread(lambda: httpx.post(s.router.url + "/v1/chat/completions", timeout=60,
                                              json=chat(model_id, stream=True)))
    rows = wait_for(lambda: [r for r in s.debug(s.prefill)["requests"] if r["stage"] == "inflight"], 30, "KV in flight")
    assert rows[0]["state"] == "Transferring"
    assert s.debug(s.prefill)["pool"]["free"] < s.debug(s.prefill)["pool"]["total"]  # KV held for the peer
    s.decode.kill()
    t_kill = time.monotonic()
    wait_for(lambda: (lambda d: d["live"] == 0 and d["pool"]["free"] == d["pool"]["total"])(s.debug(s.prefill)),
             TRANSFER_TIMEOUT_S + 1.0, "prefill to free the pages")
    assert time.monotonic() - t_kill <= TRANSFER_TIMEOUT_S + 1.0
    t.join(timeout=30)
    assert not t.is_alive(), "the client hung"
    assert out.get("status") in (502, 503, 504), out
    assert out["body"]["error"]["message"]
    assert s.metric(s.prefill, "pdrt_kv_transfers_total", {"outcome": "failed"}) == 1
    assert any(rows[0]["id"] in line and "failed" in line for line in s.prefill.log_text().splitlines())


def test_prefill_killed_decode_aborts_and_router_answers_5xx_within_the_deadline(own_stack):
    s = own_stack
    model_id = httpx.get(s.router.url + "/v1/models", timeout=10).json()["data"][0]["id"]
    s.hooks(s.prefill, stall_prefill=1)  # the request waits in prefill's queue; decode is attached, waiting for KV
    deadline_s = 20.0
    t, out = run_in_thread(lambda: httpx.post(s.router.url + "/v1/chat/completions", timeout=60,
                                              headers={"X-Request-Timeout": str(deadline_s)}, json=chat(model_id)))
    wait_for(lambda: [r for r in s.debug(s.decode)["requests"] if r["state"] == "WaitingForInput"], 30,
             "decode attached and waiting for KV")
    assert s.debug(s.decode)["pool"]["free"] < s.debug(s.decode)["pool"]["total"]  # pages reserved
    s.prefill.kill()
    t.join(timeout=deadline_s + 5)
    assert not t.is_alive(), "the client hung"
    assert out.get("status") in (502, 503), out
    assert out["elapsed"] < deadline_s
    assert out["body"]["error"]["message"]
    d = s.debug(s.decode)
    assert d["live"] == 0 and d["pool"]["free"] == d["pool"]["total"]  # decode aborted and freed its reservation
    assert s.metric(s.decode, "pdrt_kv_transfers_total", {"outcome": "failed"}) == 1
    # later requests fail fast too (prefill unreachable, then the breaker opens), never hang
    statuses = []
    for _ in range(4):
        t0 = time.monotonic()
        r = httpx.post(s.router.url + "/v1/chat/completions", json=chat(model_id), timeout=30)
        assert time.monotonic() - t0 < 10
        statuses.append(r.status_code)
        assert r.json()["error"]["message"]
    assert set(statuses) <= {502, 503} and statuses[-1] == 503  # breaker open: no ready pair
    assert httpx.get(s.router.url + "/health", timeout=5).status_code == 503
    d = s.debug(s.decode)
    assert d["live"] == 0 and d["pool"]["free"] == d["pool"]["total"]


# slow tier: the pair restarted together (the survivor stopped at once, both respawned) is
# test_up_units.py::test_every_restart_backs_off_exponentially_and_the_count_resets_after_a_healthy_period; a live
# `pdrt up` co-restart stays in make test (test_up_process.py::test_pdrt_up_co_restarts_a_pair_whose_engine_gave_up_...)
@pytest.mark.slow
def test_pdrt_up_serves_and_restarts_a_pair_together(tiny_model, tmp_path):
    port = free_port()
    base = free_port_block(3)
    env = base_env()
    proc = subprocess.Popen([sys.executable, "-m", "pdruntime.server", "up", "--model", tiny_model, "--port", str(port),
                             "--base-port", str(base), "--num-blocks", "256"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)
    reader.start()
    try:
        wait_for(lambda: any(l.startswith("curl ") for l in lines), 120, f"pdrt up to print a curl line: {lines}")
        url = f"http://127.0.0.1:{port}"
        assert any(f"ready at {url}" in l for l in lines)
        model_id = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        assert httpx.post(url + "/v1/chat/completions", json=chat(model_id), timeout=60).status_code == 200
        pre_pid = httpx.get(f"http://127.0.0.1:{base}/config", timeout=5).json()["server"]["pid"]
        dec_pid = httpx.get(f"http://127.0.0.1:{base + 1}/config", timeout=5).json()["server"]["pid"]
        os.kill(dec_pid, signal.SIGKILL)  # one worker of the pair dies

        def restarted():
            try:
                new_pre = httpx.get(f"http://127.0.0.1:{base}/config", timeout=2).json()["server"]["pid"]
                new_dec = httpx.get(f"http://127.0.0.1:{base + 1}/config", timeout=2).json()["server"]["pid"]
                ok = httpx.get(url + "/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return None
            return (new_pre, new_dec) if ok and new_pre != pre_pid and new_dec != dec_pid else None

        new_pre, new_dec = wait_for(restarted, 90, "the pair to restart together")
        with pytest.raises(ProcessLookupError):
            os.kill(pre_pid, 0)  # the surviving prefill was stopped, not kept with stale transfer state
        r = httpx.post(url + "/v1/chat/completions", json=chat(model_id), timeout=60)
        assert r.status_code == 200, r.text
    finally:
        stop_up(proc)
    assert proc.returncode == 0
