"""Block-quantised linear layers on the CPU: Q4_1 for the model's matmuls, Q8_0 for its output head.

Weights keep GGUF's block formats (see ``pdrt_cpu.c``): the embedded SmolLM2 GGUF stores its linear layers as
Q4_1 and its embedding (tied to the output head) as Q8_0, and re-quantising their dequantised values with the
same rule (min/max over each block of 32; max|w| / 127) gives back the file's own blocks. Scales are fp16, as in
the file: 20 bytes per 32 weights for Q4_1, 34 for Q8_0.

Few activation rows (decode: one per sequence) run the native kernel, which reads 5 (or 8.5) bits a weight
instead of 32 and quantises the activations per block of 32 to 16-bit integers, so the next-token choices stay
fp32's (int8 activations, as llama.cpp's, changed one in 18 on SmolLM2: docs/benchmarks.md). Many rows (prefill
chunks) dequantise the weight into a reused fp32 buffer and take torch's BLAS matmul: that is compute-bound,
and it keeps prefill's numerics those of the fp32 model.

The kernel reads its weights in its own layout (groups of 16 blocks whose bytes give 16 blocks' elements per
vector, then the blocks left in pairs; ``pdrt_cpu.c``'s header): :func:`pack` writes it from each block's codes,
:func:`unpack` reads it back.
"""

from __future__ import annotations

import threading

import numpy as np
import torch
from torch import nn

from .native import native

QK = 32  # weights per block
Q4_1, Q8_0 = 0, 1  # pdrt_cpu.c's format codes
PRE_NONE, PRE_RMSNORM, PRE_SWIGLU = 0, 1, 2  # pdrt_cpu.c's pre-ops

#: activation rows up to which the native kernel beats dequantise + BLAS (measured: bench/decode_cpu.py's
#: 16-sequence row and prefill_cpu.py's chunks, on AVX-512 and on AVX2 hosts)
KERNEL_MAX_ROWS = 32


GB = 16  # blocks per group of the kernel's layout


def quantize_q4_1(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w: [N, K] float, K % 32 == 0 -> (codes [N, K/32, 32] uint8 in 0..15, d, m [N, K/32] f16), w ~ d * q + m.

    q is computed against the fp16-rounded m and d, so d * q + m is the block's best fit in what is stored."""
    n, k = w.shape
    blocks = w.detach().float().reshape(n, k // QK, QK)
    lo, hi = blocks.amin(dim=-1), blocks.amax(dim=-1)  # [N, K/32]
    m = lo.half()
    d = ((hi - m.float()) / 15.0).half()
    df = d.float()
    inv = torch.where(df > 0, 1.0 / df, torch.zeros_like(df))
    q = ((blocks - m.float()[..., None]) * inv[..., None]).round_().clamp_(0, 15).to(torch.uint8)
    return q, d.contiguous(), m.contiguous()


def quantize_q8_0(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w: [N, K] float, K % 32 == 0 -> (codes [N, K/32, 32] uint8 = q + 128, d [N, K/32] f16), w ~ d * q."""
    n, k = w.shape
    blocks = w.detach().float().reshape(n, k // QK, QK)
    d = (blocks.abs().amax(dim=-1) / 127.0).half()
    df = d.float()
    inv = torch.where(df > 0, 1.0 / df, torch.zeros_like(df))
    q = ((blocks * inv[..., None]).round_().clamp_(-127, 127).to(torch.int16) + 128).to(torch.uint8)
    return q, d.contiguous()


def pack(codes: torch.Tensor, fmt: int) -> torch.Tensor:
    """codes [N, nb, 32] uint8 (Q4_1: 0..15; Q8_0: q + 128) -> wq [N, nb * 16 or nb * 32] in the kernel's layout."""
    n, nb, _ = codes.shape
    grouped = nb // GB * GB
    head = codes[:, :grouped].reshape(n, nb // GB, GB, QK // 2, 2)  # [N, group, block k, vector v, s]
    head = head.permute(0, 1, 3, 2, 4)  # vector v's words: (block k, s) -> element 2v + s of block k
    rest = codes[:, grouped:]
    if fmt == Q4_1:  # chunk t: vector 2t in the low nibbles, 2t + 1 in the high ones
        head = head.reshape(n, nb // GB, QK // 4, 2, GB * 2)
        head = head[:, :, :, 0] | (head[:, :, :, 1] << 4)
        rest = rest[..., : QK // 2] | (rest[..., QK // 2:] << 4)  # GGUF's order: low nibble i, high nibble i + 16
    else:
        rest = _pair_blocks(rest)
    return torch.cat([head.reshape(n, -1), rest.reshape(n, -1)], dim=1).contiguous()


def unpack(wq: torch.Tensor, fmt: int) -> torch.Tensor:
    """The inverse of :func:`pack`: wq -> codes [N, nb, 32] uint8."""
    n = wq.shape[0]
    nb = wq.shape[1] * (2 if fmt == Q4_1 else 1) // QK
    grouped = nb // GB * GB
    split = grouped * (QK // 2 if fmt == Q4_1 else QK)
    head, rest = wq[:, :split], wq[:, split:]
    if fmt == Q4_1:
        head = head.reshape(n, nb // GB, QK // 4, 1, GB * 2)
        head = torch.cat([head & 15, head >> 4], dim=3)  # [N, group, t, nibble, 32]
        rest = rest.reshape(n, nb - grouped, QK // 2)
        rest = torch.cat([rest & 15, rest >> 4], dim=2)
    else:
        rest = _unpair_blocks(rest.reshape(n, -1), nb - grouped)
    head = head.reshape(n, nb // GB, QK // 2, GB, 2).permute(0, 1, 3, 2, 4).reshape(n, grouped, QK)
    return torch.cat([head, rest.reshape(n, nb - grouped, QK)], dim=1)


def _pair_blocks(q: torch.Tensor) -> torch.Tensor:
    """q: [N, nb, 32] -> each pair of blocks (2p, 2p + 1) as [b0[:16], b1[:16], b0[16:], b1[16:]]; a lone last block
    stays in element order. -> [N, nb * 32]."""
    n, nb, _ = q.shape
    pairs = nb // 2 * 2
    head = q[:, :pairs].reshape(n, pairs // 2, 2, 2, QK // 2).transpose(2, 3).reshape(n, pairs * QK)
    return torch.cat([head, q[:, pairs:].reshape(n, -1)], dim=1)


def _unpair_blocks(b: torch.Tensor, nb: int) -> torch.Tensor:
    """The inverse of :func:`_pair_blocks`: [N, nb * 32] -> [N, nb, 32]."""
    n = b.shape[0]
    pairs = nb // 2 * 2
    head = b[:, : pairs * QK].reshape(n, pairs // 2, 2, 2, QK // 2).transpose(2, 3).reshape(n, pairs, QK)
    return torch.cat([head, b[:, pairs * QK:].reshape(n, nb - pairs, QK)], dim=1)


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class _Scratch(threading.local):
    """Per-thread fp32 buffer the many-rows path dequantises into (grown once to the largest weight)."""

    buf: torch.Tensor | None = None

    def take(self, numel: int) -> torch.Tensor:
        if self.buf is None or self.buf.numel() < numel:
            with torch.inference_mode(False):  # an ordinary tensor, writable outside inference mode too
                self.buf = torch.empty(numel, dtype=torch.float32)
        return self.buf[:numel]


_scratch = _Scratch()


class QuantLinear(nn.Module):
    """A bias-free Linear whose weight is held as Q4_1 or Q8_0 blocks. Call under torch.inference_mode().

    Built from a float weight (:meth:`from_weight`) or straight from a GGUF file's blocks (:meth:`from_gguf`)."""

    def __init__(self, codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, fmt: int, *,
                 threads: int | None = None) -> None:
        """codes [N, K/32, 32] uint8 (Q4_1: 0..15; Q8_0: q + 128), d and m [N, K/32] f16 (m: Q4_1 only)."""
        super().__init__()
        if fmt not in (Q4_1, Q8_0):
            raise ValueError(f"format {fmt} is not accepted; accepted: Q4_1 ({Q4_1}), Q8_0 ({Q8_0})")
        out_features, blocks, _ = codes.shape
        assert codes.dtype == torch.uint8 and d.shape == (out_features, blocks) and d.dtype == torch.float16
        assert (m is None) == (fmt == Q8_0)
        self.in_features, self.out_features, self.fmt, self.threads = blocks * QK, out_features, fmt, threads
        self.register_buffer("wq", pack(codes, fmt))
        self.register_buffer("d", d.contiguous())
        self.register_buffer("m", None if m is None else m.contiguous())
        self._lib = native()

    @classmethod
    def from_weight(cls, weight: torch.Tensor, fmt: int, *, threads: int | None = None) -> "QuantLinear":
        """A float weight [N, K] (K divisible by 32, on the CPU) quantised to ``fmt``."""
        if weight.shape[1] % QK:
            raise ValueError(f"a quantised Linear needs in_features divisible by {QK}, got {weight.shape[1]}")
        if weight.device.type != "cpu":
            raise ValueError(f"quantised Linear layers run on the CPU, got a weight on {weight.device}")
        if fmt == Q4_1:
            codes, d, m = quantize_q4_1(weight)
        elif fmt == Q8_0:
            (codes, d), m = quantize_q8_0(weight), None
        else:
            raise ValueError(f"format {fmt} is not accepted; accepted: Q4_1 ({Q4_1}), Q8_0 ({Q8_0})")
        return cls(codes, d, m, fmt, threads=threads)

    @classmethod
    def from_gguf(cls, type_name: str, raw: np.ndarray, *, threads: int | None = None) -> "QuantLinear":
        """A GGUF tensor's own blocks, raw: [N, K/32, block bytes] uint8 (rows in the layout torch wants):
        Q4_1 (f16 d, f16 m, 16 bytes of nibbles) or Q8_0 (f16 d, 32 int8), read without dequantising."""
        raw = np.ascontiguousarray(raw)
        d = torch.from_numpy(raw[..., 0:2].copy().view(np.float16)[..., 0])
        if type_name == "Q4_1":
            m = torch.from_numpy(raw[..., 2:4].copy().view(np.float16)[..., 0])
            nibbles = torch.from_numpy(raw[..., 4:].copy())  # GGUF's order: low nibble i, high nibble i + 16
            return cls(torch.cat([nibbles & 15, nibbles >> 4], dim=-1), d, m, Q4_1, threads=threads)
        if type_name == "Q8_0":
            q = torch.from_numpy(raw[..., 2:].copy().view(np.int8)).to(torch.int16) + 128
            return cls(q.to(torch.uint8), d, None, Q8_0, threads=threads)
        raise ValueError(f"GGUF type {type_name} is not a block format of pdstack's kernels; accepted: Q4_1, Q8_0")

    @property
    def format_name(self) -> str:
        return "q4_1" if self.fmt == Q4_1 else "q8_0"

    def _nthreads(self) -> int:
        return self.threads or torch.get_num_threads()

    def dequantized(self) -> torch.Tensor:
        """The weight as f32 [N, K], in the calling thread's reused buffer (valid until its next use)."""
        out = _scratch.take(self.out_features * self.in_features).view(self.out_features, self.in_features)
        self._lib.pdrt_dequantize(self.wq.data_ptr(), self.d.data_ptr(), _ptr(self.m), self.out_features,
                                  self.in_features, self.fmt, out.data_ptr(), self._nthreads())
        return out

    def run(self, x: torch.Tensor, *, pre: int = PRE_NONE, norm: torch.Tensor | None = None, eps: float = 0.0,
            out: torch.Tensor | None = None, accumulate: bool = False) -> torch.Tensor:
        """out[M, N] (+)= pre(x) @ W^T through the native kernel. x: [M, K] f32 rows (for PRE_SWIGLU [M, 2K]:
        gate | up), contiguous along K; pre: PRE_NONE | PRE_RMSNORM (norm [K], eps) | PRE_SWIGLU; accumulate
        adds into ``out`` (the residual stream) instead of overwriting it."""
        rows = x.shape[0]
        assert x.dtype == torch.float32 and x.stride(-1) == 1, "x must be f32 rows contiguous along K"
        assert x.shape[1] == self.in_features * (2 if pre == PRE_SWIGLU else 1), \
            f"x has {x.shape[1]} columns for a Linear of {self.in_features} inputs (pre={pre})"
        if out is None:
            out = torch.empty(rows, self.out_features, dtype=torch.float32)
        assert out.shape == (rows, self.out_features) and out.stride(-1) == 1
        rc = self._lib.pdrt_quant_linear(x.data_ptr(), rows, x.stride(0), self.in_features, pre, _ptr(norm), eps,
                                         self.wq.data_ptr(), self.d.data_ptr(), _ptr(self.m), self.out_features,
                                         self.fmt, out.data_ptr(), out.stride(0), int(accumulate), self._nthreads())
        if rc != 0:
            raise MemoryError(f"pdrt_quant_linear could not allocate its activation buffers ({rows} x "
                              f"{self.in_features})")
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., K] -> [..., N] in f32: the native kernel for few rows, dequantise + BLAS for many."""
        flat = x.reshape(-1, self.in_features)
        if flat.dtype != torch.float32 or flat.stride(-1) != 1:
            flat = flat.float().contiguous()
        if flat.shape[0] <= KERNEL_MAX_ROWS:
            y = self.run(flat)
        else:
            y = torch.nn.functional.linear(flat, self.dequantized())
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, format={self.format_name}"
