"""Integration: the real SGLang router (PyPI ``sglang-router``, a Rust binary) fronting a pdrt PD pair.

``python -m sglang_router.launch_router --pd-disaggregation --prefill URL BOOTSTRAP_PORT --decode URL``
registers the workers through /server_info and /model_info (falling back to /get_server_info and
/get_model_info) and checks /health, then sends every /generate to both workers of a pair at once, the same body with
``bootstrap_host``/``bootstrap_port``/``bootstrap_room`` added (and no ``rid``), and answers with the decode
leg's response (streamed or not). These tests send plain SGLang /generate bodies (no room, no rid) to it, so
every room the workers see was injected by the SGLang router.

Skips where ``sglang_router`` (or its Rust extension) is not installed: ``pip install sglang-router``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

try:
    import sglang_router.router  # noqa: F401  (the Rust extension)
except ImportError as exc:
    pytest.skip(f"sglang-router is not installed ({exc}); these tests run the real SGLang router in front of pdrt "
                "workers: pip install sglang-router", allow_module_level=True)

from pd_harness import Proc, free_port  # noqa: E402  (tests/pd is on sys.path via conftest.py)

pytestmark = pytest.mark.timeout(120)
SHARED_STACK = True  # its traffic leaves the stack as it found it: the process's shared stack (tiny_stack.py)

MAX_NEW = 8


# ``python -m sglang_router.launch_router``, with the ``sglang`` package hidden from that process. launch_router
# imports the Python MiniLB (debug only), which tries ``sglang.srt.tracing`` and goes without it on ImportError;
# here sglang is installed (no deps, for SGLang's argparse in tests/operator/test_sglang_render.py) and that import
# pulls in sglang.srt and torch: ~7 CPU s and ~14 s on this host per router start, in four modules. The Rust router
# these tests drive never uses it; an install of sglang-router alone starts the same way.
LAUNCH_ROUTER = ["-c", "import sys; sys.modules['sglang'] = None; "
                       "from sglang_router.launch_router import main; main()"]


class SGLangRouter(Proc):
    """The real SGLang router process; stop/kill come from pd_harness.Proc."""

    def __init__(self, stack, log_dir: str) -> None:
        self.name = "sglang-router"
        self.port, metrics_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = os.path.join(log_dir, "sglang_router.log")
        env = {**os.environ, "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}
        with open(self.log, "wb") as fh:
            self.popen = subprocess.Popen(
                [sys.executable, *LAUNCH_ROUTER, "--pd-disaggregation",
                 "--prefill", stack.prefill.url, str(stack.bootstrap_port), "--decode", stack.decode.url,
                 "--host", "127.0.0.1", "--port", str(self.port),
                 "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
                 "--policy", "round_robin", "--worker-startup-timeout-secs", "30",
                 "--worker-startup-check-interval", "1", "--shutdown-grace-period-secs", "1", "--log-level", "info"],
                env=env, stdout=fh, stderr=subprocess.STDOUT)

    def log_text(self) -> str:
        with open(self.log, errors="replace") as fh:
            return fh.read()[-4000:]

    def wait_workers(self, timeout: float = 90.0) -> list[dict]:
        """Until the router has registered both workers as healthy (its /health is 200 before that)."""
        deadline = time.monotonic() + timeout
        workers: list[dict] = []
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise RuntimeError(f"sglang router exited with {self.popen.returncode}:\n{self.log_text()}")
            try:
                workers = httpx.get(self.url + "/workers", timeout=2).json().get("workers", [])
            except (httpx.HTTPError, ValueError):
                workers = []
            if len(workers) == 2 and all(w.get("is_healthy") for w in workers):
                return workers
            time.sleep(0.2)
        raise RuntimeError(f"sglang router did not register both workers in {timeout}s: {workers}\n{self.log_text()}")


@pytest.fixture(scope="module")
def sgl(stack, tmp_path_factory):
    r = SGLangRouter(stack, str(tmp_path_factory.mktemp("sglang-router")))
    try:
        r.workers = r.wait_workers()
        yield r
    finally:
        r.stop()


def gen_body(text: str, **kw) -> dict:
    return {"text": text, "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}, **kw}


def monolithic_text(stack, text: str) -> str:
    """The same prompt run on the decode worker alone (no bootstrap fields): the greedy reference."""
    r = httpx.post(stack.decode.url + "/generate", json=gen_body(text), timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["text"]


def assert_idle(stack) -> None:
    p, d = stack.wait_idle()
    for x in (p, d):
        assert x["live"] == 0, x
        assert x["pool"]["free"] == x["pool"]["total"], x


def transfers_ok(stack) -> tuple[float, float]:
    return (stack.metric(stack.prefill, "pdrt_kv_transfers_total", {"outcome": "success"}),
            stack.metric(stack.decode, "pdrt_kv_transfers_total", {"outcome": "success"}))


def test_sglang_router_registers_the_pdrt_workers(stack, sgl):
    by_type = {w["worker_type"]: w for w in sgl.workers}
    assert set(by_type) == {"prefill", "decode"}, sgl.workers
    assert by_type["prefill"]["url"] == stack.prefill.url and by_type["decode"]["url"] == stack.decode.url
    assert by_type["prefill"]["bootstrap_port"] == stack.bootstrap_port
    assert by_type["prefill"]["metadata"].get("disaggregation_mode") == "prefill"
    assert by_type["decode"]["metadata"].get("disaggregation_mode") == "decode"
    for w, role in ((stack.prefill, "prefill"), (stack.decode, "decode")):  # SGLang's current names, tried first
        assert httpx.get(w.url + "/server_info", timeout=10).json()["disaggregation_mode"] == role
        assert httpx.get(w.url + "/model_info", timeout=10).json()["model_path"] == stack.model
    models = httpx.get(sgl.url + "/v1/models", timeout=10).json()["data"]
    assert [m["id"] for m in models] == [stack.model]  # model_path from the workers' /server_info


def test_generate_through_the_sglang_router_non_streamed(stack, sgl):
    prompt = "the quick brown fox jumps over the lazy dog"
    before = transfers_ok(stack)
    r = httpx.post(sgl.url + "/generate", json=gen_body(prompt), timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["meta_info"]["completion_tokens"] == MAX_NEW
    assert out["meta_info"]["finish_reason"] == {"type": "length"}
    # the client sent no room: the id both legs agreed on derives from the room the SGLang router injected
    assert out["meta_info"]["id"].startswith("room-"), out
    after = transfers_ok(stack)
    assert after == (before[0] + 1, before[1] + 1)  # one KV transfer, reached by the injected bootstrap host/port
    assert out["text"] == monolithic_text(stack, prompt)
    assert_idle(stack)


def test_generate_through_the_sglang_router_streamed(stack, sgl):
    prompt = "tell me about the lazy dog"
    before = transfers_ok(stack)
    with httpx.stream("POST", sgl.url + "/generate", json=gen_body(prompt, stream=True), timeout=60) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len(chunks) >= 2  # streamed, not one final body
    assert [c["meta_info"]["completion_tokens"] for c in chunks][-1] == MAX_NEW
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length"}
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert len({c["meta_info"]["id"] for c in chunks}) == 1 and chunks[0]["meta_info"]["id"].startswith("room-")
    text = "".join(c["delta"] for c in chunks)
    assert text == chunks[-1]["text"] == monolithic_text(stack, prompt)
    assert transfers_ok(stack) == (before[0] + 1, before[1] + 1)
    assert_idle(stack)


def test_concurrent_requests_through_the_sglang_router_get_distinct_rooms(stack, sgl):
    prompts = [f"request number {i} about the lazy dog" for i in range(4)]
    before = transfers_ok(stack)
    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(lambda p: httpx.post(sgl.url + "/generate", json=gen_body(p), timeout=60), prompts))
    assert [r.status_code for r in results] == [200] * len(prompts), [r.text for r in results]
    ids = {r.json()["meta_info"]["id"] for r in results}
    assert len(ids) == len(prompts)
    assert all(r.json()["meta_info"]["completion_tokens"] == MAX_NEW for r in results)
    assert transfers_ok(stack) == (before[0] + len(prompts), before[1] + len(prompts))
    assert_idle(stack)
