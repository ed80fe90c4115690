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

from pd_harness import start_stack

pytestmark = pytest.mark.timeout(180)


def chat(model_id, content="hello there", **kw):
    return {"model": model_id, "messages": [{"role": "user", "content": content}], "max_tokens": 8, **kw}


@pytest.fixture
def own_stack(tiny_model, tmp_path):
    s = start_stack(str(tmp_path), tiny_model, env_extra={"PDRT_ENGINE_MAX_STEP_FAILURES": "4"})
    yield s
    s.stop()


def _model_id(s) -> str:
    return httpx.get(s.router.url + "/v1/models", timeout=10).json()["data"][0]["id"]


def test_defect2_tiny_temperature_request_is_served_and_does_not_freeze_concurrent_prefills(own_stack):
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
    # temperature below 1e-5 samples greedily (the limit of softmax(logits / T) as T -> 0), like vLLM
    assert bad.status_code == 200, bad.text
    greedy = httpx.post(s.router.url + "/v1/chat/completions",
                        json=chat(model_id, "tell me about the fox", temperature=0), timeout=60).json()
    assert bad.json()["choices"][0]["message"]["content"] == greedy["choices"][0]["message"]["content"]
    assert s.metric(s.prefill, "pdrt_engine_step_errors_total") == 0
    assert "Traceback" not in s.prefill.log_text()
    p, d = s.wait_idle()
    assert p["pool"]["free"] == p["pool"]["total"] and d["pool"]["free"] == d["pool"]["total"]
