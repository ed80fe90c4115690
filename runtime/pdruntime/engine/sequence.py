"""Per-request state: tokens, KV pages, detokenisation with stop strings."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from .config import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"  # queued, no pages
    PREFILLING = "prefilling"  # pages for the prompt held, KV partly computed (chunked prefill)
    RUNNING = "running"  # decoding: KV for all tokens but the last is cached
    PREFILL_HELD = "prefill_held"  # prefill_only request done; pages kept until release()
    RESERVED = "reserved"  # decode side of PD: pages allocated, KV arriving from a prefill engine
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    prefill_only: bool = False
    arrival: int = 0  # admission order, for FIFO and preemption (newest first)
    status: Status = Status.WAITING
    output_ids: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    num_cached: int = 0  # tokens whose KV is stored in `blocks`
    num_published: int = 0  # leading pages of `blocks` offered to the prefix cache (full and computed)
    page_keys: list = field(default_factory=list)  # prefix-cache keys of the first full pages of `tokens` (bytes)
    cached_tokens: int | None = None  # prompt tokens whose KV came from the prefix cache (first admission/reserve)
    num_emitted: int = 0  # output tokens already reported in a StepOutput
    text: str = ""  # detokenised output (EOS excluded, cut at a stop string)
    text_emitted: int = 0  # chars of `text` already reported
    detok_prefix: int = 0  # output index where the incremental-detokenisation window starts
    detok_read: int = 0  # output tokens already turned into `text`
    finish_reason: str | None = None
    generator: torch.Generator | None = None  # unused by the counter-based sampler; kept for callers
    seed: int = 0  # the sampler's per-request seed (the client's, or drawn from the engine RNG at admission)
    matcher: Any = None  # structured output: a grammar matcher advanced by every output token (or None)
    token_mask: torch.Tensor | None = None  # int32 [ceil(V/32)] allowed tokens for the next sample (grammar)
    forks: list = field(default_factory=list)  # sequences forked from this one's prompt when it completes (n > 1)
    logprobs: list = field(default_factory=list)
    prompt_logprobs: list = field(default_factory=list)  # per prompt token after the first (prompt_logprobs set)  # per output token: (logprob, [(id, logprob)] top-n)

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def token_range(self, start: int, end: int) -> list[int]:
        """tokens[start:end] without building the whole prompt + output list (prefix-cache keys, per page)."""
        n = len(self.prompt_ids)
        if end <= n:
            return self.prompt_ids[start:end]
        if start >= n:
            return self.output_ids[start - n: end - n]
        return self.prompt_ids[start:] + self.output_ids[: end - n]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def blocks_needed(self, num_tokens: int, block_size: int) -> int:
        """Extra pages needed so that KV for `num_tokens` tokens fits."""
        return max(0, -(-num_tokens // block_size) - len(self.blocks))
