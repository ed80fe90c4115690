"""Integration: engine-step failures on real workers (tiny model, real processes on loopback).

* defect 2 of issue 13: a request whose numbers pass validation but used to make every engine step raise;
* a request that poisons every step it takes part in (test hook) fails alone; its neighbours are served;
* errors not tied to one request fail the step's requests with a client-visible error, and after N
  consecutive failing steps the worker reports 503 on /health (reason also in /config) and exits non-zero.
"""

from __future__ import annotations

import concurrent.futures as cf
import time

import httpx
import pytest

from pd_harness import hooks, metric, start_stack, start_worker

pytestmark = pytest.mark.timeout(180)


def chat(model_id, content="hello there", **kw):
    return {"model": model_id, "messages": [{"role": "user", "content": content}], "max_tokens": 8, **kw}


@pytest.fixture(scope="module")
def own_stack(tiny_model, tmp_path_factory):
    """One stack for the tests that leave it idle and healthy (their hooks are reset)."""
    s = start_stack(str(tmp_path_factory.mktemp("engine-failures")), tiny_model,
                    env_extra={"PDRT_ENGINE_MAX_STEP_FAILURES": "4"})
    yield s
    s.stop()


def _model_id(s) -> str:
    return httpx.get(s.router.url + "/v1/models", timeout=10).json()["data"][0]["id"]


def test_defect2_tiny_temperature_request_does_not_freeze_concurrent_prefills(own_stack):
    # Defect 2 (issue 13). Ran against the unfixed code (commit 1c0b2fc): FAILED — the temperature=1e-40
    # request made every prefill step raise ("probability tensor contains either inf, nan ..."), the clean
    # requests of the same steps got no token until decode's transfer watchdog killed the poisoned one
    # (~6 s here, 600 s by default), and prefill logged one traceback per step.
    s = own_stack
    model_id = _model_id(s)
    with cf.ThreadPoolExecutor(5) as pool:
        poisoned = pool.submit(httpx.post, s.router.url + "/v1/chat/completions",
                               json=chat(model_id, "tell me about the fox", temperature=1e-40), timeout=120)
        clean = [pool.submit(httpx.post, s.router.url + "/v1/chat/completions",
                             json=chat(model_id, f"clean request {i}", temperature=0), timeout=120) for i in range(4)]
        results = [f.result() for f in clean]
        bad = poisoned.result()
    for r in results:
        assert r.status_code == 200, r.text
    # the edge rejects it first (the shared request model: 0 or [1e-5, 2]), naming the parameter; a request
    # that reaches an engine directly samples greedily there instead (tests/engine: MIN_TEMPERATURE)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "temperature", bad.text
    assert s.metric(s.prefill, "pdrt_engine_step_errors_total") == 0  # (this test runs first on the stack)
    assert "Traceback" not in s.prefill.log_text()
    p, d = s.wait_idle()
    assert p["pool"]["free"] == p["pool"]["total"] and d["pool"]["free"] == d["pool"]["total"]


def test_poisoned_request_fails_alone_with_422_and_clean_concurrent_requests_are_served(own_stack):
    # a request that makes every step it runs in raise (test hook), batched with 4 clean ones (the prefill
    # engine holds its steps until all 5 are queued): the retry in parts isolates it
    s = own_stack
    model_id = _model_id(s)
    before_leg_failures = s.metric(s.router, "pdrt_router_leg_failures_total")
    s.hooks(s.prefill, poison_seed=4242, hold_steps=True)
    with cf.ThreadPoolExecutor(5) as pool:
        bad = pool.submit(httpx.post, s.router.url + "/v1/chat/completions",
                          json=chat(model_id, "poisoned prompt", seed=4242, temperature=0.7), timeout=120)
        clean = [pool.submit(httpx.post, s.router.url + "/v1/chat/completions",
                             json=chat(model_id, f"clean {i}", temperature=0.7, seed=i), timeout=120) for i in range(4)]
        deadline = time.monotonic() + 60
        while sum(r["stage"] == "waiting" for r in s.debug(s.prefill)["requests"]) < 5:
            assert time.monotonic() < deadline, s.debug(s.prefill)
            time.sleep(0.05)
        s.hooks(s.prefill, hold_steps=False)  # one step with all five
        results = [f.result() for f in clean]
        bad = bad.result()
    assert all(r.status_code == 200 for r in results), [r.text for r in results]
    assert bad.status_code == 422, bad.text
    msg = bad.json()["error"]["message"]
    assert "alone" in msg and "seed=4242" in msg, msg
    assert s.metric(s.prefill, "pdrt_engine_step_errors_total", {"verdict": "request"}) >= 1
    assert "isolated to rid=" in s.prefill.log_text()
    # not a pair failure: the breaker stays closed, the router stays healthy, the next request is served
    assert httpx.get(s.router.url + "/health", timeout=5).status_code == 200
    assert s.metric(s.router, "pdrt_router_leg_failures_total") == before_leg_failures
    assert httpx.post(s.router.url + "/v1/chat/completions", json=chat(model_id), timeout=60).status_code == 200
    s.hooks(s.prefill, poison_seed=None)
    p, d = s.wait_idle()
    assert p["pool"]["free"] == p["pool"]["total"] and d["pool"]["free"] == d["pool"]["total"]


def test_a_lone_poisoned_request_fails_alone_with_422_and_never_counts_towards_giving_up(own_stack):
    # alone in its step, a canary step tells its fault from the engine's: repeating it cannot kill the worker
    s = own_stack
    model_id = _model_id(s)
    s.hooks(s.prefill, poison_seed=777)
    for _ in range(5):  # more than PDRT_ENGINE_MAX_STEP_FAILURES=4
        r = httpx.post(s.router.url + "/v1/chat/completions", json=chat(model_id, seed=777, temperature=0.5),
                       timeout=60)
        assert r.status_code == 422 and "alone" in r.json()["error"]["message"], r.text
    s.hooks(s.prefill, poison_seed=None)
    assert httpx.get(s.prefill.url + "/health", timeout=5).status_code == 200
    assert httpx.get(s.prefill.url + "/config", timeout=5).json()["engine_health"]["consecutive_failed_steps"] == 0
    assert httpx.post(s.router.url + "/v1/chat/completions", json=chat(model_id), timeout=60).status_code == 200
    p, d = s.wait_idle()
    assert p["pool"]["free"] == p["pool"]["total"] and d["pool"]["free"] == d["pool"]["total"]


def test_a_seed_the_generator_cannot_take_is_a_400_at_admission_not_a_500(own_stack):
    s = own_stack
    r = httpx.post(s.decode.url + "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2,
                                                                                        "seed": 2 ** 64}}, timeout=30)
    assert r.status_code == 400 and "seed" in r.json()["error"]["param"], r.text
    assert "accepted: an integer in [0, " in r.json()["error"]["message"], r.text
    assert s.metric(s.decode, "pdrt_engine_step_errors_total") == 0


def test_out_of_memory_in_a_step_rejects_with_a_clear_503_and_the_worker_keeps_serving(own_stack):
    s = own_stack
    # monolithic requests on the decode worker (no bootstrap fields): its engine runs prefill and decode
    s.hooks(s.decode, inject_step_errors=10**6, inject_oom=True)
    for i in range(6):  # more than PDRT_ENGINE_MAX_STEP_FAILURES=4: OOM never counts towards the exit
        r = httpx.post(s.decode.url + "/generate", json={"text": f"hi {i}", "sampling_params": {"max_new_tokens": 4}},
                       timeout=60)
        assert r.status_code == 503, r.text
        assert "out of device memory" in r.json()["error"]["message"]
    assert httpx.get(s.decode.url + "/health", timeout=5).status_code == 200
    assert s.metric(s.decode, "pdrt_engine_step_errors_total", {"verdict": "oom"}) == 6
    assert s.metric(s.decode, "pdrt_engine_step_errors_total", {"verdict": "step"}) == 0
    s.hooks(s.decode, inject_step_errors=0, inject_oom=False)
    r = httpx.post(s.decode.url + "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 4}}, timeout=60)
    assert r.status_code == 200, r.text
    assert s.decode.popen.poll() is None


def test_step_failures_fail_requests_then_after_n_in_a_row_health_is_503_and_the_worker_exits_70(tiny_model, tmp_path):
    # the decode worker alone, serving monolithic requests (no bootstrap fields): its engine runs every step
    decode = start_worker(str(tmp_path), tiny_model, "decode", env_extra={"PDRT_ENGINE_MAX_STEP_FAILURES": "3",
                                                                           "PDRT_ENGINE_FAILURE_EXIT_GRACE_S": "6"})
    try:
        hooks(decode, inject_step_errors=10**6)
        t0 = time.monotonic()
        for i in range(3):
            r = httpx.post(decode.url + "/generate", json={"text": f"hi {i}", "sampling_params": {"max_new_tokens": 4}},
                           timeout=60)
            assert r.status_code == 500, r.text  # a clear error reaches the client
            assert "engine step failed" in r.json()["error"]["message"]
        h = httpx.get(decode.url + "/health", timeout=5)
        assert h.status_code == 503 and "3 consecutive engine steps failed" in h.json()["reason"], h.text
        cfg = httpx.get(decode.url + "/config", timeout=5).json()["engine_health"]
        assert cfg["healthy"] is False and cfg["reason"] == h.json()["reason"]
        assert metric(decode, "pdrt_engine_step_errors_total", {"verdict": "step"}) == 3
        assert metric(decode, "pdrt_engine_healthy") == 0
        assert decode.popen.wait(60) == 70  # exits non-zero so the pod (or pdrt up) restarts the pair
        assert time.monotonic() - t0 < 60
        assert "worker unhealthy" in decode.log_text()
    finally:
        decode.stop()
