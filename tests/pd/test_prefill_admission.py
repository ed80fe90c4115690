"""Admission from a measured prefill rate (issue 20, build item 2): a request that cannot be served in time is
refused at arrival with the figures, instead of failing after its deadline (runtime/pdruntime/disagg/prefill_rate.py,
worker/prefill.py; the router sends each prefill leg the seconds left as X-PDStack-Deadline-S)."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from pd_harness import start_stack
from pdruntime.disagg.prefill_rate import MIN_INTERVAL_S, PrefillRate, verdict

pytestmark = pytest.mark.timeout(300)


def test_the_rate_is_sampled_only_over_busy_intervals():
    r = PrefillRate()
    r.observe(0.0, 0, backlog_tokens=1000)
    r.observe(1.0, 500, backlog_tokens=500)  # busy throughout: 500 tokens/s
    assert r.tokens_per_s == pytest.approx(500)
    r.observe(2.0, 900, backlog_tokens=0)  # the backlog ran out inside the interval: not a sample
    assert r.tokens_per_s == pytest.approx(500)
    r.observe(5.0, 900, backlog_tokens=0)  # idle
    r.observe(6.0, 900, backlog_tokens=800)  # work arrives: a new interval starts here
    r.observe(6.0 + MIN_INTERVAL_S / 2, 950, backlog_tokens=750)  # too short: the interval stays open
    r.observe(7.0, 1900, backlog_tokens=100)  # 1000 tokens/s; EWMA 0.7 * 500 + 0.3 * 1000
    assert r.tokens_per_s == pytest.approx(650)


@pytest.mark.parametrize("rate,prompt,backlog,left,expect", [
    (None, 5000, [], 1.0, None),  # no measured rate: admit
    (1000, 5000, [], None, None),  # no deadline sent (SGLang's router): admit
    (1000, 500, [], 1.0, None),
    (1000, 5000, [], 1.0, (400, "deadline_unreachable")),  # 5 s of prompt alone, 1 s left
    (1000, 500, [8000, 8000], 1.6, None),  # fair chunks: two long prompts delay it by 2 x 500 tokens: 1.5 s
    (1000, 500, [8000, 8000, 8000], 1.6, (429, "prefill_backlog")),  # three: 2 s
])
def test_verdict(rate, prompt, backlog, left, expect):
    v = verdict(rate, prompt, backlog, left)
    assert (v and (v.status, v.code)) == expect or (v is None and expect is None), v
    if v is not None:
        assert "tokens/s" in v.message and "deadline" in v.message
        assert (v.retry_after is not None) == (v.status == 429)


def _prompt(first: str, words: int) -> str:
    return f"{first} " + "pd " * words  # the tiny model's byte-level tokenizer: ~2 tokens a word


@pytest.fixture(scope="module")
def slow_prefill(tiny_model, tmp_path_factory):
    s = start_stack(str(tmp_path_factory.mktemp("prefill-admission")), tiny_model)
    s.hooks(s.prefill, step_delay_s=1.0)  # each prefill step (one 512-token chunk) takes a second
    yield s
    s.stop()


def _post(stack, model: str, prompt: str, timeout_s: float | None = None) -> httpx.Response:
    headers = {"X-Request-Timeout": str(timeout_s)} if timeout_s else {}
    return httpx.post(stack.router.url + "/v1/completions", timeout=120, headers=headers,
                      json={"model": model, "prompt": prompt, "max_tokens": 2})


@pytest.mark.slow
def test_a_request_that_cannot_make_its_deadline_is_refused_at_arrival_with_the_figures(slow_prefill):
    stack = slow_prefill
    model = httpx.get(stack.router.url + "/v1/models", timeout=10).json()["data"][0]["id"]
    assert _post(stack, model, _prompt("warm", 900)).status_code == 200  # ~1800 tokens: ~4 s, the rate is measured
    t0 = time.monotonic()
    r = _post(stack, model, _prompt("late", 900), timeout_s=2)
    took = time.monotonic() - t0
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "deadline_unreachable" and "tokens/s" in err["message"], err
    assert "X-Request-Timeout" in err["message"]
    assert took < 10, took  # at arrival (before: it failed at its deadline, or after a watchdog's minute)
    assert _post(stack, model, _prompt("fits", 900), timeout_s=60).status_code == 200
    assert stack.metric(stack.prefill, "pdrt_requests_refused_total", {"reason": "deadline_unreachable"}) >= 1


@pytest.mark.slow
def test_behind_a_backlog_it_gets_a_429_with_retry_after_and_a_short_prompt_is_still_admitted(slow_prefill):
    stack = slow_prefill
    model = httpx.get(stack.router.url + "/v1/models", timeout=10).json()["data"][0]["id"]
    assert _post(stack, model, _prompt("warm2", 900)).status_code == 200
    out: dict = {}
    long_ones = [threading.Thread(target=lambda i=i: out.update({i: _post(stack, model, _prompt(f"long{i}", 900))}))
                 for i in range(2)]
    for t in long_ones:
        t.start()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and len(stack.debug(stack.prefill)["requests"]) < 2:
        time.sleep(0.05)
    r = _post(stack, model, _prompt("third", 900), timeout_s=6)  # ~3.6 s alone, ~11 s behind the two
    short = _post(stack, model, _prompt("short", 10), timeout_s=6)  # fair chunks: it is not behind them
    for t in long_ones:
        t.join(120)
    assert r.status_code == 429, r.text
    assert int(r.headers["retry-after"]) >= 1 and "prefill is too busy" in r.json()["error"]["message"]
    assert short.status_code == 200, short.text
    assert [out[i].status_code for i in range(2)] == [200, 200]
    p, d = stack.wait_idle(timeout=30)
    assert p["pool"]["free"] == p["pool"]["total"] and d["pool"]["free"] == d["pool"]["total"]
