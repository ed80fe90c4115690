"""How the router speaks to the two workers of a pair (``--worker-protocol``): one :class:`WorkerProtocol` per
engine convention. legs.py runs one code path for all of them (both legs, aborts, the deadline, busy and breaker
verdicts, retries, stall evidence); a protocol only says what each leg's request is, whether decode's waits for
prefill's answer, and how decode's stream reads back.

``pdrt``
    ``POST /generate`` to both legs at once: pdrt's body (``sampling_params`` + the prompt) with ``rid`` and
    ``bootstrap_host``/``bootstrap_port``/``bootstrap_room``; decode streams pdrt token events
    (:meth:`TokenEvent.from_json`), prefill's answer carries the first token's logprobs.
``sglang``
    What sglang-router 0.3.2 sends in PD mode (sgl-router ``routers/http/pd_router.rs``: ``execute_dual_dispatch``
    serializes its typed request and ``inject_bootstrap_into_value`` adds the fields): the client's OpenAI body, to
    the same OpenAI route on both legs at once, with ``bootstrap_host``, ``bootstrap_port`` and ``bootstrap_room``
    (chat with ``n`` > 1: arrays of n, one fresh room each) and no ``rid``.
``vllm``
    The two-step ``kv_transfer_params`` exchange of vLLM's own PD proxy
    (vllm ``tests/v1/kv_connector/nixl_integration/toy_proxy_server.py``, ``send_request_to_service``): prefill first,
    with ``kv_transfer_params`` {do_remote_decode: true, do_remote_prefill: false, remote_engine_id,
    remote_block_ids, remote_host, remote_port: null}, ``max_tokens`` 1 (and ``max_completion_tokens`` 1 when
    given), ``stream`` false, no ``stream_options``/``min_tokens``/``min_completion_tokens``; then decode, with the
    client's body and the ``kv_transfer_params`` prefill returned (NixlConnector ``request_finished``,
    ``vllm/distributed/kv_transfer/kv_connector/v1/nixl_connector.py``: do_remote_prefill, remote_block_ids,
    remote_engine_id, remote_request_id, remote_host, remote_port, tp_size).

In both OpenAI modes the decode leg is always streamed with ``stream_options`` {include_usage, continuous_usage_stats}
(:data:`DECODE_STREAM`), whatever the client asked: the router reads per-token progress (stall evidence, the
first-token admission bound, mid-stream failures) the same way in every mode and answers the client in the shape it
asked for. That is the one field where the router's decode request differs from sglang-router's.
"""

from __future__ import annotations

import functools
import random
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable
from urllib.parse import urlparse

import httpx

from pdruntime.server.openai.events import OpenAIStreamReader, TokenEvent
from pdruntime.util import h1

if TYPE_CHECKING:
    from pdruntime.server.router.legs import Outbound
    from pdruntime.server.router.topology import Pair

WORKER_PROTOCOLS = ("pdrt", "sglang", "vllm")
DECODE_STREAM = {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}

#: What sglang-router 0.3.2's serde serialization of its typed ChatCompletionRequest / CompletionRequest writes into
#: every body it forwards when the client left them out; captured from the real router through a recording proxy
#: (tests/pd/test_worker_protocol_sglang.py holds these to it)
SGLANG_ROUTER_CHAT_DEFAULTS: dict[str, Any] = {
    "continue_final_message": False, "ignore_eos": False, "logprobs": False, "no_stop_trim": False,
    "return_hidden_states": False, "separate_reasoning": True, "skip_special_tokens": True, "stream": False,
    "stream_reasoning": True}
SGLANG_ROUTER_COMPLETION_DEFAULTS: dict[str, Any] = {
    "echo": False, "ignore_eos": False, "no_stop_trim": False, "return_hidden_states": False,
    "skip_special_tokens": True, "stream": False}
#: its other rewrites, seen the same way: these sampling fields are f32 in its structs (0.9 goes out as
#: 0.8999999761581421), chat's max_tokens goes out as max_completion_tokens, stream_options keeps include_usage
#: alone, and the client's ``user`` is not forwarded
SGLANG_ROUTER_F32 = ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty")
SGLANG_ROUTER_DROPS = ("user",)


def _f32(v: Any) -> Any:
    return struct.unpack("f", struct.pack("f", v))[0] if isinstance(v, float | int) and not isinstance(v, bool) else v


def sglang_router_body(client: dict, chat: bool) -> dict:
    """The client's OpenAI body as sglang-router 0.3.2 forwards it (before its bootstrap fields)."""
    body = {**(SGLANG_ROUTER_CHAT_DEFAULTS if chat else SGLANG_ROUTER_COMPLETION_DEFAULTS), **client}
    for name in SGLANG_ROUTER_DROPS:
        body.pop(name, None)
    for name in SGLANG_ROUTER_F32:
        if body.get(name) is not None:
            body[name] = _f32(body[name])
    if chat and "max_tokens" in body:
        limit = body.pop("max_tokens")
        body.setdefault("max_completion_tokens", limit)
    if isinstance(body.get("stream_options"), dict):
        body["stream_options"] = {k: v for k, v in body["stream_options"].items() if k == "include_usage"}
    return body


#: the prefill leg's kv_transfer_params in vLLM's proxy (toy_proxy_server.py send_request_to_service)
VLLM_PREFILL_KV_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                          "remote_block_ids": None, "remote_host": None, "remote_port": None}


@dataclass(slots=True)
class LegRequest:
    """One leg's HTTP request: its path on the worker and its JSON body (read-only once built; two per request, so
    not a frozen dataclass, which costs a setattr call per field)."""

    path: str
    body: dict


def _room() -> int:
    return random.getrandbits(63)


class WorkerProtocol:
    """pdrt's own protocol; subclasses override what differs. ``sequential``: decode's request needs prefill's
    answer. ``parses_tools``: decode answers tool calls already parsed (the router passes them through)."""

    name = "pdrt"
    sequential = False
    parses_tools = False

    def room(self, out: "Outbound") -> int | list[int]:
        return _room()

    def prefill(self, out: "Outbound", pair: "Pair", room: Any) -> LegRequest:
        return LegRequest("/generate", self._pd_body(out, pair, room, False))

    def decode(self, out: "Outbound", pair: "Pair", room: Any, prefill_result: dict | None) -> LegRequest:
        return LegRequest("/generate", self._pd_body(out, pair, room, True))

    def _pd_body(self, out: "Outbound", pair: "Pair", room: Any, stream: bool) -> dict:
        return {**out.body, "rid": out.rid, "bootstrap_host": pair.bootstrap_host, "bootstrap_port": pair.bootstrap_port,
                "bootstrap_room": room, "stream": stream}

    def reader(self, out: "Outbound") -> Callable[[dict], TokenEvent | list[TokenEvent]]:
        """Decode's SSE payload -> its token event, or a list of them (ValueError for a malformed one)."""
        return functools.partial(TokenEvent.from_json, n=out.n)

    def worker_rid(self, out: "Outbound", room: Any, prefill_result: dict | None) -> str:
        """The id both workers know the request by (their /abort_request takes it)."""
        return out.rid

    def first_token_logprobs(self, prefill_result: dict | None) -> tuple[Any, Any]:
        """(the first token's logprobs entry, the prompt's entries) from prefill's answer (it sampled that token)."""
        mi = (prefill_result or {}).get("meta_info") or {}
        return (mi.get("output_token_logprobs") or [None])[0], mi.get("input_token_logprobs")

    async def model_info(self, client: "h1.Client", url: str, timeout: float) -> dict | None:
        """What a worker serves (``model_name``, ``model_path``, ``max_model_len``, ...): SGLang's /get_model_info."""
        try:
            r = await client.get(url + "/get_model_info", timeout=timeout)
            return r.json() if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None


class _OpenAIProtocol(WorkerProtocol):
    """The client's OpenAI body to the client's OpenAI route; decode's OpenAI chunks read back."""

    parses_tools = True

    def reader(self, out: "Outbound") -> Callable[[dict], TokenEvent | list[TokenEvent]]:
        return OpenAIStreamReader(out.n, out.chat).events

    def first_token_logprobs(self, prefill_result: dict | None) -> tuple[Any, Any]:
        return None, None  # prefill's OpenAI answer is not merged: decode's stream carries every token's


class SGLangProtocol(_OpenAIProtocol):
    name = "sglang"

    def room(self, out: "Outbound") -> int | list[int]:
        """sgl-router's batch size rule: chat with n > 1, or a completion whose prompt is a list, gets one room per
        entry (arrays); anything else one room."""
        prompt = (out.openai or {}).get("prompt")
        many = (out.n if out.n > 1 else None) if out.chat else (len(prompt) if isinstance(prompt, list) and prompt else None)
        return [_room() for _ in range(many)] if many else _room()

    def _body(self, out: "Outbound", pair: "Pair", room: Any) -> dict:
        many = isinstance(room, list)
        return {**sglang_router_body(out.openai or {}, out.chat),
                "bootstrap_host": [pair.bootstrap_host] * len(room) if many else pair.bootstrap_host,
                "bootstrap_port": [pair.bootstrap_port] * len(room) if many else pair.bootstrap_port,
                "bootstrap_room": room}

    def prefill(self, out: "Outbound", pair: "Pair", room: Any) -> LegRequest:
        return LegRequest(out.route, self._body(out, pair, room))

    def decode(self, out: "Outbound", pair: "Pair", room: Any, prefill_result: dict | None) -> LegRequest:
        return LegRequest(out.route, {**self._body(out, pair, room), **DECODE_STREAM})

    def worker_rid(self, out: "Outbound", room: Any, prefill_result: dict | None) -> str:
        first = room[0] if isinstance(room, list) else room
        return f"room-{first}"  # a pdrt worker's id of a body without rid (worker/prompts.py request_id)


class VLLMProtocol(_OpenAIProtocol):
    name = "vllm"
    sequential = True

    def room(self, out: "Outbound") -> None:
        return None  # prefill names the request (remote_request_id); no router-chosen room

    def prefill(self, out: "Outbound", pair: "Pair", room: Any) -> LegRequest:
        body = {**out.openai, "kv_transfer_params": dict(VLLM_PREFILL_KV_PARAMS), "stream": False, "max_tokens": 1}
        if "max_completion_tokens" in body:
            body["max_completion_tokens"] = 1
        for name in ("stream_options", "min_tokens", "min_completion_tokens"):  # "not supported for P"
            body.pop(name, None)
        return LegRequest(out.route, body)

    def decode(self, out: "Outbound", pair: "Pair", room: Any, prefill_result: dict | None) -> LegRequest:
        body = dict(out.openai)
        params = (prefill_result or {}).get("kv_transfer_params")
        if params:  # as vLLM's proxy: without them decode computes the prompt itself
            body["kv_transfer_params"] = params
        return LegRequest(out.route, {**body, **DECODE_STREAM})

    def worker_rid(self, out: "Outbound", room: Any, prefill_result: dict | None) -> str:
        params = (prefill_result or {}).get("kv_transfer_params") or {}
        return str(params.get("remote_request_id") or out.rid)  # the router sends its rid as X-Request-Id

    async def model_info(self, client: "h1.Client", url: str, timeout: float) -> dict | None:
        """vLLM serves no /get_model_info: its /v1/models (id, root, max_model_len) says the same."""
        try:
            r = await client.get(url + "/v1/models", timeout=timeout)
            data = r.json().get("data") if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError, AttributeError):
            return None
        if not data or not isinstance(data[0], dict) or not data[0].get("id"):
            return None
        m = data[0]
        return {"model_name": m["id"], "model_path": m.get("root") or m["id"], "max_model_len": m.get("max_model_len"),
                "sampling_defaults": m.get("sampling_defaults")}


PROTOCOLS: dict[str, type[WorkerProtocol]] = {"pdrt": WorkerProtocol, "sglang": SGLangProtocol, "vllm": VLLMProtocol}


def protocol_for(name: str) -> WorkerProtocol:
    try:
        return PROTOCOLS[name]()
    except KeyError:
        raise ValueError(f"--worker-protocol {name!r} is not accepted; accepted: {', '.join(WORKER_PROTOCOLS)}") from None


def observe_url(worker_url: str, protocol: str, agent_port: int) -> str:
    """Where a worker's /config and /debug/requests are read: a pdrt worker serves them itself; a real SGLang or vLLM
    engine's come from the pdstack sidecar (``pdrt agent``) on ``agent_port`` of the same host (0: the worker URL)."""
    if protocol == "pdrt" or agent_port == 0:
        return worker_url
    u = urlparse(worker_url)
    host = f"[{u.hostname}]" if u.hostname and ":" in u.hostname else u.hostname
    return f"http://{host}:{agent_port}"
