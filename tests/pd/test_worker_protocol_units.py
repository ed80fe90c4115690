"""The router's worker protocols (server/router/protocol.py) as pure functions: what each leg's request is in every
mode, how decode's OpenAI chunks read back, where a real engine's /debug/requests are read."""

from __future__ import annotations

import argparse

import pytest

from pdruntime.server.openai.events import OpenAIStreamReader
from pdruntime.server.openai.format import finished_tool_calls, merge_tool_call_deltas
from pdruntime.server.router.legs import Outbound
from pdruntime.server.router.protocol import (DECODE_STREAM, VLLM_PREFILL_KV_PARAMS, SGLangProtocol, VLLMProtocol,
                                              WorkerProtocol, observe_url, protocol_for)
from pdruntime.server.router.topology import Pair
from pdruntime.server.worker.lease import held_room, pd_fields

PAIR = Pair(0, True, "http://10.0.0.11:8000", "10.0.0.11", 8998, "http://10.0.0.12:8000")
CLIENT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 9, "stream": True,
          "stream_options": {"include_usage": True}, "min_tokens": 2}


def out(**kw) -> Outbound:
    return Outbound("rid1", {"sampling_params": {"max_new_tokens": 9}, "messages": CLIENT["messages"]}, {}, 0.0,
                    openai=kw.pop("openai", CLIENT), **kw)


def test_pdrt_sends_its_generate_body_with_rid_and_room_to_both():
    p = WorkerProtocol()
    room = p.room(out())
    pre, dec = p.prefill(out(), PAIR, room), p.decode(out(), PAIR, room, None)
    assert pre.path == dec.path == "/generate"
    assert pre.body["rid"] == "rid1" and pre.body["bootstrap_room"] == dec.body["bootstrap_room"] == room
    assert (pre.body["stream"], dec.body["stream"]) == (False, True)
    assert p.worker_rid(out(), room, None) == "rid1"


def test_sglang_sends_the_client_body_with_bootstrap_fields_and_arrays_for_chat_n():
    p = SGLangProtocol()
    room = p.room(out())
    pre = p.prefill(out(), PAIR, room)
    assert pre.path == "/v1/chat/completions" and "rid" not in pre.body
    assert pre.body["bootstrap_host"] == "10.0.0.11" and pre.body["bootstrap_port"] == 8998
    assert pre.body["stream_options"] == {"include_usage": True} and pre.body["min_tokens"] == 2
    dec = p.decode(out(), PAIR, room, None)
    assert dec.body == {**pre.body, **DECODE_STREAM}
    o3 = out(n=3, openai={**CLIENT, "n": 3})
    rooms = p.room(o3)
    assert isinstance(rooms, list) and len(set(rooms)) == 3
    body = p.prefill(o3, PAIR, rooms).body
    assert body["bootstrap_host"] == ["10.0.0.11"] * 3 and body["bootstrap_port"] == [8998] * 3
    assert p.worker_rid(o3, rooms, None) == f"room-{rooms[0]}"
    assert isinstance(p.room(out(n=3, chat=False)), int)  # completions: one prompt, one room (sgl-router's rule)


def test_vllm_prefill_is_the_toy_proxys_request_and_decode_carries_prefills_params():
    p = VLLMProtocol()
    body = {**CLIENT, "max_completion_tokens": 9, "min_completion_tokens": 1}
    pre = p.prefill(out(openai=body), PAIR, None)
    assert pre.body["kv_transfer_params"] == VLLM_PREFILL_KV_PARAMS
    assert (pre.body["max_tokens"], pre.body["max_completion_tokens"], pre.body["stream"]) == (1, 1, False)
    assert not {"stream_options", "min_tokens", "min_completion_tokens"} & set(pre.body)
    answered = {"kv_transfer_params": {"do_remote_prefill": True, "remote_request_id": "held-7"}}
    dec = p.decode(out(openai=body), PAIR, None, answered)
    assert dec.body == {**body, "kv_transfer_params": answered["kv_transfer_params"], **DECODE_STREAM}
    assert p.worker_rid(out(), None, answered) == "held-7"
    assert "kv_transfer_params" not in p.decode(out(), PAIR, None, {}).body  # as the proxy: none to pass on
    assert p.sequential and not WorkerProtocol.sequential


def test_openai_chunks_read_back_with_usage_counted_per_choice():
    r = OpenAIStreamReader(2, chat=True)
    role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
    assert r.events(role) == []
    ev, = r.events({"id": "x", "choices": [{"index": 1, "delta": {"content": "ab"}, "finish_reason": None}],
                    "usage": {"prompt_tokens": 5, "completion_tokens": 2}})
    assert (ev.choice, ev.delta, ev.num_tokens, ev.completion_tokens, ev.prompt_tokens) == (1, "ab", 2, 2, 5)
    ev, = r.events({"choices": [{"index": 0, "delta": {"content": "c"}, "finish_reason": "length"}],
                    "usage": {"prompt_tokens": 5, "completion_tokens": 3}})
    assert (ev.choice, ev.num_tokens, ev.finish_reason) == (0, 1, "length")
    assert r.events({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3}}) == []
    with pytest.raises(ValueError):
        r.events({"choices": [{"index": 2, "delta": {"content": "x"}}]})
    no_usage = OpenAIStreamReader(1, chat=False)
    ev, = no_usage.events({"choices": [{"index": 0, "text": "hi", "finish_reason": None}]})
    assert ev.num_tokens == 1 and ev.text == "hi"


def test_tool_call_deltas_fold_into_whole_calls():
    calls: list = []
    merge_tool_call_deltas(calls, [{"index": 0, "id": "c1", "type": "function",
                                    "function": {"name": "f", "arguments": "{\"a\""}}])
    merge_tool_call_deltas(calls, [{"index": 0, "function": {"arguments": ": 1}"}}])
    assert finished_tool_calls(calls) == [{"id": "c1", "type": "function", "function": {"name": "f",
                                                                                        "arguments": "{\"a\": 1}"}}]


def test_observe_url_reads_a_real_engines_agent_and_a_pdrt_worker_itself():
    assert observe_url("http://10.0.0.11:8000", "sglang", 8090) == "http://10.0.0.11:8090"
    assert observe_url("http://[fd00::1]:8000", "vllm", 8090) == "http://[fd00::1]:8090"
    assert observe_url("http://10.0.0.11:8000", "vllm", 0) == "http://10.0.0.11:8000"
    assert observe_url("http://10.0.0.11:8000", "pdrt", 8090) == "http://10.0.0.11:8000"
    with pytest.raises(ValueError, match="accepted: pdrt, sglang, vllm"):
        protocol_for("nixl")


def test_held_params_map_to_the_same_room_on_both_workers():
    from pdruntime.server.openai.schemas import KVTransferParams

    pre, held = pd_fields(KVTransferParams(do_remote_decode=True), "prefill", "rid-9")
    dec, _ = pd_fields(KVTransferParams(do_remote_prefill=True, remote_host="h", remote_port=7, remote_request_id="rid-9"),
                       "decode", None)
    assert held and pre.rid == dec.rid == "rid-9" and pre.bootstrap_room == dec.bootstrap_room == held_room("rid-9")
    assert (dec.bootstrap_host, dec.bootstrap_port) == ("h", 7)
    assert 0 <= held_room("x") < 1 << 63


def test_worker_protocol_flags_parse_and_refuse():
    from pdruntime.server import commands

    parser = argparse.ArgumentParser()
    commands.register(parser.add_subparsers())
    args = parser.parse_args(["serve", "--role", "router", "--worker-protocol", "vllm", "--worker-agent-port", "0"])
    assert (args.worker_protocol, args.worker_agent_port) == ("vllm", 0)
    assert parser.parse_args(["serve", "--role", "router"]).worker_agent_port == 8090
    assert parser.parse_args(["up", "--worker-protocol", "sglang"]).worker_protocol == "sglang"
    for bad in (["--worker-protocol", "nixl"], ["--worker-agent-port", "70000"]):
        with pytest.raises(SystemExit) as exc:
            parser.parse_args(["serve", "--role", "router", *bad])
        assert exc.value.code == 2
