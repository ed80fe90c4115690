"""Torch paged decode attention: the CPU serving path, the fallback, and the test oracle.

Layout (shared with the Triton kernel and the engine's KV pool):
    q:           [B, Hq, D]
    k_cache:     [num_blocks, BLOCK_SIZE, Hkv, D]   (v_cache the same)
    block_table: [B, max_blocks] int32, page ids; entries past a sequence's length are ignored
    seq_lens:    [B] int32, tokens of context per sequence, each >= 1
    out:         [B, Hq, D], dtype of q

Query head ``h`` attends with KV head ``h // (Hq // Hkv)`` (GQA, consecutive grouping).
Slots past ``seq_len`` may hold anything (even NaN: the pool does not clear pages), so
both K and V are masked, not just the scores.
"""

from __future__ import annotations

import math

import torch

# Gathered K (or V) elements per chunk of the batch in the vectorised path: 16M fp32
# elements = 64 MiB per tensor. Keeps the transient gather bounded for long contexts.
_GATHER_BUDGET = 1 << 24


def check_decode_inputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_table: torch.Tensor, seq_lens: torch.Tensor) -> tuple[int, int, int, int, int]:
    """Assert the shared layout; returns ``(B, Hq, Hkv, D, BLOCK_SIZE)``."""
    assert q.dim() == 3, f"q must be [B, Hq, D], got {tuple(q.shape)}"
    assert k_cache.dim() == 4, f"k_cache must be [num_blocks, BLOCK_SIZE, Hkv, D], got {tuple(k_cache.shape)}"
    assert v_cache.shape == k_cache.shape, f"v_cache {tuple(v_cache.shape)} != k_cache {tuple(k_cache.shape)}"
    batch, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, kv_dim = k_cache.shape
    assert kv_dim == head_dim, f"head dim of q ({head_dim}) != head dim of the cache ({kv_dim})"
    assert num_q_heads % num_kv_heads == 0, f"Hq={num_q_heads} is not a multiple of Hkv={num_kv_heads}"
    assert block_table.dim() == 2 and block_table.shape[0] == batch, \
        f"block_table must be [B={batch}, max_blocks], got {tuple(block_table.shape)}"
    assert seq_lens.shape == (batch,), f"seq_lens must be [B={batch}], got {tuple(seq_lens.shape)}"
    assert block_table.dtype == torch.int32 and seq_lens.dtype == torch.int32, \
        f"block_table and seq_lens must be int32, got {block_table.dtype} and {seq_lens.dtype}"
    assert k_cache.dtype == v_cache.dtype, f"k_cache {k_cache.dtype} != v_cache {v_cache.dtype}"
    return batch, num_q_heads, num_kv_heads, head_dim, block_size


def torch_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_table: torch.Tensor, seq_lens: torch.Tensor,
                           sm_scale: float | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Vectorised paged decode attention (no per-sequence Python loop).

    Gathers the pages of the whole batch up to the longest sequence, masks the tail of
    each sequence, and does one batched GQA matmul + softmax. Large batches with long
    contexts are processed in batch chunks of at most ``_GATHER_BUDGET`` elements.
    Computes in fp32 (fp64 stays fp64) and returns q's dtype; writes ``out`` when given.
    """
    batch, num_q_heads, num_kv_heads, head_dim, block_size = check_decode_inputs(
        q, k_cache, v_cache, block_table, seq_lens)
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim)
    lens_cpu = seq_lens.tolist()  # one small host read; decode already syncs each step
    assert batch == 0 or min(lens_cpu) >= 1, "every sequence needs >= 1 token of context"
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.dtype == q.dtype, "out must be like q"
    if batch == 0:
        return out
    # Sort-free chunking: consecutive rows, each chunk gathers up to its own longest row.
    row_cost = max(lens_cpu) * num_kv_heads * head_dim
    rows = max(1, _GATHER_BUDGET // max(1, row_cost))
    for start in range(0, batch, rows):
        stop = min(batch, start + rows)
        out[start:stop] = _attend_rows(q[start:stop], k_cache, v_cache, block_table[start:stop],
                                       seq_lens[start:stop], max(lens_cpu[start:stop]), block_size, scale)
    return out


def _attend_rows(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                 seq_lens: torch.Tensor, max_len: int, block_size: int, scale: float) -> torch.Tensor:
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    num_pages = -(-max_len // block_size)
    pages = block_table[:, :num_pages].long().clamp_(0, k_cache.shape[0] - 1)  # [B, P]; garbage ids stay in range
    length = num_pages * block_size
    # k, v: [B, P, BLOCK, Hkv, D] -> [B, Hkv, L, D]
    k = k_cache[pages].reshape(batch, length, num_kv_heads, head_dim).transpose(1, 2).to(compute)
    v = v_cache[pages].reshape(batch, length, num_kv_heads, head_dim).transpose(1, 2).to(compute)
    valid = torch.arange(length, device=q.device)[None, :] < seq_lens.to(q.device)[:, None]  # [B, L]
    v = v.masked_fill(~valid[:, None, :, None], 0.0)  # unwritten slots may hold NaN
    qg = q.to(compute).reshape(batch, num_kv_heads, group, head_dim)  # [B, Hkv, G, D]
    scores = torch.matmul(qg, k.transpose(-1, -2)) * scale  # [B, Hkv, G, L]
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)  # masked_fill also replaced NaN scores of unwritten K slots
    return torch.matmul(probs, v).reshape(batch, num_q_heads, head_dim).to(q.dtype)  # [B, Hq, D]


def reference_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_table: torch.Tensor, seq_lens: torch.Tensor,
                               sm_scale: float | None = None) -> torch.Tensor:
    """Float64 oracle: one sequence and one head at a time, token by token from the block table.

    Deliberately written differently from ``torch_decode_attention`` (per-sequence loop,
    explicit page walk, textbook softmax) so the two can check each other. Tests only.
    """
    batch, num_q_heads, num_kv_heads, head_dim, block_size = check_decode_inputs(
        q, k_cache, v_cache, block_table, seq_lens)
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim)
    group = num_q_heads // num_kv_heads
    out = torch.empty(q.shape, dtype=torch.float64)
    for b in range(batch):
        n = int(seq_lens[b])
        token = torch.arange(n)
        page = block_table[b].long()[token // block_size]
        slot = token % block_size
        k = k_cache[page, slot].double()  # [n, Hkv, D]
        v = v_cache[page, slot].double()
        for h in range(num_q_heads):
            kvh = h // group
            s = (k[:, kvh, :] @ q[b, h].double()) * scale  # [n]
            p = torch.exp(s - s.max())
            out[b, h] = (p / p.sum()) @ v[:, kvh, :]
    return out
