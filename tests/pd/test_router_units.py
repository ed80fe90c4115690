"""Unit tests of the router's pure parts: pair choice, stickiness, circuit breaker, topology, request validation."""

from __future__ import annotations

import os

import pytest

from pdruntime.server.metrics import ClientLabels
from pdruntime.server.router.policy import CircuitBreaker, PairPicker
from pdruntime.server.openai.schemas import ApiError, ChatCompletionRequest, CompletionRequest, parse_body, validate
from pdruntime.server.local.supervisor import backoff_for, plan_restarts
from pdruntime.server.router.topology import (TopologyError, TopologyWatcher, load_topology_text, parse_topology,
                                              topology_from_flags)

TOPO = """
version: 1
revision: "abc123"
pairs:
  - index: 0
    ready: true
    prefill: {url: "http://10.0.0.11:8000", bootstrap_host: "10.0.0.11", bootstrap_port: 8998}
    decode:  {url: "http://10.0.0.12:8000"}
  - index: 1
    ready: true
    prefill: {url: "http://10.0.0.21:8000", bootstrap_port: 8998}
    decode:  {url: "http://10.0.0.22:8000"}
  - index: 2
    ready: false
    prefill: {url: "http://10.0.0.31:8000"}
    decode:  {url: "http://10.0.0.32:8000"}
"""


def test_topology_parses_the_operator_format():
    t = load_topology_text(TOPO)
    assert t.revision == "abc123" and [p.index for p in t.ready_pairs()] == [0, 1]
    assert t.pairs[1].bootstrap_host == "10.0.0.21"  # defaults to the prefill URL's host
    assert t.pairs[2].bootstrap_port == 8998
    assert parse_topology(t.as_dict()) == t


@pytest.mark.parametrize("doc, needle", [
    ({"version": 2, "pairs": []}, "version"),
    ({"pairs": [{"prefill": {"url": "10.0.0.1"}, "decode": {"url": "http://x:1"}}]}, "prefill.url"),
    ({"pairs": [{"index": 0, "prefill": {"url": "http://a:1"}, "decode": {"url": "http://b:1"}},
                {"index": 0, "prefill": {"url": "http://a:1"}, "decode": {"url": "http://b:1"}}]}, "index"),
    ({"pairs": [{"prefill": {"url": "http://a:1", "bootstrap_port": 70000}, "decode": {"url": "http://b:1"}}]}, "bootstrap_port"),
    ({"pairs": [{"ready": "yes", "prefill": {"url": "http://a:1"}, "decode": {"url": "http://b:1"}}]}, "ready"),
])
def test_topology_errors_name_the_field(doc, needle):
    with pytest.raises(TopologyError, match=needle):
        parse_topology(doc)


def test_topology_from_flags_pairs_by_position():
    t = topology_from_flags(["http://127.0.0.1:1"], ["http://127.0.0.1:2"], [9001])
    assert t.pairs[0].bootstrap_port == 9001 and t.pairs[0].bootstrap_host == "127.0.0.1"
    with pytest.raises(TopologyError):
        topology_from_flags(["http://a:1"], [], [])


def test_topology_watcher_hot_reloads_on_content_change_and_keeps_last_good(tmp_path):
    path = tmp_path / "topology.yaml"
    path.write_text(TOPO)
    seen, errors = [], []
    w = TopologyWatcher(str(path), seen.append, errors.append)
    assert w.load_now() is not None and len(seen) == 1
    assert w.load_now() is None  # unchanged content: no reload
    path.write_text("pairs: [oops")
    assert w.load_now() is None and errors and len(seen) == 1  # bad file: last good kept
    tmp = tmp_path / "new.yaml"
    tmp.write_text(TOPO.replace("ready: false", "ready: true"))
    os.replace(tmp, path)  # ConfigMap-style atomic swap
    w.load_now()
    assert len(seen) == 2 and len(seen[-1].ready_pairs()) == 3


def _picker():
    p = PairPicker(threshold=2, cooldown_s=10.0)
    p.set_pairs(load_topology_text(TOPO).pairs)
    return p


def test_pair_choice_is_least_outstanding_among_ready_pairs():
    p = _picker()
    a = p.choose(0.0, None)
    a.outstanding += 1
    b = p.choose(0.0, None)
    assert {a.pair.index, b.pair.index} == {0, 1}  # pair 2 is not ready
    b.outstanding += 5
    assert p.choose(0.0, None).pair.index == a.pair.index


def test_sticky_conversation_keeps_its_pair_even_when_busier():
    p = _picker()
    s = p.choose(0.0, "agent-7")
    s.outstanding += 10
    assert p.choose(0.0, "agent-7") is s
    assert p.choose(0.0, "agent-8") is not s
    # excluded (retry) or unhealthy pairs break stickiness
    assert p.choose(0.0, "agent-7", exclude={s.pair.index}) is not s


def test_circuit_breaker_opens_half_opens_and_closes():
    b = CircuitBreaker(threshold=2, cooldown_s=10.0)
    b.record_failure(0.0)
    assert b.allows(0.0)
    b.record_failure(1.0)
    assert b.state(1.0) == "open" and not b.allows(5.0)
    assert b.state(11.0) == "half_open" and b.allows(11.0)
    b.on_dispatch(11.0)
    assert not b.allows(11.5)  # one trial at a time
    b.record_failure(12.0)
    assert b.state(12.0) == "open"  # a failed trial re-opens
    b.on_dispatch(22.5)
    b.record_success()
    assert b.state(22.6) == "closed"


def test_open_breaker_takes_a_pair_out_of_choice():
    p = _picker()
    st = p.states[0]
    st.breaker.record_failure(0.0)
    st.breaker.record_failure(0.0)
    assert all(p.choose(1.0, None).pair.index == 1 for _ in range(3))
    p.states[1].breaker.record_failure(0.0)
    p.states[1].breaker.record_failure(0.0)
    assert p.choose(1.0, None) is None


def test_new_topology_keeps_breakers_of_unchanged_pairs():
    p = _picker()
    p.states[0].breaker.record_failure(0.0)
    p.states[0].outstanding = 3
    p.set_pairs(load_topology_text(TOPO.replace("ready: false", "ready: true")).pairs)
    assert p.states[0].breaker.failures == 1 and p.states[0].outstanding == 3


# ---- validation ----------------------------------------------------------------------------------

def _chat(**kw):
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **kw}


@pytest.mark.parametrize("body, status, param", [
    (_chat(max_tokens=-1), 400, "max_tokens"),
    (_chat(max_tokens="10"), 400, "max_tokens"),
    (_chat(temperature="hot"), 400, "temperature"),
    (_chat(messages="hi"), 400, "messages"),
    (_chat(messages=[]), 400, "messages"),
    (_chat(messages=[{"role": "wizard", "content": "x"}]), 400, "messages.0.role"),
    (_chat(best_of=2), 400, "best_of"),
    (_chat(tools=[{"type": "function"}]), 400, "tools.0.function"),
    (_chat(n=9), 400, "n"),
    (_chat(frobnicate=1), 400, "frobnicate"),
    ({"messages": [{"role": "user", "content": "x"}]}, 400, "model"),
    (_chat(stop=["a", "b", "c", "d", "e"]), 400, None),
])
def test_bad_chat_requests_are_rejected_with_a_named_param(body, status, param):
    with pytest.raises(ApiError) as e:
        validate(ChatCompletionRequest, body)
    assert e.value.status == status
    if param is not None:
        assert e.value.param == param
    err = e.value.body()["error"]
    assert err["message"] and err["type"] == "invalid_request_error"


def test_valid_requests_map_to_worker_sampling_params():
    r = validate(ChatCompletionRequest, _chat(max_completion_tokens=5, temperature=0, stop="x", seed=3))
    # fields the client left out are omitted: the worker applies the model's defaults
    assert r.sampling_params() == {"max_new_tokens": 5, "temperature": 0.0, "seed": 3, "stop": ["x"],
                                   "ignore_eos": False, "frequency_penalty": 0.0, "presence_penalty": 0.0}
    c = validate(CompletionRequest, {"model": "m", "prompt": ["once"]})
    assert c.prompt_text() == "once" and c.max_tokens == 16


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b"\xff\xfe"])
def test_malformed_bodies_are_400(raw):
    with pytest.raises(ApiError) as e:
        parse_body(raw)
    assert e.value.status == 400 and e.value.code == "invalid_json"


def test_client_labels_have_bounded_cardinality():
    labels = ClientLabels(limit=3)
    got = [labels.label(f"c{i}") for i in range(6)]
    assert got == ["c0", "c1", "c2", "other", "other", "other"]
    assert labels.label("c1") == "c1" and labels.label(None) == "other"


def test_supervision_restarts_a_pair_together():
    assert plan_restarts({0: (True, True), 1: (True, False), 2: (False, True)}) == [1, 2]
    assert backoff_for(1) < backoff_for(2) <= backoff_for(100) == 30.0


def test_client_of_from_header_or_api_key_never_the_key():
    from pdruntime.server.router.auth import client_of

    assert client_of({"x-client-id": "harness"}) == "harness"
    key = client_of({"authorization": "Bearer sk-secret-123"})
    assert key.startswith("key-") and "secret" not in key
    assert key == client_of({"authorization": "Bearer sk-secret-123"})
    assert client_of({}) == "anonymous"


class _Recorder:
    """A transport that keeps each write apart (what goes out as one segment and one wake-up for the client)."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))

    def close(self) -> None:
        pass


@pytest.mark.parametrize("version, ends_with_done", [("1.1", True), ("1.1", False), ("1.0", True)])
def test_a_streamed_answer_ends_in_the_write_that_carries_done(version, ends_with_done):
    """The router's server writes the head with the first chunk and, when a chunk ends in ``data: [DONE]``, the
    chunked terminator with that chunk: a one-token stream is one write. A stream that ends without [DONE] still gets
    its terminator, in a write of its own; HTTP/1.0 gets no chunk framing; ``finish`` runs once, told it completed."""
    import asyncio

    from pdruntime.server.router.reply import Streamed
    from pdruntime.server.router.server import RouterConnection, _Exchange
    from pdruntime.util.sse import SSE_DONE

    last = b'data: {"n": 2}\n\n' + (SSE_DONE if ends_with_done else b"")
    finished: list[bool] = []

    async def chunks():
        yield b'data: {"n": 1}\n\n'
        yield last

    async def finish(completed: bool) -> None:
        finished.append(completed)

    async def run() -> list[bytes]:
        conn = RouterConnection()
        conn.transport = _Recorder()  # type: ignore[assignment]
        ex = _Exchange()
        ex.version, ex.keep_alive = version, True
        assert await conn._stream(ex, Streamed(chunks(), finish))
        return conn.transport.writes  # type: ignore[attr-defined]

    writes = asyncio.run(run())
    assert finished == [True]
    if version == "1.0":
        assert len(writes) == 2 and writes[0].endswith(b'data: {"n": 1}\n\n') and writes[1] == last
        return
    assert writes[0].startswith(b"HTTP/1.1 200 OK\r\n") and b"transfer-encoding: chunked" in writes[0]
    assert writes[1] == b"%x\r\n%b\r\n" % (len(last), last) + (b"0\r\n\r\n" if ends_with_done else b"")
    assert writes[2:] == ([] if ends_with_done else [b"0\r\n\r\n"])


def test_metric_children_updated_on_the_loop_render_what_prometheus_clients_own_would():
    """Metrics.on_loop: the router's per-request counters and histograms are plain numbers until a render folds them
    in; the exposition is the one prometheus_client's own inc() and observe() give, bucket bounds included (a value
    exactly on a bound counts in that bucket), and a second render adds nothing twice."""
    from pdruntime.server.metrics import Metrics

    values = [0.0, 0.001, 0.0010001, 0.0025, 0.3, 2.5, 2.6, 7.0, 1e9]
    mine, theirs = Metrics("router"), Metrics("router")
    hist, count = mine.on_loop(mine.itl.labels("router")), mine.on_loop(mine.tokens.labels("router", "c"))
    for v in values:
        hist.observe(v)
        theirs.itl.labels("router").observe(v)
    count.inc(3)
    count.inc()
    theirs.tokens.labels("router", "c").inc(4)
    assert mine.render() == theirs.render()
    hist.observe(0.2)
    theirs.itl.labels("router").observe(0.2)
    assert mine.render() == theirs.render()
    assert b'pdrt_inter_token_latency_seconds_bucket{le="0.001",role="router"} 2.0' in mine.render()
