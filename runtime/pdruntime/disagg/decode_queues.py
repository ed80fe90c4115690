"""Decode worker queues.

prealloc -> transfer -> running

* prealloc: admitted, waiting for pages in decode's own pool (freed pages wake it).
* transfer: pages reserved; attached to the prefill worker and pulling the KV (decode transfer watchdog).
* running:  KV verified and handed to the engine; in the continuous decode batch, streaming tokens.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from pdruntime.disagg.queues import StageTable
from pdruntime.disagg.states import TransferStatus

STAGES = ("prealloc", "transfer", "running")
BUSY_GRACE_S = 0.5  # seconds a request waits for KV pages to come free before decode answers 429 (busy)


@dataclass(eq=False)
class DecodeRequest:
    rid: str
    room: int
    client: str
    prompt_ids: list[int]
    params: Any  # pdruntime.engine.SamplingParams
    bootstrap_host: str
    bootstrap_port: int
    created_at: float  # watchdog clock seconds
    status: TransferStatus
    outputs: asyncio.Queue = field(default_factory=asyncio.Queue)  # StepOutput | BaseException
    task: asyncio.Task | None = None  # the transfer task
    writer: Any = None  # transfer.KVConn while attached (close() fails the transfer)
    reserved: bool = False
    in_engine: bool = False
    bytes_received: int = 0
    kv_stats: Any = None  # transfer.TransferStats of the bulk phase (live; /debug/requests)
    completion_tokens: int = 0  # all choices together
    last_token_at: float | None = None  # watchdog clock seconds of the last generated token (idle_s in /debug)
    failure: str | None = None
    prefill_tokens: int = 0  # prompt tokens prefill reports computed (PROGRESS frames, before the KV is ready)
    prefill_steps: int = -1  # prefill engine steps at its last report
    prefill_progress_at: float | None = None  # watchdog clock seconds of the last report that advanced
    # n > 1: choices 1..n-1 are engine forks of this prompt, [(engine request id, SamplingParams)]; choice 0 is
    # the request itself (engine id ``rid``), whose first token prefill sampled
    forks: list = field(default_factory=list)
    busy_grace_s: float = BUSY_GRACE_S  # seconds it waits for KV pages before a 429 (at most; the router's may be less)
    open_ids: set = field(default_factory=set)  # engine ids of the choices still generating
    page_refs: list | None = None  # at the fork: holders of each of the prompt's pages (shared: n)
    held_tokens: int = 0  # leading prompt tokens whose KV decode held at reserve (its prefix cache): not transferred
    cached_tokens: int | None = None  # prompt tokens whose KV prefill did not recompute (usage.cached_tokens)

    @property
    def n(self) -> int:
        return 1 + len(self.forks)

    @property
    def gone(self) -> bool:
        """Failed or aborted: nothing may give it pages any more (engine commands check this)."""
        return self.failure is not None

    def engine_ids(self) -> list[str]:
        """The engine request id of each choice, by choice index."""
        return [self.rid] + [fid for fid, _ in self.forks]


class DecodeQueues(StageTable[DecodeRequest]):
    def __init__(self) -> None:
        super().__init__(STAGES)
