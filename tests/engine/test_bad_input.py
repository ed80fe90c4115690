"""Bad requests are refused with an error that names the problem; the engine keeps serving the rest."""

from __future__ import annotations

import pytest

from pdruntime.engine import EngineConfig, InvalidRequest, SamplingParams
from pdruntime.model import ModelLoadError, load_model


@pytest.mark.parametrize("kwargs,match", [
    ({"max_tokens": 0}, "max_tokens=0 is invalid; accepted: an integer >= 1"),
    ({"max_tokens": -3}, "max_tokens=-3"),
    ({"temperature": -0.5}, "temperature=-0.5 is invalid; accepted: a finite number >= 0"),
    ({"temperature": float("nan")}, "temperature=nan"),
    ({"top_p": 0.0}, "top_p=0.0 is invalid"),
    ({"top_k": -1}, "top_k=-1 is invalid"),
    ({"stop": ("",)}, "stop="),
])
def test_sampling_params_reject_bad_values(kwargs, match):
    with pytest.raises(InvalidRequest, match=match):
        SamplingParams(**kwargs)


def test_engine_config_rejects_bad_values():
    with pytest.raises(ValueError, match="block_size=0"):
        EngineConfig(block_size=0)
    with pytest.raises(ValueError, match="num_blocks=-1"):
        EngineConfig(num_blocks=-1)


def test_bad_requests_do_not_disturb_running_ones(make_engine, tiny, tmp_path):
    tok = tiny.tokenizer
    good = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    prompts = [tok.encode("Paged attention"), tok.encode("The quick brown fox")]
    expected = make_engine(max_model_len=64).generate(prompts, good)

    engine = make_engine(max_model_len=64)
    engine.add_request("ok0", prompts[0], good)
    engine.add_request("ok1", prompts[1], good)
    got: dict[str, list[int]] = {"ok0": [], "ok1": []}
    for o in engine.step():
        got[o.request_id].extend(o.new_token_ids)

    bad_file = tmp_path / "corrupt.gguf"
    bad_file.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 64)
    cases = [
        (lambda: engine.add_request("e1", [], good), InvalidRequest, "prompt is empty"),
        (lambda: engine.add_request("e2", [5] * 60, SamplingParams(max_tokens=10)), InvalidRequest,
         r"prompt \(60 tokens\) \+ max_tokens \(10\) = 70 exceeds the context limit of 64"),
        (lambda: engine.add_request("e3", [5] * 80, SamplingParams(max_tokens=1)), InvalidRequest,
         "exceeds the context limit"),
        (lambda: engine.add_request("e4", [5, 99999], good), InvalidRequest, "outside the vocabulary"),
        (lambda: engine.add_request("ok0", [5], good), InvalidRequest, "already live"),
        (lambda: engine.add_request("e5", [5], SamplingParams(max_tokens=0)), InvalidRequest, "max_tokens=0"),
        (lambda: engine.add_request("e6", [5], SamplingParams(temperature=-1.0)), InvalidRequest, "temperature=-1.0"),
        (lambda: load_model(str(tmp_path / "missing.gguf")), ModelLoadError, "missing.gguf does not exist"),
        (lambda: load_model(str(bad_file)), ModelLoadError, "corrupt.gguf: not a readable GGUF file"),
    ]
    for call, exc, match in cases:
        with pytest.raises(exc, match=match):
            call()
        for o in engine.step():  # keeps serving between refusals
            got[o.request_id].extend(o.new_token_ids)
    while engine.has_work():
        for o in engine.step():
            got[o.request_id].extend(o.new_token_ids)
    assert [got["ok0"], got["ok1"]] == expected
    engine.pool.assert_no_leaks()
    assert engine.stats()["num_waiting"] == 0


def test_context_limit_defaults_to_the_models(make_engine, tiny):
    engine = make_engine(num_blocks=1024)
    limit = tiny.model.config.max_position_embeddings
    assert engine.max_model_len == limit
    with pytest.raises(InvalidRequest, match=f"context limit of {limit}"):
        engine.add_request("x", [1] * limit, SamplingParams(max_tokens=1))


def test_request_larger_than_the_kv_pool_is_refused(make_engine):
    engine = make_engine(num_blocks=4, block_size=4)
    with pytest.raises(InvalidRequest, match="KV cache capacity of 16 tokens"):
        engine.add_request("big", [1] * 10, SamplingParams(max_tokens=10))
