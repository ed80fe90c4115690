"""Prefix cache: greedy tokens equal a cache-off run (page boundaries, mid-page prefixes, eviction pressure, n=3,
a json_schema grammar, an abort mid-prefill, PD), exact pool accounting with cached pages counted apart, LRU
eviction that never takes a held page, hit/miss counters, and a multi-round conversation that prefills only
its new tokens."""

from __future__ import annotations

import json
import random

import pytest

from pdruntime.engine import BlockPool, OutOfBlocks, SamplingParams
from pdruntime.engine.config import InvalidRequest
from pdruntime.engine.prefix_cache import PrefixCache, chain_keys, namespace_root
from pdruntime.engine.sequence import Sequence

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
BS = 4  # tokens per page in these tests (make_engine's default)


def toks(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 300) for _ in range(n)]


def run(engine, reqs) -> dict[str, tuple[list[int], object]]:
    """Add ``reqs`` [(rid, prompt, params, add_request kwargs)] at once and step until idle, checking the pool's
    accounting after every step. rid -> (tokens, first StepOutput)."""
    got: dict[str, tuple[list[int], object]] = {}
    for rid, prompt, params, kw in reqs:
        engine.add_request(rid, prompt, params, **kw)
    for _ in range(10_000):  # bounded: a scheduling livelock fails instead of hanging
        if not engine.has_work():
            break
        for o in engine.step():
            tokens, first = got.get(o.request_id, ([], o))
            got[o.request_id] = (tokens + o.new_token_ids, first)
        engine.check_accounting()
    assert not engine.has_work(), "requests still running after 10000 steps"
    return got


def waves(engine, waves_) -> dict[str, tuple[list[int], object]]:
    """Each wave runs to completion before the next is added (so later waves can hit what earlier ones cached)."""
    out: dict[str, tuple[list[int], object]] = {}
    for wave in waves_:
        out.update(run(engine, [(r[0], r[1], r[2], r[3] if len(r) > 3 else {}) for r in wave]))
    return out


def same_tokens(on, off) -> None:
    assert {r: t for r, (t, _) in on.items()} == {r: t for r, (t, _) in off.items()}


def idle_and_clean(engine) -> None:
    """At idle no page is held, every cached page is evictable, and the pool and the index agree."""
    engine.check_accounting()
    engine.pool.assert_no_leaks(held=0, cached=len(engine.prefix_cache))
    st = engine.stats()
    assert st["blocks_evictable"] == st["blocks_cached"] and st["blocks_free"] == st["blocks_total"]


# -- pure: the pool and the index -----------------------------------------------------------------------------
def _pool_with(num_blocks: int, held: list[int], evictable: list[int]) -> tuple[BlockPool, list[int]]:
    """A pool where ``held`` pages are cached and held by a live sequence, and ``evictable`` pages are cached and
    unheld, freed in that order (the first is least recently used). Returns (pool, evictions seen)."""
    pool = BlockPool(num_blocks)
    ids = pool.allocate(num_blocks)
    assert ids == list(range(num_blocks))
    seen: list[int] = []
    pool.on_evict = seen.append
    for p in held + evictable:
        pool.mark_cached(p)
    pool.free([p for p in ids if p not in held and p not in evictable])  # empty pages
    for p in evictable:
        pool.free([p])
    return pool, seen


@pytest.mark.parametrize("num_blocks,held,evictable,n,evicted", [
    # (pool size, cached pages a live sequence holds, unheld cached pages LRU first, pages asked, pages evicted)
    (6, [0, 1], [2, 3], 2, []),  # 2 empty pages (4, 5): no eviction at all
    (6, [0, 1], [2, 3], 3, [2]),  # one short: the least recently used cached page goes
    (6, [0, 1], [3, 2], 3, [3]),  # LRU by free order, not by page id
    (6, [0, 1], [2, 3], 4, [2, 3]),  # every unheld page, never 0 or 1
    (6, [0, 1], [2, 3], 5, None),  # would need a held page: OutOfBlocks, nothing evicted
    (4, [0, 1, 2, 3], [], 1, None),  # all cached pages held: nothing to evict
    (4, [], [0, 1, 2, 3], 4, [0, 1, 2, 3]),
])
def test_eviction_never_takes_a_page_a_live_sequence_holds(num_blocks, held, evictable, n, evicted):
    pool, seen = _pool_with(num_blocks, held, evictable)
    if evicted is None:
        with pytest.raises(OutOfBlocks):
            pool.allocate(n)
        assert seen == [] and pool.num_evictable == len(evictable)
        return
    got = pool.allocate(n)
    assert not set(got) & set(held)
    assert seen == evicted and pool.num_evictions == len(evicted)
    assert all(pool.refs(p) == 1 for p in held) and all(pool.is_cached(p) for p in held)
    pool.assert_no_leaks(held=len(held) + n, cached=len(held) + len(evictable) - len(evicted))


def test_reuse_moves_a_cached_page_out_of_the_lru_and_back_to_its_most_recent_end():
    pool, seen = _pool_with(5, [], [0, 1, 2])  # LRU: 0, 1, 2; empty: 3, 4
    assert pool.num_free == 5 and pool.num_used == 0 and pool.num_cached == 3
    assert pool.can_allocate(5) and not pool.can_allocate(5, reusing=[0])
    pool.reuse([0])  # a hit: held again, not evictable
    assert pool.refs(0) == 1 and pool.num_evictable == 2
    pool.free([0])  # LRU now 1, 2, 0
    pool.allocate(4)  # 2 empty + 1, 2
    assert seen == [1, 2]
    with pytest.raises(ValueError):
        pool.reuse([3])  # not cached
    pool.assert_no_leaks(held=4, cached=1)


def test_a_freed_sequence_evicts_its_tail_page_before_its_root():
    pool, seen = _pool_with(3, [0, 1, 2], [])
    pool.free([0, 1, 2])  # one sequence's pages, root first
    pool.allocate(1)
    assert seen == [2]  # its root page 0 (the prefix every continuation needs) stays longest


def test_chain_keys_name_the_whole_prefix_and_the_namespace():
    root = namespace_root("model=a dtype=fp32 block=4")
    a = chain_keys(root, [1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    assert len(a) == 2 and len(a[0]) == 16  # the partial third page has no key
    assert chain_keys(root, [1, 2, 3, 4, 5, 6, 7, 8], 4) == a
    assert chain_keys(root, [0, 2, 3, 4, 5, 6, 7, 8], 4)[1] != a[1]  # same second page, different first
    assert chain_keys(namespace_root("model=b dtype=fp32 block=4"), [1, 2, 3, 4], 4)[0] != a[0]


def test_only_full_computed_pages_are_indexed_and_a_duplicate_stays_uncached():
    pool = BlockPool(8)
    cache = PrefixCache(pool, 4, "ns")
    s = Sequence("a", list(range(10)), GREEDY)
    s.blocks = pool.allocate(3)
    s.num_cached = 7  # page 1 is only partly computed
    cache.publish(s)
    assert len(cache) == 1 and pool.is_cached(s.blocks[0]) and not pool.is_cached(s.blocks[1])
    s.num_cached = 10
    cache.publish(s)
    assert len(cache) == 2 and not pool.is_cached(s.blocks[2])  # page 2 holds 2 of 4 tokens
    t = Sequence("b", list(range(10)), GREEDY)
    t.blocks, t.num_cached = pool.allocate(3), 10  # the same prefix computed again at once
    cache.publish(t)
    assert len(cache) == 2 and not pool.is_cached(t.blocks[0])
    assert cache.match(Sequence("c", list(range(12)), GREEDY), 11) == s.blocks[:2]
    assert cache.match(Sequence("c", list(range(12)), GREEDY), 7) == s.blocks[:1]  # at most 7 tokens: one page
    cache.check()


def test_prefix_cache_max_pages_bounds_the_index(make_engine):
    engine = make_engine(prefix_cache_max_pages=3)
    waves(engine, [[(f"r{i}", toks(i, 13), GREEDY)] for i in range(3)])
    assert engine.stats()["blocks_cached"] == 3
    idle_and_clean(engine)


# -- engine: equal tokens -------------------------------------------------------------------------------------
def test_greedy_equals_cache_off_across_page_boundaries_and_a_mid_page_prefix(make_engine):
    base = toks(1, 18)
    later = [("aligned", base[:8] + toks(2, 3), GREEDY),  # shares 2 full pages
             ("mid-page", base[:13] + toks(3, 5), GREEDY),  # shares 13 tokens: 3 full pages + 1 token
             ("same", base, GREEDY),  # the whole prompt: all but the last token may hit (4 pages)
             ("longer", base + toks(4, 9), GREEDY)]
    plan = [[("base", base, GREEDY)]] + [[r] for r in later]
    on = waves(make_engine(), plan)
    off = waves(make_engine(prefix_cache=False), plan)
    same_tokens(on, off)
    cached = {r: first.cached_tokens for r, (_, first) in on.items()}
    assert cached == {"base": 0, "aligned": 8, "mid-page": 12, "same": 16, "longer": 16}
    assert all(first.cached_tokens == 0 for _, first in off.values())


def test_concurrent_requests_with_one_prefix_equal_cache_off(make_engine):
    base = toks(5, 11)
    plan = [[(f"r{i}", base + toks(10 + i, 2 + i), GREEDY) for i in range(4)]]  # admitted together: no hits
    on = make_engine(max_prefill_tokens=6)
    same_tokens(waves(on, plan), waves(make_engine(prefix_cache=False, max_prefill_tokens=6), plan))
    idle_and_clean(on)


def test_greedy_equals_cache_off_under_eviction_pressure(make_engine):
    """A 12-page pool holds 48 tokens; 10 conversations of ~20 tokens each cannot all stay cached."""
    plan = []
    for i in range(5):
        head = toks(100 + i, 9)
        plan.append([(f"a{i}", head + toks(200 + i, 3), GREEDY), (f"b{i}", head + toks(300 + i, 4), GREEDY)])
        plan.append([(f"c{i}", head + toks(200 + i, 3) + toks(400 + i, 2), GREEDY)])
    on = make_engine(num_blocks=12)
    got = waves(on, plan)
    same_tokens(got, waves(make_engine(num_blocks=12, prefix_cache=False), plan))
    same_tokens(got, waves(make_engine(prefix_cache=False), plan))  # and a pool that never preempts
    st = on.stats()
    assert st["cache_evictions"] > 0 and st["cache_hit_tokens"] > 0
    assert all(got[f"c{i}"][1].cached_tokens >= 8 for i in range(5))  # the previous wave's pages survived
    idle_and_clean(on)


def test_n3_forks_over_a_cached_prefix_equal_cache_off(make_engine):
    head = toks(7, 10)
    n3 = {"forks": [("r#1", GREEDY), ("r#2", SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))]}
    plan = [[("warm", head + toks(8, 2), GREEDY)], [("r", head + toks(9, 5), GREEDY, n3)],
            [("after", head + toks(9, 5) + toks(10, 1), GREEDY)]]
    on = make_engine()
    got = waves(on, plan)
    same_tokens(got, waves(make_engine(prefix_cache=False), plan))
    assert got["r"][0] == got["r#1"][0] and got["r#2"][0] == got["r"][0][:4]
    assert got["r"][1].cached_tokens == got["r#1"][1].cached_tokens == 8
    assert got["after"][1].cached_tokens == 12  # the shared prompt's 3 full pages (15 tokens + decode)
    idle_and_clean(on)


def test_json_schema_grammar_over_a_cached_prefix_equals_cache_off(make_engine):
    import llguidance

    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["n"], "additionalProperties": False}
    g = SamplingParams(max_tokens=24, temperature=0, grammar=llguidance.LLMatcher.grammar_from_json_schema(
        json.dumps(schema)))
    head = toks(11, 13)
    plan = [[("warm", head, GREEDY)], [("json", head + toks(12, 3), g)], [("json2", head + toks(12, 3), g)]]
    on = make_engine()
    got = waves(on, plan)
    same_tokens(got, waves(make_engine(prefix_cache=False), plan))
    assert got["json"][1].cached_tokens == 12 and got["json2"][1].cached_tokens == 12
    assert got["json2"][0] == got["json"][0]
    idle_and_clean(on)


def test_abort_mid_prefill_keeps_only_full_computed_pages_and_a_sharer_equals_cache_off(make_engine):
    prompt = toks(13, 22)
    engine = make_engine(max_prefill_tokens=5)  # two steps compute 10 tokens: pages 0-1 full, page 2 partial
    engine.add_request("a", prompt, GREEDY)
    engine.step()
    engine.step()
    assert engine.pages("a")[1] == 10
    engine.abort("a")
    engine.take_pending()
    assert engine.stats()["blocks_cached"] == 2  # never the partly computed page 2
    idle_and_clean(engine)
    sharer = [[("b", prompt[:20] + toks(14, 3), GREEDY)]]
    got = waves(engine, sharer)
    assert got["b"][1].cached_tokens == 8
    same_tokens(got, waves(make_engine(prefix_cache=False), sharer))
    idle_and_clean(engine)


def test_preempted_sequences_recompute_from_their_own_cached_pages_and_equal_cache_off(make_engine):
    plan = [[(f"r{i}", toks(50 + i, 7), SamplingParams(max_tokens=14, temperature=0, ignore_eos=True))
             for i in range(3)]]
    on = make_engine(num_blocks=13)  # 3 x 21 tokens need 18 pages: the newest is preempted
    got = waves(on, plan)
    same_tokens(got, waves(make_engine(prefix_cache=False), plan))
    assert on.stats()["num_preemptions"] > 0 and on.stats()["cache_hit_tokens"] > 0
    idle_and_clean(on)


# -- engine: counters, accounting ------------------------------------------------------------------------------
def test_hit_and_miss_counters_and_prefill_tokens(make_engine):
    engine = make_engine()
    a = toks(20, 10)
    out = waves(engine, [[("a", a, GREEDY)]])["a"][0]  # 10 prompt tokens + 5 decoded: pages 0-2 full (12 tokens)
    st = engine.stats()
    assert (st["cache_hit_tokens"], st["cache_miss_tokens"], st["num_prefill_tokens"]) == (0, 10, 10)
    assert st["blocks_cached"] == 3
    waves(engine, [[("b", a + out + toks(21, 2), GREEDY)]])  # 18 tokens: 12 hit (decoded ones too), 6 computed
    st = engine.stats()
    assert (st["cache_hit_tokens"], st["cache_miss_tokens"], st["num_prefill_tokens"]) == (12, 16, 16)
    waves(engine, [[("c", a + toks(22, 4), GREEDY)]])  # page 2 differs from a's (a's output): 8 hit
    st = engine.stats()
    assert (st["cache_hit_tokens"], st["cache_miss_tokens"], st["num_prefill_tokens"]) == (20, 22, 22)
    off = make_engine(prefix_cache=False)
    waves(off, [[("a", a, GREEDY)]])
    st = off.stats()
    assert not st["prefix_cache"] and st["blocks_cached"] == st["cache_hit_tokens"] == 0
    off.pool.assert_no_leaks(held=0, cached=0)


def test_prompt_logprobs_requests_compute_every_position(make_engine):
    engine = make_engine()
    a = toks(22, 12)
    waves(engine, [[("a", a, GREEDY)]])
    p = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, prompt_logprobs=0)
    got = waves(engine, [[("b", a, p)]])
    assert got["b"][1].cached_tokens == 0 and len(got["b"][1].prompt_logprobs) == 11


def test_accounting_holds_through_forks_aborts_prefill_only_and_release(make_engine):
    engine = make_engine(num_blocks=40, max_prefill_tokens=6, max_num_seqs=4)
    head = toks(30, 9)
    engine.add_request("held", head + toks(31, 4), GREEDY, prefill_only=True)
    engine.add_request("n3", head + toks(32, 3), GREEDY, forks=[("n3#1", GREEDY), ("n3#2", GREEDY)])
    engine.add_request("gone", head + toks(33, 11), GREEDY)
    for step in range(40):
        engine.step()
        engine.check_accounting()
        if step == 1:
            engine.abort("gone")
        if step == 3:
            engine.add_request("late", head + toks(34, 2), GREEDY)
        if "held" in engine._seqs and engine._seqs["held"].status.value == "prefill_held":
            blocks, n = engine.pages("held")
            assert n == 13 and all(engine.pool.refs(b) >= 1 for b in blocks)
            engine.release("held")
            engine.check_accounting()
        if not engine.has_work():
            break
    engine.take_pending()
    assert engine.stats()["cache_hit_tokens"] >= 8  # "late" shared the head's pages
    idle_and_clean(engine)


def test_multi_round_conversation_prefills_only_the_new_tokens(make_engine):
    on, off = make_engine(), make_engine(prefix_cache=False)
    history: list[int] = toks(40, 9)
    prev_total = None
    for k in range(5):
        prompt = history + toks(41 + k, 5)  # the previous prompt + its output + a new message
        before = on.stats()
        got = run(on, [(f"round{k}", prompt, GREEDY, {})])
        after = on.stats()
        want = run(off, [(f"round{k}", prompt, GREEDY, {})])
        same_tokens(got, want)
        out, first = got[f"round{k}"]
        computed = after["num_prefill_tokens"] - before["num_prefill_tokens"]
        if prev_total is not None:
            held = (prev_total - 1) // BS * BS  # the previous round's prompt + output, all but its last token
            assert first.cached_tokens == held
            assert after["cache_hit_tokens"] - before["cache_hit_tokens"] == held
            assert computed == len(prompt) - held <= 5 + BS  # the new message plus the last partial page
        history = prompt + out
        prev_total = len(history)
    idle_and_clean(on)


# -- PD entry points --------------------------------------------------------------------------------------------
def _copy_pages(tiny, src_engine, src_blocks, dst_engine, dst_blocks, start: int, n: int) -> None:
    """Token by token, positions [start, n): what a KV transfer of only the missing pages writes."""
    for layer in range(tiny.model.config.num_layers):
        for t in range(start, n):
            s, d = (src_blocks[t // BS], t % BS), (dst_blocks[t // BS], t % BS)
            dst_engine.kv.k[layer][d] = src_engine.kv.k[layer][s]
            dst_engine.kv.v[layer][d] = src_engine.kv.v[layer][s]


def _pd_round(tiny, pre, dec, rid, prompt):
    pre.add_request(rid, prompt, GREEDY, prefill_only=True)
    got = run(pre, [])
    (first,), first_out = got[rid]
    src, n = pre.pages(rid)
    dst = dec.reserve(rid, n, prompt_token_ids=prompt)
    dst_again, held = dec.pages(rid)
    assert dst_again == dst and held % BS == 0
    assert all(dec.pool.refs(b) >= 1 and dec.pool.is_cached(b) for b in dst[:held // BS])  # shared, read-only
    _copy_pages(tiny, pre, src, dec, dst, held, n)  # only the pages decode lacks
    pre.release(rid)
    dec.add_prefilled(rid, prompt, first, GREEDY)
    out = run(dec, [])[rid][0]
    return out, held, first_out.cached_tokens


def test_pd_decode_reserve_shares_what_it_holds_and_continues_like_a_cache_off_run(make_engine, tiny):
    pre, dec, mono = make_engine(), make_engine(), make_engine(prefix_cache=False)
    history = toks(60, 10)
    prev_out: list[int] = []
    for k in range(3):
        prompt = history + toks(61 + k, 4)
        out, held, pre_cached = _pd_round(tiny, pre, dec, f"r{k}", prompt)
        assert out == run(mono, [(f"r{k}", prompt, GREEDY, {})])[f"r{k}"][0]
        if k == 0:
            assert held == pre_cached == 0
        else:
            assert held == (len(history) - 1) // BS * BS  # decode holds its own earlier rounds' output too
            assert pre_cached == (len(history) - len(prev_out)) // BS * BS  # prefill holds only prompts
        prev_out = out
        history = prompt + out
    for e in (pre, dec):
        idle_and_clean(e)


def test_pd_add_prefilled_refuses_a_prompt_that_differs_from_the_held_prefix(make_engine):
    dec = make_engine()
    a = toks(70, 12)
    waves(dec, [[("a", a, GREEDY)]])
    dec.reserve("r", 14, prompt_token_ids=a + [1, 2])
    assert dec.pages("r")[1] == 12
    with pytest.raises(InvalidRequest, match="differs from the one reserve"):
        dec.add_prefilled("r", [5] + a[1:] + [1, 2], 3, GREEDY)
    assert dec.abort("r")
    dec.take_pending()
    idle_and_clean(dec)
    with pytest.raises(InvalidRequest, match="num_tokens"):
        dec.reserve("s", 5, prompt_token_ids=[1, 2])
    with pytest.raises(OutOfBlocks):
        make_engine(num_blocks=3).reserve("t", 14, prompt_token_ids=a + [1, 2])


def test_prefix_cache_flags_reach_the_engine_config_and_the_workers_pdrt_up_starts():
    from pdruntime.cli import build_parser
    from pdruntime.server.commands import _engine_config, _worker_args

    parser = build_parser()
    on = _engine_config(parser.parse_args(["serve", "--role", "decode", "--device", "cpu"]))
    assert on.prefix_cache is True and on.prefix_cache_max_pages is None
    off = _engine_config(parser.parse_args(["serve", "--role", "decode", "--device", "cpu", "--no-prefix-cache",
                                            "--prefix-cache-max-pages", "7"]))
    assert off.prefix_cache is False and off.prefix_cache_max_pages == 7
    out = _worker_args(parser.parse_args(["up", "--no-prefix-cache", "--prefix-cache-max-pages", "7"]))
    assert "--no-prefix-cache" in out and out[out.index("--prefix-cache-max-pages") + 1] == "7"
    assert "--no-prefix-cache" not in _worker_args(parser.parse_args(["up"]))
    with pytest.raises(ValueError, match="prefix_cache_max_pages"):
        type(on)(prefix_cache_max_pages=0)


def test_token_range_equals_slicing_the_tokens():
    s = Sequence("a", [1, 2, 3, 4, 5], GREEDY, output_ids=[6, 7, 8])
    for a in range(9):
        for b in range(a, 9):
            assert s.token_range(a, b) == s.tokens[a:b]


def test_tp2_multi_round_hits_the_cache_and_equals_a_cache_off_single_rank_engine(tiny_model, make_engine):
    """gloo TP on the CPU: the followers write the same page ids rank 0 schedules, so shared pages hold every
    rank's heads; a conversation's rounds hit and give the tokens of a one-rank cache-off engine."""
    from pdruntime.engine import Engine, EngineConfig, load_for

    two = EngineConfig(num_blocks=64, block_size=BS, tensor_parallel_size=2)
    tp = Engine(load_for(tiny_model, two), two)
    try:
        off = make_engine(prefix_cache=False)
        history = toks(80, 7)
        for k in range(3):
            prompt = history + toks(81 + k, 3)
            got = run(tp, [(f"r{k}", prompt, GREEDY, {})])
            same_tokens(got, run(off, [(f"r{k}", prompt, GREEDY, {})]))
            assert (got[f"r{k}"][1].cached_tokens > 0) == (k > 0)
            history = prompt + got[f"r{k}"][0]
        idle_and_clean(tp)
    finally:
        tp.shutdown()


def test_pd_reserve_with_forks_over_a_held_prefix_equals_cache_off_n3(make_engine, tiny):
    pre, dec, mono = make_engine(), make_engine(), make_engine(prefix_cache=False)
    head = toks(90, 9)
    run(dec, [("warm", head, GREEDY, {})])  # decode holds head's pages (prompt + decoded)
    prompt = head + toks(91, 6)
    forks = [("r#1", GREEDY), ("r#2", GREEDY)]
    pre.add_request("r", prompt, GREEDY, prefill_only=True)
    (first,), _ = run(pre, [])["r"]
    src, n = pre.pages("r")
    dst = dec.reserve("r", n, ["r#1", "r#2"], prompt_token_ids=prompt)
    held = dec.pages("r")[1]
    assert held == 8
    _copy_pages(tiny, pre, src, dec, dst, held, n)
    pre.release("r")
    dec.add_prefilled("r", prompt, first, GREEDY, forks=forks)
    dec.check_accounting()
    got = run(dec, [])
    want = run(mono, [("r", prompt, GREEDY, {"forks": forks})])
    assert {r: got[r][0] for r in ("r", "r#1", "r#2")} == {r: t for r, (t, _) in want.items()}
    for e in (pre, dec):
        idle_and_clean(e)
