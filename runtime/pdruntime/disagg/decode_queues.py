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
    completion_tokens: int = 0
    last_token_at: float | None = None  # watchdog clock seconds of the last generated token (idle_s in /debug)
    failure: str | None = None


class DecodeQueues(StageTable[DecodeRequest]):
    def __init__(self) -> None:
        super().__init__(STAGES)
