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
import threading

import torch
import torch.nn.functional as F

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

    Gathers the pages of the whole batch up to the longest sequence into reused
    buffers, masks each sequence's tail, and runs one GQA ``scaled_dot_product_attention``
    over the batch (CPU flash kernel, fp32 accumulation for fp16/bf16). Large batches
    with long contexts go in batch chunks of at most ``_GATHER_BUDGET`` elements.
    Returns q's dtype; writes ``out`` when given.
    """
    batch, num_q_heads, num_kv_heads, head_dim, block_size = check_decode_inputs(
        q, k_cache, v_cache, block_table, seq_lens)
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim)
    lens_cpu = seq_lens.tolist()  # one small host read; decode already syncs each step
    assert batch == 0 or min(lens_cpu) >= 1, "every sequence needs >= 1 token of context"
    assert out is None or (out.shape == q.shape and out.dtype == q.dtype), "out must be like q"
    if batch == 0:
        return out if out is not None else torch.empty_like(q)
    if batch == 1 and q.dtype == k_cache.dtype == torch.float32:
        res = _attend_one_fp32(q, k_cache, v_cache, block_table, lens_cpu[0], block_size, scale)
        return res if out is None else out.copy_(res)
    # Sort-free chunking: consecutive rows, each chunk gathers up to its own longest row.
    row_cost = max(lens_cpu) * num_kv_heads * head_dim
    rows = max(1, _GATHER_BUDGET // max(1, row_cost))
    if rows >= batch and out is None:  # common case: one chunk, no copy into out
        return _attend_rows(q, k_cache, v_cache, block_table, seq_lens, lens_cpu, block_size, scale)
    if out is None:
        out = torch.empty_like(q)
    for start in range(0, batch, rows):
        stop = min(batch, start + rows)
        out[start:stop] = _attend_rows(q[start:stop], k_cache, v_cache, block_table[start:stop],
                                       seq_lens[start:stop], lens_cpu[start:stop], block_size, scale)
    return out


class _Workspace(threading.local):
    """Per-thread gather buffers, grown to the largest step seen and then reused.

    Measured on the CPU serving path: gathering pages into a fresh 25 MB tensor costs
    ~5x a gather into a reused buffer (the fresh allocation is mmap'd and page-faulted
    on first touch every step). Bounded by ``_GATHER_BUDGET`` elements per buffer.
    """

    def __init__(self) -> None:
        self.buffers: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}

    def take(self, name: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        key = (name, dtype, device)
        buf = self.buffers.get(key)
        if buf is None or buf.numel() < numel:
            # A normal tensor even when first needed under torch.inference_mode() (the
            # engine's decode step): an inference tensor could not be written outside it.
            with torch.inference_mode(False):
                buf = self.buffers[key] = torch.empty(numel, dtype=dtype, device=device)
        return buf[:numel]


_workspace = _Workspace()


def _gather_pages(cache: torch.Tensor, pages: torch.Tensor, name: str) -> torch.Tensor:
    """cache[pages] into a reused buffer: [B, P] page ids -> [B, P * BLOCK_SIZE, Hkv, D]."""
    num_blocks, block_size, num_kv_heads, head_dim = cache.shape
    row = block_size * num_kv_heads * head_dim
    flat = pages.reshape(-1)
    out = _workspace.take(name, flat.numel() * row, cache.dtype, cache.device).view(flat.numel(), row)
    torch.index_select(cache.reshape(num_blocks, row), 0, flat, out=out)
    return out.view(pages.shape[0], pages.shape[1] * block_size, num_kv_heads, head_dim)


def _attend_rows(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                 seq_lens: torch.Tensor, lens: list[int], block_size: int, scale: float) -> torch.Tensor:
    batch, num_q_heads, head_dim = q.shape
    max_len = max(lens)
    num_pages = -(-max_len // block_size)
    pages = block_table[:, :num_pages]  # [B, P] int32
    ragged = min(lens) != max_len
    if ragged:  # shorter rows' entries past their pages may be garbage ids: keep them in range
        pages = pages.clamp(0, k_cache.shape[0] - 1)
    # k, v: [B, L, Hkv, D] gathered, viewed as [B, Hkv, max_len, D] (no copy)
    k = _gather_pages(k_cache, pages, "k")[:, :max_len].transpose(1, 2)
    v = _gather_pages(v_cache, pages, "v")[:, :max_len].transpose(1, 2)
    mask = None
    if ragged:  # equal lengths (e.g. B == 1) need no mask after the slice
        mask = torch.arange(max_len, device=q.device)[None, :] < seq_lens.to(q.device)[:, None]  # [B, L]
    qc = q.to(k.dtype)  # SDPA wants one dtype; the cache's wins (e.g. fp32 q over a bf16 cache)
    out = _sdpa_gqa(qc, k, v, mask, scale)
    if mask is not None and not bool(torch.isfinite(out).all()):
        # Slots past a sequence's length may hold NaN/inf (pool pages are not cleared),
        # and 0 * NaN poisons P @ V. Rare, so mask the gathered copies only then; a
        # non-finite value inside a sequence stays non-finite, as it should.
        k.masked_fill_(~mask[:, None, :, None], 0.0)
        v.masked_fill_(~mask[:, None, :, None], 0.0)
        out = _sdpa_gqa(qc, k, v, mask, scale)
    return out.to(q.dtype)


def _attend_one_fp32(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                     seq_len: int, block_size: int, scale: float) -> torch.Tensor:
    """Batch-1 decode (the CPU latency case) as baddbmm -> softmax -> bmm over the gathered pages.

    q: [1, Hq, D] fp32 -> [1, Hq, D]. Exactly ``seq_len`` keys are used, so no mask and no garbage
    slots are involved; the three ops cost a fraction of the SDPA call (its per-call setup dominates
    at one query row). fp32 only: scores and softmax stay in the cache's dtype."""
    _, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    pages = block_table[:, : -(-seq_len // block_size)]  # [1, P]
    k = _gather_pages(k_cache, pages, "k")[0, :seq_len]  # [L, Hkv, D]
    v = _gather_pages(v_cache, pages, "v")[0, :seq_len]
    qg = q.view(num_kv_heads, num_q_heads // num_kv_heads, head_dim)  # [Hkv, G, D], consecutive grouping
    scores = torch.baddbmm(_workspace.take("beta0", 1, q.dtype, q.device).view(1, 1, 1), qg, k.permute(1, 2, 0),
                           beta=0.0, alpha=scale)  # [Hkv, G, L]; beta=0 ignores the (uninitialised) input
    out = torch.bmm(torch.softmax(scores, dim=-1), v.transpose(0, 1))  # [Hkv, G, D]
    return out.view(1, num_q_heads, head_dim)


def _sdpa_gqa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """q: [B, Hq, D]; k, v: [B, Hkv, L, D]; mask: [B, L] bool (True = attend) -> [B, Hq, D]."""
    attn_mask = mask[:, None, None, :] if mask is not None else None
    out = F.scaled_dot_product_attention(q[:, :, None, :], k, v, attn_mask=attn_mask, scale=scale, enable_gqa=True)
    return out[:, :, 0, :]


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
