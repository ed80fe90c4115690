"""Device, dtype and KV-cache sizing decisions: pure functions of what was asked and what the host has.

The engine configuration (``EngineConfig``) is the one owner of the device and dtype. ``auto`` is
resolved here, once, from host facts passed in as arguments (``cuda_available``, ``cuda_count``);
nothing below the engine asks the host again.
"""

from __future__ import annotations

import torch

DEVICE_CHOICES = ("auto", "cpu", "cuda", "cuda:N")
DTYPE_CHOICES = ("auto", "bf16", "fp16", "fp32")
DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_DTYPE_ALIASES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float": "fp32"}
DEFAULT_CPU_KV_MIB = 512  # CPU KV budget when neither --num-blocks nor --kv-cache-mib is given
DEFAULT_KV_MEMORY_FRACTION = 0.85  # CUDA: share of free device memory (after the weights load) for KV


def resolve_device(requested: str, *, cuda_available: bool, cuda_count: int) -> str:
    """'auto' | 'cpu' | 'cuda' | 'cuda:N' -> a concrete device name ('cpu', 'cuda:0', ...).

    auto = cuda:0 when CUDA is available, else cpu. Raises ValueError naming what is accepted."""
    req = str(requested).strip().lower()
    if req == "auto":
        return "cuda:0" if cuda_available and cuda_count > 0 else "cpu"
    if req == "cpu":
        return "cpu"
    if req == "cuda" or req.startswith("cuda:"):
        index_s = req[5:] if req.startswith("cuda:") else "0"
        if not index_s.isdigit():
            raise ValueError(f"device {requested!r} is not accepted; accepted: {', '.join(DEVICE_CHOICES)}")
        if not cuda_available or cuda_count == 0:
            raise ValueError(f"device {requested!r} was asked for but this host has no usable CUDA device; "
                             "accepted here: cpu or auto")
        index = int(index_s)
        if index >= cuda_count:
            raise ValueError(f"device {requested!r}: this host has {cuda_count} CUDA device(s); "
                             f"accepted: cuda:0..cuda:{cuda_count - 1}")
        return f"cuda:{index}"
    raise ValueError(f"device {requested!r} is not accepted; accepted: {', '.join(DEVICE_CHOICES)}")


def resolve_dtype(requested: str, device: str) -> str:
    """'auto' | 'bf16' | 'fp16' | 'fp32' (or torch names) -> 'bf16' | 'fp16' | 'fp32'.

    auto = bf16 on CUDA, fp32 on CPU."""
    req = str(requested).strip().lower()
    req = _DTYPE_ALIASES.get(req, req)
    if req == "auto":
        return "bf16" if device.startswith("cuda") else "fp32"
    if req not in DTYPES:
        raise ValueError(f"dtype {requested!r} is not accepted; accepted: {', '.join(DTYPE_CHOICES)}")
    return req


def rank_device(device: str, rank: int) -> str:
    """The device of TP rank ``rank``: cpu stays cpu; cuda:B -> cuda:(B + rank), one GPU per rank."""
    if device == "cpu":
        return "cpu"
    base = int(device.split(":", 1)[1]) if ":" in device else 0
    return f"cuda:{base + rank}"


def kv_cache_blocks(bytes_per_block: int, *, useful_blocks: int, num_blocks: int | None, kv_cache_mib: int | None,
                    memory_fraction: float, free_bytes: int | None) -> tuple[int, str]:
    """How many KV pages to allocate, and why (for the log and /config).

    Precedence: explicit ``num_blocks`` > explicit ``kv_cache_mib`` > ``memory_fraction`` of
    ``free_bytes`` (CUDA: free device memory after the weights load) > the CPU default budget.
    Never more than ``useful_blocks`` (max_num_seqs full-length sequences) unless pages were given
    explicitly; always at least 1."""
    if num_blocks is not None:
        return num_blocks, "num_blocks"
    if kv_cache_mib is not None:
        budget, source = (kv_cache_mib << 20), f"kv_cache_mib={kv_cache_mib}"
    elif free_bytes is not None:
        budget = int(free_bytes * memory_fraction)
        source = f"kv_cache_memory_fraction={memory_fraction} of {free_bytes >> 20} MiB free"
    else:
        budget, source = DEFAULT_CPU_KV_MIB << 20, f"default {DEFAULT_CPU_KV_MIB} MiB"
    return max(1, min(budget // max(1, bytes_per_block), useful_blocks)), source


def cuda_graph_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """Decode batch sizes captured as CUDA graphs: 1, 2, 4, 8, then every 16, up to max_num_seqs."""
    out = [b for b in (1, 2, 4, 8) if b < max_num_seqs]
    out += list(range(16, max_num_seqs, 16))
    out.append(max_num_seqs)
    return tuple(sorted(set(out)))


def bucket_for(batch: int, buckets: tuple[int, ...]) -> int | None:
    """Smallest captured bucket that holds ``batch`` rows, or None (run eagerly)."""
    for b in buckets:
        if b >= batch:
            return b
    return None
