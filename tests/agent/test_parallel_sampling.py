"""n > 1 in the engine: one prefill, n decode sequences sharing the prompt's KV pages (full pages
reference-counted, the partly filled last page copied), with exact page accounting at every step."""

from __future__ import annotations

import pytest

from pdruntime.engine import Engine, EngineConfig, SamplingParams
from pdruntime.engine.block_pool import BlockPool


def _engine(tiny, **kw):
    return Engine(tiny, EngineConfig(**{"num_blocks": 64, "block_size": 4, **kw}))


def _drain(engine, check=True):
    out: dict[str, list[int]] = {}
    reasons = {}
    while engine.has_work():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                reasons[o.request_id] = o.finish_reason
        if check:
            engine.check_accounting()
    return out, reasons


def test_block_pool_reference_counts():
    pool = BlockPool(4)
    a = pool.allocate(2)
    pool.share(a)
    assert pool.num_used == 2 and pool.refs(a[0]) == 2
    pool.free(a)
    assert pool.num_used == 2 and pool.refs(a[0]) == 1  # still held once
    pool.free(a)
    pool.assert_no_leaks()
    with pytest.raises(ValueError):
        pool.free(a)  # double free
    with pytest.raises(ValueError):
        pool.share([3])  # not in use


@pytest.mark.parametrize("prompt_len", [9, 12])  # a partly filled last page (copied) / only full pages (shared)
def test_n_forks_prefill_once_share_pages_and_decode_like_independent_requests(tiny, prompt_len):
    prompt = list(range(5, 5 + prompt_len))
    ps = [SamplingParams(max_tokens=6, temperature=0.9, seed=s, ignore_eos=True) for s in (11, 12, 13)]
    eng = _engine(tiny)
    eng.add_request("r", prompt, ps[0], forks=[("r/1", ps[1]), ("r/2", ps[2])])
    first = {o.request_id: o.new_token_ids for o in eng.step()}  # the prefill: once, for the parent
    assert set(first) == {"r", "r/1", "r/2"}  # each sampled its own first token from the same logits
    full = prompt_len // 4
    seqs = {rid: eng._seqs[rid] for rid in ("r", "r/1", "r/2")}
    shared = seqs["r"].blocks[:full]
    assert all(s.blocks[:full] == shared for s in seqs.values())
    assert all(eng.pool.refs(b) == 3 for b in shared)
    tails = {s.blocks[full] for s in seqs.values() if len(s.blocks) > full}
    assert len(tails) == (3 if prompt_len % 4 else 0)  # each sequence its own copy of the last prompt page
    assert eng.pool.num_used == full + len(tails)  # vs 3 * ceil(prompt_len / 4) without sharing
    eng.check_accounting()
    got, reasons = _drain(eng)
    got = {k: first[k] + v for k, v in got.items()}
    assert set(reasons.values()) == {"length"} and all(len(v) == 6 for v in got.values())
    eng.pool.assert_no_leaks()
    # the same three as independent requests (three prefills): the same tokens
    ind = _engine(tiny)
    for rid, p in zip(("a", "b", "c"), ps):
        ind.add_request(rid, prompt, p)
    want, _ = _drain(ind, check=False)
    assert [got["r"], got["r/1"], got["r/2"]] == [want["a"], want["b"], want["c"]]
    assert len({tuple(v) for v in got.values()}) >= 2  # different seeds, different samples


def test_aborting_a_parent_before_its_prefill_lets_its_forks_run_alone(tiny):
    eng = _engine(tiny, max_prefill_tokens=4)  # chunked: the parent is mid-prefill after one step
    p = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    eng.add_request("r", list(range(5, 15)), p, forks=[("r/1", p)])
    eng.step()
    eng.abort("r")
    got, reasons = _drain(eng)
    assert reasons == {"r": "abort", "r/1": "length"} and len(got["r/1"]) == 3
    eng.pool.assert_no_leaks()


def test_forks_under_page_pressure_stay_exact(tiny):
    eng = _engine(tiny, num_blocks=12)  # preemptions: pages run out while the three decode
    p = [SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)] * 3
    eng.add_request("r", list(range(5, 19)), p[0], forks=[("r/1", p[1]), ("r/2", p[2])])
    got, reasons = _drain(eng)
    assert set(reasons.values()) == {"length"} and got["r"] == got["r/1"] == got["r/2"]
    eng.pool.assert_no_leaks()


@pytest.mark.parametrize("prompt_len", [9, 12])
def test_decode_side_forks_share_the_transferred_prompt_pages(tiny, prompt_len):
    """PD: prefill runs once; the decode engine forks n - 1 more sequences off the transferred KV (shared pages,
    a copy of the last prompt page, one recomputed position each) — tokens equal to independent requests."""
    prompt = list(range(5, 5 + prompt_len))
    ps = [SamplingParams(max_tokens=5, temperature=0.9, seed=s, ignore_eos=True) for s in (21, 22, 23)]
    pre, dec = _engine(tiny), _engine(tiny)
    pre.add_request("r", prompt, ps[0], prefill_only=True)
    first = None
    while pre.has_work():
        for o in pre.step():
            first = o.new_token_ids[0]
    src, n = pre.pages("r")
    dst = dec.reserve("r", n)
    for layer in range(tiny.model.config.num_layers):
        for a, b in zip(src, dst):
            dec.kv.k[layer][b] = pre.kv.k[layer][a]
            dec.kv.v[layer][b] = pre.kv.v[layer][a]
    pre.release("r")
    dec.add_prefilled("r", prompt, first, ps[0], forks=[("r/1", ps[1]), ("r/2", ps[2])])
    k = (prompt_len - 1) // 4
    shared = dec._seqs["r"].blocks[:k]
    assert all(dec.pool.refs(b) == 3 for b in shared) and dec._seqs["r/1"].blocks[:k] == shared
    dec.check_accounting()
    got, reasons = _drain(dec)
    assert set(reasons.values()) == {"length"} and all(len(v) == 5 for v in got.values())
    dec.pool.assert_no_leaks()
    ind = _engine(tiny)
    for rid, p in zip(("a", "b", "c"), ps):
        ind.add_request(rid, prompt, p)
    want, _ = _drain(ind, check=False)
    assert [got["r"], got["r/1"], got["r/2"]] == [want["a"], want["b"], want["c"]]
