"""The official ``openai`` Python client against pdrt's router in PD mode (router + prefill + decode on loopback):
chat, completions, streaming, n, logprobs (checked against a log-softmax of the model's logits), json_schema
output, a named tool_choice, a three-round tool loop with ``role: tool`` messages, and clear 400s."""

from __future__ import annotations

import json

import pytest
import torch

pytestmark = pytest.mark.timeout(600)
SHARED_STACK = True  # its traffic leaves the stack as it found it: the process's shared stack (tiny_stack.py)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999},
                                                    "b": {"type": "integer", "minimum": 0, "maximum": 999}},
                   "required": ["a", "b"], "additionalProperties": False}}}


def _validate(obj, schema):
    import jsonschema

    jsonschema.validate(obj, schema)


def test_chat_completions_and_streaming(client, model_id):
    r = client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                                       temperature=0)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens >= 1
    c = client.completions.create(model=model_id, prompt="The sky is", max_tokens=6, temperature=0)
    assert c.object == "text_completion" and c.choices[0].finish_reason == "length" and c.usage.completion_tokens == 6
    stream = client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                                            temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == r.choices[0].message.content  # greedy: the same text streamed and not
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    cont = list(client.completions.create(model=model_id, prompt="The sky is", max_tokens=4, temperature=0, stream=True,
                                          stream_options={"include_usage": True, "continuous_usage_stats": True}))
    assert all(ch.usage is not None for ch in cont)  # SGLang's continuous_usage_stats: usage on every chunk
    assert "".join(ch.choices[0].text for ch in cont if ch.choices) == c.choices[0].text[: len("".join(
        ch.choices[0].text for ch in cont if ch.choices))]


def test_n_choices_are_distinct_sequences(client, model_id):
    r = client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "tell a story"}],
                                       max_tokens=12, temperature=1.0, n=3, seed=5)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert len({c.message.content for c in r.choices}) >= 2  # seeds 5, 6, 7: different samples
    assert r.usage.completion_tokens == 36
    again = client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "tell a story"}],
                                           max_tokens=12, temperature=1.0, n=3, seed=5)
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]  # reproducible
    chunks = list(client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "tell a story"}],
                                                 max_tokens=12, temperature=1.0, n=3, seed=5, stream=True,
                                                 stream_options={"include_usage": True}))
    texts = {i: "".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
             for i in range(3)}
    assert [texts[i] for i in range(3)] == [c.message.content for c in r.choices]  # streamed n = 3, same choices
    assert sum(1 for c in chunks if c.choices and c.choices[0].finish_reason) == 3
    assert chunks[-1].usage.completion_tokens == 36 and not chunks[-1].choices


def test_logprobs_match_a_log_softmax_of_the_models_logits(client, model_id, reference):
    tok, logits_of = reference
    msgs = [{"role": "user", "content": "count to five"}]
    r = client.chat.completions.create(model=model_id, messages=msgs, max_tokens=6, temperature=0.8, seed=3,
                                       logprobs=True, top_logprobs=5)
    entries = r.choices[0].logprobs.content
    assert len(entries) == r.usage.completion_tokens
    prompt = tok.encode(tok.apply_chat_template(msgs, add_generation_prompt=True))
    ids: list[int] = []
    for e in entries:  # position by position: the reference distribution after the prompt + the tokens so far
        ref = torch.log_softmax(logits_of(prompt + ids)[-1], dim=-1)
        assert len(e.top_logprobs) == 5
        top = torch.topk(ref, 5)
        assert [t.logprob for t in e.top_logprobs] == pytest.approx(top.values.tolist(), abs=2e-3)
        assert [t.token for t in e.top_logprobs] == [tok.decode([j]) for j in top.indices.tolist()]
        # the chosen token: the id whose text is e.token and whose reference logprob is e.logprob
        cands = [j for j in range(ref.shape[0]) if tok.decode([j]) == e.token and abs(float(ref[j]) - e.logprob) < 2e-3]
        assert cands, (e.token, e.logprob)
        ids.append(cands[0])
    # completions: the legacy shape, streamed and not
    c = client.completions.create(model=model_id, prompt="one two three", max_tokens=4, temperature=0, logprobs=3)
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == 4 and len(lp.token_logprobs) == 4 and all(1 <= len(t) <= 3 for t in lp.top_logprobs)  # dict: equal strings merge
    ref2 = torch.log_softmax(logits_of(tok.encode("one two three"))[-1], -1)
    assert lp.token_logprobs[0] == pytest.approx(float(ref2.max()), abs=2e-3)  # greedy, from prefill: the best
    streamed = list(client.completions.create(model=model_id, prompt="one two three", max_tokens=4, temperature=0,
                                              logprobs=3, stream=True))
    s_lps = [x for ch in streamed if ch.choices and ch.choices[0].logprobs for x in ch.choices[0].logprobs.token_logprobs]
    assert s_lps == pytest.approx(lp.token_logprobs, abs=1e-5)


def test_json_schema_output_validates_20_of_20_with_sampling(client, model_id):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                               "population": {"type": "integer", "minimum": 0, "maximum": 99999},
                                               "capital": {"type": "boolean"}},
              "required": ["city", "population", "capital"], "additionalProperties": False}
    ok = 0
    for seed in range(20):
        r = client.chat.completions.create(
            model=model_id, messages=[{"role": "user", "content": "Describe Paris as JSON."}], max_tokens=240,
            temperature=1.0, seed=seed,
            response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema, "strict": True}})
        obj = json.loads(r.choices[0].message.content)
        _validate(obj, schema)
        ok += 1
    assert ok == 20
    # json_object: any object. The random tiny model may write one key for ever, so a "length" cut is allowed, but
    # the text is a JSON object's prefix from its first character, and a finished one parses
    r = client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "json please"}],
                                       max_tokens=60, temperature=0.7, seed=1, response_format={"type": "json_object"})
    text = r.choices[0].message.content
    assert text.startswith("{")
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


def test_named_tool_choice_yields_a_valid_tool_call(client, model_id):
    for stream in (False, True):
        kw = dict(model=model_id, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER, ADD],
                  tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=240,
                  temperature=0.9, seed=2)
        if not stream:
            r = client.chat.completions.create(**kw)
            ch = r.choices[0]
            assert ch.finish_reason == "tool_calls", ch
            calls = ch.message.tool_calls
        else:
            chunks = list(client.chat.completions.create(**kw, stream=True))
            assert chunks[-1].choices[0].finish_reason == "tool_calls"
            frags: dict[int, dict] = {}
            for c in chunks:
                for d in c.choices[0].delta.tool_calls or ():
                    f = frags.setdefault(d.index, {"name": "", "arguments": "", "id": None})
                    f["id"] = f["id"] or d.id
                    f["name"] += d.function.name or "" if d.function else ""
                    f["arguments"] += (d.function.arguments or "") if d.function else ""
            assert len(frags) == 1 and frags[0]["id"].startswith("call_")
            calls = [type("C", (), {"function": type("F", (), frags[0])()})()]
        assert len(calls) == 1 and calls[0].function.name == "get_weather"
        _validate(json.loads(calls[0].function.arguments), WEATHER["function"]["parameters"])


def test_a_three_round_tool_loop_with_tool_messages(client, model_id):
    messages = [{"role": "user", "content": "Add some numbers for me, three times."}]
    prompts = []
    for round_ in range(3):
        r = client.chat.completions.create(model=model_id, messages=messages, tools=[ADD, WEATHER],
                                           tool_choice="required", parallel_tool_calls=False, max_tokens=240,
                                           temperature=0.8, seed=round_)
        msg = r.choices[0].message
        prompts.append(r.usage.prompt_tokens)
        assert r.choices[0].finish_reason == "tool_calls" and len(msg.tool_calls) == 1
        call = msg.tool_calls[0]
        args = json.loads(call.function.arguments)
        schema = (ADD if call.function.name == "add" else WEATHER)["function"]["parameters"]
        _validate(args, schema)
        result = args["a"] + args["b"] if call.function.name == "add" else {"temp": 21}
        messages.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function", "function": {"name": call.function.name,
                                                             "arguments": call.function.arguments}}]})
        messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)})
    final = client.chat.completions.create(model=model_id, messages=messages, tools=[ADD], tool_choice="none",
                                           max_tokens=10, temperature=0)
    assert final.choices[0].message.tool_calls is None and final.choices[0].finish_reason in ("stop", "length")
    assert prompts[0] < prompts[1] < prompts[2]  # each round's call and tool result went into the prompt
    alone = client.chat.completions.create(model=model_id, messages=messages[:1], max_tokens=1, temperature=0)
    assert final.usage.prompt_tokens > alone.usage.prompt_tokens + 3 * 20


def test_unsupported_combinations_are_400s_naming_the_parameter(client, model_id):
    import openai

    msgs = [{"role": "user", "content": "x"}]
    cases = [
        (dict(n=9), "n"),
        (dict(best_of=2), "best_of"),
        (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
        (dict(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}), "response_format"),
        (dict(top_logprobs=3), "top_logprobs"),
        (dict(logit_bias={"999999": 5}), "logit_bias"),
    ]
    for extra, name in cases:
        body = {k: v for k, v in extra.items() if k != "best_of"}
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=model_id, messages=msgs, max_tokens=4,
                                           extra_body={"best_of": 2} if "best_of" in extra else None, **body)
        assert name in str(e.value), (name, str(e.value))
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model_id, prompt="x", max_tokens=2, echo=True, logprobs=2, stream=True)
    assert "echo" in str(e.value)


def test_echo_with_logprobs_gives_prompt_logprobs_from_prefill(client, model_id, reference):
    tok, logits_of = reference
    prompt = "one two three four"
    ids = tok.encode(prompt)
    c = client.completions.create(model=model_id, prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=2)
    ch = c.choices[0]
    lp = ch.logprobs
    assert ch.text.startswith(prompt)
    assert len(lp.tokens) == len(ids) + 3 and lp.token_logprobs[0] is None  # nothing predicts the first token
    ref = torch.log_softmax(logits_of(ids), -1)
    for j in range(1, len(ids)):
        assert lp.token_logprobs[j] == pytest.approx(float(ref[j - 1][ids[j]]), abs=2e-3)
    assert lp.token_logprobs[len(ids)] == pytest.approx(float(ref[-1].max()), abs=2e-3)  # greedy first output


def test_stop_token_ids_and_length(client, model_id, reference):
    tok, logits_of = reference
    ids = tok.encode("The sky is")
    first = int(torch.argmax(logits_of(ids)[-1]))
    r = client.completions.create(model=model_id, prompt="The sky is", max_tokens=8, temperature=0,
                                  extra_body={"stop_token_ids": [first]})
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == "" and r.usage.completion_tokens == 1
    second = client.completions.create(model=model_id, prompt="The sky is", max_tokens=8, temperature=0,
                                       logprobs=0)
    assert second.choices[0].finish_reason == "length" and second.usage.completion_tokens == 8
