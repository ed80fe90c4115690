"""Pure pieces: tool-call parsers (Hermes, Llama-3 JSON), the streaming parser's deltas, parser auto-detection,
rendering tools/tool messages for a template without tool support, forced-tool grammars (both formats, run
through the engine), and --generation-config resolution."""

from __future__ import annotations

import json

import pytest

from pdruntime.engine.defaults import resolve
from pdruntime.server.openai.tools import StreamParser, detect_parser, parser_for, render_messages

HERMES = parser_for("hermes")
LLAMA = parser_for("llama3_json")


@pytest.mark.parametrize("text, content, calls", [
    ('<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>', "", [("f", {"x": 1})]),
    ('Sure.\n<tool_call>{"name": "f", "arguments": {}}</tool_call>\n<tool_call>{"name": "g", "arguments": {"y": "z"}}'
     '</tool_call>', "Sure.", [("f", {}), ("g", {"y": "z"})]),
    ("no calls here", "no calls here", []),
    ('<tool_call>{"name": 3}</tool_call>', '<tool_call>{"name": 3}</tool_call>', []),  # malformed stays text
])
def test_hermes_parser(text, content, calls):
    got_content, got = HERMES.parse(text)
    assert got_content == content
    assert [(c["name"], json.loads(c["arguments"])) for c in got] == calls


@pytest.mark.parametrize("text, calls", [
    ('{"name": "f", "parameters": {"a": 2}}', [("f", {"a": 2})]),
    ('<|python_tag|>{"name": "f", "parameters": {}}; {"name": "g", "parameters": {"b": [1]}}', [("f", {}), ("g", {"b": [1]})]),
    ("The answer is 4.", []),
])
def test_llama3_json_parser(text, calls):
    _, got = LLAMA.parse(text)
    assert [(c["name"], json.loads(c["arguments"])) for c in got] == calls


def test_stream_parser_emits_content_then_a_call_with_argument_fragments():
    sp = StreamParser(HERMES)
    text = 'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris, France", "unit": "c"}}\n</tool_call>'
    deltas = []
    for i in range(0, len(text), 5):  # 5-character deltas: tags split across them
        deltas += sp.feed(text[i: i + 5])
    deltas += sp.feed("", final=True)
    content = "".join(d.get("content", "") for d in deltas)
    assert content == "Let me check."
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert calls[0]["function"]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    args = "".join(c["function"].get("arguments", "") for c in calls)
    assert json.loads(args) == {"city": "Paris, France", "unit": "c"} and len(calls) > 2  # fragments


def test_stream_parser_holds_back_a_possible_tag_start_only():
    sp = StreamParser(HERMES)
    assert sp.feed("a <tool") == [{"content": "a "}]
    assert sp.feed("s are fun", final=True) == [{"content": "<tools are fun"}]


def test_parser_auto_detection():
    assert detect_parser("{% if tools %}<tool_call>{% endif %}") == "hermes"
    assert detect_parser("<|start_header_id|>ipython<|end_header_id|> <|python_tag|>") == "llama3_json"
    assert detect_parser(None) == "hermes"
    with pytest.raises(ValueError):
        parser_for("mistral")


def test_render_for_a_template_without_tools():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "go"},
            {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function",
                                                                 "function": {"name": "f", "arguments": '{"a": 1}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "42"}]
    out = render_messages(msgs, tools, "hermes", template_has_tools=False)
    assert out[0]["role"] == "system" and out[0]["content"].startswith("Be brief.") and '"name": "f"' in out[0]["content"]
    assert out[2] == {"role": "assistant", "content": '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'}
    assert out[3] == {"role": "user", "content": "<tool_response>\n42\n</tool_response>"}
    assert render_messages(msgs, tools, "hermes", template_has_tools=True) is msgs


@pytest.mark.parametrize("parser", ["hermes", "llama3_json"])
def test_forced_tool_grammar_yields_a_parseable_call_in_each_format(parser, tmp_path):
    from pdruntime.engine import Engine, EngineConfig, SamplingParams
    from pdruntime.model import load_model
    from pdruntime.model.testing import write_tiny_checkpoint
    from pdruntime.server.openai.schemas import Tool
    from pdruntime.server.openai.structured import tool_grammar

    tools = [Tool.model_validate({"type": "function", "function": {
        "name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0,
                                                                             "maximum": 99}},
                                      "required": ["a"], "additionalProperties": False}}})]
    g = tool_grammar(tools, "add", parallel=False, parser=parser)
    loaded = load_model(write_tiny_checkpoint(str(tmp_path)))
    out = Engine(loaded, EngineConfig(num_blocks=64)).generate(
        [loaded.tokenizer.encode("hi")], SamplingParams(max_tokens=120, temperature=1.0, seed=7, grammar=g))[0]
    text = loaded.tokenizer.decode([t for t in out if t not in loaded.tokenizer.eos_token_ids])
    _, calls = parser_for(parser).parse(text)
    assert len(calls) == 1 and calls[0]["name"] == "add" and 0 <= json.loads(calls[0]["arguments"])["a"] <= 99, text


def test_generation_config_resolution(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.95, "top_k": 20}))
    d = resolve("auto", str(tmp_path), "whatever")
    assert (d.temperature, d.top_p, d.top_k) == (0.6, 0.95, 20) and "generation_config.json" in d.source
    assert resolve(str(tmp_path), None, None).temperature == 0.6
    assert resolve("none", str(tmp_path), "smollm2").temperature == 1.0
    s = resolve("auto", "/x/SmolLM2-135M-Instruct-Q4_1.gguf", None)
    assert (s.temperature, s.top_p, s.repetition_penalty) == (0.2, 0.9, 1.1)
    assert resolve("auto", "/x/other.gguf", "other").temperature == 1.0
    (tmp_path / "g2.json").write_text(json.dumps({"do_sample": False}))
    assert resolve(str(tmp_path / "g2.json"), None, None).temperature == 0.0
    with pytest.raises(ValueError, match="generation-config"):
        resolve(str(tmp_path / "missing.json"), None, None)
