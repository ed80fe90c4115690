"""Tensor-parallel sharding of a Llama model (Megatron style) and the one collective it needs.

Rank ``r`` of ``size`` holds query heads ``[r*Hq/size, (r+1)*Hq/size)``, the KV heads they attend with,
and MLP columns ``[r*I/size, (r+1)*I/size)``: q/k/v and gate/up are split by output rows (column-
parallel), o and down by input columns (row-parallel), so each layer needs one all-reduce (sum) after
o and one after down. Embedding, norms and lm_head are replicated: every rank ends with full logits.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import torch

from .config import LlamaConfig, ModelLoadError


@dataclass(frozen=True)
class TPShard:
    """This process's place in a tensor-parallel group."""

    rank: int
    size: int
    group: Any = None  # torch.distributed ProcessGroup; None = the default group

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"TP rank {self.rank} is outside a group of {self.size}")


def shard_config(cfg: LlamaConfig, size: int) -> LlamaConfig:
    """The per-rank architecture: heads, KV heads and MLP width divided by ``size``.

    Raises ModelLoadError when the model cannot be split that way, naming what would be accepted."""
    if size == 1:
        return cfg
    bad = [(n, v) for n, v in (("num_attention_heads", cfg.num_heads), ("num_key_value_heads", cfg.num_kv_heads),
                               ("intermediate_size", cfg.intermediate_size)) if v % size]
    if bad:
        ok = [d for d in range(1, cfg.num_kv_heads + 1)
              if cfg.num_heads % d == 0 and cfg.num_kv_heads % d == 0 and cfg.intermediate_size % d == 0]
        raise ModelLoadError(f"tensor_parallel_size={size} does not divide the model's "
                             + ", ".join(f"{n}={v}" for n, v in bad) + f"; accepted: one of {ok}")
    return dataclasses.replace(cfg, num_heads=cfg.num_heads // size, num_kv_heads=cfg.num_kv_heads // size,
                               intermediate_size=cfg.intermediate_size // size)


def all_reduce_fn(tp: TPShard | None) -> Callable[[torch.Tensor], None] | None:
    """In-place sum over the TP group, or None when there is no group (the caller skips the call)."""
    if tp is None or tp.size == 1:
        return None
    import torch.distributed as dist

    group = tp.group

    def all_reduce(t: torch.Tensor) -> None:
        dist.all_reduce(t, group=group)

    return all_reduce
