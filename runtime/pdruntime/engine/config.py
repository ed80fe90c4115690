"""Typed, frozen engine configuration, sampling parameters, and the engine's error/output types."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

FinishReason = Literal["stop", "length", "abort", "prefill_done", "error"]

# temperatures below this sample greedily: softmax(logits / T) tends to argmax as T -> 0, and logits / T
# overflows fp32 to inf (NaN probabilities) below ~1e-38, which used to make every step of a batch raise
MIN_TEMPERATURE = 1e-5
SEED_LIMIT = 1 << 64  # torch.Generator.manual_seed accepts [0, 2**64)


class InvalidRequest(ValueError):
    """A request the engine refuses; the message says what was wrong and what is accepted."""


class OutOfBlocks(RuntimeError):
    """The KV block pool cannot hold what was asked for (raised by Engine.reserve / BlockPool.allocate)."""


@dataclass(frozen=True)
class EngineConfig:
    block_size: int = 16  # tokens per KV page
    num_blocks: int | None = None  # None = size from kv_cache_mib
    max_num_seqs: int = 64  # sequences admitted at once (prefilling + decoding)
    max_prefill_tokens: int = 512  # prompt tokens processed per step (chunked-prefill chunk)
    max_model_len: int | None = None  # None = the model's max_position_embeddings
    kv_cache_mib: int = 512  # KV budget when num_blocks is None

    def __post_init__(self) -> None:
        def positive(name: str, value, *, allow_none: bool = False) -> None:
            if value is None and allow_none:
                return
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"EngineConfig.{name}={value!r} is invalid; accepted: a positive integer"
                                 + (" or None" if allow_none else ""))

        positive("block_size", self.block_size)
        positive("num_blocks", self.num_blocks, allow_none=True)
        positive("max_num_seqs", self.max_num_seqs)
        positive("max_prefill_tokens", self.max_prefill_tokens)
        positive("max_model_len", self.max_model_len, allow_none=True)
        positive("kv_cache_mib", self.kv_cache_mib)


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int | None = None  # per-request RNG seed; None = engine RNG
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise InvalidRequest(f"max_tokens={self.max_tokens!r} is invalid; accepted: an integer >= 1")
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidRequest(f"temperature={self.temperature!r} is invalid; accepted: a finite number >= 0 (0 = greedy)")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidRequest(f"top_k={self.top_k!r} is invalid; accepted: an integer >= 0 (0 = off)")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise InvalidRequest(f"top_p={self.top_p!r} is invalid; accepted: a number in (0, 1]")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not 0 <= self.seed < SEED_LIMIT):
            raise InvalidRequest(f"seed={self.seed!r} is invalid; accepted: an integer in [0, 2**64) or None")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        if not isinstance(self.stop, (tuple, list)) or not all(isinstance(s, str) and s for s in self.stop):
            raise InvalidRequest(f"stop={self.stop!r} is invalid; accepted: a tuple of non-empty strings")
        object.__setattr__(self, "stop", tuple(self.stop))

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE or self.top_k == 1


@dataclass(frozen=True)
class StepOutput:
    request_id: str
    new_token_ids: list[int]
    text_delta: str
    finished: bool
    finish_reason: FinishReason | None = None
    error: str | None = None  # finish_reason == "error": why the engine failed this request alone
