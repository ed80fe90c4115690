"""Typed, frozen engine configuration, sampling parameters, and the engine's error/output types."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal

import torch

from .device import DEFAULT_KV_MEMORY_FRACTION, DTYPES, resolve_device, resolve_dtype

FinishReason = Literal["stop", "length", "abort", "prefill_done", "error"]

# temperatures below this sample greedily: softmax(logits / T) tends to argmax as T -> 0, and logits / T
# overflows fp32 to inf (NaN probabilities) below ~1e-38, which used to make every step of a batch raise
MIN_TEMPERATURE = 1e-5
SEED_LIMIT = 1 << 64  # torch.Generator.manual_seed accepts [0, 2**64)


class InvalidRequest(ValueError):
    """A request the engine refuses; the message says what was wrong and what is accepted, ``code`` names the
    cause for the API's error body (e.g. ``invalid_grammar``, ``unsatisfiable_schema``)."""

    def __init__(self, message: str, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.code = code


class OutOfBlocks(RuntimeError):
    """The KV block pool cannot hold what was asked for (raised by Engine.reserve / BlockPool.allocate)."""


@dataclass(frozen=True)
class EngineConfig:
    """What one engine runs with. Device, dtype and tensor parallelism have this one owner: the loader,
    KV cache, sampler and kernels take them from here (``auto`` is resolved by :meth:`resolve`)."""

    block_size: int = 16  # tokens per KV page
    num_blocks: int | None = None  # None = size from kv_cache_mib / kv_cache_memory_fraction
    max_num_seqs: int = 64  # sequences admitted at once (prefilling + decoding)
    max_prefill_tokens: int = 512  # prompt tokens processed per step (chunked-prefill chunk)
    max_model_len: int | None = None  # None = the model's max_position_embeddings
    kv_cache_mib: int | None = None  # KV budget, MiB; None = CPU: 512 MiB, CUDA: kv_cache_memory_fraction
    device: str = "cpu"  # concrete: cpu | cuda:N (rank 0's device under TP; rank r uses cuda:N+r)
    dtype: str = "fp32"  # concrete: fp32 | bf16 | fp16 (weights, activations, KV cache)
    kv_cache_memory_fraction: float = DEFAULT_KV_MEMORY_FRACTION  # CUDA: share of free memory after weights
    cuda_graphs: bool = False  # capture decode steps as CUDA graphs per batch bucket (CUDA only)
    tensor_parallel_size: int = 1  # ranks sharding heads and MLP (one process and device each)
    prefix_cache: bool = True  # keep full KV pages keyed by their token prefix; reuse them across requests
    prefix_cache_max_pages: int | None = None  # cached pages indexed at most; None = any free page may hold one

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
        positive("kv_cache_mib", self.kv_cache_mib, allow_none=True)
        positive("tensor_parallel_size", self.tensor_parallel_size)
        positive("prefix_cache_max_pages", self.prefix_cache_max_pages, allow_none=True)
        if not isinstance(self.prefix_cache, bool):
            raise ValueError(f"EngineConfig.prefix_cache={self.prefix_cache!r} is invalid; accepted: True or False")
        dev = self.device
        if not (dev == "cpu" or (dev.startswith("cuda:") and dev[5:].isdigit())):
            raise ValueError(f"EngineConfig.device={dev!r} is invalid; accepted: cpu or cuda:N "
                             "(resolve 'auto'/'cuda' with EngineConfig.resolve)")
        if self.dtype not in DTYPES:
            raise ValueError(f"EngineConfig.dtype={self.dtype!r} is invalid; accepted: {', '.join(DTYPES)}")
        frac = self.kv_cache_memory_fraction
        if isinstance(frac, bool) or not isinstance(frac, (int, float)) or not 0 < frac <= 1:
            raise ValueError(f"EngineConfig.kv_cache_memory_fraction={frac!r} is invalid; accepted: a number in (0, 1]")
        if self.cuda_graphs and dev == "cpu":
            raise ValueError("EngineConfig.cuda_graphs=True needs a CUDA device; accepted on cpu: cuda_graphs=False")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)

    @classmethod
    def resolve(cls, *, device: str = "auto", dtype: str = "auto", cuda_graphs: bool | None = None,
                cuda_available: bool | None = None, cuda_count: int | None = None, **kw) -> "EngineConfig":
        """Build a config from user choices (``auto`` allowed). The only place that asks the host about CUDA
        (unless the facts are passed in). cuda_graphs None = on for CUDA, off for CPU."""
        if cuda_available is None:
            cuda_available = torch.cuda.is_available()
        if cuda_count is None:
            cuda_count = torch.cuda.device_count() if cuda_available else 0
        dev = resolve_device(device, cuda_available=cuda_available, cuda_count=cuda_count)
        tp = kw.get("tensor_parallel_size", 1)
        if dev != "cpu" and isinstance(tp, int) and tp > 1 and int(dev[5:]) + tp > cuda_count:
            raise ValueError(f"tensor_parallel_size={tp} on {dev} needs devices {dev}..cuda:{int(dev[5:]) + tp - 1}, "
                             f"but this host has {cuda_count}; accepted: tensor_parallel_size <= {cuda_count - int(dev[5:])}")
        graphs = (dev != "cpu") if cuda_graphs is None else bool(cuda_graphs)
        if graphs and dev == "cpu":
            raise ValueError("--cuda-graphs needs a CUDA device; the engine runs on cpu")
        return cls(device=dev, dtype=resolve_dtype(dtype, dev), cuda_graphs=graphs, **kw)


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int | None = None  # per-request RNG seed; None = engine RNG
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    min_p: float = 0.0  # 0 = off; keeps tokens with p >= min_p * p_max
    repetition_penalty: float = 1.0  # 1 = off; HF/vLLM: seen logits l > 0 -> l / r, else l * r
    frequency_penalty: float = 0.0  # OpenAI: l -= f * count(token in output)
    presence_penalty: float = 0.0  # OpenAI: l -= p * (token in output)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    logprobs: int | None = None  # None = off; n >= 0 = the chosen token's logprob plus the top n
    stop_token_ids: tuple[int, ...] = ()  # tokens that end the request (like EOS; not in the text)
    grammar: str | None = None  # structured-output grammar (JSON: see server/openai/structured.py); None = free text
    prompt_logprobs: int | None = None  # None = off; n >= 0 = each prompt token's logprob (after the first) + top n

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
        for name, lo, hi in (("min_p", 0.0, 1.0), ("repetition_penalty", 1e-3, 100.0),
                             ("frequency_penalty", -2.0, 2.0), ("presence_penalty", -2.0, 2.0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not lo <= v <= hi:
                raise InvalidRequest(f"{name}={v!r} is invalid; accepted: a number in [{lo:g}, {hi:g}]")
        bias = tuple((int(t), float(b)) for t, b in (self.logit_bias.items() if isinstance(self.logit_bias, dict)
                                                     else self.logit_bias))
        if any(t < 0 or not math.isfinite(b) for t, b in bias):
            raise InvalidRequest(f"logit_bias={self.logit_bias!r} is invalid; accepted: token id -> finite bias")
        object.__setattr__(self, "logit_bias", bias)
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= 20):
                raise InvalidRequest(f"{name}={v!r} is invalid; accepted: None or an integer in [0, 20]")

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE or self.top_k == 1

    def for_choice(self, index: int) -> "SamplingParams":
        """The params of choice ``index`` of an n > 1 request: the same, seeded ``seed + index`` when seeded (so
        choice i equals a lone request with that seed, in PD and monolithic runs alike); unseeded stays unseeded
        (the engine draws each fork its own seed)."""
        if index == 0 or self.seed is None:
            return self
        return replace(self, seed=(self.seed + index) % SEED_LIMIT)


@dataclass(frozen=True)
class StepOutput:
    request_id: str
    new_token_ids: list[int]
    text_delta: str
    finished: bool
    finish_reason: FinishReason | None = None
    error: str | None = None  # finish_reason == "error": why the engine failed this request alone
    error_code: str | None = None  # finish_reason == "error": the cause's API code when it is the request's (a grammar)
    # params.logprobs set: one (logprob, [(token id, logprob)] top-n) per new_token_ids entry, else None
    logprobs: list | None = None
    # params.prompt_logprobs set, on the request's first output: one entry per prompt token after the first
    prompt_logprobs: list | None = None
    # on a request's first output: prompt tokens whose KV came from the prefix cache (usage.cached_tokens), else None
    cached_tokens: int | None = None
