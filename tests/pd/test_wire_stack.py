"""The KV wire inside real workers on loopback: refusals reach the client with both values named, both
pools get every page back, corruption fails cleanly, and every transfer is measured.

Processes: the module's shared stack (router + a matched pair, conftest ``stack``), plus a prefill
worker with two mismatched decode workers (16-token vs 8-token pages; a 2-layer vs a 3-layer model)
behind a second router.
"""

from __future__ import annotations

import asyncio
import re
import time

import httpx
import pytest

from pd_harness import KV_TOKEN, WORKER_FLAGS, base_env, free_port, spawn, wait_for, wait_healthy
from pdruntime.disagg import transfer, wire
from pdruntime.model.testing import write_tiny_checkpoint


def _flags(block_size: int) -> list[str]:
    flags = list(WORKER_FLAGS)
    flags[flags.index("--block-size") + 1] = str(block_size)
    return flags


@pytest.fixture(scope="module")
def mismatched(tiny_model, tmp_path_factory):
    """prefill P (16-token pages, 2 layers); decode D8 (8-token pages); decode D3 (3-layer model); router P+D8."""
    d = str(tmp_path_factory.mktemp("wire-mismatch"))
    three = write_tiny_checkpoint(d + "/three-layers", num_layers=3)
    env = base_env()
    pp, bp, d8, d3, rp = free_port(), free_port(), free_port(), free_port(), free_port()
    procs = {
        "prefill": spawn("prefill", ["--role", "prefill", "--port", str(pp), "--bootstrap-port", str(bp), "--model",
                                     tiny_model, *_flags(16)], env, d, pp),
        "decode8": spawn("decode8", ["--role", "decode", "--port", str(d8), "--model", tiny_model, *_flags(8)], env, d, d8),
        "decode3": spawn("decode3", ["--role", "decode", "--port", str(d3), "--model", three, *_flags(16)], env, d, d3),
    }
    procs["router"] = spawn("router", ["--role", "router", "--port", str(rp), "--prefill", f"http://127.0.0.1:{pp}",
                                       "--decode", f"http://127.0.0.1:{d8}", "--bootstrap-ports", str(bp)], env, d, rp)
    try:
        wait_healthy(list(procs.values()))
        yield procs, bp
    finally:
        for p in procs.values():
            p.stop()


def _pool_idle(proc, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        dbg = httpx.get(proc.url + "/debug/requests", timeout=10).json()
        if (dbg["live"] == 0 and dbg["pool"]["free"] == dbg["pool"]["total"]) or time.monotonic() > deadline:
            return dbg


def _dual(prefill_url: str, decode_url: str, bootstrap_port: int, room: int) -> tuple[httpx.Response, httpx.Response]:
    """What a PD router does: the same request to both legs at once."""
    body = {"text": "hello there, how are you", "sampling_params": {"max_new_tokens": 4, "ignore_eos": True},
            "rid": f"wire-{room}", "bootstrap_host": "127.0.0.1", "bootstrap_port": bootstrap_port, "bootstrap_room": room}

    async def both():
        async with httpx.AsyncClient(timeout=60) as c:
            return await asyncio.gather(c.post(prefill_url + "/generate", json=body),
                                        c.post(decode_url + "/generate", json=body))

    return asyncio.run(both())


def test_page_size_mismatch_reaches_the_client_through_the_router_and_both_pools_are_freed(mismatched):
    procs, _ = mismatched
    model = httpx.get(procs["router"].url + "/v1/models", timeout=10).json()["data"][0]["id"]
    r = httpx.post(procs["router"].url + "/v1/chat/completions", timeout=60,
                   json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert r.status_code >= 500, r.text
    assert "KV page size (tokens per page): prefill sends 16, decode expects 8" in r.text, r.text
    for name in ("prefill", "decode8"):
        dbg = _pool_idle(procs[name])
        assert dbg["live"] == 0 and dbg["pool"]["free"] == dbg["pool"]["total"], (name, dbg)


def test_layer_count_mismatch_fails_both_legs_with_both_values_and_frees_both_pools(mismatched):
    procs, bp = mismatched
    pr, dr = _dual(procs["prefill"].url, procs["decode3"].url, bp, room=31337)
    for leg, resp in (("prefill", pr), ("decode", dr)):
        assert resp.status_code >= 500, (leg, resp.text)
        assert "layer count: prefill sends 2, decode expects 3" in resp.text, (leg, resp.text)
    for name in ("prefill", "decode3"):
        dbg = _pool_idle(procs[name])
        assert dbg["live"] == 0 and dbg["pool"]["free"] == dbg["pool"]["total"], (name, dbg)


def _serve_supports(flag: str) -> bool:
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "pdruntime.server", "serve", "--help"], capture_output=True, text=True,
                         timeout=120)
    return flag in out.stdout


def test_dtype_mismatch_fails_both_legs_with_both_values_and_frees_both_pools(mismatched, tiny_model, tmp_path):
    if not _serve_supports("--dtype"):
        pytest.skip("needs `pdrt serve --dtype` (the device/dtype part of issue 8); the wire-level dtype refusal is "
                    "tests/pd/test_wire.py::test_decode_refuses_a_layout_mismatch_and_prefill_fails_with_the_same_message")
    procs, bp = mismatched
    port = free_port()
    dec = spawn("decode-bf16", ["--role", "decode", "--port", str(port), "--model", tiny_model, "--dtype", "bf16",
                                *_flags(16)], base_env(), str(tmp_path), port)
    try:
        wait_healthy([dec])
        pr, dr = _dual(procs["prefill"].url, dec.url, bp, room=4711)
        for leg, resp in (("prefill", pr), ("decode", dr)):
            assert resp.status_code >= 500, (leg, resp.text)
            assert "KV dtype: prefill sends float32, decode expects bfloat16" in resp.text, (leg, resp.text)
        for proc in (procs["prefill"], dec):
            dbg = _pool_idle(proc)
            assert dbg["live"] == 0 and dbg["pool"]["free"] == dbg["pool"]["total"], dbg
    finally:
        dec.stop()


def test_tp_size_mismatch_is_refused_at_bootstrap_and_counted(mismatched):
    procs, bp = mismatched
    before = _metric(procs["prefill"], "pdrt_kv_transfer_rejected_total", 'reason="mismatch"')

    async def pull():
        att = wire.Attach(room=4242, rid="", num_tokens=3, prompt_crc=wire.prompt_crc([1, 2, 3]), tp_size=2,
                          tp_ranks=(0, 1))
        conn = await transfer.open_attach("127.0.0.1", bp, KV_TOKEN, att)
        try:
            await transfer.recv_header(conn)
        except wire.WireError as exc:
            return exc
        finally:
            conn.close()

    err = asyncio.run(pull())
    assert err is not None and err.reason == "mismatch"
    assert "prefill runs tp_size=1, decode runs tp_size=2" in err.message
    assert _metric(procs["prefill"], "pdrt_kv_transfer_rejected_total", 'reason="mismatch"') == before + 1


def _metric(proc, name: str, label: str = "") -> float:
    text = httpx.get(proc.url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and (line[len(name)] in "{ ") and label in line)


# ---- the matched pair (conftest's shared stack) ------------------------------------------------------

def test_a_corrupted_chunk_fails_the_request_cleanly_and_the_next_one_succeeds(stack, model_id):
    stack.hooks(stack.prefill, corrupt_kv_chunk=1)
    body = {"model": model_id, "messages": [{"role": "user", "content": "tell me about pages"}], "max_tokens": 4}
    r = httpx.post(stack.router.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code >= 500 and "checksum" in r.text, r.text
    p, d = stack.wait_idle()
    for dbg in (p, d):
        assert dbg["live"] == 0 and dbg["pool"]["free"] == dbg["pool"]["total"], dbg
    assert stack.metric(stack.decode, "pdrt_kv_transfer_failures_total") >= 1
    ok = httpx.post(stack.router.url + "/v1/chat/completions", json=body, timeout=60)
    assert ok.status_code == 200, ok.text


def test_each_transfer_is_measured_in_metrics_and_in_debug_rows(stack, model_id):
    bytes_before = stack.metric(stack.decode, "pdrt_kv_transfer_bytes_total")
    wire_before = stack.metric(stack.decode, "pdrt_kv_transfer_wire_seconds_count")
    sent_before = stack.metric(stack.prefill, "pdrt_kv_transfer_bytes_total")
    stack.hooks(stack.decode, step_delay_s=0.05)  # a slow decode: the request stays live long enough to look at
    rows = []
    try:
        body = {"model": model_id, "messages": [{"role": "user", "content": "count slowly"}], "max_tokens": 40,
                "stream": True, "ignore_eos": True}
        with httpx.stream("POST", stack.router.url + "/v1/chat/completions", json=body, timeout=60) as resp:
            for line in resp.iter_lines():
                if line.startswith("data:") and not rows:
                    rows = [r for r in stack.debug(stack.decode)["requests"] if r.get("kv_bytes")]
    finally:
        stack.hooks(stack.decode, step_delay_s=0)
    assert rows, "no live decode row carried kv_bytes"
    row = rows[0]
    assert row["kv_bytes"] > 0 and row["kv_seconds"] > 0 and row["kv_gbps"] > 0, row
    assert stack.metric(stack.decode, "pdrt_kv_transfer_bytes_total") == bytes_before + row["kv_bytes"]
    assert stack.metric(stack.prefill, "pdrt_kv_transfer_bytes_total") == sent_before + row["kv_bytes"]
    assert stack.metric(stack.decode, "pdrt_kv_transfer_wire_seconds_count") == wire_before + 1


def test_rejected_pulls_are_counted_every_time_but_logged_at_most_once_per_interval(stack):
    before = stack.metric(stack.prefill, "pdrt_kv_transfer_rejected_total", {"reason": "auth"})
    start = len(stack.prefill.log_text())

    async def pull(token):
        att = wire.Attach(room=99, rid="x", num_tokens=1, prompt_crc=0)
        conn = await transfer.open_attach("127.0.0.1", stack.bootstrap_port, token, att)
        try:
            await transfer.recv_header(conn)
        except wire.WireError as exc:
            return exc.reason
        finally:
            conn.close()

    async def burst():
        return [await pull(t) for t in ("wrong-1", None, "wrong-2", None, "wrong-3", "wrong-4")]

    assert asyncio.run(burst()) == ["auth"] * 6
    assert stack.metric(stack.prefill, "pdrt_kv_transfer_rejected_total", {"reason": "auth"}) == before + 6
    # one more rejection once the log interval (10 s) is over: its line counts what the burst suppressed, and it
    # is written after every line the burst wrote, so those are all in the file once it is
    stack.hooks(stack.prefill, advance_clock_s=3600)
    assert asyncio.run(pull("wrong-5")) == "auth"

    def next_interval_line() -> str | None:
        text = stack.prefill.log_text()[start:]
        return text if "more rejections suppressed" in text else None
    new = wait_for(next_interval_line, 10, "the rejection line of the next log interval")
    assert new.count("KV pull rejected") - 1 <= 1  # the burst's six: one line at most
    assert int(re.search(r"\[(\d+) more rejections suppressed", new).group(1)) >= 5
    log = stack.prefill.log_text()
    assert KV_TOKEN not in log and "wrong-1" not in log and "wrong-5" not in log
