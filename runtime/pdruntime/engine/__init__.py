"""Serving engine: paged KV block pool, continuous-batching scheduler, sampler."""

from .block_pool import BlockPool
from .config import EngineConfig, InvalidRequest, OutOfBlocks, SamplingParams, StepOutput
from .engine import Engine, load_for
from .kv_cache import KVCache

__all__ = ["BlockPool", "Engine", "EngineConfig", "InvalidRequest", "KVCache", "OutOfBlocks",
           "SamplingParams", "StepOutput", "load_for"]
