"""n > 1 through pdrt's router in PD mode, with the official ``openai`` client: one PD request per call (one
prefill and one KV transfer, read from the workers' own counters), n decode sequences forked off the transferred
prompt pages (shared, copy on write), each choice with its own index, text, finish_reason, logprobs and grammar;
seeded choices reproducible and equal to lone requests seeded seed + i; a client that leaves ends every choice."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from pd_harness import wait_for
from raw_http import read_request

pytestmark = pytest.mark.timeout(300)
SHARED_STACK = True  # its traffic leaves the stack as it found it: the process's shared stack (tiny_stack.py)

N = 3
PAGE = 16  # pd_harness.WORKER_FLAGS --block-size


def _prefill_and_transfers(stack) -> tuple[float, float, float, float]:
    """(prefill requests, prefill KV transfers, decode KV transfers, decode requests): each worker's own counters."""
    return (stack.metric(stack.prefill, "pdrt_requests_total", {"role": "prefill"}),
            stack.metric(stack.prefill, "pdrt_kv_transfers_total", {"role": "prefill"}),
            stack.metric(stack.decode, "pdrt_kv_transfers_total", {"role": "decode"}),
            stack.metric(stack.decode, "pdrt_requests_total", {"role": "decode"}))


def _one_pd_request_since(stack, before) -> None:
    """Exactly one more of each counter (waits for them to land; then checks none came on top)."""
    want = tuple(b + 1 for b in before)
    wait_for(lambda: all(g >= w for g, w in zip(_prefill_and_transfers(stack), want)), 10,
             "the workers' counters of one PD request")
    assert _prefill_and_transfers(stack) == want  # one prefill, one transfer: not n


def _chunks_by_choice(chunks, chat: bool) -> dict[int, dict]:
    """Streamed chunks -> {index: {"text", "finish_reason", "chunks"}}."""
    out: dict[int, dict] = {}
    for ch in chunks:
        for c in ch.choices:
            got = out.setdefault(c.index, {"text": "", "finish_reason": None, "chunks": 0})
            got["text"] += (c.delta.content or "") if chat else c.text
            got["finish_reason"] = got["finish_reason"] or c.finish_reason
            got["chunks"] += 1
    return out


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_n3_is_one_prefill_and_one_transfer_with_three_indexed_choices(stack, client, model_id, chat, stream):
    kw = dict(model=model_id, max_tokens=6, temperature=1.0, seed=11, n=N, extra_body={"ignore_eos": True})
    if stream:
        kw["stream_options"] = {"include_usage": True}
    create = (lambda **k: client.chat.completions.create(messages=[{"role": "user", "content": "name three colours"}],
                                                         **k)) if chat else \
        (lambda **k: client.completions.create(prompt="Three colours are", **k))
    one = create(**{**kw, "n": 1, "stream": False, "stream_options": None})  # the prompt's size, alone
    before = _prefill_and_transfers(stack)
    r = create(**kw, stream=stream)
    if stream:
        chunks = list(r)
        by = _chunks_by_choice(chunks, chat)
        assert sorted(by) == [0, 1, 2]
        assert all(c["text"] and c["finish_reason"] == "length" for c in by.values()), by
        assert sum(1 for ch in chunks for c in ch.choices if c.finish_reason) == N  # one finish per choice
        usage = chunks[-1].usage
        assert not chunks[-1].choices and usage is not None  # the usage chunk ends the stream, once
    else:
        assert [c.index for c in r.choices] == [0, 1, 2]
        texts = [c.message.content if chat else c.text for c in r.choices]
        assert all(texts) and [c.finish_reason for c in r.choices] == ["length"] * N
        usage = r.usage
    assert usage.prompt_tokens == one.usage.prompt_tokens  # the prompt once
    assert usage.completion_tokens == N * 6 and usage.total_tokens == usage.prompt_tokens + N * 6
    _one_pd_request_since(stack, before)


def test_the_decode_forks_share_the_transferred_prompt_pages(stack, client, model_id, reference):
    """During an n = 3 generation decode holds the prompt's pages once (held by 3 sequences each), plus one copied
    page per fork: with copies it would hold about 3x a lone request's pages."""
    tok, _ = reference
    prompt = "pages of a prompt are shared " * 20
    length = len(tok.encode(prompt))
    shared = (length - 1) // PAGE  # pages before the one with the last prompt position
    assert shared >= 6, length

    def used_pages_while_generating(n: int) -> tuple[float, list]:
        """Decode's used KV pages (its own gauge) and its /debug/requests rows, read mid-generation."""
        seen: dict = {}
        started: set[int] = set()
        stream = client.completions.create(model=model_id, prompt=prompt, max_tokens=8, temperature=1.0, seed=5, n=n,
                                           stream=True, extra_body={"ignore_eos": True})
        for ch in stream:
            started |= {c.index for c in ch.choices}
            if not seen and len(started) == n:  # every choice has its first token: all are in the batch
                seen["used"] = stack.metric(stack.decode, "pdrt_kv_pool_blocks", {"role": "decode", "state": "used"})
                seen["rows"] = stack.debug(stack.decode)["requests"]
        return seen["used"], seen["rows"]

    stack.hooks(stack.decode, step_delay_s=0.3)  # slow decode steps: the request stays live to be looked at
    try:
        alone, _ = used_pages_while_generating(1)
        forked, rows = used_pages_while_generating(N)
    finally:
        stack.hooks(stack.decode, step_delay_s=0)
    assert alone >= shared + 1
    assert forked <= alone + 2 * (N - 1), (alone, forked)  # each fork: its copied page (+ at most one decode page)
    assert forked < 2 * alone, (alone, forked)  # copying the prompt would take >= 3x
    row, = rows
    assert row["n"] == N and row["choices_open"] == N
    refs = row["prompt_page_refs"]  # the engine's reference counts of choice 0's pages, right after the fork
    assert refs[:shared] == [N] * shared, refs  # every full prompt page: one physical page, three holders
    assert set(refs[shared:]) == {1}, refs  # the page with the last prompt position: copied per choice
    stack.wait_idle()


def test_seeded_n3_is_reproducible_varied_and_equal_to_lone_requests_seeded_seed_plus_i(stack, client, model_id):
    msgs = [{"role": "user", "content": "tell a short story about a boat"}]
    kw = dict(model=model_id, messages=msgs, max_tokens=10, temperature=1.0)
    a = client.chat.completions.create(**kw, n=N, seed=7)
    b = client.chat.completions.create(**kw, n=N, seed=7)
    texts = [c.message.content for c in a.choices]
    assert texts == [c.message.content for c in b.choices]  # reproducible
    assert len(set(texts)) >= 2  # sampled: not all choices the same
    lone = [client.chat.completions.create(**kw, n=1, seed=7 + i).choices[0].message.content for i in range(N)]
    assert lone == texts  # choice i is the request seeded seed + i (the fan-out convention, kept)
    # single-server mode: the decode worker alone (no bootstrap fields: it prefills itself), same forks
    mono = httpx.post(stack.decode.url + "/generate", timeout=60, json={
        "messages": msgs, "sampling_params": {"max_new_tokens": 10, "temperature": 1.0, "seed": 7, "n": N}}).json()
    assert [m["index"] for m in mono] == [0, 1, 2] and [m["text"] for m in mono] == texts


def test_logprobs_of_each_choice_are_its_own_tokens(stack, client, model_id, reference):
    tok, logits_of = reference
    msgs = [{"role": "user", "content": "count to five"}]
    r = client.chat.completions.create(model=model_id, messages=msgs, max_tokens=5, temperature=1.0, seed=3, n=N,
                                       logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    prompt = tok.encode(tok.apply_chat_template(msgs, add_generation_prompt=True))
    for c in r.choices:
        entries = c.logprobs.content
        assert len(entries) == 5
        ids: list[int] = []
        for e in entries:  # position by position: the model's distribution after the prompt + this choice's tokens
            ref = torch.log_softmax(logits_of(prompt + ids)[-1], dim=-1)
            top = torch.topk(ref, 2)
            assert [t.logprob for t in e.top_logprobs] == pytest.approx(top.values.tolist(), abs=2e-3), (c.index, ids)
            # the chosen token: an id whose text is e.token and whose logprob is e.logprob (the closest, as byte
            # tokens share the text "\ufffd")
            cands = [j for j in range(ref.shape[0]) if tok.decode([j]) == e.token and abs(float(ref[j]) - e.logprob) < 2e-3]
            assert cands, (c.index, e.token, e.logprob)
            ids.append(min(cands, key=lambda j: abs(float(ref[j]) - e.logprob)))
    assert r.usage.completion_tokens == 5 * N
    # completions, streamed: each chunk's logprobs belong to its choice's tokens
    chunks = list(client.completions.create(model=model_id, prompt="one two three", max_tokens=4, temperature=1.0,
                                            seed=3, n=N, logprobs=2, stream=True, extra_body={"ignore_eos": True}))
    per: dict[int, list] = {}
    for ch in chunks:
        for c in ch.choices:
            if c.logprobs is not None:
                per.setdefault(c.index, []).extend(c.logprobs.token_logprobs)
    assert sorted(per) == [0, 1, 2] and all(len(v) == 4 and None not in v for v in per.values()), per


def test_json_schema_holds_for_every_choice(client, model_id):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                                 "maximum": 99}},
              "required": ["ok", "n"], "additionalProperties": False}
    r = client.chat.completions.create(
        model=model_id, messages=[{"role": "user", "content": "answer as JSON"}], max_tokens=60, temperature=1.0,
        seed=2, n=N, response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema,
                                                                             "strict": True}})
    assert [c.index for c in r.choices] == [0, 1, 2]
    for c in r.choices:  # each fork follows its own grammar matcher from its own first token
        obj = json.loads(c.message.content)
        assert set(obj) == {"ok", "n"} and isinstance(obj["ok"], bool) and 0 <= obj["n"] <= 99


def test_a_client_that_leaves_mid_stream_ends_every_choice(stack, model_id):
    aborted = stack.metric(stack.decode, "pdrt_aborted_requests_total", {"role": "decode"})
    stack.hooks(stack.decode, step_delay_s=0.2)  # 200 tokens: 40 s unless aborted
    try:
        started: set[int] = set()
        body = {"model": model_id, "prompt": "a long story", "max_tokens": 200, "n": N, "temperature": 1.0,
                "stream": True, "ignore_eos": True}
        with httpx.stream("POST", stack.router.url + "/v1/completions", json=body, timeout=60) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    started |= {c["index"] for c in json.loads(line[6:])["choices"]}
                    if len(started) == N:
                        rows = stack.debug(stack.decode)["requests"]
                        assert len(rows) == 1 and rows[0]["n"] == N and rows[0]["choices_open"] == N, rows
                        break  # every choice is generating: leave (closing the stream)
        p, d = stack.wait_idle(timeout=20)  # still slow: only an abort ends it this soon
    finally:
        stack.hooks(stack.decode, step_delay_s=0)
    assert d["live"] == 0 and d["pool"]["free"] == d["pool"]["total"], d  # every fork aborted, its pages freed
    assert p["live"] == 0
    assert stack.metric(stack.decode, "pdrt_aborted_requests_total", {"role": "decode"}) == aborted + 1


def test_a_failed_transfer_fails_the_n3_request_once(stack, client, model_id):
    import openai

    before = _prefill_and_transfers(stack)
    stack.hooks(stack.prefill, corrupt_kv_chunk=1)
    with pytest.raises(openai.APIStatusError) as e:
        client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                       n=N)
    assert e.value.status_code == 502 and "checksum" in str(e.value), str(e.value)
    p, d = stack.wait_idle()
    assert d["live"] == 0 and d["pool"]["free"] == d["pool"]["total"], d
    _one_pd_request_since(stack, before)  # one prefill, one (failed) transfer: no retry per choice


def test_unsupported_n_values_are_400s_naming_n(client, model_id):
    import openai

    msgs = [{"role": "user", "content": "x"}]
    for bad in (0, 9):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=model_id, messages=msgs, max_tokens=2, n=bad)
        assert "'n'" in str(e.value) or "n:" in str(e.value), str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model_id, prompt="x", max_tokens=2, n=2, extra_body={"best_of": 3})
    assert "best_of" in str(e.value)


def test_generate_with_n_through_the_sglang_router_is_one_transfer_and_n_choices(stack, tmp_path):
    """SGLang's /generate carries n in sampling_params; SGLang's router sends it to both workers with one room."""
    from test_sglang_router import SGLangRouter  # skips without sglang-router (tests/pd is on sys.path)

    sgl = SGLangRouter(stack, str(tmp_path))
    try:
        sgl.wait_workers()
        before = _prefill_and_transfers(stack)
        body = {"text": "three ways to say hi", "sampling_params": {"max_new_tokens": 4, "temperature": 1.0, "n": N,
                                                                    "ignore_eos": True}}
        r = httpx.post(sgl.url + "/generate", json=body, timeout=60)
        assert r.status_code == 200, r.text
        out = r.json()  # SGLang's shape for n > 1: a list, one entry per choice
        assert [o["index"] for o in out] == [0, 1, 2]
        assert all(o["meta_info"]["completion_tokens"] == 4 and o["meta_info"]["finish_reason"]["type"] == "length"
                   for o in out)
        _one_pd_request_since(stack, before)
        idle = stack.wait_idle()
        assert all(x["live"] == 0 and x["pool"]["free"] == x["pool"]["total"] for x in idle), idle
    finally:
        sgl.stop()


def test_engine_reserves_fork_pages_with_the_prompt_all_or_nothing(tiny_model):
    """Decode engine: reserve(fork_ids) holds each fork's copy page before the KV arrives; add_prefilled takes them
    (no allocation after the transfer); too few pages reserve nothing; aborting every id frees every page."""
    from pdruntime.engine import Engine, EngineConfig, OutOfBlocks, SamplingParams
    from pdruntime.model import load_model

    eng = Engine(load_model(tiny_model), EngineConfig(num_blocks=8, block_size=4))
    prompt = list(range(5, 19))  # 14 tokens: 4 pages (+ the decode slot, the same page), 3 shared with forks
    with pytest.raises(OutOfBlocks):
        eng.reserve("big", 30, ["big#1"])  # 8 + 1 pages of 8: none taken
    eng.pool.assert_no_leaks()
    pages = eng.reserve("r", len(prompt), ["r#1", "r#2"])
    assert len(pages) == 4 and eng.pool.num_used == 6
    eng.check_accounting()
    p = SamplingParams(max_tokens=2, temperature=0.7, seed=1, ignore_eos=True)
    eng.add_prefilled("r", prompt, 7, p, forks=[("r#1", p.for_choice(1)), ("r#2", p.for_choice(2))])
    assert eng.pool.num_used == 6  # the forks' copies went into their reserved pages
    assert eng.page_refs("r")[:3] == [3, 3, 3] and eng.page_refs("r#1") == [3, 3, 3, 1]
    eng.check_accounting()
    eng.step()
    for rid in ("r", "r#1", "r#2"):
        eng.abort(rid)
    eng.pool.assert_no_leaks()
    eng.reserve("s", len(prompt), ["s#1"])
    for rid in ("s", "s#1"):  # a transfer that failed: the reserved forks are freed with their request
        eng.abort(rid)
    eng.pool.assert_no_leaks()


def test_choices_shape_n_streams_into_one_response():
    """Pure: openai.format.Choices + OpenAIShape on interleaved events of 2 choices."""
    from pdruntime.server.openai.events import TokenEvent
    from pdruntime.server.openai.format import Choices, OpenAIShape

    def ev(i, delta, done, tokens):
        return TokenEvent.from_json({"index": i, "delta": delta, "token_ids": [1], "meta_info": {
            "prompt_tokens": 5, "completion_tokens": tokens, "finish_reason": {"type": "length"} if done else None}})

    shape = OpenAIShape(True, "chatcmpl-x", "m", 0)
    choices = Choices(2)
    chunks = []
    for e in (ev(1, "b", False, 1), ev(0, "a", False, 1), ev(0, "c", True, 2), ev(1, "d", True, 2)):
        i, first = choices.see(e)
        chunks += shape.stream_chunks(e, first=first, include_usage=True, choices=choices)
    assert [c["choices"][0]["index"] for c in chunks[:-1]] == [1, 0, 0, 1]
    assert [("role" in c["choices"][0]["delta"]) for c in chunks[:-1]] == [True, True, False, False]
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]] == [None, None, "length", "length"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == {"prompt_tokens": 5, "completion_tokens": 4,
                                                                   "total_tokens": 9}  # once, after the last choice
    whole = shape.response([shape.choice(i, t, ev(i, "", True, 2)) for i, t in enumerate(("ac", "bd"))], choices.usage())
    assert [(c["index"], c["message"]["content"]) for c in whole["choices"]] == [(0, "ac"), (1, "bd")]
    with pytest.raises(ValueError, match="index"):
        choices.see(ev(2, "x", False, 1))


def test_a_decode_worker_that_ignores_n_fails_the_request_clearly():
    """The router with a decode leg that streams choice 0 alone and ends (a worker that ignores
    sampling_params.n): a 502 naming the unfinished choices (streamed: an error event), never a partial answer."""
    import asyncio

    from pdruntime.env import RuntimeEnv
    from pdruntime.server.router.app import Router
    from pdruntime.server.router.topology import Pair, Topology
    from pdruntime.util import h1

    def answer(decode: bool, path: str) -> bytes:
        if not decode or path == "/abort_request":  # prefill, aborts
            body, ctype = json.dumps({"text": "a", "meta_info": {"prompt_tokens": 3, "completion_tokens": 1}}), "json"
        else:
            ev = {"delta": "a", "token_ids": [1], "meta_info": {"prompt_tokens": 3, "completion_tokens": 1,
                                                                 "finish_reason": {"type": "length"}}}
            body, ctype = f"data: {json.dumps(ev)}\n\ndata: [DONE]\n\n", "event-stream"
        data = body.encode()
        return b"HTTP/1.1 200 OK\r\ncontent-type: text/%b\r\ncontent-length: %d\r\n\r\n%b" % (ctype.encode(), len(data), data)

    async def serve(decode: bool) -> int:
        """A worker on loopback (the router's client speaks HTTP to real sockets) answering as above."""
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                while True:
                    _, path, _, _ = await read_request(reader)
                    writer.write(answer(decode, path))
                    await writer.drain()
            except (asyncio.IncompleteReadError, ConnectionError):
                writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        return server.sockets[0].getsockname()[1]

    async def main() -> list[httpx.Response]:
        prefill, decode = await serve(False), await serve(True)
        pair = Pair(0, True, f"http://127.0.0.1:{prefill}", "127.0.0.1", 9002, f"http://127.0.0.1:{decode}")
        router = Router(RuntimeEnv.from_environ({}), topology=Topology(1, "r", (pair,)))
        router.client = h1.Client()
        router.models = {"m": {"model_name": "m"}}
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=router.build_app()), base_url="http://r") as c:
            body = {"model": "m", "prompt": "x", "max_tokens": 1}
            return [await c.post("/v1/completions", json={**body, **kw})
                    for kw in ({"n": 2}, {"n": 2, "stream": True}, {})]

    whole, streamed, single = asyncio.run(main())
    assert whole.status_code == 502 and "choices [1] of n=2 unfinished" in whole.text, whole.text
    assert streamed.status_code == 200 and "choices [1] of n=2 unfinished" in streamed.text
    assert "[DONE]" not in streamed.text
    assert single.status_code == 200 and single.json()["choices"][0]["text"] == "a"  # n = 1: unchanged
