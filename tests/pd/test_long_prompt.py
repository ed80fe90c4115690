"""Watchdogs that measure progress, not time (issue 20, build item 2).

Decode's transfer timer starts when prefill reports the KV ready; before that, prefill reports its progress
(PROGRESS frames: prompt tokens computed, engine steps) and decode fails only a prefill that stops advancing for
``PDRT_PREFILL_STALL_S``. A long prompt that advances succeeds however long it takes; a frozen prefill fails with
the stage named."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest

from pd_harness import start_stack

pytestmark = pytest.mark.timeout(300)

STALL_S = 4.0  # prefill stall limit here; the transfer timeout is 6 s (pd_harness TIMEOUTS)
STEP_DELAY_S = 2.5  # each prefill step this slow: 4 chunks of 512 take ~10 s, past the old watchdog's 6 s


@pytest.fixture(scope="module")
def slow_stack(tiny_model, tmp_path_factory):
    s = start_stack(str(tmp_path_factory.mktemp("long-prompt")), tiny_model,
                    env_extra={"PDRT_PREFILL_STALL_S": str(STALL_S)})
    yield s
    s.stop()


def _long_prompt(first: str = "pd", tokenizer_len: int = 2048) -> str:
    """~95% of the context; ``first`` makes it unique (the prefix cache must not serve a timed request)."""
    return f"{first} " + "pd " * (int(tokenizer_len * 0.95 * 0.5) - 1)  # tiny model's byte-level: ~2 per word


def _count_tokens(stack, model: str, text: str) -> int:
    r = httpx.post(stack.router.url + "/v1/completions", timeout=120, json={
        "model": model, "prompt": text, "max_tokens": 1})
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens"]


def test_a_prompt_of_95_percent_of_the_context_succeeds_while_prefill_keeps_advancing(slow_stack):
    stack = slow_stack
    model = httpx.get(stack.router.url + "/v1/models", timeout=10).json()["data"][0]["id"]
    text = _long_prompt()
    n = _count_tokens(stack, model, text)
    assert 0.85 * 2048 <= n < 2048, n
    stack.hooks(stack.prefill, step_delay_s=STEP_DELAY_S)  # every step slow, each one still progress
    out: dict = {}
    try:
        t0 = time.monotonic()
        t = threading.Thread(target=lambda: out.update(r=httpx.post(stack.router.url + "/v1/completions", timeout=120, json={
            "model": model, "prompt": _long_prompt("qq"), "max_tokens": 4, "ignore_eos": True})), daemon=True)
        t.start()
        verdicts = _sweep_while(t, stack.router.url)
        took = time.monotonic() - t0
    finally:
        stack.hooks(stack.prefill, step_delay_s=0)
    r = out["r"]
    assert r.status_code == 200, r.text
    assert took > 6.0, took  # longer than the old decode transfer timeout, which would have failed it
    assert r.json()["usage"]["completion_tokens"] == 4
    # the operator's stall sweep, fed the router's real /debug/requests, reads the same progress: never Stalled,
    # although the request was older than stall.seconds before decode (what the age-only rule flagged)
    old = [e for e in verdicts if any(r.pre_decode and r.age_s >= STALL_S for r in e.observation.rows)]
    assert old, [e.reason for e in verdicts]
    assert not [e.reason for e in verdicts if e.stalled]


def _sweep_while(t, router_url: str) -> list:
    """The operator's stall verdicts (stall.seconds = STALL_S), one a second, while thread ``t`` runs."""
    from pdoperator.core.stall import evaluate, observe, rows_by_pair

    prev, verdicts = None, []
    while t.is_alive():
        doc = httpx.get(router_url + "/debug/requests", timeout=10).json()
        rows = rows_by_pair([doc])[0].get(0, [])
        if rows:
            cur = observe(0, time.monotonic(), rows, [], [])
            e = evaluate(prev, cur, STALL_S)
            prev = e.observation
            verdicts.append(e)
        t.join(1.0)
    return verdicts


def test_a_frozen_prefill_fails_after_the_stall_limit_naming_the_stage(slow_stack):
    stack = slow_stack
    model = httpx.get(stack.router.url + "/v1/models", timeout=10).json()["data"][0]["id"]
    stack.hooks(stack.prefill, step_delay_s=1.0)
    pid = stack.prefill.popen.pid
    try:
        out: dict = {}
        t = threading.Thread(target=lambda: out.update(r=httpx.post(
            stack.router.url + "/v1/completions", timeout=120,
            json={"model": model, "prompt": _long_prompt("zz"), "max_tokens": 4})), daemon=True)
        t.start()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # wait until decode holds the request, waiting for prefill's KV
            rows = stack.debug(stack.decode)["requests"]
            if rows and rows[0]["stage"] == "transfer":
                break
            time.sleep(0.1)
        os.kill(pid, signal.SIGSTOP)
        t0 = time.monotonic()
        t.join(60)
        waited = time.monotonic() - t0
    finally:
        os.kill(pid, signal.SIGCONT)
        stack.hooks(stack.prefill, step_delay_s=0)
    r = out["r"]
    msg = r.json()["error"]["message"]
    assert r.status_code >= 500 and "prefill stalled" in msg and "stage prefill" in msg, (r.status_code, msg)
    assert STALL_S - 0.5 <= waited < STALL_S + 20, waited
    assert stack.metric(stack.decode, "pdrt_watchdog_fired_total", {"phase": "prefill_stall"}) >= 1
    p, d = stack.wait_idle(timeout=30)
    assert d["pool"]["free"] == d["pool"]["total"] and p["pool"]["free"] == p["pool"]["total"]
