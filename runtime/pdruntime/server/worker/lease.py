"""vLLM's ``kv_transfer_params`` exchange on pdrt workers (the router's ``--worker-protocol vllm``), over pdrt's KV wire.

vLLM's PD proxy (vllm ``tests/v1/kv_connector/nixl_integration/toy_proxy_server.py``) sends prefill the request with
``kv_transfer_params.do_remote_decode`` and ``max_tokens`` 1. A pdrt prefill then computes the prompt at once, holds
its KV pages under a lease and answers with ``kv_transfer_params`` naming itself, with NixlConnector's field names
(``request_finished`` in vllm ``vllm/distributed/kv_transfer/kv_connector/v1/nixl_connector.py``): do_remote_prefill,
do_remote_decode, remote_block_ids, remote_engine_id, remote_request_id, remote_host, remote_port, tp_size. Here
remote_host/remote_port are the prefill's KV (bootstrap) address and remote_request_id its id of the held request.
The proxy passes them to decode, which attaches to that address as for any PD request (room: :func:`held_room` of
the id) and pulls the pages; prefill frees them on decode's receipt, or when the lease runs out (:data:`KV_LEASE_S`:
a decode that never comes must not hold pages forever). vLLM 0.33's NixlConnector leases the KV for
``kv_lease_duration`` (30 s) and decode renews it by heartbeat (``nixl/base_scheduler.py``); a pdrt decode sends no
heartbeat, so the lease here is one fixed span, the 480 s older vLLM held it for (``VLLM_NIXL_ABORT_REQUEST_TIMEOUT``).
"""

from __future__ import annotations

import hashlib
import uuid
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pdruntime.server.openai.schemas import KVTransferParams, _PDFields

# The schemas (pydantic, ~0.17 s) are imported where a request needs them, not here: every `pdrt` command line
# imports this module for KV_LEASE_S (the --kv-lease-s default), and only the workers parse OpenAI bodies.

#: seconds a prefill holds the KV of a vLLM-protocol request for its decode, unrenewed (older vLLM's fixed
#: VLLM_NIXL_ABORT_REQUEST_TIMEOUT default); ``pdrt serve --role prefill --kv-lease-s``
KV_LEASE_S = 480.0


def held_room(rid: str) -> int:
    """The bootstrap room of a held request: derived from its id, so that prefill (which named it) and decode
    (which gets the id as remote_request_id) agree without a field vLLM's params do not have."""
    return int.from_bytes(hashlib.sha256(rid.encode("utf-8")).digest()[:8], "big") >> 1


def held_rid(header: str | None) -> str:
    """The id of a held request: the router's X-Request-Id (vLLM's proxy convention; pdstack's router sends its
    own id there), else a fresh one."""
    from pdruntime.server.openai.schemas import MAX_ID_CHARS

    if header and 0 < len(header) <= MAX_ID_CHARS and header.isprintable():
        return header
    return uuid.uuid4().hex


def pd_fields(kv: "KVTransferParams", role: str, header_rid: str | None) -> tuple["_PDFields", bool]:
    """(the request's PD fields, held) of a body with vLLM's kv_transfer_params; ApiError(400) for params that do not
    fit this worker's role. ``held``: a prefill that computes now and holds its KV for a decode."""
    from pdruntime.server.openai.schemas import ApiError, _PDFields

    if kv.do_remote_decode:
        if role != "prefill":
            raise ApiError(400, "kv_transfer_params.do_remote_decode asks a prefill worker to hold the KV for a remote "
                           "decode, and this is a decode worker; accepted: do_remote_prefill with remote_host, "
                           "remote_port and remote_request_id (a prefill's answer)", param="kv_transfer_params")
        rid = held_rid(header_rid)
        return _PDFields(rid=rid, bootstrap_room=held_room(rid)), True
    if kv.do_remote_prefill:
        if role != "decode":
            raise ApiError(400, "kv_transfer_params.do_remote_prefill asks a decode worker to pull the KV, and this is "
                           "a prefill worker; accepted: do_remote_decode: true", param="kv_transfer_params")
        missing = [k for k in ("remote_host", "remote_port", "remote_request_id") if getattr(kv, k) is None]
        if missing:
            raise ApiError(400, f"kv_transfer_params.do_remote_prefill needs {', '.join(missing)}; accepted: the "
                           "kv_transfer_params a prefill worker answered", param=f"kv_transfer_params.{missing[0]}")
        rid = kv.remote_request_id
        return _PDFields(rid=rid, bootstrap_host=kv.remote_host, bootstrap_port=kv.remote_port,
                         bootstrap_room=held_room(rid)), False
    return _PDFields(), False  # neither: a plain request (decode runs it whole; a prefill refuses it)


def answer_params(*, rid: str, host: str, port: int, engine_id: str, pages: list[int], tp_size: int) -> dict[str, Any]:
    """What a held prefill answers in ``kv_transfer_params`` (NixlConnector.request_finished's fields)."""
    return {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": list(pages),
            "remote_engine_id": engine_id, "remote_request_id": rid, "remote_host": host, "remote_port": port,
            "tp_size": tp_size}


def advertised_host(bound: str, request_host: str | None) -> str:
    """The KV host a held prefill names: its bootstrap bind address, or (bound to every address) the host the
    router reached it by."""
    if bound in ("0.0.0.0", "::", "") and request_host:
        return request_host
    return bound
