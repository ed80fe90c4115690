"""Unit tests of the one request model (schemas.py): the router's and the workers' models share every bound,
and the byte-level edge rejects what is not a JSON object of Unicode text. Pure, no servers.

Against the unfixed code (main at 1c0b2fc) this module does not import (no shared bounds: ACCEPTED,
WorkerChatRequest and validate_generate did not exist); there the worker's sampling model had no upper
bound on temperature and none at all on seed and top_k, and parse_body let surrogates, NaN and deep
nesting through (the integration tests in test_edge_input.py show the resulting 500s).
"""

from __future__ import annotations

import json

import pytest

from pdruntime.server.openai.schemas import (ACCEPTED, MAX_JSON_DEPTH, ApiError, ChatCompletionRequest,
                                             CompletionRequest, WorkerChatRequest, WorkerSampling, parse_body, validate,
                                             validate_generate)

# OpenAI name -> SGLang sampling_params name
SHARED = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "seed": "seed",
          "max_tokens": "max_new_tokens"}


def _bounds(schema: dict) -> tuple:
    s = schema.get("anyOf", [schema])[0]
    return s.get("minimum"), s.get("maximum"), s.get("exclusiveMinimum"), s.get("exclusiveMaximum")


@pytest.mark.parametrize("model", [ChatCompletionRequest, CompletionRequest, WorkerChatRequest])
def test_router_and_worker_models_share_every_bound(model):
    openai = model.model_json_schema()["properties"]
    worker = WorkerSampling.model_json_schema()["properties"]
    for o, w in SHARED.items():
        assert _bounds(openai[o]) == _bounds(worker[w]) != (None, None, None, None), (o, openai[o], worker[w])


@pytest.mark.parametrize("raw,status,code", [
    (b'{"prompt": "\\ud800"}', 400, "invalid_unicode"),
    (b'{"prompt": ["ok", {"x": "\\udfff"}]}', 400, "invalid_unicode"),
    (b'{"\\ud800": 1}', 400, "invalid_unicode"),
    (b'{"temperature": NaN}', 400, "invalid_json"),
    (b'{"temperature": Infinity}', 400, "invalid_json"),
    (b'{"a": ' + b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1) + b"}", 400, "invalid_json"),
    (b"[" * 200_000, 400, "invalid_json"),
    (b'{"prompt": "\xff"}', 400, "invalid_json"),
])
def test_parse_body_rejects_what_is_not_a_json_object_of_unicode_text(raw, status, code):
    with pytest.raises(ApiError) as e:
        parse_body(raw)
    assert (e.value.status, e.value.code) == (status, code) and "accepted:" in e.value.message


@pytest.mark.parametrize("raw", [
    b'{"model": "m", "prompt": "Say hi", "max_tokens": 1, "temperature": 0}',
    b'{"seed": 123456789012345678901234567890, "x": -0, "y": 1.5e300, "z": [1, {"a": null}]}',  # ints past 64 bits
    b'{"a": ' + b"[" * (MAX_JSON_DEPTH - 1) + b"]" * (MAX_JSON_DEPTH - 1) + b"}",  # as deep as accepted
    b'{"prompt": "brackets in text: [[[[{{{{", "k": "\\u00e9 \\ud83d\\ude00", "dup": 1, "dup": 2}',
    b'{"top_p": 1e400}',  # the stdlib reads inf (the model then rejects it); orjson refuses it
])
def test_parse_body_gives_the_stdlib_parsers_value_whichever_parser_reads_it(raw):
    """parse_body reads most bodies with orjson, and falls back to the stdlib's parser (which also words the
    errors): the value is the same either way, a 30-digit integer stays an exact int."""
    got = parse_body(raw)
    assert got == json.loads(raw) and [type(v) for v in got.values()] == [type(v) for v in json.loads(raw).values()]


def test_proper_surrogate_pairs_and_astral_text_pass():
    assert parse_body(b'{"prompt": "\\ud83d\\ude00 ok"}')["prompt"] == "\U0001f600 ok"


@pytest.mark.parametrize("field,value", [("temperature", 1e-45), ("temperature", 2.5), ("top_p", 1e-300),
                                         ("seed", 2 ** 64), ("seed", -1), ("top_k", -2), ("max_tokens", 0),
                                         ("max_tokens", 2 ** 40), ("stop", ["a"] * 5), ("stop", "x" * 300)])
def test_every_out_of_range_value_names_its_parameter_and_range(field, value):
    with pytest.raises(ApiError) as e:
        validate(CompletionRequest, {"model": "m", "prompt": "p", field: value})
    assert e.value.status == 400 and e.value.param == field
    assert e.value.message.endswith("accepted: " + ACCEPTED[field]), e.value.message
    sp_field = SHARED.get(field, field)
    with pytest.raises(ApiError) as w:
        validate_generate({"text": "p", "sampling_params": {sp_field: value}})
    assert w.value.param == f"sampling_params.{sp_field}"


def test_no_op_values_of_unsupported_and_sglang_parameters_are_accepted():
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "logprobs": False, "echo": None,
            "skip_special_tokens": True, "no_stop_trim": False, "bootstrap_room": 7, "bootstrap_port": 9,
            "bootstrap_host": "h"}
    assert validate(WorkerChatRequest, body).bootstrap_room == 7
    for name, value in (("best_of", 2), ("skip_special_tokens", False)):
        with pytest.raises(ApiError) as e:
            validate(WorkerChatRequest, {**body, name: value})
        assert e.value.param == name and e.value.code == "unsupported_parameter"


def test_pd_fields_are_bounded_on_the_worker():
    base = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    for name, value in (("bootstrap_port", 70000), ("bootstrap_room", -1), ("bootstrap_room", 2 ** 64)):
        with pytest.raises(ApiError) as e:
            validate(WorkerChatRequest, {**base, name: value})
        assert e.value.param == name
    assert json.dumps(ACCEPTED)  # every accepted-text is plain data
