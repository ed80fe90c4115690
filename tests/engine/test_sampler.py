"""Sampling (greedy, temperature, top-k, top-p, per-request seed), stop strings and detokenised deltas."""

from __future__ import annotations

import math

import torch

from pdruntime.engine import SamplingParams
from pdruntime.engine.sampler import sample_one


def _freqs(logits, params, n=4000, seed=0):
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(logits.shape[0])
    for _ in range(n):
        counts[sample_one(logits, params, g)] += 1
    return counts / n


def test_temperature_sampling_follows_softmax():
    logits = torch.log(torch.tensor([0.1, 0.2, 0.3, 0.4]))
    f = _freqs(logits, SamplingParams(temperature=1.0))
    assert torch.allclose(f, torch.tensor([0.1, 0.2, 0.3, 0.4]), atol=0.03), f
    hot = _freqs(logits, SamplingParams(temperature=0.5))  # p^2 renormalised
    want = torch.tensor([0.01, 0.04, 0.09, 0.16]) / 0.30
    assert torch.allclose(hot, want, atol=0.03), hot


def test_top_k_and_top_p_restrict_support():
    logits = torch.log(torch.tensor([0.05, 0.15, 0.3, 0.5]))
    f = _freqs(logits, SamplingParams(temperature=1.0, top_k=2), n=2000)
    assert f[0] == 0 and f[1] == 0 and math.isclose(float(f[3]), 0.5 / 0.8, abs_tol=0.04)
    f = _freqs(logits, SamplingParams(temperature=1.0, top_p=0.75), n=2000)  # {0.5, 0.3} reach 0.8 >= 0.75
    assert f[0] == 0 and f[1] == 0 and f[2] > 0.3
    f = _freqs(logits, SamplingParams(temperature=1.0, top_p=0.01), n=200)
    assert f[3] == 1.0


def test_seeded_requests_reproduce_regardless_of_batch(make_engine, tiny):
    tok = tiny.tokenizer
    p = SamplingParams(max_tokens=16, temperature=1.0, seed=1234, ignore_eos=True)
    prompt = tok.encode("The quick brown fox")
    alone = make_engine().generate([prompt], p)[0]
    mixed = make_engine().generate([tok.encode("noise"), prompt, tok.encode("more noise")],
                                   [SamplingParams(max_tokens=16, temperature=1.0), p,
                                    SamplingParams(max_tokens=5, temperature=0.7, seed=1)])[1]
    assert mixed == alone
    other = make_engine().generate([prompt], SamplingParams(max_tokens=16, temperature=1.0, seed=99, ignore_eos=True))[0]
    assert other != alone
    greedy = make_engine().generate([prompt], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))[0]
    assert make_engine().generate([prompt], SamplingParams(max_tokens=16, top_k=1, ignore_eos=True))[0] == greedy


def _stream(engine, rid):
    text, toks, reason = "", [], None
    while engine.has_work():
        for o in engine.step():
            if o.request_id == rid:
                text += o.text_delta
                toks += o.new_token_ids
                reason = o.finish_reason if o.finished else reason
    return text, toks, reason


def test_stop_string_across_tokens_cuts_the_text(make_engine, tiny):
    tok = tiny.tokenizer
    prompt = tok.encode("Paged attention")
    engine = make_engine()
    engine.add_request("full", prompt, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    full_text, full_toks, _ = _stream(engine, "full")
    assert full_text == tok.decode(full_toks)
    # pick a stop string that starts in the middle of the generated text and spans a token boundary
    mid = len(full_text) // 2
    stop = full_text[mid: mid + 3]
    assert len(stop) == 3
    cut = full_text.find(stop)
    engine.add_request("cut", prompt, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=(stop,)))
    text, toks, reason = _stream(engine, "cut")
    assert reason == "stop"
    assert text == full_text[:cut]
    assert toks == full_toks[: len(toks)] and len(toks) < len(full_toks)
    engine.pool.assert_no_leaks()


def test_max_tokens_is_exact_and_reports_length(make_engine, tiny):
    engine = make_engine()
    engine.add_request("m", tiny.tokenizer.encode("0"), SamplingParams(max_tokens=7, temperature=0, ignore_eos=True))
    _, toks, reason = _stream(engine, "m")
    assert len(toks) == 7 and reason == "length"


def test_incremental_detokenisation_keeps_multibyte_characters_whole(make_engine, tiny):
    from pdruntime.engine.sequence import Sequence

    engine = make_engine()
    tok = tiny.tokenizer
    ids = tok.encode("héllo 世界 🙂 naïve café — done")
    assert len(ids) > 20  # byte-level: the non-ASCII characters span several tokens
    seq = Sequence("x", [1], SamplingParams(max_tokens=100))
    for t in ids:
        seq.output_ids.append(t)
        engine._detokenize(seq, flush=False)
        assert "\ufffd" not in seq.text
    engine._detokenize(seq, flush=True)
    assert seq.text == tok.decode(ids) == "héllo 世界 🙂 naïve café — done"
