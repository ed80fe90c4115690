"""Opt-in int8 weights (dynamic-quantised Linear): close to fp32, served by the same engine."""

from __future__ import annotations

import pytest

from pdruntime.engine import Engine, EngineConfig, SamplingParams
from pdruntime.model import ModelLoadError, load_model

from .helpers import prefill_logits, rel_err




def test_int8_weights_are_close_to_fp32_and_serve(tiny, tiny_model):
    q = load_model(tiny_model, weights="int8")
    assert q.info.weights == "int8-dynamic"
    ids = tiny.tokenizer.encode("Paged attention stores the KV cache")
    err = rel_err(prefill_logits(q, ids), prefill_logits(tiny, ids))
    assert 0 < err < 0.05, err
    engine = Engine(q, EngineConfig(num_blocks=64, block_size=4))
    outs = engine.generate([ids, ids[:3]], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    assert [len(o) for o in outs] == [10, 10]
    assert engine.describe()["weights"] == "int8-dynamic"
    engine.pool.assert_no_leaks()


def test_unknown_weight_format_is_refused(tiny_model):
    with pytest.raises(ModelLoadError, match="weights='int3' is not accepted; accepted: auto, fp32, int4, int8"):
        load_model(tiny_model, weights="int3")
