"""Continuous batching, chunked prefill, KV-page accounting under churn, preemption."""

from __future__ import annotations

import random

from pdruntime.engine import SamplingParams


def _collect(outputs, texts, tokens, finished):
    for o in outputs:
        tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
        texts[o.request_id] = texts.get(o.request_id, "") + o.text_delta
        if o.finished:
            assert o.request_id not in finished, f"{o.request_id} finished twice"
            finished[o.request_id] = o.finish_reason


def test_request_arriving_mid_generation_gets_first_token_before_running_ones_finish(make_engine, tiny):
    engine = make_engine(max_prefill_tokens=8)
    tok = tiny.tokenizer
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    for i in range(3):
        engine.add_request(f"run{i}", tok.encode(f"Paged attention {i}"), params)
    produced: dict[str, int] = {}
    while min(produced.get(f"run{i}", 0) for i in range(3)) < 5:
        for o in engine.step():
            produced[o.request_id] = produced.get(o.request_id, 0) + len(o.new_token_ids)
    # a late request with a prompt long enough to need several prefill chunks (8 tokens each)
    late_prompt = tok.encode("Continuous batching lets new requests join a running decode batch. " * 2)
    assert len(late_prompt) > 16
    engine.add_request("late", late_prompt, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    finished = set()
    steps = 0
    while True:
        before = dict(produced)
        outs = engine.step()
        steps += 1
        for o in outs:
            produced[o.request_id] = produced.get(o.request_id, 0) + len(o.new_token_ids)
            if o.finished:
                finished.add(o.request_id)
        # the running batch keeps decoding while the late prompt is prefilled in chunks
        for i in range(3):
            assert produced[f"run{i}"] == before[f"run{i}"] + 1
        if produced.get("late"):
            break
    assert steps >= -(-len(late_prompt) // 8)  # it really was chunked
    assert not finished & {"run0", "run1", "run2"}
    assert all(produced[f"run{i}"] < 40 for i in range(3))
    while engine.has_work():
        engine.step()
    engine.pool.assert_no_leaks()


def test_running_batch_is_joined_not_restarted(make_engine, tiny):
    """Outputs of a request are identical whether it runs alone or joins others mid-flight (greedy)."""
    tok = tiny.tokenizer
    p = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    alone = make_engine().generate([tok.encode("The quick brown fox")], p)[0]
    engine = make_engine(max_prefill_tokens=4)
    engine.add_request("a", tok.encode("Prefill and decode run"), p)
    engine.add_request("b", tok.encode("The quick brown fox"), p)
    got: dict[str, list[int]] = {}
    step = 0
    while engine.has_work():
        if step == 3:
            engine.add_request("c", tok.encode("def main():"), p)
        for o in engine.step():
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
        step += 1
    assert got["b"] == alone


def test_kv_accounting_200_requests_with_aborts_and_stop_strings(make_engine, tiny):
    """200 requests of random lengths, random aborts and stop strings, a pool small enough to preempt."""
    engine = make_engine(num_blocks=48, block_size=4, max_num_seqs=8, max_prefill_tokens=16)
    rng = random.Random(7)
    vocab = tiny.model.config.vocab_size
    stops = ["e", "th", " a", "o", "re"]
    texts: dict[str, str] = {}
    tokens: dict[str, list[int]] = {}
    finished: dict[str, str] = {}
    stop_of: dict[str, tuple[str, ...]] = {}
    aborted: set[str] = set()
    submitted = 0
    while submitted < 200 or engine.has_work():
        for _ in range(rng.randint(0, 3)):
            if submitted < 200:
                rid = f"r{submitted}"
                stop = tuple(rng.sample(stops, rng.randint(1, 2))) if rng.random() < 0.4 else ()
                stop_of[rid] = stop
                params = SamplingParams(max_tokens=rng.randint(1, 30), temperature=rng.choice([0, 0.9]),
                                        top_k=rng.choice([0, 20]), seed=rng.choice([None, submitted]), stop=stop,
                                        ignore_eos=rng.random() < 0.5)
                engine.add_request(rid, [rng.randrange(vocab) for _ in range(rng.randint(1, 40))], params)
                submitted += 1
        live = [r for r in list(engine._seqs)]
        if live and rng.random() < 0.15:
            victim = rng.choice(live)
            assert engine.abort(victim)
            aborted.add(victim)
        _collect(engine.step(), texts, tokens, finished)
        engine.check_accounting()
    engine.check_accounting()
    assert engine.pool.num_free == engine.pool.num_total
    engine.pool.assert_no_leaks()
    assert set(finished) == {f"r{i}" for i in range(200)}
    assert {r for r, why in finished.items() if why == "abort"} == aborted
    assert len(aborted) >= 10
    assert engine.num_preemptions > 0, "the pool was meant to be small enough to force preemption"
    stopped = [r for r in finished if finished[r] == "stop" and stop_of[r]]
    assert stopped, "some requests should end on a stop string"
    for r, stop in stop_of.items():
        for s in stop:
            assert s not in texts.get(r, ""), (r, s, texts[r])
    assert engine.stats()["num_running"] == 0


def test_preempted_request_resumes_with_identical_greedy_tokens(make_engine, tiny):
    tok = tiny.tokenizer
    p = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    prompts = [tok.encode(t) for t in ("Paged attention stores", "The quick brown", "0123", "def main")]
    roomy = make_engine(num_blocks=256, block_size=4).generate(prompts, p)
    tight_engine = make_engine(num_blocks=20, block_size=4)
    tight = tight_engine.generate(prompts, p)
    assert tight_engine.num_preemptions > 0
    assert tight == roomy
    tight_engine.pool.assert_no_leaks()
