"""Prefill worker queues.

bootstrap -> waiting -> inflight

* bootstrap: registered by the HTTP request, waiting for the decode peer to attach (bootstrap watchdog).
* waiting:   peer attached; the request is in the engine being prefilled (no watchdog: engine-bound).
* inflight:  KV computed and held in pages until decode confirms receipt (transfer watchdog,
             armed at "KV ready", disarmed at ACK), then the pages are released.

A vLLM-protocol request (kv_transfer_params do_remote_decode) computes first: registered straight into waiting, then
inflight with its KV held under the lease watchdog until its decode attaches (then the transfer watchdog).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from pdruntime.disagg.queues import StageTable
from pdruntime.disagg.states import TransferStatus
from pdruntime.util.aio import within

STAGES = ("bootstrap", "waiting", "inflight")


@dataclass(eq=False)
class PrefillRequest:
    rid: str
    room: int
    client: str
    prompt_ids: list[int]
    params: Any  # pdruntime.engine.SamplingParams
    created_at: float  # watchdog clock seconds
    status: TransferStatus
    done: asyncio.Future  # None on Success; an exception on failure
    attached: asyncio.Event = field(default_factory=asyncio.Event)
    kv_ready: asyncio.Future | None = None  # first token id when the engine reports prefill_done
    writer: Any = None  # transfer.KVConn while attached (close() fails the transfer)
    in_engine: bool = False
    first_token_id: int | None = None
    first_logprobs: Any = None  # (logprob, top-n) of the first token when the request asked for logprobs
    prompt_logprobs: Any = None  # per prompt token after the first, when the request asked (echo + logprobs)
    bytes_sent: int = 0
    cached_tokens: int | None = None  # prompt tokens this prefill's own prefix cache held (not recomputed)
    skipped_tokens: int = 0  # leading prompt tokens whose KV decode held: left off the wire
    kv_stats: Any = None  # transfer.TransferStats of the bulk phase (live; /debug/requests)
    progress_send: asyncio.Task | None = None  # the PROGRESS report being written to decode, if any
    computed_tokens: int = 0  # prompt tokens the engine has computed so far (its last report)
    computed_at: float | None = None  # watchdog clock: when that count last advanced (/debug/requests idle_s)
    # vLLM protocol (server/worker/lease.py): the KV was computed before any decode attached and is held under a
    # lease: (its pages, tokens); None for pdrt's and SGLang's flow (compute once decode attached)
    held_pages: tuple[list[int], int] | None = None

    @property
    def gone(self) -> bool:
        """Failed, aborted or done: nothing may give it pages any more (engine commands check this)."""
        return self.status.state.terminal


class PrefillQueues(StageTable[PrefillRequest]):
    def __init__(self) -> None:
        super().__init__(STAGES)
        self.by_room: dict[int, PrefillRequest] = {}
        self._room_waiters: dict[int, list[asyncio.Future]] = {}

    def register(self, req: PrefillRequest) -> None:
        if req.room in self.by_room:
            raise KeyError(f"bootstrap room {req.room} is already in use by request {self.by_room[req.room].rid}")
        self.put(req.rid, req, "bootstrap")
        self.by_room[req.room] = req
        for fut in self._room_waiters.pop(req.room, []):
            if not fut.done():
                fut.set_result(req)

    def finish(self, req: PrefillRequest) -> None:
        self.remove(req.rid)
        if self.by_room.get(req.room) is req:
            del self.by_room[req.room]

    async def wait_room(self, room: int, timeout_s: float) -> PrefillRequest | None:
        """The request registered for ``room``, waiting up to ``timeout_s`` for it (decode may attach
        before the router's prefill request arrives; SGLang routers send both legs at once)."""
        req = self.by_room.get(room)
        if req is not None:
            return req
        fut = asyncio.get_running_loop().create_future()
        self._room_waiters.setdefault(room, []).append(fut)
        try:
            return await within(fut, timeout_s)
        except asyncio.TimeoutError:
            return None
        finally:
            waiters = self._room_waiters.get(room)
            if waiters is not None:
                if fut in waiters:
                    waiters.remove(fut)
                if not waiters:
                    del self._room_waiters[room]
