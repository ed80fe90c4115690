"""Paged decode attention and RoPE + KV store on the CPU, through pdstack's native kernels (``pdrt_cpu.c``).

The torch path (``kernels/reference.py``) gathers every page of the batch into one buffer and runs SDPA over
it: at 8 sequences of ~2,500 tokens that gather alone was a quarter of a decode step. This kernel reads each
sequence's pages where they are, one span of one sequence per work item, all its KV heads, with the query heads
that share a KV head together, online softmax over chunks of 16 tokens, and cuts long contexts into spans merged
by their max and sum when there are fewer work items than threads (flash-decoding). fp32 caches; the caller keeps
the torch path for others.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from .native import native

#: tokens a span must keep when a long context is cut for more parallel work items (shorter spans cost more in
#: the merge than they win in balance)
MIN_SPAN_TOKENS = 64
MAX_GROUP = 16  # query heads per KV head (pdrt_cpu.c's GMAX)


def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the native kernel takes these tensors (fp32 on the CPU, contiguous cache, heads in rows)."""
    return (q.device.type == "cpu" and k_cache.device.type == "cpu" and q.dtype == k_cache.dtype == torch.float32
            and k_cache.is_contiguous() and q.stride(-1) == 1 and q.stride(1) == q.shape[-1]
            and q.shape[1] // k_cache.shape[2] <= MAX_GROUP)


def cpu_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                         seq_lens: torch.Tensor, sm_scale: float | None = None, out: torch.Tensor | None = None,
                         threads: int | None = None) -> torch.Tensor:
    """q: [B, Hq, D] f32 (rows may be strided, e.g. a view into qkv); caches [num_pages, BLOCK, Hkv, D] f32;
    block_table [B, max_pages] int32; seq_lens [B] int32, each >= 1 -> out [B, Hq, D] f32."""
    batch, num_q_heads, head_dim = q.shape
    _, block, num_kv_heads, _ = k_cache.shape
    assert supports(q, k_cache) and v_cache.shape == k_cache.shape and v_cache.is_contiguous(), \
        "cpu_decode_attention takes f32 CPU tensors: q [B, Hq, D] with contiguous heads, contiguous caches"
    assert block_table.dtype == seq_lens.dtype == torch.int32 and block_table.stride(1) == 1 \
        and seq_lens.is_contiguous(), "block_table and seq_lens must be int32, rows contiguous"
    if out is None:
        out = torch.empty(batch, num_q_heads, head_dim, dtype=torch.float32)
    assert out.is_contiguous() and out.shape == q.shape
    if batch == 0:
        return out
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim)
    rc = native().pdrt_paged_attention(
        q.data_ptr(), q.stride(0), batch, num_q_heads, num_kv_heads, head_dim, k_cache.data_ptr(),
        v_cache.data_ptr(), block, block_table.data_ptr(), block_table.stride(0), seq_lens.data_ptr(), scale,
        out.data_ptr(), threads or torch.get_num_threads(), MIN_SPAN_TOKENS)
    if rc != 0:
        raise MemoryError(f"pdrt_paged_attention could not allocate its span buffers ({batch} sequences)")
    return out


class HeadShape(NamedTuple):
    q: int  # query heads
    kv: int  # KV heads
    dim: int  # head dim


def rope_store_kv(qkv: torch.Tensor, heads: HeadShape, positions: torch.Tensor, slots: torch.Tensor,
                  rope: tuple[torch.Tensor, torch.Tensor], caches: tuple[torch.Tensor, torch.Tensor]) -> None:
    """RoPE on q and k of qkv [B, (Hq + 2 Hkv) * D] in place (rotate-half; rope = (cos, sin_signed) [max_pos, D] as
    the model keeps them), then k and v stored at ``slots`` [B] int64 (flat rows of the [num_pages * BLOCK, Hkv, D]
    caches = (k_cache, v_cache))."""
    (cos, sin_signed), (k_cache, v_cache) = rope, caches
    assert qkv.is_contiguous() and qkv.dtype == torch.float32
    assert positions.dtype == slots.dtype == torch.int64 and positions.is_contiguous() and slots.is_contiguous()
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.dtype == torch.float32
    native().pdrt_rope_store_kv(qkv.data_ptr(), qkv.shape[0], heads.q, heads.kv, heads.dim, positions.data_ptr(),
                                cos.data_ptr(), sin_signed.data_ptr(), slots.data_ptr(), k_cache.data_ptr(),
                                v_cache.data_ptr())
