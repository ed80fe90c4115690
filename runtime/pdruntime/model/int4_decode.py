"""The int4 decode step: every layer as six calls into pdstack's CPU kernels, no torch op between them.

Batch-1 decode of a small model is a few milliseconds of kernel time, so what surrounds the kernels counts: a
torch op, a module attribute lookup or a ``data_ptr()`` costs about a microsecond each, and a layer of the generic
path makes dozens. :class:`Int4Decoder` is built once per set of weights. It holds each layer's weight pointers
as plain ints and reuses one set of activation buffers per batch size, so a step is 6 x layers ctypes calls:

    qkv  = Wqkv  . rmsnorm(x)          (pdrt_quant_linear, PRE_RMSNORM)
    q, k = rope(q, k); cache[slot] = k, v  (pdrt_rope_store_kv)
    a    = attention(q, cache)          (pdrt_paged_attention; the configured backend when it is not ``cpu``)
    x   += Wo . a                       (pdrt_quant_linear, accumulate)
    gu   = Wgu . rmsnorm(x)             (pdrt_quant_linear, PRE_RMSNORM)
    x   += Wdown . swiglu(gu)           (pdrt_quant_linear, PRE_SWIGLU, accumulate)

Invariant: the weights are never replaced in place after the decoder is built (the model drops its decoder when it
reloads or re-quantises).
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple, Sequence

import torch

from pdruntime.kernels.cpu.attention import MIN_SPAN_TOKENS, supports
from pdruntime.kernels.cpu.native import native
from pdruntime.kernels.cpu.quant import PRE_NONE, PRE_RMSNORM, PRE_SWIGLU, QuantLinear


class _Weight(NamedTuple):
    """One quantised matrix as pdrt_quant_linear takes it."""

    wq: int
    d: int
    m: int | None
    n: int  # out features
    k: int  # in features
    fmt: int

    @classmethod
    def of(cls, ql: QuantLinear) -> "_Weight":
        return cls(ql.wq.data_ptr(), ql.d.data_ptr(), None if ql.m is None else ql.m.data_ptr(), ql.out_features,
                   ql.in_features, ql.fmt)


class _Layer(NamedTuple):
    input_norm: int
    qkv: _Weight
    o: _Weight
    post_norm: int
    gate_up: _Weight
    down: _Weight


class Int4Decoder:
    """Runs :meth:`LlamaModel.decode` for a model whose Linear layers are all :class:`QuantLinear` (no TP)."""

    def __init__(self, model) -> None:
        cfg = model.config
        self.lib = native()
        self.cfg = cfg
        self.model = model  # keeps the weights (and their pointers) alive
        self.layers = [_Layer(l.input_norm.data_ptr(), _Weight.of(l.qkv), _Weight.of(l.o), l.post_norm.data_ptr(),
                              _Weight.of(l.gate_up), _Weight.of(l.down)) for l in model.layers]
        self.head = _Weight.of(model.lm_head)
        self.final_norm = model.norm.data_ptr()
        self.rope = (model.rope_cos.data_ptr(), model.rope_sin.data_ptr())
        self.scale = 1.0 / math.sqrt(cfg.head_dim)
        self._bufs: dict[int, tuple[torch.Tensor, ...]] = {}

    def _buffers(self, batch: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(qkv [B, (Hq + 2 Hkv) D], attention out [B, Hq D], gate_up [B, 2 I]), reused by every step of size B."""
        bufs = self._bufs.get(batch)
        if bufs is None:
            c = self.cfg
            with torch.inference_mode(False):
                bufs = self._bufs[batch] = (torch.empty(batch, c.q_size + 2 * c.kv_size),
                                            torch.empty(batch, c.q_size), torch.empty(batch, 2 * c.intermediate_size))
        return bufs

    def step(self, batch: "DecodeBatch", k_cache: Sequence[torch.Tensor], v_cache: Sequence[torch.Tensor],
             attend: Callable[..., torch.Tensor], native_attention: bool) -> torch.Tensor:
        """One token per sequence -> fp32 logits [B, V] (the batch as :meth:`LlamaModel.decode` takes it).
        native_attention: the configured attention backend is ``cpu`` (else ``attend`` runs it)."""
        c, lib = self.cfg, self.lib
        bsz = batch.token_ids.shape[0]
        hq, hkv, d = c.num_heads, c.num_kv_heads, c.head_dim
        hidden, inter = c.hidden_size, c.intermediate_size
        threads, eps = torch.get_num_threads(), c.rms_norm_eps
        positions, slots = batch.positions.contiguous(), batch.slots.contiguous()
        x = self.model.embed[batch.token_ids]  # [B, H], a fresh tensor: o and down accumulate into it
        qkv, attn, gu = self._buffers(bsz)
        xp, qkvp, attnp, gup = x.data_ptr(), qkv.data_ptr(), attn.data_ptr(), gu.data_ptr()
        qkv_w = qkv.shape[1]

        def linear(w: _Weight, src: tuple[int, int], dst: tuple[int, int], pre: int = PRE_NONE,
                   norm: int | None = None, accumulate: bool = False) -> None:
            """dst (+)= W . pre(src); src, dst: (pointer, row stride in floats) of B rows."""
            if lib.pdrt_quant_linear(src[0], bsz, src[1], w.k, pre, norm, eps, w.wq, w.d, w.m, w.n, w.fmt, dst[0],
                                     dst[1], int(accumulate), threads) != 0:
                raise MemoryError(f"pdrt_quant_linear could not allocate its activation buffers ({bsz} rows)")

        native_attention = native_attention and supports(qkv[:, : hq * d].view(bsz, hq, d), k_cache[0])
        if native_attention:
            table, lens = batch.block_table, batch.seq_lens.contiguous()
            assert table.dtype == lens.dtype == torch.int32 and table.stride(1) == 1
        block = k_cache[0].shape[1]
        for n, layer in enumerate(self.layers):
            kc, vc = k_cache[n], v_cache[n]
            linear(layer.qkv, (xp, hidden), (qkvp, qkv_w), PRE_RMSNORM, layer.input_norm)
            lib.pdrt_rope_store_kv(qkvp, bsz, hq, hkv, d, positions.data_ptr(), self.rope[0], self.rope[1],
                                   slots.data_ptr(), kc.data_ptr(), vc.data_ptr())
            if native_attention:
                if lib.pdrt_paged_attention(qkvp, qkv_w, bsz, hq, hkv, d, kc.data_ptr(), vc.data_ptr(), block,
                                            table.data_ptr(), table.stride(0), lens.data_ptr(), self.scale, attnp,
                                            threads, MIN_SPAN_TOKENS) != 0:
                    raise MemoryError(f"pdrt_paged_attention could not allocate its span buffers ({bsz} sequences)")
            else:
                attn.view(bsz, hq, d).copy_(attend(qkv[:, : hq * d].view(bsz, hq, d), kc, vc, batch.block_table,
                                                   batch.seq_lens))
            linear(layer.o, (attnp, hq * d), (xp, hidden), accumulate=True)
            linear(layer.gate_up, (xp, hidden), (gup, 2 * inter), PRE_RMSNORM, layer.post_norm)
            linear(layer.down, (gup, 2 * inter), (xp, hidden), PRE_SWIGLU, accumulate=True)
        logits = torch.empty(bsz, self.head.n)
        linear(self.head, (xp, hidden), (logits.data_ptr(), self.head.n), PRE_RMSNORM, self.final_norm)
        return logits


class DecodeBatch(NamedTuple):
    """One decode step's inputs, as :meth:`LlamaModel.decode` takes them (all on the CPU)."""

    token_ids: torch.Tensor  # [B] int64
    positions: torch.Tensor  # [B] int64
    slots: torch.Tensor  # [B] int64, flat cache rows of the new tokens
    block_table: torch.Tensor  # [B, max_pages] int32
    seq_lens: torch.Tensor  # [B] int32 = positions + 1
