"""Every body pdstack's router sends a real engine is one that engine's own request model takes, field for field:
SGLang's ``ChatCompletionRequest`` / ``CompletionRequest`` (sglang 0.5.23, ``sglang.srt.entrypoints.openai.protocol``,
installed --no-deps by ``make setup``) for ``--worker-protocol sglang``, and vLLM's (vllm 0.33,
``vllm.entrypoints.openai.{chat_completion,completion}.protocol``, from ``make vllm-parser``, imported as
tests/support/vllm_parser.py imports it for every test) for ``vllm``.

Both engines' models take fields they do not define without an error (SGLang drops them, vLLM logs and ignores
them), so validating alone would pass a misspelt field: every field of every body must also be one the model
defines, i.e. the engine reads every field the router sends (``continuous_usage_stats`` included, which
sglang-router never sends)."""

from __future__ import annotations

import os

import pytest

from pdruntime.server.router.legs import Outbound
from pdruntime.server.router.protocol import SGLangProtocol, VLLMProtocol
from pdruntime.server.router.topology import Pair
from vllm_parser import import_vllm

PAIR = Pair(0, True, "http://10.0.0.11:8000", "10.0.0.11", 8998, "http://10.0.0.12:8000")
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 9, "temperature": 0.7,
        "top_p": 0.9, "stop": ["\n\n"], "seed": 7, "stream_options": {"include_usage": True}, "user": "agent-1"}
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "weather of a city",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                        "required": ["city"]}}}
CASES = {
    "chat": (True, CHAT),
    "chat stream": (True, {**CHAT, "stream": True}),
    "chat n=3": (True, {**CHAT, "n": 3, "temperature": 1.0}),
    "chat tools": (True, {**CHAT, "tools": [TOOL], "tool_choice": "auto"}),
    "chat json_schema": (True, {**CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "city", "schema": {"type": "object", "properties": {"city": {"type": "string"}}}}}}),
    "completion": (False, {"model": "m", "prompt": "Once upon", "max_tokens": 5, "temperature": 0, "logprobs": 2}),
    "completion stream": (False, {"model": "m", "prompt": "Once upon", "max_tokens": 5, "stream": True}),
}


def _out(chat: bool, body: dict) -> Outbound:
    return Outbound("rid-1", {"sampling_params": {"max_new_tokens": body.get("max_tokens", 16)}}, {}, 0.0,
                    n=body.get("n", 1), chat=chat, openai=body)


def _engine_models(engine: str):
    env = dict(os.environ)  # importing sglang points cache variables at its own dirs: keep later tests' env clean
    try:
        if engine == "sglang":
            protocol = pytest.importorskip("sglang.srt.entrypoints.openai.protocol",
                                           reason="sglang (installed --no-deps by `make setup`)")
            return protocol.ChatCompletionRequest, protocol.CompletionRequest
        chat, completion = import_vllm("vllm.entrypoints.openai.chat_completion.protocol",
                                       "vllm.entrypoints.openai.completion.protocol")
        return chat.ChatCompletionRequest, completion.CompletionRequest
    finally:
        os.environ.clear()
        os.environ.update(env)


def unknown_fields(model_cls, body: dict) -> set[str]:
    """Top-level fields of ``body`` that ``model_cls`` does not define (by name or alias)."""
    known = set(model_cls.model_fields) | {f.alias for f in model_cls.model_fields.values() if f.alias}
    return set(body) - known


def _legs(engine: str, chat: bool, body: dict) -> list[tuple[str, dict]]:
    out = _out(chat, body)
    if engine == "sglang":
        p = SGLangProtocol()
        room = p.room(out)
        return [("prefill", p.prefill(out, PAIR, room).body), ("decode", p.decode(out, PAIR, room, None).body)]
    p = VLLMProtocol()
    pre = p.prefill(out, PAIR, None).body
    answer = {"kv_transfer_params": {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [1, 2],
                                     "remote_engine_id": "e1", "remote_request_id": "rid-1", "remote_host": "10.0.0.11",
                                     "remote_port": 5600, "tp_size": 1}}
    return [("prefill", pre), ("decode", p.decode(out, PAIR, None, answer).body)]


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_every_leg_body_is_read_whole_by_the_engines_own_request_model(engine, case):
    chat_model, completion_model = _engine_models(engine)
    chat, body = CASES[case]
    for leg, sent in _legs(engine, chat, body):
        cls = chat_model if chat else completion_model
        model = cls.model_validate(sent)
        assert not unknown_fields(cls, sent), f"{engine} {case} {leg}: fields {engine} does not define: " \
                                              f"{sorted(unknown_fields(cls, sent))}"
        assert not getattr(model, "model_extra", None)
        if leg == "decode":
            assert model.stream and model.stream_options.continuous_usage_stats is True


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_a_misspelt_field_would_be_caught(engine):
    """The check above is not vacuous: the engine's model takes a misspelt field without an error, and the check
    names it."""
    chat_model, _ = _engine_models(engine)
    chat_model.model_validate({**CHAT, "stream": True, "bootstrap_rooom": 1})
    assert unknown_fields(chat_model, {**CHAT, "bootstrap_rooom": 1}) == {"bootstrap_rooom"}
