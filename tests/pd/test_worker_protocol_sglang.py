"""pdstack's router with ``--worker-protocol sglang`` in front of pdrt workers: it serves chat, streaming, ``n`` = 3,
tools and completions, and what it sends each leg is what the real sglang-router 0.3.2 (PyPI ``sglang-router``) sends.

A recording reverse proxy sits in front of each worker (recording_proxy.py); both routers are pointed at the same two
proxies, each client request is sent through one router and then the other, and the bodies each leg received are
compared: the same keys and values, the bootstrap rooms aside (fresh per request; arrays of n for chat n > 1), so
sglang-router's own rewrites (defaults, f32 sampling values, max_completion_tokens; protocol.sglang_router_body) are
pinned here. The one documented difference is the decode leg's ``stream``/``stream_options`` (protocol.DECODE_STREAM:
pdstack's router always reads decode's per-token stream, then answers the client in the shape it asked for).

Skips where ``sglang_router`` is not installed (it is in the dev extra).
"""

from __future__ import annotations

import json
import os
import time
from types import SimpleNamespace

import httpx
import pytest

try:
    import sglang_router.router  # noqa: F401  (the Rust extension)
except ImportError as exc:
    pytest.skip(f"sglang-router is not installed ({exc}); pip install sglang-router", allow_module_level=True)

from pd_harness import router_at  # noqa: E402
from recording_proxy import proxied  # noqa: E402
from test_sglang_router import SGLangRouter  # noqa: E402

from pdruntime.server.router.protocol import DECODE_STREAM  # noqa: E402
from pdruntime.util.sse import DONE, iter_sse  # noqa: E402

pytestmark = pytest.mark.timeout(240)
SHARED_STACK = True  # its traffic leaves the stack as it found it: the process's shared stack (tiny_stack.py)

CHAT = "/v1/chat/completions"
UNIT_TOOL = {"type": "function", "function": {
    "name": "set_unit", "description": "Set the temperature unit",
    "parameters": {"type": "object", "properties": {"unit": {"type": "string", "enum": ["c", "f"]}},
                   "required": ["unit"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def proxies(stack):
    with proxied(stack) as both:
        yield both


@pytest.fixture(scope="module")
def pdstack_router(stack, proxies, tmp_path_factory):
    """pdstack's router, --worker-protocol sglang, at the proxies (the workers serve /debug/requests themselves)."""
    with router_at(str(tmp_path_factory.mktemp("rsglang")), proxies[0].url, proxies[1].url, stack.bootstrap_port,
                   "--worker-protocol", "sglang", "--worker-agent-port", "0", name="router-sglang") as r:
        yield r


@pytest.fixture(scope="module")
def sglang_router(stack, proxies, tmp_path_factory):
    """The real sglang-router 0.3.2 at the same proxies."""
    p, d = proxies
    at = SimpleNamespace(prefill=SimpleNamespace(url=p.url), decode=SimpleNamespace(url=d.url),
                         bootstrap_port=stack.bootstrap_port)
    r = SGLangRouter(at, str(tmp_path_factory.mktemp("sgl-proxied")))
    try:
        r.wait_workers()
        yield r
    finally:
        r.stop()


def _send(url: str, path: str, body: dict) -> tuple[int, object]:
    """One client request: (status, the JSON answer or the list of streamed chunks, [DONE] last)."""
    if body.get("stream"):
        with httpx.stream("POST", url + path, json=body, timeout=120) as r:
            if r.status_code != 200:
                return r.status_code, json.loads(r.read())
            return 200, list(iter_sse(r.iter_lines()))
    r = httpx.post(url + path, json=body, timeout=120)
    return r.status_code, r.json()


def _legs(proxies, path: str) -> tuple[dict, dict]:
    """The one prefill and one decode body the last request sent (the proxies record at arrival)."""
    p, d = proxies
    deadline = time.monotonic() + 10
    while not (p.posts(path) and d.posts(path)):
        assert time.monotonic() < deadline, "a leg was never sent"
        time.sleep(0.02)
    assert len(p.posts(path)) == 1 and len(d.posts(path)) == 1, (p.posts(path), d.posts(path))
    return p.posts(path)[0].body, d.posts(path)[0].body


def _through(router_url: str, proxies, path: str, body: dict):
    for px in proxies:
        px.clear()
    status, answer = _send(router_url, path, body)
    assert status == 200, answer
    return answer, _legs(proxies, path)


def _rooms_apart(body: dict, n: int) -> dict:
    """``body`` without its room(s), which are checked: one integer, or (chat n > 1) n of them."""
    b = dict(body)
    room = b.pop("bootstrap_room")
    rooms = room if isinstance(room, list) else [room]
    assert all(isinstance(x, int) and not isinstance(x, bool) for x in rooms), room
    assert len(rooms) == n and len(set(rooms)) == n, room
    return b


def _same_legs(pdstack, sglang, n: int) -> None:
    (ours_p, ours_d), (theirs_p, theirs_d) = pdstack, sglang
    assert _rooms_apart(ours_p, n) == _rooms_apart(theirs_p, n)
    assert _rooms_apart(ours_d, n) == {**_rooms_apart(theirs_d, n), **DECODE_STREAM}
    assert ours_p["bootstrap_room"] == ours_d["bootstrap_room"]  # one room (list) for both legs of a request
    assert "rid" not in ours_p  # sglang-router sends none: the workers derive their id from the room


def _text(answer, chat: bool = True) -> list[str]:
    """Each choice's text of a response or of a stream's chunks."""
    if isinstance(answer, dict):
        return [c["message"]["content"] if chat else c["text"] for c in answer["choices"]]
    texts: dict[int, str] = {}
    for ch in answer[:-1]:
        for c in ch["choices"]:
            piece = (c["delta"].get("content") or "") if chat else c["text"]
            texts[c["index"]] = texts.get(c["index"], "") + piece
    return [texts[i] for i in sorted(texts)]


def test_chat_is_served_and_sent_as_sglang_router_sends_it(stack, proxies, pdstack_router, sglang_router):
    body = {"model": stack.model, "messages": [{"role": "user", "content": "the quick brown fox"}], "max_tokens": 8,
            "temperature": 0}
    ours, ours_legs = _through(pdstack_router.url, proxies, CHAT, body)
    theirs, theirs_legs = _through(sglang_router.url, proxies, CHAT, body)
    _same_legs(ours_legs, theirs_legs, 1)
    assert ours["object"] == "chat.completion" and ours["usage"]["completion_tokens"] == 8
    reference = httpx.post(stack.router.url + CHAT, json=body, timeout=120).json()  # pdrt's protocol, same workers
    assert _text(ours) == _text(theirs) == _text(reference)


def test_streamed_chat_is_sent_as_sglang_router_sends_it(stack, proxies, pdstack_router, sglang_router):
    body = {"model": stack.model, "messages": [{"role": "user", "content": "tell me about the lazy dog"}],
            "max_tokens": 8, "temperature": 0.7, "top_p": 0.9, "seed": 5, "stream": True,
            "stream_options": {"include_usage": True}, "user": "agent-7"}
    ours, ours_legs = _through(pdstack_router.url, proxies, CHAT, body)
    theirs, theirs_legs = _through(sglang_router.url, proxies, CHAT, body)
    _same_legs(ours_legs, theirs_legs, 1)
    # sglang-router's rewrites, mirrored: f32 sampling values, max_completion_tokens, no user
    assert ours_legs[0]["temperature"] == 0.699999988079071 and ours_legs[0]["max_completion_tokens"] == 8
    assert "user" not in ours_legs[0] and "max_tokens" not in ours_legs[0]
    assert ours[-1] == DONE and len(ours) >= 3
    assert _text(ours) == _text(theirs)
    assert ours[-2]["usage"]["completion_tokens"] == 8  # include_usage: the usage chunk ends the stream


def test_n3_sends_three_rooms_like_sglang_router_and_answers_three_choices(stack, proxies, pdstack_router,
                                                                          sglang_router):
    body = {"model": stack.model, "messages": [{"role": "user", "content": "pick a colour"}], "max_tokens": 6,
            "temperature": 0.9, "seed": 3, "n": 3}
    ours, ours_legs = _through(pdstack_router.url, proxies, CHAT, body)
    theirs, theirs_legs = _through(sglang_router.url, proxies, CHAT, body)
    _same_legs(ours_legs, theirs_legs, 3)
    assert [c["index"] for c in ours["choices"]] == [0, 1, 2]
    assert all(c["finish_reason"] == "length" for c in ours["choices"])
    assert ours["usage"]["completion_tokens"] == 18
    assert _text(ours) == _text(theirs)  # same seed, same workers: the same three choices
    streamed, _ = _through(pdstack_router.url, proxies, CHAT, {**body, "stream": True})
    assert _text(streamed) == _text(ours)


def test_tool_call_passes_through_as_decode_parsed_it(stack, proxies, pdstack_router, sglang_router):
    body = {"model": stack.model, "messages": [{"role": "user", "content": "use celsius"}], "tools": [UNIT_TOOL],
            "tool_choice": {"type": "function", "function": {"name": "set_unit"}}, "max_tokens": 240,
            "temperature": 0}
    ours, ours_legs = _through(pdstack_router.url, proxies, CHAT, body)
    theirs, theirs_legs = _through(sglang_router.url, proxies, CHAT, body)
    _same_legs(ours_legs, theirs_legs, 1)
    ch = ours["choices"][0]
    assert ch["finish_reason"] == "tool_calls", ch
    call = ch["message"]["tool_calls"][0]
    assert call["function"]["name"] == "set_unit" and json.loads(call["function"]["arguments"])["unit"] in ("c", "f")
    theirs_call = theirs["choices"][0]["message"]["tool_calls"][0]
    assert call["function"] == theirs_call["function"]  # ids are fresh per response
    streamed, _ = _through(pdstack_router.url, proxies, CHAT, {**body, "stream": True})
    calls = [tc for chunk in streamed[:-1] for c in chunk["choices"] for tc in c["delta"].get("tool_calls") or []]
    assert calls and calls[0]["function"]["name"] == "set_unit"
    assert "".join(tc["function"].get("arguments") or "" for tc in calls) == call["function"]["arguments"]
    assert streamed[-2]["choices"][0]["finish_reason"] == "tool_calls"


def test_completions_are_sent_as_sglang_router_sends_them(stack, proxies, pdstack_router, sglang_router):
    body = {"model": stack.model, "prompt": "once upon a time", "max_tokens": 8, "temperature": 0}
    ours, ours_legs = _through(pdstack_router.url, proxies, "/v1/completions", body)
    theirs, theirs_legs = _through(sglang_router.url, proxies, "/v1/completions", body)
    _same_legs(ours_legs, theirs_legs, 1)
    assert _text(ours, chat=False) == _text(theirs, chat=False)


def test_the_router_reports_its_protocol_and_leaves_both_workers_idle(stack, pdstack_router):
    cfg = httpx.get(pdstack_router.url + "/config", timeout=10).json()["router"]
    assert cfg["worker_protocol"] == "sglang" and cfg["worker_agent_port"] == 0
    debug = httpx.get(pdstack_router.url + "/debug/requests", timeout=10).json()
    assert {w["role"] for w in debug["workers"]} == {"prefill", "decode"} and not any("error" in w for w in debug["workers"])
    p, d = stack.wait_idle()
    for x in (p, d):
        assert x["live"] == 0 and x["pool"]["free"] == x["pool"]["total"], x


def test_a_bad_worker_protocol_exits_2_naming_what_is_accepted():
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "pdruntime.server", "serve", "--role", "router", "--worker-protocol",
                        "nixl"], capture_output=True, text=True, timeout=60, env={**os.environ})
    assert r.returncode == 2
    assert "--worker-protocol" in r.stderr and "invalid choice" in r.stderr, r.stderr
    assert all(name in r.stderr.split("choose from")[1] for name in ("pdrt", "sglang", "vllm")), r.stderr
