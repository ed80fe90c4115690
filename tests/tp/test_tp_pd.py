"""A PD pair with tensor parallelism on both sides (TP=2: gloo, each worker starts its own follower process)
serves a chat completion through the router with the same greedy text as a TP=1 pair; a TP=2 prefill
paired with a TP=1 decode is refused at bootstrap with a message naming both sizes."""

from __future__ import annotations

import os
import sys

import httpx
import pytest

from pdruntime.model.testing import write_tiny_checkpoint

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "pd"))
from pd_harness import base_env, free_port, spawn, wait_healthy  # noqa: E402

FLAGS = ["--num-blocks", "256", "--block-size", "16", "--max-num-seqs", "8", "--threads", "1", "--device", "cpu"]
CHAT = {"messages": [{"role": "user", "content": "Paged attention stores the KV cache in blocks."}],
        "max_tokens": 24, "temperature": 0}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """prefill TP1, decode TP1, prefill TP2, decode TP2 and three routers: (P1, D1), (P2, D2), (P2, D1)."""
    model = write_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny-tp-pd")))
    logs = str(tmp_path_factory.mktemp("tp-pd-logs"))
    env = base_env()
    procs, urls, boot, by_name = [], {}, {}, {}

    def worker(name: str, role: str, tp: int):
        port = free_port()
        args = ["--role", role, "--port", str(port), "--model", model, "--tensor-parallel-size", str(tp), *FLAGS]
        if role == "prefill":
            boot[name] = free_port()
            args += ["--bootstrap-port", str(boot[name])]
        p = spawn(name, args, env, logs, port)
        procs.append(p)
        urls[name] = p.url
        by_name[name] = p

    def router(name: str, prefill: str, decode: str):
        port = free_port()
        p = spawn(name, ["--role", "router", "--port", str(port), "--prefill", urls[prefill], "--decode", urls[decode],
                         "--bootstrap-ports", str(boot[prefill])], env, logs, port)
        procs.append(p)
        urls[name] = p.url

    try:
        for name, role, tp in (("p1", "prefill", 1), ("d1", "decode", 1), ("p2", "prefill", 2), ("d2", "decode", 2)):
            worker(name, role, tp)
        router("r11", "p1", "d1")
        router("r22", "p2", "d2")
        router("r21", "p2", "d1")
        wait_healthy(procs, timeout=240)
        yield {**urls, "procs": by_name}
    finally:
        for p in procs:
            p.stop()


def _chat(url: str) -> httpx.Response:
    model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
    return httpx.post(url + "/v1/chat/completions", json={"model": model, **CHAT}, timeout=120)


def test_tp2_pair_serves_the_same_greedy_text_as_tp1(cluster):
    cfg = httpx.get(cluster["d2"] + "/config", timeout=30).json()["engine"]
    assert cfg["tensor_parallel_size"] == 2 and cfg["device"] == "cpu"
    one, two = _chat(cluster["r11"]), _chat(cluster["r22"])
    assert one.status_code == 200, one.text
    assert two.status_code == 200, two.text
    text1 = one.json()["choices"][0]["message"]["content"]
    text2 = two.json()["choices"][0]["message"]["content"]
    assert text1 and text2 == text1
    assert two.json()["usage"]["completion_tokens"] == one.json()["usage"]["completion_tokens"]
    # KV crossed the wire as two shards (one per rank) of half the heads each: same bytes as TP=1 in total
    kv1 = httpx.get(cluster["p1"] + "/metrics", timeout=30).text
    kv2 = httpx.get(cluster["p2"] + "/metrics", timeout=30).text
    assert _metric(kv2, "pdrt_kv_transfer_bytes_total") == _metric(kv1, "pdrt_kv_transfer_bytes_total") > 0


def test_tp2_pair_sends_only_the_pages_decode_lacks_and_keeps_the_text(cluster):
    """The same chat again: each decode holds the prompt's full pages (its prefix cache), so both pairs leave them
    off the wire - TP=2 one shard per rank - and the text stays the TP=1 pair's."""
    def counters(url: str) -> tuple[float, float]:
        text = httpx.get(url + "/metrics", timeout=30).text
        return _metric(text, "pdrt_kv_transfer_bytes_total"), _metric(text, "pdrt_kv_transfer_saved_bytes_total")

    moved = {}
    for pair, prefill in (("r11", "p1"), ("r22", "p2")):
        sent0, saved0 = counters(cluster[prefill])
        r = _chat(cluster[pair])
        assert r.status_code == 200, r.text
        moved[pair] = r.json()["choices"][0]["message"]["content"]
        sent1, saved1 = counters(cluster[prefill])
        moved[pair, "sent"], moved[pair, "saved"] = sent1 - sent0, saved1 - saved0
    assert moved["r22"] == moved["r11"]
    assert moved["r22", "saved"] == moved["r11", "saved"] > 0  # the same pages held, in two shards of half the heads
    assert moved["r22", "sent"] == moved["r11", "sent"]  # the pages after the held ones


def test_tp_size_mismatch_is_refused_with_both_sizes_named(cluster):
    r = _chat(cluster["r21"])
    assert r.status_code >= 500, r.text
    assert "tensor-parallel size mismatch: prefill runs tp_size=2, decode runs tp_size=1" in r.text
    # and the prefill worker keeps serving its matching pair
    assert _chat(cluster["r22"]).status_code == 200


def _metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


def test_a_dead_tp_follower_takes_its_worker_down_loudly(cluster):
    """Rank 0 cannot serve without its peers: when a follower dies, the worker exits non-zero with one log line
    naming the rank (so the pod restarts and the operator co-restarts the pair), instead of hanging.
    Runs last in this module: it takes the TP=2 decode worker down."""
    import signal

    proc = cluster["procs"]["d2"]
    pids = httpx.get(cluster["d2"] + "/config", timeout=30).json()["engine"]["tp_follower_pids"]
    assert len(pids) == 1
    os.kill(pids[0], signal.SIGKILL)
    assert proc.popen.wait(60) == 3  # generous deadline: a hang fails here
    assert f"tensor-parallel rank 1 (pid {pids[0]}) exited with code -9" in proc.log_text()
