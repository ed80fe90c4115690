"""Integration: router + one PD pair as real processes on loopback (tiny random model), shared by these tests.

Tests leave the stack idle (no live requests, every page free) so they can share it.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time

import httpx
import pytest

from pdruntime.disagg import transfer, wire
from pdruntime.util.sse import iter_sse

pytestmark = pytest.mark.timeout(120)


def chat_body(model_id, content="hello there", **kw):
    return {"model": model_id, "messages": [{"role": "user", "content": content}], **kw}


def sse_events(resp) -> list[dict | str]:
    return list(iter_sse(resp.iter_lines()))


def assert_idle(stack):
    p, d = stack.wait_idle()
    for x in (p, d):
        assert x["live"] == 0, x
        assert x["pool"]["free"] == x["pool"]["total"], x


def test_streamed_chat_completion_through_the_router_matches_monolithic(stack, model_id):
    body = chat_body(model_id, "tell me about the lazy dog", max_tokens=12, temperature=0, ignore_eos=True,
                     stream=True, stream_options={"include_usage": True})
    with httpx.stream("POST", stack.router.url + "/v1/chat/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = sse_events(resp)
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if e["choices"]]
    assert chunks[0]["object"] == "chat.completion.chunk" and chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    usage = events[-2]["usage"]
    assert usage["completion_tokens"] == 12 and usage["prompt_tokens"] > 5
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    # the same prompt run monolithically on the decode worker (no bootstrap fields): identical greedy output,
    # so the KV that crossed the wire is the KV prefill computed
    mono = httpx.post(stack.decode.url + "/generate", json={
        "messages": body["messages"], "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}},
        timeout=60).json()
    assert mono["meta_info"]["completion_tokens"] == 12
    assert text == mono["text"]
    assert stack.metric(stack.prefill, "pdrt_kv_transfers_total", {"outcome": "success"}) >= 1
    assert stack.metric(stack.decode, "pdrt_kv_transfer_bytes_total") > 0
    assert_idle(stack)


def test_non_streamed_completions_and_models(stack, model_id):
    models = httpx.get(stack.router.url + "/v1/models", timeout=10).json()
    assert models["object"] == "list" and models["data"][0]["id"] == model_id
    r = httpx.post(stack.router.url + "/v1/completions", json={"model": model_id, "prompt": "once upon", "max_tokens": 5,
                                                               "ignore_eos": True}, timeout=60)
    assert r.status_code == 200, r.text
    j = r.json()
    assert j["object"] == "text_completion" and j["choices"][0]["finish_reason"] == "length"
    assert j["usage"]["completion_tokens"] == 5 and j["usage"]["total_tokens"] == j["usage"]["prompt_tokens"] + 5
    r = httpx.post(stack.router.url + "/v1/chat/completions", json=chat_body(model_id, max_tokens=4, ignore_eos=True),
                   timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant"
    assert r.json()["usage"]["completion_tokens"] == 4
    # the model's path (or its file/dir name) is accepted as an alias of its id
    path = httpx.get(stack.decode.url + "/get_model_info", timeout=10).json()["model_path"]
    r = httpx.post(stack.router.url + "/v1/chat/completions", json=chat_body(os.path.basename(path), max_tokens=2),
                   timeout=60)
    assert r.status_code == 200 and r.json()["model"] == model_id
    assert_idle(stack)


def test_one_token_requests_end_without_an_error_at_decode(stack, model_id):
    """A 1-token request can end in the engine (prefill sampled its only token) before decode's transfer step moves
    it to running: that step once raised a KeyError for it, logged as an unexpected error (a line per request,
    tens of thousands in a few minutes of the router bench) though the client got its answer."""
    before = stack.decode.log_text().count("unexpected error")

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(*(client.post(stack.router.url + "/v1/completions", json={
                "model": model_id, "prompt": f"count {i}", "max_tokens": 1}) for i in range(24)))

    for r in asyncio.run(burst()):
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1, r.text
    assert_idle(stack)
    assert stack.decode.log_text().count("unexpected error") == before, stack.decode.log_text()[-2000:]


def test_bad_input_at_the_router_is_a_4xx_with_an_openai_error_body(stack, model_id):
    url = stack.router.url
    huge = "the quick brown fox " * 2000  # far beyond the tiny model's 2048-token context
    cases = [
        ("/v1/chat/completions", b"{not json", 400),
        ("/v1/chat/completions", b"", 400),
        ("/v1/chat/completions", b"[1,2,3]", 400),
        ("/v1/chat/completions", chat_body(model_id, max_tokens="ten"), 400),
        ("/v1/chat/completions", chat_body(model_id, temperature=[1]), 400),
        ("/v1/chat/completions", {"model": model_id, "messages": "hi"}, 400),
        ("/v1/chat/completions", {"model": model_id, "messages": [{"role": "user", "content": 5}]}, 400),
        ("/v1/chat/completions", chat_body("gpt-17"), 404),
        ("/v1/chat/completions", chat_body(model_id, huge), 400),
        ("/v1/chat/completions", chat_body(model_id, max_tokens=-3), 400),
        ("/v1/chat/completions", chat_body(model_id, max_tokens=0), 400),
        ("/v1/chat/completions", chat_body(model_id, max_tokens=100000), 400),
        ("/v1/chat/completions", chat_body(model_id, best_of=2), 400),
        ("/v1/chat/completions", chat_body(model_id, tools=[{"type": "function"}]), 400),
        ("/v1/chat/completions", chat_body(model_id, n=9), 400),
        ("/v1/chat/completions", chat_body(model_id, whatever=1), 400),
        ("/v1/chat/completions", chat_body(model_id, stream=True, max_tokens=-1), 400),
        ("/v1/completions", {"model": model_id, "prompt": 42}, 400),
        ("/v1/completions", {"model": model_id, "prompt": "x", "echo": True, "logprobs": 2, "stream": True}, 400),
        ("/v1/completions", {"model": model_id, "prompt": huge, "stream": True}, 400),
    ]
    with httpx.Client(timeout=30) as c:
        for path, body, status in cases:
            if isinstance(body, bytes):
                r = c.post(url + path, content=body, headers={"content-type": "application/json"})
            else:
                r = c.post(url + path, json=body)
            assert r.status_code == status, (body if not isinstance(body, dict) else {k: str(v)[:40] for k, v in body.items()}, r.text)
            err = r.json()["error"]
            assert err["message"] and err["type"] == "invalid_request_error", r.text
        r = c.post(url + "/v1/chat/completions", json=chat_body(model_id, huge))
        assert "context" in r.json()["error"]["message"] and r.json()["error"]["code"] == "context_length_exceeded"
    assert stack.metric(stack.router, "pdrt_requests_total", {"outcome": "failed"}) == 0
    assert_idle(stack)


async def test_16_concurrent_requests_are_batched_in_decode(stack, model_id):
    stack.hooks(stack.decode, step_delay_s=0.03)  # slow decode steps so all 16 overlap on a loaded machine
    seen = []
    stop = threading.Event()

    def poll():
        while not stop.is_set():
            seen.append(stack.metric(stack.decode, "pdrt_running_batch_requests"))
            time.sleep(0.03)

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        async with httpx.AsyncClient(timeout=120) as c:
            async def one(i):
                r = await c.post(stack.router.url + "/v1/chat/completions",
                                 json=chat_body(model_id, f"request number {i}", max_tokens=96, ignore_eos=True))
                return r.status_code, r.json()["usage"]["completion_tokens"]

            results = await asyncio.gather(*(one(i) for i in range(16)))
    finally:
        stop.set()
        poller.join()
        stack.hooks(stack.decode, step_delay_s=0)
    assert results == [(200, 96)] * 16
    assert max(seen) == 16
    # and an engine step ran with a batch of exactly 16 (histogram: le=16 minus le=15)
    b16 = stack.metric(stack.decode, "pdrt_batch_size_bucket", {"le": "16.0"})
    b15 = stack.metric(stack.decode, "pdrt_batch_size_bucket", {"le": "15.0"})
    assert b16 > b15
    assert_idle(stack)


def test_client_disconnect_mid_stream_aborts_both_legs(stack, model_id):
    aborted_before = stack.metric(stack.decode, "pdrt_aborted_requests_total")
    disc_before = stack.metric(stack.router, "pdrt_router_client_disconnects_total")
    stack.hooks(stack.decode, step_delay_s=0.05)
    try:
        with httpx.stream("POST", stack.router.url + "/v1/chat/completions", timeout=60,
                          json=chat_body(model_id, max_tokens=500, ignore_eos=True, stream=True)) as resp:
            got = 0
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    got += 1
                if got == 3:
                    break
        # the client is gone; the generation had ~500 x 50 ms to go
        assert_idle(stack)
    finally:
        stack.hooks(stack.decode, step_delay_s=0)
    assert stack.metric(stack.decode, "pdrt_aborted_requests_total") > aborted_before
    assert stack.metric(stack.router, "pdrt_router_client_disconnects_total") > disc_before


def test_client_disconnect_during_transfer_frees_both_legs(stack, model_id):
    """Before the first token both legs hold pages (prefill: inflight KV; decode: reserved pages)."""
    p_failed = stack.metric(stack.prefill, "pdrt_kv_transfers_total", {"outcome": "failed"})
    d_aborted = stack.metric(stack.decode, "pdrt_aborted_requests_total", {"cause": "abort_request"}) + \
        stack.metric(stack.decode, "pdrt_aborted_requests_total", {"cause": "client_disconnect"})
    fired = stack.metric(stack.prefill, "pdrt_watchdog_fired_total") + stack.metric(stack.decode, "pdrt_watchdog_fired_total")
    stack.hooks(stack.decode, stall_transfers=1)
    result = {}

    def client():
        try:
            httpx.post(stack.router.url + "/v1/chat/completions", json=chat_body(model_id, max_tokens=8), timeout=1.5)
        except httpx.TimeoutException as exc:
            result["exc"] = exc  # the client gives up and closes its connection

    t = threading.Thread(target=client)
    t.start()
    t.join()
    assert "exc" in result
    p, d = stack.wait_idle(timeout=10)
    assert p["live"] == 0 and p["pool"]["free"] == p["pool"]["total"]
    assert d["live"] == 0 and d["pool"]["free"] == d["pool"]["total"]
    # both legs were failed (prefill's held KV dropped, decode's reserved pages freed), not completed
    assert stack.metric(stack.prefill, "pdrt_kv_transfers_total", {"outcome": "failed"}) == p_failed + 1
    assert stack.metric(stack.decode, "pdrt_aborted_requests_total", {"cause": "abort_request"}) + \
        stack.metric(stack.decode, "pdrt_aborted_requests_total", {"cause": "client_disconnect"}) == d_aborted + 1
    # freed by the router's aborts, not by a watchdog (transfer 3 s / decode 6 s)
    assert stack.metric(stack.prefill, "pdrt_watchdog_fired_total") + \
        stack.metric(stack.decode, "pdrt_watchdog_fired_total") == fired


def test_lone_stuck_transfer_is_failed_by_the_watchdog_with_no_other_traffic(stack, model_id):
    fired_before = stack.metric(stack.prefill, "pdrt_watchdog_fired_total", {"role": "prefill", "phase": "transfer"})
    stack.hooks(stack.decode, stall_transfers=1)  # decode reads the HEADER, then never reads on nor ACKs
    result = {}

    def client():
        t0 = time.monotonic()
        r = httpx.post(stack.router.url + "/v1/chat/completions", headers={"X-Client-Id": "agent-harness"},
                       json=chat_body(model_id, max_tokens=8), timeout=60)
        result.update(status=r.status_code, body=r.json(), elapsed=time.monotonic() - t0)

    t = threading.Thread(target=client)
    t.start()
    deadline = time.monotonic() + 20
    while True:
        rows = stack.debug(stack.prefill)["requests"]
        if rows and rows[0]["stage"] == "inflight":
            break
        assert time.monotonic() < deadline, rows
        time.sleep(0.05)
    t_stuck = time.monotonic()
    rid = rows[0]["id"]
    assert rows[0]["state"] == "Transferring" and rows[0]["client"] == "agent-harness"
    # one call shows the request in every stage it occupies, with its client
    view = stack.debug(stack.router)
    assert view["requests"][0]["id"] == rid and view["requests"][0]["client"] == "agent-harness"
    assert view["requests"][0]["stage"] == "waiting_first_token"
    by_role = {w["role"]: w for w in view["workers"]}
    assert by_role["prefill"]["requests"][0]["stage"] == "inflight"
    assert by_role["decode"]["requests"][0]["id"] == rid and by_role["decode"]["requests"][0]["stage"] == "transfer"
    assert by_role["decode"]["requests"][0]["client"] == "agent-harness"
    # now: no other traffic at all while the watchdog has to find it on its own (the client's answer is the event)
    t.join(timeout=20)
    assert result["status"] in (502, 503, 504) and result["body"]["error"]["message"]
    fired = stack.metric(stack.prefill, "pdrt_watchdog_fired_total", {"role": "prefill", "phase": "transfer"})
    assert fired == fired_before + 1
    p = stack.debug(stack.prefill)
    assert p["live"] == 0 and p["pool"]["free"] == p["pool"]["total"]
    assert time.monotonic() - t_stuck < 3.0 + 1.0 + 1.5
    lines = [l for l in stack.prefill.log_text().splitlines() if "watchdog fired" in l and rid in l]
    assert len(lines) == 1 and "phase=transfer" in lines[0]
    assert_idle(stack)
    empty = stack.debug(stack.router)
    assert empty["live_total"] == 0 and "look outside" in empty["verdict"]


def test_generation_longer_than_the_transfer_timeout_completes_untouched(stack, model_id):
    fired_before = stack.metric(stack.prefill, "pdrt_watchdog_fired_total") + stack.metric(stack.decode, "pdrt_watchdog_fired_total")
    stack.hooks(stack.decode, step_delay_s=0.04)  # 120 tokens x 40 ms: longer than the 3 s transfer timeout in real time too
    try:
        t0 = time.monotonic()
        with httpx.stream("POST", stack.router.url + "/v1/chat/completions", timeout=120,
                          json=chat_body(model_id, max_tokens=120, ignore_eos=True, stream=True,
                                         stream_options={"include_usage": True})) as resp:
            events = []
            for line in resp.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line)
                if len(events) == 5:
                    # mid-generation: jump both watchdog clocks far past every PD timeout, let them tick
                    stack.hooks(stack.prefill, advance_clock_s=1000)
                    stack.hooks(stack.decode, advance_clock_s=1000)
                    time.sleep(0.5)
        elapsed = time.monotonic() - t0
    finally:
        stack.hooks(stack.decode, step_delay_s=0)
    parsed = [json.loads(e[6:]) for e in events if e != "data: [DONE]"]
    assert events[-1] == "data: [DONE]"
    assert parsed[-1]["usage"]["completion_tokens"] == 120
    assert [c for c in parsed if c["choices"]][-1]["choices"][0]["finish_reason"] == "length"
    assert elapsed > 3.0
    fired = stack.metric(stack.prefill, "pdrt_watchdog_fired_total") + stack.metric(stack.decode, "pdrt_watchdog_fired_total")
    assert fired == fired_before
    assert_idle(stack)


async def test_multi_round_agents_over_keep_alive(stack, model_id):
    """16 agents x 5 rounds, each round resending a longer conversation over one keep-alive connection."""
    agents, rounds = 16, 5

    async def agent(i: int) -> list[int]:
        prompt_tokens = []
        history = [{"role": "system", "content": f"you are agent {i}"}]
        limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
        async with httpx.AsyncClient(timeout=120, limits=limits) as c:
            for r in range(rounds):
                history.append({"role": "user", "content": f"round {r}: the quick brown fox, tell me more {i}"})
                resp = await c.post(stack.router.url + "/v1/chat/completions", headers={"X-Client-Id": f"agent-{i}"},
                                    json={"model": model_id, "messages": history, "max_tokens": 16, "ignore_eos": True,
                                          "user": f"agent-{i}", "stream": r % 2 == 1,
                                          **({"stream_options": {"include_usage": True}} if r % 2 == 1 else {})})
                assert resp.status_code == 200, resp.text
                if r % 2 == 1:
                    events = [json.loads(l[6:]) for l in resp.text.splitlines() if l.startswith("data: {")]
                    reply = "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])
                    usage = events[-1]["usage"]
                else:
                    reply = resp.json()["choices"][0]["message"]["content"]
                    usage = resp.json()["usage"]
                assert usage["completion_tokens"] == 16
                prompt_tokens.append(usage["prompt_tokens"])
                history.append({"role": "assistant", "content": reply})
            assert len(c._transport._pool.connections) == 1  # every round reused one keep-alive connection
        return prompt_tokens

    results = await asyncio.wait_for(asyncio.gather(*(agent(i) for i in range(agents))), timeout=110)
    for growth in results:
        assert all(b > a for a, b in zip(growth, growth[1:])), growth  # context grows every round
    assert_idle(stack)
    assert stack.metric(stack.router, "pdrt_requests_total", {"outcome": "ok"}) >= agents * rounds


def test_workers_speak_sglang_and_expose_observability(stack, model_id):
    for w in (stack.prefill, stack.decode):
        info = httpx.get(w.url + "/get_model_info", timeout=10).json()
        assert info["model_name"] == model_id and info["is_generation"]
        srv = httpx.get(w.url + "/get_server_info", timeout=10).json()
        assert srv["disaggregation_mode"] in ("prefill", "decode")
        cfg = httpx.get(w.url + "/config", timeout=10).json()
        assert cfg["env"]["kv_auth_token"] == "<redacted>" and cfg["env"]["process_env"]["PDRT_KV_AUTH_TOKEN"] == "<redacted>"
        assert "pd-test-token" not in json.dumps(cfg)
        assert cfg["engine"]["model"]["sha256"]
    # an SGLang-style PD request: the same body with bootstrap fields to both workers at once
    room = 123456789
    body = {"text": "hello", "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}, "rid": "sgl-1",
            "bootstrap_host": "127.0.0.1", "bootstrap_port": stack.bootstrap_port, "bootstrap_room": room}

    async def both():
        async with httpx.AsyncClient(timeout=60) as c:
            return await asyncio.gather(c.post(stack.prefill.url + "/generate", json=body),
                                        c.post(stack.decode.url + "/generate", json=body))

    pr, dr = asyncio.run(both())
    assert pr.status_code == 200 and dr.status_code == 200, (pr.text, dr.text)
    assert dr.json()["meta_info"]["completion_tokens"] == 4 and dr.json()["meta_info"]["finish_reason"]["type"] == "length"
    assert pr.json()["meta_info"]["finish_reason"]["type"] == "prefill_done"
    assert_idle(stack)


def test_unauthenticated_and_wrong_room_pulls_are_rejected_and_counted(stack):
    auth_before = stack.metric(stack.prefill, "pdrt_kv_transfer_rejected_total", {"reason": "auth"})
    room_before = stack.metric(stack.prefill, "pdrt_kv_transfer_rejected_total", {"reason": "unknown_room"})

    async def pull(token):
        att = wire.Attach(room=987, rid="nope", num_tokens=3, prompt_crc=wire.prompt_crc([1, 2, 3]))
        conn = await transfer.open_attach("127.0.0.1", stack.bootstrap_port, token, att)
        try:
            await transfer.recv_header(conn)
        except wire.WireError as exc:
            return exc.reason
        finally:
            conn.close()

    assert asyncio.run(pull("wrong-token")) == "auth"
    assert asyncio.run(pull(None)) == "auth"
    assert asyncio.run(pull("pd-test-token")) == "unknown_room"
    assert stack.metric(stack.prefill, "pdrt_kv_transfer_rejected_total", {"reason": "auth"}) == auth_before + 2
    assert stack.metric(stack.prefill, "pdrt_kv_transfer_rejected_total", {"reason": "unknown_room"}) == room_before + 1


def test_router_hot_reloads_topology_and_retries_on_another_pair_before_the_first_token(stack, model_id, tmp_path):
    """A second router in front of the shared pair, fed by a topology file it hot-reloads."""
    import yaml
    from pd_harness import base_env, free_port, spawn

    pre, dec = stack.prefill.url, stack.decode.url
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    good = {"index": 1, "ready": False, "prefill": {"url": pre, "bootstrap_port": stack.bootstrap_port}, "decode": {"url": dec}}
    path = tmp_path / "topology.yaml"
    path.write_text(yaml.safe_dump({"version": 1, "revision": "r1", "pairs": [good]}))
    port = free_port()
    router = spawn("router2", ["--role", "router", "--port", str(port), "--topology-file", str(path)], base_env(),
                   str(tmp_path), port)
    try:
        wait_for_status = lambda code: _wait(lambda: httpx.get(router.url + "/health", timeout=2).status_code == code, 30)
        wait_for_status(503)  # the only pair is not ready (operator: co-restart in progress)
        r = httpx.post(router.url + "/v1/chat/completions", json=chat_body(model_id, max_tokens=2), timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_ready_pair"
        # the operator rewrites the file (atomic replace, like a ConfigMap update): a dead pair 0 and ready pair 1
        tmp = tmp_path / "t.yaml"
        tmp.write_text(yaml.safe_dump({"version": 1, "revision": "r2", "pairs": [
            {"index": 0, "ready": True, "prefill": {"url": dead, "bootstrap_port": 1}, "decode": {"url": dead}},
            {**good, "ready": True}]}))
        os.replace(tmp, path)
        _wait(lambda: httpx.get(router.url + "/config", timeout=2).json()["topology"]["revision"] == "r2", 30)
        wait_for_status(200)
        for i in range(4):
            r = httpx.post(router.url + "/v1/chat/completions", json=chat_body(model_id, f"retry {i}", max_tokens=3,
                                                                             ignore_eos=True), timeout=60)
            assert r.status_code == 200, r.text
        assert stack.metric(router, "pdrt_router_retries_total") >= 1
        assert stack.metric(router, "pdrt_router_leg_failures_total", {"pair": "0"}) >= 1
        assert stack.metric(router, "pdrt_router_circuit_open", {"pair": "0"}) == 1
        assert stack.metric(router, "pdrt_router_topology_reloads_total", {"outcome": "ok"}) == 2
    finally:
        router.stop()
    assert_idle(stack)


def _wait(pred, timeout):
    deadline = time.monotonic() + timeout
    while True:
        try:
            if pred():
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline
        time.sleep(0.1)


def test_pdrt_chat_talks_to_the_router(stack):
    import subprocess
    import sys

    from pd_harness import base_env

    before = stack.metric(stack.router, "pdrt_requests_total", {"outcome": "ok"})
    r = subprocess.run([sys.executable, "-m", "pdruntime.server", "chat", "--url", stack.router.url, "--max-tokens", "4",
                        "hello from pdrt chat"], env=base_env(), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert stack.metric(stack.router, "pdrt_requests_total", {"outcome": "ok"}) == before + 1
    r = subprocess.run([sys.executable, "-m", "pdruntime.server", "chat", "--url", "http://127.0.0.1:9", "hi"],
                       env=base_env(), capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "pdrt up" in r.stderr  # says what to do when no router is there


def test_bootstrap_watchdog_fails_a_request_whose_decode_never_attaches(stack):
    before = stack.metric(stack.prefill, "pdrt_watchdog_fired_total", {"phase": "bootstrap"})
    body = {"text": "nobody will attach", "sampling_params": {"max_new_tokens": 4}, "rid": "orphan-1",
            "bootstrap_host": "127.0.0.1", "bootstrap_port": stack.bootstrap_port, "bootstrap_room": 4242}
    t0 = time.monotonic()
    result = {}
    t = threading.Thread(target=lambda: result.update(r=httpx.post(stack.prefill.url + "/generate", json=body, timeout=30)))
    t.start()
    _wait(lambda: any(r["id"] == "orphan-1" and r["stage"] == "bootstrap" for r in stack.debug(stack.prefill)["requests"]), 10)
    stack.hooks(stack.prefill, advance_clock_s=60)  # far past PDRT_BOOTSTRAP_TIMEOUT_S on the watchdog's clock
    t.join(timeout=20)
    assert result["r"].status_code == 504 and "bootstrap timeout" in result["r"].json()["error"]["message"]
    assert time.monotonic() - t0 < 4.0  # the clock jump, not the real 4 s timeout, fired it
    assert stack.metric(stack.prefill, "pdrt_watchdog_fired_total", {"phase": "bootstrap"}) == before + 1
    assert_idle(stack)


def test_decode_watchdog_fails_a_transfer_it_waits_on_and_the_router_frees_both_legs(stack, model_id):
    """Prefill holds the request before its engine (no progress report); decode waits for the KV until its
    prefill-stall watchdog fires (prefill's compute is timed by its progress, not by the transfer timeout)."""
    before = stack.metric(stack.decode, "pdrt_watchdog_fired_total", {"role": "decode", "phase": "prefill_stall"})
    stack.hooks(stack.prefill, stall_prefill=1)
    result = {}
    t = threading.Thread(target=lambda: result.update(r=httpx.post(
        stack.router.url + "/v1/chat/completions", json=chat_body(model_id, max_tokens=4), timeout=30)))
    t.start()
    _wait(lambda: any(r["state"] == "WaitingForInput" for r in stack.debug(stack.decode)["requests"]), 20)
    stack.hooks(stack.decode, advance_clock_s=60)  # past PDRT_PREFILL_STALL_S on decode's clock only
    t.join(timeout=20)
    assert result["r"].status_code in (502, 504), result["r"].text
    assert "prefill stalled" in result["r"].json()["error"]["message"]
    assert stack.metric(stack.decode, "pdrt_watchdog_fired_total", {"role": "decode", "phase": "prefill_stall"}) == before + 1
    assert_idle(stack)  # prefill's held request was aborted by the router, decode's reservation freed
