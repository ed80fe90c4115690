"""Engine level: a batch mixing greedy, sampled (penalties, top-k/p) and grammar-constrained requests gives each
request exactly what it gets alone; a constrained, seeded, logprobs request split across a prefill engine and a
decode engine (the PD hooks) equals its monolithic run, tokens and logprobs."""

from __future__ import annotations

import json

import torch

from pdruntime.engine import Engine, EngineConfig, SamplingParams
from pdruntime.server.openai.structured import _json_grammar

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "ok": {"type": "boolean"}}, "required": ["n", "ok"],
          "additionalProperties": False}


def _engine(tiny, block=4):
    return Engine(tiny, EngineConfig(num_blocks=256, block_size=block))


def _params():
    g = _json_grammar(SCHEMA)
    return [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
            SamplingParams(max_tokens=12, temperature=0.9, top_k=20, top_p=0.9, seed=3, ignore_eos=True,
                           frequency_penalty=0.5, presence_penalty=0.3, repetition_penalty=1.2),
            SamplingParams(max_tokens=40, temperature=1.0, seed=4, grammar=g, logprobs=2),
            SamplingParams(max_tokens=12, temperature=0.7, min_p=0.1, seed=5, logit_bias={7: 3.0}, ignore_eos=True)]


def test_a_mixed_batch_gives_each_request_what_it_gets_alone(tiny):
    tok = tiny.tokenizer
    prompts = [tok.encode(t) for t in ("hello there", "once upon a time", "give me json", "the end")]
    params = _params()
    # the constrained row greedy here: a batch's fp32 matmuls differ from a lone row's in the last bits, which can
    # move a sampled draw across a CDF boundary among near-equal digits (the sampler itself is batch-exact on
    # fixed logits: tests/agent/test_batched_sampler.py::test_a_mixed_batch_gives_each_row_what_it_gets_alone)
    params[2] = SamplingParams(max_tokens=40, temperature=0, grammar=params[2].grammar, logprobs=2)
    together = _engine(tiny).generate(prompts, params)
    alone = [_engine(tiny).generate([p], [q])[0] for p, q in zip(prompts, params)]
    assert together == alone
    obj = json.loads(tok.decode(together[2]).replace("<|im_end|>", "").strip() or "null")
    assert set(obj) == {"n", "ok"} and isinstance(obj["ok"], bool)


def _run(engine, rid):
    toks, lps, last = [], [], None
    while engine.has_work():
        for o in engine.step():
            if o.request_id == rid:
                toks += o.new_token_ids
                lps += o.logprobs or []
                last = o
    return toks, lps, last


def test_constrained_seeded_logprobs_request_is_the_same_split_across_prefill_and_decode(tiny):
    tok = tiny.tokenizer
    prompt = tok.encode("give me json please")
    p = _params()[2]
    mono = _engine(tiny)
    mono.add_request("r", prompt, p)
    want, want_lps, _ = _run(mono, "r")
    pre, dec = _engine(tiny), _engine(tiny, block=8)
    pre.add_request("r", prompt, p, prefill_only=True)
    first_toks, first_lps, out = _run(pre, "r")
    assert out.finish_reason == "prefill_done" and len(first_lps) == 1
    src, n = pre.pages("r")
    dst = dec.reserve("r", n)
    for layer in range(tiny.model.config.num_layers):
        for t in range(n):
            dec.kv.k[layer][dst[t // 8], t % 8] = pre.kv.k[layer][src[t // 4], t % 4]
            dec.kv.v[layer][dst[t // 8], t % 8] = pre.kv.v[layer][src[t // 4], t % 4]
    pre.release("r")
    dec.add_prefilled("r", prompt, first_toks[0], p, first_logprobs=first_lps[0])
    rest, rest_lps, last = _run(dec, "r")
    # decode reports prefill's first token again with its first step (the engine's PD convention), with a None
    # logprobs entry that the router fills in from prefill's answer
    assert rest == want and rest[0] == first_toks[0]  # the grammar continued on decode from prefill's first token
    assert rest_lps[0] is first_lps[0]
    got_lps = rest_lps
    assert [t for t, _ in got_lps[0][1]] == [t for t, _ in want_lps[0][1]]
    assert all(abs(a[0] - b[0]) < 1e-4 for a, b in zip(got_lps, want_lps)) and len(got_lps) == len(want_lps)
    assert last.finish_reason == "stop"
    dec.check_accounting()
    assert dec.pool.num_free == dec.pool.num_total
    assert torch.is_tensor(dec.kv.k[0])


def test_prompt_logprobs_are_the_log_softmax_at_every_prompt_position_across_chunks(tiny):
    from pdruntime.engine.sampler import Row  # noqa: F401 (the sampler's row type; here: engine outputs)

    prompt = list(range(5, 19))
    eng = Engine(tiny, EngineConfig(num_blocks=64, block_size=4, max_prefill_tokens=5))  # 3 prefill chunks
    eng.add_request("r", prompt, SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=2))
    first = None
    while eng.has_work():
        for o in eng.step():
            if o.prompt_logprobs is not None:
                first = o.prompt_logprobs
    assert first is not None and len(first) == len(prompt) - 1
    ref_eng = Engine(tiny, EngineConfig(num_blocks=64, block_size=4))
    blocks = torch.arange(-(-len(prompt) // 4))
    with torch.inference_mode():
        ref = torch.log_softmax(ref_eng.model.prefill(torch.tensor(prompt), 0, ref_eng.kv.k, ref_eng.kv.v, blocks,
                                                      all_logits=True), -1)
    for j, (lp, top) in enumerate(first):
        assert abs(lp - float(ref[j][prompt[j + 1]])) < 1e-4
        assert [t for t, _ in top] == torch.topk(ref[j], 2).indices.tolist()
