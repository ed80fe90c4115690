"""PD hooks: prefill_only keeps pages until release; KV copied to another engine continues identically."""

from __future__ import annotations

import pytest

from pdruntime.engine import Engine, EngineConfig, OutOfBlocks, SamplingParams

GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)


def _run(engine, rid):
    toks, last = [], None
    while engine.has_work():
        for o in engine.step():
            if o.request_id == rid:
                toks.extend(o.new_token_ids)
                last = o
    return toks, last


def test_prefill_only_keeps_pages_until_release(make_engine, tiny):
    prompt = tiny.tokenizer.encode("Prefill and decode run on different workers")
    mono = make_engine().generate([prompt], GREEDY)[0]
    engine = make_engine(max_prefill_tokens=5)
    engine.add_request("p", prompt, GREEDY, prefill_only=True)
    toks, last = _run(engine, "p")
    assert last.finished and last.finish_reason == "prefill_done"
    assert toks == [mono[0]]
    blocks, n = engine.pages("p")
    assert n == len(prompt) and len(blocks) == -(-len(prompt) // engine.config.block_size)
    assert engine.pool.num_used == len(blocks)
    assert engine.stats()["num_prefill_held"] == 1
    engine.check_accounting()
    engine.release("p")
    engine.release("p")  # idempotent
    engine.pool.assert_no_leaks()
    assert engine.stats()["num_prefill_held"] == 0


@pytest.mark.parametrize("block_p,block_d", [(4, 4), (4, 8)])
def test_reserve_add_prefilled_continues_like_a_monolithic_run(tiny, block_p, block_d):
    prompt = tiny.tokenizer.encode("Paged attention stores the KV cache in fixed-size blocks.")
    mono = Engine(tiny, EngineConfig(num_blocks=64, block_size=4)).generate([prompt], GREEDY)[0]
    pre = Engine(tiny, EngineConfig(num_blocks=64, block_size=block_p))
    dec = Engine(tiny, EngineConfig(num_blocks=64, block_size=block_d))
    dec.add_request("other", tiny.tokenizer.encode("def main"), GREEDY)  # decode batch already running
    dec.step()
    pre.add_request("r", prompt, GREEDY, prefill_only=True)
    (first,), _ = _run(pre, "r")
    src_blocks, n = pre.pages("r")
    dst_blocks = dec.reserve("r", n)
    assert dec.stats()["num_reserved"] == 1
    for layer in range(tiny.model.config.num_layers):  # token-by-token copy: page sizes may differ
        for t in range(n):
            s = (src_blocks[t // block_p], t % block_p)
            d = (dst_blocks[t // block_d], t % block_d)
            dec.kv.k[layer][d] = pre.kv.k[layer][s]
            dec.kv.v[layer][d] = pre.kv.v[layer][s]
    pre.release("r")
    pre.pool.assert_no_leaks()
    dec.add_prefilled("r", prompt, first, GREEDY)
    toks, last = _run(dec, "r")
    assert toks == mono
    assert last.finish_reason == "length"
    dec.pool.assert_no_leaks()


def test_add_prefilled_first_token_eos_finishes_next_step(make_engine, tiny):
    engine = make_engine()
    prompt = tiny.tokenizer.encode("hello")
    engine.reserve("r", len(prompt))
    eos = min(tiny.tokenizer.eos_token_ids)
    engine.add_prefilled("r", prompt, eos, SamplingParams(max_tokens=10))
    outs = engine.step()
    assert [(o.request_id, o.new_token_ids, o.finish_reason) for o in outs] == [("r", [eos], "stop")]
    engine.pool.assert_no_leaks()


def test_reserve_out_of_blocks(make_engine):
    engine = make_engine(num_blocks=4, block_size=4)
    engine.reserve("a", 10)  # 11 tokens -> 3 pages
    with pytest.raises(OutOfBlocks):
        engine.reserve("b", 8)
    assert engine.abort("a")
    engine.pool.assert_no_leaks()


def test_abort_frees_everything_in_every_state(make_engine, tiny):
    tok = tiny.tokenizer
    engine = make_engine(max_prefill_tokens=4, max_num_seqs=3)
    long_prompt = tok.encode("Continuous batching lets new requests join a running decode batch.")
    engine.add_request("running", tok.encode("Paged"), GREEDY)
    engine.step()
    engine.add_request("prefilling", long_prompt, GREEDY)
    engine.add_request("held", tok.encode("The quick"), GREEDY, prefill_only=True)
    engine.add_request("waiting", tok.encode("zzz"), GREEDY)
    engine.step()
    engine.reserve("reserved", 9)
    states = {s.request_id: s.status.value for s in engine._seqs.values()}
    assert states["prefilling"] == "prefilling" and states["waiting"] == "waiting"
    assert states["running"] == "running" and states["reserved"] == "reserved"
    while states["held"] != "prefill_held":
        engine.step()
        states = {s.request_id: s.status.value for s in engine._seqs.values()}
    assert engine.pool.num_used > 0
    for rid in ("running", "prefilling", "held", "waiting", "reserved"):
        if rid in engine._seqs:
            assert engine.abort(rid)
        assert not engine.abort(rid)
    engine.pool.assert_no_leaks()
    outs = engine.step()
    assert all(o.finish_reason == "abort" for o in outs)
    assert not engine.has_work()
