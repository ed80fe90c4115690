"""The batched sampler against reference formulas on fixed logits: penalties, logit bias, exact candidate sets
for top-k / top-p / min-p, seeded reproducibility, logprobs, and a mixed batch equal to each row alone."""

from __future__ import annotations

import pytest
import torch

from pdruntime.engine import SamplingParams
from pdruntime.engine.sampler import Row, apply_processors, sample_batch, unpack_bitmask

V = 12


def _logits(seed=0, rows=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, V, generator=g) * 3


def _support(logits, params, n=400):
    """The set of tokens a row can draw (n seeds)."""
    rows = [Row(params, seed=s) for s in range(n)]
    return set(sample_batch(logits.expand(n, -1).clone(), rows).tokens)


def test_repetition_frequency_presence_penalties_and_bias_match_reference_formulas():
    x = _logits(1)[0]
    prompt, out = [1, 2, 2], [3, 3, 3, 4, 1]
    p = SamplingParams(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.7,
                       logit_bias={5: 2.5, 6: -100.0})
    got = apply_processors(x[None].clone(), [Row(p, prompt_ids=prompt, output_ids=out)])[0]
    want = x.clone()
    for t in set(prompt + out):  # repetition (HF/vLLM): over prompt + output
        want[t] = want[t] / 1.3 if want[t] > 0 else want[t] * 1.3
    for t in set(out):  # OpenAI: frequency per occurrence, presence once, over the output only
        want[t] -= 0.4 * out.count(t) + 0.7
    want[5] += 2.5
    want[6] -= 100.0
    assert torch.allclose(got, want, atol=1e-6), (got, want)


def test_processors_touch_only_the_rows_that_ask():
    x = _logits(2, rows=3)
    rows = [Row(SamplingParams()), Row(SamplingParams(presence_penalty=1.0), output_ids=[0]),
            Row(SamplingParams(logit_bias={3: 1.0}))]
    got = apply_processors(x.clone(), rows)
    assert torch.equal(got[0], x[0])
    assert got[1][0] == x[1][0] - 1.0 and torch.equal(got[1][1:], x[1][1:])
    assert got[2][3] == x[2][3] + 1.0


def test_top_k_keeps_exactly_the_k_best():
    x = _logits(3)
    best = set(torch.topk(x[0], 4).indices.tolist())
    assert _support(x, SamplingParams(temperature=1.5, top_k=4)) == best


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    x = torch.log(torch.tensor([[0.02, 0.05, 0.08, 0.1, 0.15, 0.25, 0.35] + [0.0] * (V - 7)]) + 1e-12)
    # sorted: .35, .25, .15 (cum .75) -> top_p .7 keeps exactly {6, 5, 4}
    assert _support(x, SamplingParams(temperature=1.0, top_p=0.7)) == {6, 5, 4}
    assert _support(x, SamplingParams(temperature=1.0, top_p=0.6)) == {6, 5}
    # top-k then top-p over the renormalised top-k: k=2 -> {.35/.6, .25/.6}; p=.5 keeps only the first
    assert _support(x, SamplingParams(temperature=1.0, top_k=2, top_p=0.5)) == {6}


def test_top_p_falls_back_to_a_full_sort_when_the_probe_is_short():
    from pdruntime.engine import sampler

    x = torch.zeros(1, 600)  # uniform: 256 candidates hold 43% of the mass, top_p 0.9 needs 540
    rows = [Row(SamplingParams(temperature=1.0, top_p=0.9), seed=s) for s in range(3000)]
    got = set(sample_batch(x.expand(3000, -1).clone(), rows).tokens)
    assert len(got) > sampler.TOP_P_PROBE  # candidates beyond the probe were reachable


def test_min_p_keeps_tokens_at_least_min_p_times_the_best():
    probs = torch.tensor([[0.4, 0.2, 0.1, 0.05, 0.03] + [0.0] * (V - 5)])
    probs[0, 5:] = (1 - probs.sum()) / (V - 5)
    x = torch.log(probs)
    # min_p .2 -> threshold .08: {0, 1, 2}
    assert _support(x, SamplingParams(temperature=1.0, min_p=0.2)) == {0, 1, 2}
    assert _support(x, SamplingParams(temperature=1.0, min_p=0.45)) == {0, 1}


def test_temperature_sampling_follows_the_scaled_softmax():
    x = torch.log(torch.tensor([[0.1, 0.2, 0.3, 0.4]]))
    n = 6000
    toks = sample_batch(x.expand(n, -1).clone(), [Row(SamplingParams(temperature=0.5), seed=s) for s in range(n)]).tokens
    freq = torch.bincount(torch.tensor(toks), minlength=4).float() / n
    want = torch.tensor([0.01, 0.04, 0.09, 0.16]) / 0.30
    assert torch.allclose(freq, want, atol=0.03), freq


def test_seeded_rows_reproduce_and_depend_on_seed_and_position_only():
    x = _logits(4, rows=1)
    p = SamplingParams(temperature=1.0)
    a = [sample_batch(x, [Row(p, seed=7, output_ids=[0] * i)]).tokens[0] for i in range(30)]
    b = [sample_batch(x, [Row(p, seed=7, output_ids=[0] * i)]).tokens[0] for i in range(30)]
    c = [sample_batch(x, [Row(p, seed=8, output_ids=[0] * i)]).tokens[0] for i in range(30)]
    assert a == b and a != c


def test_logprobs_are_the_log_softmax_of_the_raw_logits():
    x = _logits(5, rows=2)
    rows = [Row(SamplingParams(temperature=0.7, logprobs=3, presence_penalty=1.0), seed=1, output_ids=[2]),
            Row(SamplingParams(temperature=0))]
    got = sample_batch(x.clone(), rows)
    ref = torch.log_softmax(x[0], -1)
    chosen, top = got.logprobs[0]
    assert abs(chosen - float(ref[got.tokens[0]])) < 1e-5
    assert [t for t, _ in top] == torch.topk(ref, 3).indices.tolist()
    assert all(abs(v - float(ref[t])) < 1e-5 for t, v in top)
    assert got.logprobs[1] is None


def _mask(allowed, vocab=V):
    words = torch.zeros(-(-vocab // 32), dtype=torch.int64)
    for t in allowed:
        words[t // 32] |= 1 << (t % 32)
    return words.to(torch.int32) if vocab <= 31 else ((words + (1 << 31)) % (1 << 32) - (1 << 31)).to(torch.int32)


def test_bitmask_unpacks_to_the_allowed_tokens():
    m = _mask({0, 3, 11})
    assert unpack_bitmask(m[None], V)[0].nonzero().flatten().tolist() == [0, 3, 11]
    big = _mask({0, 31, 32, 70}, vocab=80)
    assert unpack_bitmask(big[None], 80)[0].nonzero().flatten().tolist() == [0, 31, 32, 70]


def test_a_mixed_batch_gives_each_row_what_it_gets_alone():
    x = _logits(6, rows=5)
    rows = [Row(SamplingParams(temperature=0), seed=0),
            Row(SamplingParams(temperature=0.9, top_k=5), seed=11, output_ids=[1, 2]),
            Row(SamplingParams(temperature=0.8, top_p=0.8, frequency_penalty=0.5), seed=12, output_ids=[3, 3]),
            Row(SamplingParams(temperature=1.0, min_p=0.1), seed=13, token_mask=_mask({2, 4, 9})),
            Row(SamplingParams(temperature=0, logit_bias={7: 50.0}, logprobs=2), seed=0)]
    batch = sample_batch(x.clone(), rows)
    for i, r in enumerate(rows):
        alone = sample_batch(x[i:i + 1].clone(), [r])
        assert batch.tokens[i] == alone.tokens[0], i
        assert batch.logprobs[i] == alone.logprobs[0]
    assert batch.tokens[0] == int(torch.argmax(x[0]))
    assert batch.tokens[3] in {2, 4, 9}
    assert batch.tokens[4] == 7


@pytest.mark.parametrize("bad", [dict(min_p=1.5), dict(repetition_penalty=0), dict(frequency_penalty=3),
                                 dict(logprobs=21), dict(logit_bias={1: float("nan")})])
def test_out_of_range_sampling_params_are_rejected(bad):
    from pdruntime.engine import InvalidRequest

    with pytest.raises(InvalidRequest):
        SamplingParams(**bad)
