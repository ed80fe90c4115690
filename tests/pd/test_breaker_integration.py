"""Integration: the breaker case of issue 13 (defect 1) with real processes on loopback.

A decode worker is killed; requests fail until the pair's breaker opens; the worker is restarted on its
port; the first request after the cooldown (the half-open trial) comes from an impatient client that leaves
before the first token. The pair must come back: within the breaker's window plus one trial, the next
request succeeds and the router's /health is 200 again.

Run against the unfixed code (main at 1c0b2fc's runtime on PYTHONPATH): it failed there — the abandoned
trial was never resolved, every later request got 503 "no ready PD pair" and /health stayed 503 until the
test's deadline.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from pd_harness import WORKER_FLAGS, base_env, spawn, start_stack, wait_healthy

pytestmark = pytest.mark.timeout(240)

COOLDOWN_S = 2.0  # --breaker-cooldown-s for this router
TRIAL_TIMEOUT_S = 30.0  # RouterConfig default: the "one trial" of the bound


def chat(model_id, **kw):
    return {"model": model_id, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, **kw}


@pytest.fixture
def own_stack(tiny_model, tmp_path):
    s = start_stack(str(tmp_path), tiny_model, router_flags=["--breaker-cooldown-s", str(COOLDOWN_S)])
    yield s
    s.stop()


def test_breaker_recovers_within_its_window_plus_one_trial_after_an_impatient_trial_client(own_stack, tmp_path):
    s = own_stack
    model_id = httpx.get(s.router.url + "/v1/models", timeout=10).json()["data"][0]["id"]
    assert httpx.post(s.router.url + "/v1/chat/completions", json=chat(model_id), timeout=60).status_code == 200

    # 1. kill decode: requests fail until the breaker opens (threshold 3), then 503 "no ready pair"
    s.decode.kill()
    statuses = [httpx.post(s.router.url + "/v1/chat/completions", json=chat(model_id), timeout=60).status_code
                for _ in range(4)]
    assert statuses[-1] == 503 and set(statuses) <= {502, 503}, statuses
    assert s.metric(s.router, "pdrt_router_circuit_open") == 1
    health = httpx.get(s.router.url + "/health", timeout=10)
    assert health.status_code == 503 and 0 < health.json()["next_trial_in_s"] <= COOLDOWN_S

    # 2. restart decode on its port (same pair), then wait out the cooldown
    port = int(s.decode.url.rsplit(":", 1)[1])
    decode = spawn("decode2", ["--role", "decode", "--port", str(port), "--model", s.model, *WORKER_FLAGS], base_env(),
                   str(tmp_path), port)
    s.procs.append(decode)
    s.decode = decode
    wait_healthy([decode])
    time.sleep(COOLDOWN_S + 0.2)

    # 3. the half-open trial: an impatient client that leaves before the first token (prefill holds it)
    s.hooks(s.prefill, stall_prefill=1)
    gone: dict = {}

    def impatient() -> None:
        try:
            httpx.post(s.router.url + "/v1/chat/completions", json=chat(model_id, stream=True),
                       timeout=httpx.Timeout(10.0, read=1.5))
        except httpx.ReadTimeout:
            gone["left"] = True

    t = threading.Thread(target=impatient)
    t.start()
    t.join(30)
    assert gone.get("left"), "the impatient client should have left before the first token"
    t_left = time.monotonic()

    # 4. the pair comes back: a normal request succeeds within the window plus one trial (not after a restart)
    bound = COOLDOWN_S + TRIAL_TIMEOUT_S
    last = None
    while time.monotonic() - t_left < bound + 5:
        last = httpx.post(s.router.url + "/v1/chat/completions", json=chat(model_id), timeout=60)
        if last.status_code == 200:
            break
        time.sleep(0.5)
    assert last is not None and last.status_code == 200, f"pair still excluded {bound + 5:.0f}s later: {last.text}"
    assert httpx.get(s.router.url + "/health", timeout=10).status_code == 200
    assert s.metric(s.router, "pdrt_router_circuit_open") == 0
    router_view = httpx.get(s.router.url + "/debug/requests", timeout=10).json()
    assert router_view["live"] == 0  # the abandoned trial left no live entry
    assert s.metric(s.router, "pdrt_router_pair_outstanding_requests") == 0
