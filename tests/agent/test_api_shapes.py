"""OpenAI API shapes that real clients depend on (issue 20, build item 8), each with the client that showed it."""

from __future__ import annotations

import httpx
import pytest

pytestmark = pytest.mark.timeout(300)
SHARED_STACK = True  # its traffic leaves the stack as it found it: the process's shared stack (tiny_stack.py)


def test_langchain_counts_streamed_usage_once(stack, model_id):
    lc = pytest.importorskip("langchain_openai", reason="langchain-openai is in the dev extra")
    llm = lc.ChatOpenAI(base_url=stack.router.url + "/v1", api_key="unused", model=model_id, max_tokens=6,
                        temperature=0, stream_usage=True, max_retries=0, timeout=120)
    full = None
    for chunk in llm.stream("Say something about paged attention."):
        full = chunk if full is None else full + chunk
    plain = llm.invoke("Say something about paged attention.")
    assert full.usage_metadata is not None and plain.usage_metadata is not None
    assert full.usage_metadata["output_tokens"] == plain.usage_metadata["output_tokens"] <= 6, \
        (full.usage_metadata, plain.usage_metadata)
    assert full.usage_metadata["input_tokens"] == plain.usage_metadata["input_tokens"]


def test_usage_is_in_the_final_chunk_only_and_only_when_asked(client, model_id):
    kw = dict(model=model_id, messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0)
    with_usage = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert [c.usage is not None for c in with_usage] == [False] * (len(with_usage) - 1) + [True]
    assert with_usage[-1].choices == []
    without = list(client.chat.completions.create(**kw, stream=True))
    assert all(c.usage is None for c in without)


def test_every_503_and_429_carries_retry_after(stack, model_id):
    r = httpx.post(stack.router.url + "/v1/chat/completions", timeout=30, headers={"X-PDStack-Pair": "7"},
                   json={"model": model_id, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert r.status_code == 503, r.text  # a pinned group that does not exist (a loopback client may pin)
    assert int(r.headers["retry-after"]) >= 1
