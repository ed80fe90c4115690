"""Issue 20's smaller API defects, each pinned with the official ``openai`` client through the PD stack's router:
a forced tool call cut off by ``max_tokens``, unsatisfiable schemas, ``echo`` with logprobs, and error codes that
name their cause."""

from __future__ import annotations

import json

import httpx
import pytest

pytestmark = pytest.mark.timeout(300)
SHARED_STACK = True  # its traffic leaves the stack as it found it: the process's shared stack (tiny_stack.py)

openai = pytest.importorskip("openai", reason="the official openai client is in the dev extra")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
FORCED = dict(messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER], temperature=0.9, seed=2,
              tool_choice={"type": "function", "function": {"name": "get_weather"}})


# ---- 1. a forced tool call cut off by max_tokens ------------------------------------------------------------

def _cut_point(client, model_id) -> tuple[int, str]:
    """(max_tokens that ends the forced call a few tokens into its arguments, the whole call's arguments):
    seeded sampling depends on the seed and the position only, so a shorter run is a prefix of the long one."""
    full = client.chat.completions.create(model=model_id, max_tokens=240, logprobs=True, **FORCED)
    assert full.choices[0].finish_reason == "tool_calls", full
    text = ""
    for i, entry in enumerate(full.choices[0].logprobs.content):
        text += entry.token
        if '"arguments": {"' in text:
            return i + 3, full.choices[0].message.tool_calls[0].function.arguments
    raise AssertionError(f"no arguments in the forced call: {text!r}")


def test_a_forced_tool_call_cut_by_max_tokens_ends_length_with_the_partial_call(client, model_id):
    cut, whole = _cut_point(client, model_id)
    r = client.chat.completions.create(model=model_id, max_tokens=cut, **FORCED)
    ch = r.choices[0]
    assert ch.finish_reason == "length", ch
    assert not ch.message.content or "<tool_call>" not in ch.message.content, ch.message
    assert ch.message.tool_calls and len(ch.message.tool_calls) == 1, ch.message
    call = ch.message.tool_calls[0]
    assert call.id.startswith("call_") and call.function.name == "get_weather"
    args = call.function.arguments
    assert args.startswith('{"') and whole.startswith(args) and args != whole, (args, whole)


def test_a_streamed_forced_tool_call_streams_its_deltas_as_generated_and_ends_length(stack, client, model_id):
    cut, whole = _cut_point(client, model_id)
    # slow decode steps: a reader that falls behind gets the tokens waiting for it in one event (decode_stream), and
    # a loaded host's reader fell behind for the whole of the arguments' ~16 tokens
    stack.hooks(stack.decode, step_delay_s=0.02)
    try:
        chunks = list(client.chat.completions.create(model=model_id, max_tokens=cut, stream=True, **FORCED,
                                                     stream_options={"include_usage": True,
                                                                     "continuous_usage_stats": True}))
    finally:
        stack.hooks(stack.decode, step_delay_s=0)
    with_choice = [c for c in chunks if c.choices]
    assert with_choice[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in with_choice[:-1])
    assert all(not c.choices[0].delta.content for c in with_choice), "the call's markup leaked into content"
    calls = [(c.usage.completion_tokens, d) for c in with_choice for d in c.choices[0].delta.tool_calls or ()]
    assert calls, "no tool-call deltas"
    (at_name, head), frags = calls[0], calls[1:]
    assert head.id.startswith("call_") and head.function.name == "get_weather" and head.index == 0
    assert all(d.index == 0 and not d.id and not d.function.name for _, d in frags)
    # as generated: the name comes before the last token, and the arguments arrive over several tokens
    last = with_choice[-1].usage.completion_tokens
    assert at_name < last and len({n for n, _ in frags}) >= 2, [(n, d.function.arguments) for n, d in calls]
    args = (head.function.arguments or "") + "".join(d.function.arguments or "" for _, d in frags)
    plain = client.chat.completions.create(model=model_id, max_tokens=cut, **FORCED)
    assert args == plain.choices[0].message.tool_calls[0].function.arguments and whole.startswith(args)


def test_a_complete_streamed_forced_call_still_ends_tool_calls(client, model_id):
    chunks = list(client.chat.completions.create(model=model_id, max_tokens=240, stream=True, **FORCED))
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    args = "".join(d.function.arguments or "" for c in chunks for d in c.choices[0].delta.tool_calls or ())
    plain = client.chat.completions.create(model=model_id, max_tokens=240, **FORCED)
    assert json.loads(args) == json.loads(plain.choices[0].message.tool_calls[0].function.arguments)


# ---- 2. unsatisfiable schemas: a 400 at admission ------------------------------------------------------------

UNSATISFIABLE = {
    "integer range": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 5, "maximum": 1}},
                      "required": ["x"]},
    "empty enum": {"enum": []},
    "not anything": {"type": "object", "properties": {"x": {"not": {}}}, "required": ["x"]},
    "required but forbidden": {"type": "object", "required": ["a"], "additionalProperties": False},
    "false property": {"type": "object", "properties": {"x": False}, "required": ["x"]},
    # no finite instance: the grammar can only end mid-value (the reported 200 "stop" with content '{"x": ')
    "refs without a base case": {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
                                 "type": "object", "properties": {"x": {"$ref": "#/$defs/a"}}, "required": ["x"]},
    "requires itself": {"type": "object", "properties": {"x": {"$ref": "#"}}, "required": ["x"]},
}


@pytest.mark.parametrize("case", sorted(UNSATISFIABLE))
def test_an_unsatisfiable_json_schema_is_a_400_naming_it(client, model_id, case):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=model_id, messages=[{"role": "user", "content": "json"}], max_tokens=20,
            response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": UNSATISFIABLE[case]}})
    err = info.value
    assert err.status_code == 400 and err.code == "unsatisfiable_schema", err.body
    assert err.body["type"] == "invalid_request_error" and err.body["param"] == "response_format", err.body
    assert "unsatisfiable" in err.body["message"] and "accepted" in err.body["message"], err.body


def test_forced_tool_parameters_that_are_unsatisfiable_are_a_400_naming_the_tool(client, model_id):
    bad = {"type": "function", "function": {"name": "f", "parameters": UNSATISFIABLE["integer range"]}}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "x"}], max_tokens=20,
                                       tools=[WEATHER, bad], tool_choice="required")
    assert info.value.code == "unsatisfiable_schema", info.value.body
    assert info.value.body["param"] == "tools[1].function.parameters", info.value.body


def test_a_grammar_dead_end_at_generation_is_an_error_not_a_stop(stack, tiny):
    """A grammar past admission (a raw ``sampling_params.grammar``) that dead-ends mid-value: the decode worker
    alone (monolithic /generate) answers an error naming it, never 200 "stop" with the JSON cut."""
    from pdruntime.server.openai.structured import _json_grammar

    grammar = _json_grammar(UNSATISFIABLE["refs without a base case"])
    r = httpx.post(stack.decode.url + "/generate", timeout=60,
                   json={"text": "json", "sampling_params": {"max_new_tokens": 30, "temperature": 0, "grammar": grammar}})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "unsatisfiable_schema", r.text
    assert "dead end" in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("case, prefill_status", [("self", 400), ("refs without a base case", 200)])
def test_a_pd_grammar_dead_end_fails_both_legs_with_its_code(stack, case, prefill_status):
    """Both legs of a PD request (as a router sends them), with a raw grammar that dead-ends: at the first token
    (prefill samples it: prefill's 400 reaches decode over the KV wire with its code) or later (decode's)."""
    import asyncio

    from pdruntime.server.openai.structured import _json_grammar

    schema = {"$ref": "#"} if case == "self" else UNSATISFIABLE[case]
    body = {"text": "json", "rid": f"dead-{prefill_status}", "bootstrap_host": "127.0.0.1",
            "bootstrap_port": stack.bootstrap_port, "bootstrap_room": 777000 + prefill_status,
            "sampling_params": {"max_new_tokens": 30, "temperature": 0, "grammar": _json_grammar(schema)}}

    async def both():
        async with httpx.AsyncClient(timeout=60) as c:
            return await asyncio.gather(c.post(stack.prefill.url + "/generate", json=body),
                                        c.post(stack.decode.url + "/generate", json=body))

    pr, dr = asyncio.run(both())
    assert pr.status_code == prefill_status, pr.text
    assert dr.status_code == 400 and dr.json()["error"]["code"] == "unsatisfiable_schema", dr.text
    if prefill_status == 400:
        assert pr.json()["error"]["code"] == "unsatisfiable_schema", pr.text


def test_the_engine_fails_a_dead_ending_grammar_with_its_code(make_engine):
    from pdruntime.engine import SamplingParams
    from pdruntime.server.openai.structured import _json_grammar

    eng = make_engine()
    for name, schema in (("refs", UNSATISFIABLE["refs without a base case"]), ("self", {"$ref": "#"})):
        eng.add_request(name, [5, 6, 7], SamplingParams(max_tokens=40, temperature=0, grammar=_json_grammar(schema)))
    done = {}
    for _ in range(100):
        for out in eng.step() + eng.take_pending():
            if out.finished:
                done[out.request_id] = out
        if len(done) == 2:
            break
    assert {k: o.finish_reason for k, o in done.items()} == {"refs": "error", "self": "error"}, done
    assert all(o.error_code == "unsatisfiable_schema" and "dead end" in o.error for o in done.values()), done


# ---- 3. echo with logprobs on /v1/completions -----------------------------------------------------------------

@pytest.mark.parametrize("logprobs", [0, 1, 3])
def test_echo_with_logprobs_gives_every_prompt_token_its_text_and_offset(client, model_id, reference, logprobs):
    tok, _ = reference
    prompt = "Hello world, paged attention"
    ascii_ids = tok.encode("abcde xyz")  # the completion stays ASCII: each token's text is its own slice
    r = client.completions.create(model=model_id, prompt=prompt, echo=True, logprobs=logprobs, max_tokens=5,
                                  temperature=0, logit_bias={str(t): 100 for t in ascii_ids})
    ch = r.choices[0]
    lp = ch.logprobs
    text, n_prompt = ch.text, len(tok.encode(prompt))
    assert text.startswith(prompt) and len(lp.tokens) == n_prompt + r.usage.completion_tokens, (text, lp.tokens)
    assert "".join(lp.tokens[:n_prompt]) == prompt and "".join(lp.tokens) == text, lp.tokens
    for i, t in enumerate(lp.tokens):
        assert text[lp.text_offset[i]: lp.text_offset[i] + len(t)] == t, (i, t, lp.text_offset)
    assert lp.text_offset[0] == 0 and lp.text_offset[n_prompt] == len(prompt), lp.text_offset
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing predicts the first token
    assert all(isinstance(v, float) and v <= 0 for v in lp.token_logprobs[1:]), lp.token_logprobs
    assert all(len(d) >= min(logprobs, 1) for d in lp.top_logprobs[1:]), lp.top_logprobs


def test_logprobs_without_echo_offsets_start_at_zero(client, model_id, reference):
    tok, _ = reference
    r = client.completions.create(model=model_id, prompt="Hello", logprobs=1, max_tokens=4, temperature=0,
                                  logit_bias={str(t): 100 for t in tok.encode("abcde xyz")})
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == r.choices[0].text and lp.text_offset[0] == 0
    for i, t in enumerate(lp.tokens):
        assert r.choices[0].text[lp.text_offset[i]: lp.text_offset[i] + len(t)] == t


# ---- 4. error codes name their cause --------------------------------------------------------------------------

def test_a_schema_the_grammar_engine_cannot_compile_is_invalid_json_schema(client, model_id):
    schema = {"type": "object", "properties": {"x": {"type": "string", "pattern": "(?!a)b"}}, "required": ["x"]}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=model_id, messages=[{"role": "user", "content": "json"}], max_tokens=20,
            response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": schema}})
    assert info.value.code == "invalid_json_schema", info.value.body
    assert info.value.body["param"] == "response_format" and "look-around" in info.value.body["message"]


def test_a_schema_past_a_grammar_limit_is_grammar_limit(client, model_id):
    schema = {"type": "object", "properties": {"x": {"type": "string", "pattern": "^a{300}$"}}}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=model_id, messages=[{"role": "user", "content": "json"}], max_tokens=20,
            response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": schema}})
    assert info.value.code == "grammar_limit" and info.value.body["param"] == "response_format", info.value.body
    assert "counted repetitions" in info.value.body["message"]


def test_a_raw_grammar_the_engine_rejects_is_invalid_grammar_not_transfer_failed(stack):
    """A raw grammar the engine cannot compile (monolithic /generate): the code names the grammar."""
    r = httpx.post(stack.decode.url + "/generate", timeout=60,
                   json={"text": "x", "sampling_params": {"max_new_tokens": 4, "grammar": "start: (("}})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_grammar", r.text


# ---- pure: the cut-call parser and the streamed deltas agree ------------------------------------------------

def test_a_cut_call_parses_and_streams_to_the_same_partial_call():
    from pdruntime.server.openai.tools import StreamParser, parser_for

    hermes = parser_for("hermes")
    whole = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa}ris", "unit": "c"}}\n</tool_call>'
    for cut in range(len("<tool_call>"), len(whole)):  # from the opened tag on (a cut tag prefix is content)
        text = whole[:cut]
        content, calls = hermes.parse_cut(text)
        assert content == "", (cut, content)
        sp = StreamParser(hermes)
        deltas = [d for k in range(0, cut, 3) for d in sp.feed(text[k: k + 3])] + sp.feed("", final=True, cut=True)
        assert not any("content" in d for d in deltas), (cut, deltas)
        streamed = "".join(t["function"].get("arguments", "") for d in deltas for t in d.get("tool_calls", ()))
        if '"get_weather"' not in text:
            assert calls == [] and deltas == [], (cut, calls, deltas)
            continue
        assert [c["name"] for c in calls] == ["get_weather"], (cut, calls)
        assert calls[0]["arguments"] == streamed and '{"city": "Pa}ris", "unit": "c"}'.startswith(streamed), cut
    llama = parser_for("llama3_json")
    assert llama.parse_cut('{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {"y"') == \
        ("", [{"name": "a", "arguments": '{"x": 1}'}, {"name": "b", "arguments": '{"y"'}])


def test_the_finite_instance_check_rejects_only_what_it_proves():
    from pdruntime.server.openai.structured import has_finite_instance

    linked = {"type": "object", "properties": {"v": {"type": "integer"},
                                               "next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
              "required": ["v", "next"]}
    tree = {"$defs": {"node": {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
                               "required": ["kids"]}}, "$ref": "#/$defs/node"}
    chain = {"$defs": {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(10)} | {"d10": {"type": "string"}},
             "type": "object", "properties": {"x": {"$ref": "#/$defs/d0"}}, "required": ["x"]}
    for ok in (linked, tree, chain, {}, {"type": "object"}, {"$ref": "https://example.com/remote"}):
        assert has_finite_instance(ok) is True, ok
    needs_two = {"type": "array", "minItems": 2, "prefixItems": [{"type": "string"}, {"$ref": "#"}]}
    for bad in (*(UNSATISFIABLE[k] for k in ("refs without a base case", "requires itself", "not anything")),
                needs_two, {"$ref": "#"}, {"allOf": [{"type": "string"}, {"enum": []}]}):
        assert has_finite_instance(bad) is False, bad


def test_a_request_error_crosses_the_kv_wire_with_its_status_and_code():
    from pdruntime.server.worker.decode import _request_failed

    assert _request_failed("request_failed:400:unsatisfiable_schema") == (400, "unsatisfiable_schema")
    assert _request_failed("request_failed:400") == (400, None)  # an older prefill: decode's own code
    assert _request_failed("request_failed:500:x") == (422, "x")  # never a 5xx: the request's fault
    assert _request_failed("request_failed:400:bad code!") == (400, None)
    assert _request_failed("protocol") == (None, None)
