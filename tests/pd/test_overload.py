"""Overload on one PD pair (issue 20): no page without an owner, back-pressure instead of failure.

The leak repro of the issue: 48 concurrent 600-token completions fill the decode pool; requests waiting for
pages are failed by the router meanwhile; afterwards both pools must return exactly to their idle count, and
clean requests must all succeed."""

from __future__ import annotations

import os
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from pd_harness import Stack, base_env, free_port, spawn, wait_healthy  # noqa: E402

pytestmark = pytest.mark.timeout(600)


def _complete(url: str, model: str, i: int, max_tokens: int) -> httpx.Response:
    return httpx.post(url + "/v1/completions", timeout=300, json={
        "model": model, "prompt": f"overload request {i}: tell a long story", "max_tokens": max_tokens,
        "ignore_eos": True, "temperature": 0})


@pytest.fixture(scope="module")
def small_stack(tiny_model, tmp_path_factory):
    """One pair whose decode pool holds about 6 of the 48 requests: most wait for pages, and the router fails
    some of them meanwhile (prefill's bootstrap timeout)."""
    d = str(tmp_path_factory.mktemp("overload"))
    env = base_env()
    pp, dp, bp, rp = free_port(), free_port(), free_port(), free_port()
    common = ["--block-size", "16", "--max-num-seqs", "64", "--model", tiny_model]
    prefill = spawn("prefill", ["--role", "prefill", "--port", str(pp), "--bootstrap-port", str(bp),
                                "--num-blocks", "1024", *common], env, d, pp)
    decode = spawn("decode", ["--role", "decode", "--port", str(dp), "--num-blocks", "256", *common], env, d, dp)
    router = spawn("router", ["--role", "router", "--port", str(rp), "--prefill", f"http://127.0.0.1:{pp}",
                              "--decode", f"http://127.0.0.1:{dp}", "--bootstrap-ports", str(bp)], env, d, rp)
    s = Stack(router, prefill, decode, bp, tiny_model, [router, prefill, decode])
    try:
        wait_healthy([prefill, decode, router])
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def small_model_id(small_stack) -> str:
    return httpx.get(small_stack.router.url + "/v1/models", timeout=10).json()["data"][0]["id"]


def test_48_concurrent_600_token_completions_leave_both_pools_at_their_idle_count(small_stack, small_model_id):
    stack, model_id = small_stack, small_model_id
    p0, d0 = stack.wait_idle()
    assert p0["pool"]["free"] == p0["pool"]["total"] and d0["pool"]["free"] == d0["pool"]["total"]
    with ThreadPoolExecutor(48) as pool:
        resps = list(pool.map(lambda i: _complete(stack.router.url, model_id, i, 600), range(48)))
    codes = [r.status_code for r in resps]
    print("OVERLOAD", {c: codes.count(c) for c in set(codes)}, [r.text[:200] for r in resps if r.status_code != 200][:5])
    p, d = stack.wait_idle(timeout=30)
    assert (p["live"], d["live"]) == (0, 0), (p, d)
    assert (p["pool"]["orphaned"], d["pool"]["orphaned"]) == (0, 0), (p["pool"], d["pool"])
    assert d["pool"]["free"] == d["pool"]["total"], f"decode pages held by no live request: {d['pool']} ({codes})"
    assert p["pool"]["free"] == p["pool"]["total"], f"prefill pages held by no live request: {p['pool']}"
    with ThreadPoolExecutor(4) as pool:
        clean = [r.status_code for r in pool.map(lambda i: _complete(stack.router.url, model_id, i, 8), range(10))]
    assert clean == [200] * 10, clean
