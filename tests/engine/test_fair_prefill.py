"""Fair chunked prefill (issue 20, build item 3): a long prompt cannot hold the engine for more than one
chunk while another prompt waits; a short request's first token comes within about one chunk-time, set by
the chunk size and not by the long prompt's length; decode steps run in every step; tokens are unchanged."""

from __future__ import annotations

import pytest

from pdruntime.engine import SamplingParams
from pdruntime.engine.scheduler import fair_chunks


@pytest.mark.parametrize("remaining, budget, want", [
    ([8000, 16], 512, [496, 16]),  # the short prompt is done in one step; the long takes what is left
    ([16, 8000], 512, [16, 496]),  # admission order does not matter for who fits
    ([8000, 8000], 512, [256, 256]),  # two long ones share equally
    ([600, 10, 5], 512, [497, 10, 5]),
    ([7, 7, 7], 10, [4, 3, 3]),  # an uneven split: the earliest admitted get the remainder
    ([3], 512, [3]),
    ([0, 9], 4, [0, 4]),
    ([], 512, []),
])
def test_fair_chunks_is_a_max_min_fair_split_of_the_budget(remaining, budget, want):
    got = fair_chunks(remaining, budget)
    assert got == want and sum(got) == min(budget, sum(remaining))


def test_no_starvation_a_long_prompt_advances_every_step_while_short_ones_keep_arriving():
    long_left = 10_000
    while long_left > 512:
        g = fair_chunks([long_left, 16, 16, 16], 512)
        assert g[0] >= 512 // 4 and g[1:] == [16, 16, 16]
        long_left -= g[0]


def _first_token_step(engine, rid: str, max_steps: int) -> int:
    for step in range(1, max_steps + 1):
        if any(o.request_id == rid and o.new_token_ids for o in engine.step()):
            return step
    raise AssertionError(f"{rid} got no token in {max_steps} steps")


def test_a_short_request_gets_its_first_token_within_two_chunks_while_a_long_prompt_prefills(make_engine, tiny):
    chunk = 64
    engine = make_engine(max_prefill_tokens=chunk, num_blocks=1024)
    long_prompt = [5 + i % 300 for i in range(1900)]  # ~30 chunks of 64
    p = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    engine.add_request("long", long_prompt, p)
    engine.step()
    engine.step()  # the long prompt is 2 chunks in
    engine.add_request("short", tiny.tokenizer.encode("a sixteen token question about paged attention now"), p)
    assert _first_token_step(engine, "short", 30) <= 2
    while engine.has_work():
        engine.step()
    engine.pool.assert_no_leaks()


def test_running_sequences_decode_in_every_step_of_a_long_prefill(make_engine):
    engine = make_engine(max_prefill_tokens=64, num_blocks=1024)
    p = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    engine.add_request("run", [7, 8, 9, 10], p)
    engine.step()
    engine.add_request("long", [5 + i % 300 for i in range(1500)], SamplingParams(max_tokens=1, temperature=0))
    for _ in range(20):  # the long prompt needs ~24 chunks: every one of these steps also decodes "run"
        assert any(o.request_id == "run" and o.new_token_ids for o in engine.step())


def test_interleaving_leaves_every_requests_tokens_as_they_are_alone(make_engine, tiny):
    p = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompts = {"long": [5 + i % 300 for i in range(700)], "a": tiny.tokenizer.encode("hello there"),
               "b": tiny.tokenizer.encode("what is a KV cache and why is it paged")}
    alone = {rid: make_engine(max_prefill_tokens=64).generate([ids], p)[0] for rid, ids in prompts.items()}
    engine = make_engine(max_prefill_tokens=64)
    got: dict[str, list[int]] = {}
    engine.add_request("long", prompts["long"], p)
    engine.step()
    engine.add_request("a", prompts["a"], p)
    engine.add_request("b", prompts["b"], p)
    while engine.has_work():
        for o in engine.step():
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert got == alone
