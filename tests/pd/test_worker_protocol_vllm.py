"""pdstack's router with ``--worker-protocol vllm`` in front of pdrt workers: vLLM's two-step ``kv_transfer_params``
exchange, spoken over pdrt's KV wire, so a real transfer happens.

Field names from vLLM's source: the proxy's prefill request, vllm ``tests/v1/kv_connector/nixl_integration/
toy_proxy_server.py`` (``send_request_to_service``: kv_transfer_params {do_remote_decode: true, do_remote_prefill:
false, remote_engine_id/remote_block_ids/remote_host/remote_port: null}, max_tokens 1, stream false); prefill's answer,
``vllm/distributed/kv_transfer/kv_connector/v1/nixl_connector.py`` (``NixlConnectorScheduler.request_finished``:
do_remote_prefill, do_remote_decode, remote_block_ids, remote_engine_id, remote_request_id, remote_host, remote_port,
tp_size); the lease (``--kv-lease-s``, a fixed span) (a prefill whose decode never comes frees its
blocks after it): pdrt's ``--kv-lease-s``.

Recording proxies in front of both workers show what each leg got; a second router in pdrt's own protocol on the
same workers is the greedy reference.
"""

from __future__ import annotations

import httpx
import pytest

from pd_harness import router_at, wait_for  # noqa: E402
from recording_proxy import proxied  # noqa: E402

from pdruntime.server.router.protocol import DECODE_STREAM, VLLM_PREFILL_KV_PARAMS  # noqa: E402
from pdruntime.server.worker.lease import KV_LEASE_S, held_room  # noqa: E402
from pdruntime.util.sse import DONE, iter_sse  # noqa: E402

pytestmark = pytest.mark.timeout(180)

CHAT = "/v1/chat/completions"
NIXL_ANSWER_KEYS = {"do_remote_prefill", "do_remote_decode", "remote_block_ids", "remote_engine_id",
                    "remote_request_id", "remote_host", "remote_port", "tp_size"}


@pytest.fixture(scope="module")
def proxies(stack):
    with proxied(stack) as both:
        yield both


@pytest.fixture(scope="module")
def vllm_router(stack, proxies, tmp_path_factory):
    with router_at(str(tmp_path_factory.mktemp("rvllm")), proxies[0].url, proxies[1].url, stack.bootstrap_port,
                   "--worker-protocol", "vllm", "--worker-agent-port", "0", name="router-vllm") as r:
        yield r


def kv_bytes(stack) -> tuple[float, float]:
    return (stack.metric(stack.prefill, "pdrt_kv_transfer_bytes_total"),
            stack.metric(stack.decode, "pdrt_kv_transfer_bytes_total"))


def chat(model: str, text: str, **kw) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 8, "temperature": 0, **kw}


def streamed_text(url: str, body: dict) -> tuple[str, list]:
    with httpx.stream("POST", url + CHAT, json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        chunks = list(iter_sse(r.iter_lines()))
    assert chunks[-1] == DONE
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks[:-1] if c["choices"]), chunks


def test_chat_runs_the_kv_transfer_params_exchange_and_the_kv_travels(stack, proxies, vllm_router):
    p, d = proxies
    p.clear()
    d.clear()
    before = kv_bytes(stack)
    body = chat(stack.model, "the quick brown fox jumps over the lazy dog", max_completion_tokens=8)
    r = httpx.post(vllm_router.url + CHAT, json=body, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["usage"]["completion_tokens"] == 8 and out["choices"][0]["finish_reason"] == "length"
    (pre,), (dec,) = p.posts(CHAT), d.posts(CHAT)
    # the prefill leg: vLLM's proxy's request (toy_proxy_server.py send_request_to_service)
    assert pre.body == {**body, "kv_transfer_params": VLLM_PREFILL_KV_PARAMS, "stream": False, "max_tokens": 1,
                        "max_completion_tokens": 1}
    params = pre.answer["kv_transfer_params"]
    assert set(params) == NIXL_ANSWER_KEYS and params["do_remote_prefill"] is True
    assert (params["remote_host"], params["remote_port"]) == ("127.0.0.1", stack.bootstrap_port)  # pdrt's KV wire
    assert params["remote_block_ids"] and params["tp_size"] == 1
    assert pre.answer["usage"]["completion_tokens"] == 1
    # the decode leg: the client's body with what prefill answered (and decode's per-token stream)
    assert dec.body == {**body, "kv_transfer_params": params, **DECODE_STREAM}
    after = kv_bytes(stack)
    assert after[1] > before[1] and after[1] - before[1] == after[0] - before[0]  # decode received what prefill sent
    reference = httpx.post(stack.router.url + CHAT, json=body, timeout=120).json()  # pdrt's protocol, same workers
    assert out["choices"][0]["message"]["content"] == reference["choices"][0]["message"]["content"]
    p_dbg, d_dbg = stack.wait_idle()
    for x in (p_dbg, d_dbg):
        assert x["live"] == 0 and x["pool"]["free"] == x["pool"]["total"], x


def test_streamed_chat_equals_pdrt_protocol_output(stack, vllm_router):
    body = chat(stack.model, "tell me about the lazy dog", max_tokens=12, stream=True)
    before = kv_bytes(stack)
    text, chunks = streamed_text(vllm_router.url, body)
    reference, _ = streamed_text(stack.router.url, body)
    assert text == reference and len(chunks) >= 3
    assert kv_bytes(stack)[1] > before[1]
    assert stack.metric(stack.decode, "pdrt_kv_transfers_total", {"outcome": "success"}) >= 2


def test_a_held_prefill_whose_decode_never_comes_frees_its_pages_after_the_lease(stack):
    """pdrt's --kv-lease-s: the lease watchdog frees the held pages of a request no decode pulls."""
    fired = stack.metric(stack.prefill, "pdrt_watchdog_fired_total", {"phase": "lease"})
    body = {**chat(stack.model, "a prompt nobody decodes, long enough for a few pages " * 3),
            "kv_transfer_params": VLLM_PREFILL_KV_PARAMS, "max_tokens": 1, "stream": False}
    r = httpx.post(stack.prefill.url + CHAT, json=body, headers={"x-request-id": "never-decoded"}, timeout=60)
    assert r.status_code == 200, r.text
    params = r.json()["kv_transfer_params"]
    assert params["remote_request_id"] == "never-decoded"
    held = stack.debug(stack.prefill)
    (row,) = [x for x in held["requests"] if x["id"] == "never-decoded"]
    assert row["stage"] == "inflight" and row["pages"] == len(params["remote_block_ids"]) > 0
    assert row["room"] == held_room("never-decoded")
    assert any(a["phase"] == "lease" and a["timeout_s"] == KV_LEASE_S for a in held["armed"])
    assert held["pool"]["free"] < held["pool"]["total"]
    stack.hooks(stack.prefill, advance_clock_s=KV_LEASE_S + 1)  # the watchdog clock: the lease runs out
    wait_for(lambda: stack.metric(stack.prefill, "pdrt_watchdog_fired_total", {"phase": "lease"}) == fired + 1, 10,
             "the lease watchdog")
    p = wait_for(lambda: (x := stack.debug(stack.prefill))["live"] == 0 and x["pool"]["free"] == x["pool"]["total"]
                 and x, 10, "the held pages freed")
    assert p["pool"]["orphaned"] == 0
    # the decode that comes too late fails cleanly (prefill no longer knows the request): a 5xx, no leaked pages
    late = {**chat(stack.model, "a prompt nobody decodes, long enough for a few pages " * 3), "kv_transfer_params": params}
    r = httpx.post(stack.decode.url + CHAT, json=late, timeout=60)
    assert r.status_code >= 500, r.text
    _, d = stack.wait_idle()
    assert d["live"] == 0 and d["pool"]["free"] == d["pool"]["total"], d


@pytest.mark.parametrize("role, params, param", [
    ("decode", {"do_remote_decode": True}, "kv_transfer_params"),
    ("prefill", {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 1, "remote_request_id": "x"},
     "kv_transfer_params"),
    ("decode", {"do_remote_prefill": True, "remote_port": 1, "remote_request_id": "x"}, "kv_transfer_params.remote_host"),
])
def test_kv_transfer_params_that_do_not_fit_the_worker_get_a_400(stack, role, params, param):
    worker = stack.prefill if role == "prefill" else stack.decode
    r = httpx.post(worker.url + CHAT, json={**chat(stack.model, "hi"), "kv_transfer_params": params}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and "accepted" in r.json()["error"]["message"]


def test_the_router_reports_vllm_and_reads_models_from_v1_models(vllm_router, stack):
    cfg = httpx.get(vllm_router.url + "/config", timeout=10).json()
    assert cfg["router"]["worker_protocol"] == "vllm"
    models = httpx.get(vllm_router.url + "/v1/models", timeout=10).json()["data"]
    assert [m["id"] for m in models] == [httpx.get(stack.decode.url + "/v1/models", timeout=10).json()["data"][0]["id"]]


@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
def test_overload_is_a_429_with_retry_after_in_every_protocol(stack, tmp_path, protocol):
    """The router's admission bound (--max-pending-per-pair) holds whatever the workers speak: a request that finds
    the pair at its bound and may not wait gets 429 pairs_busy with Retry-After (the one holding the slot: a stalled
    KV transfer, failed by its watchdog)."""
    import threading

    flags = ("--worker-protocol", protocol, "--worker-agent-port", "0", "--max-pending-per-pair", "1",
             "--admission-wait-s", "0")
    with router_at(str(tmp_path), stack.prefill.url, stack.decode.url, stack.bootstrap_port, *flags) as r:
        stack.hooks(stack.decode, stall_transfers=1)  # the first request's KV never lands: it holds the one slot
        try:
            first: dict = {}
            t = threading.Thread(target=lambda: first.update(r=httpx.post(r.url + CHAT, json=chat(stack.model, "slow one"),
                                                                           timeout=60)))
            t.start()
            wait_for(lambda: stack.metric(r, "pdrt_router_pair_outstanding_requests") == 1, 10, "the first dispatched")
            busy = httpx.post(r.url + CHAT, json=chat(stack.model, "second"), timeout=30)
            assert busy.status_code == 429, busy.text
            assert busy.json()["error"]["code"] == "pairs_busy" and int(busy.headers["retry-after"]) >= 1
            t.join(60)
            assert first["r"].status_code >= 500, first["r"].text  # the stalled transfer's watchdog failed it
        finally:
            stack.hooks(stack.decode, stall_transfers=0)
        p, d = stack.wait_idle()
        for x in (p, d):
            assert x["live"] == 0 and x["pool"]["free"] == x["pool"]["total"], x


# slow tier: `pdrt up` handing --worker-protocol to its router is
# test_up_units.py::test_pdrt_up_starts_its_router_with_the_worker_protocol_it_was_given, and that router's vLLM
# exchange with pdrt workers is this module's vllm_router tests (test_chat_runs_the_kv_transfer_params_exchange_...)
@pytest.mark.slow
def test_pdrt_up_runs_its_router_in_the_vllm_protocol(tiny_model):
    """`pdrt up --worker-protocol vllm`: the local stack's router dispatches with vLLM's exchange to pdrt workers."""
    import subprocess
    import sys
    import threading

    from pd_harness import base_env, free_port, stop_up
    from pdruntime.util.ports import free_port_block

    port, base = free_port(), free_port_block(3)
    proc = subprocess.Popen([sys.executable, "-m", "pdruntime.server", "up", "--model", tiny_model, "--port", str(port),
                             "--base-port", str(base), "--num-blocks", "256", "--worker-protocol", "vllm"],
                            env=base_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True).start()
    try:
        wait_for(lambda: any(x.startswith("curl ") for x in lines), 150, f"pdrt up to be ready: {lines}")
        url = f"http://127.0.0.1:{port}"
        assert httpx.get(url + "/config", timeout=10).json()["router"]["worker_protocol"] == "vllm"
        model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        r = httpx.post(url + CHAT, json=chat(model, "hello there"), timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8, r.text
        decode = f"http://127.0.0.1:{base + 1}"
        text = httpx.get(decode + "/metrics", timeout=10).text
        assert any(x.startswith("pdrt_kv_transfer_bytes_total") and float(x.split()[-1]) > 0 for x in text.splitlines())
    finally:
        stop_up(proc)


@pytest.mark.parametrize("protocol", ["pdrt", "sglang", "vllm"])
def test_a_client_that_leaves_mid_stream_aborts_both_legs_in_every_protocol(stack, tmp_path, protocol):
    """The router aborts decode (and prefill, by the id the workers know) when its client goes away, whatever the
    protocol: nothing stays live and no page stays held."""
    flags = ("--worker-protocol", protocol, "--worker-agent-port", "0")
    aborted = stack.metric(stack.decode, "pdrt_aborted_requests_total")
    with router_at(str(tmp_path), stack.prefill.url, stack.decode.url, stack.bootstrap_port, *flags) as r:
        stack.hooks(stack.decode, step_delay_s=0.05)  # a generation that lasts seconds
        try:
            body = chat(stack.model, "a long story", max_tokens=200, stream=True, ignore_eos=True)
            with httpx.stream("POST", r.url + CHAT, json=body, timeout=60) as resp:
                assert resp.status_code == 200
                got = 0
                for line in resp.iter_lines():
                    got += line.startswith("data: ")
                    if got == 3:
                        break  # the client goes away mid-stream
            wait_for(lambda: stack.metric(stack.decode, "pdrt_aborted_requests_total") > aborted, 20,
                     f"decode to abort: {httpx.get(stack.decode.url + '/metrics').text.count('aborted')}")
        finally:
            stack.hooks(stack.decode, step_delay_s=0)
        p, d = stack.wait_idle()
        for x in (p, d):
            assert x["live"] == 0 and x["pool"]["free"] == x["pool"]["total"], x
