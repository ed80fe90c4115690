"""Paged split-K decode attention in Triton (flash-decoding), GQA-grouped.

Read it like Triton's tutorials: the two ``@triton.jit`` kernels, then the wrapper
that checks shapes/strides/dtypes and computes the grids. The torch reference it is
tested against is ``pdruntime.kernels.reference``.

One decode step, B sequences, Hq query heads sharing Hkv KV heads (G = Hq // Hkv):

* stage 1, grid ``(W, Hkv)``: work item ``w`` is one (sequence, split). The CTA loads the
  G query heads of its KV head once, walks its split's KV tokens ``BLOCK_N`` at a time
  through the block table (each K/V tile is read once for all G heads: that is the GQA
  grouping), and keeps an online softmax. It writes the normalised partial output and
  its log2-sum-exp per query head. ``W = sum(splits)``: short sequences in a mixed batch
  get fewer splits and no CTA is launched without work (see ``split_heuristic``).
* stage 2, grid ``(B, Hq)``: merges a sequence's partials with their LSE weights.
  When every sequence has one split, stage 1 writes ``out`` directly and stage 2 is skipped.

On CPU tensors the kernels run through Triton's interpreter (tests), which requires
``TRITON_INTERPRET=1`` before ``triton`` is first imported (see
``decode_attention.triton_interpreter_active``).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Sequence, TypedDict, Unpack

import torch
import triton
import triton.language as tl

from pdruntime.kernels.reference import check_decode_inputs
from pdruntime.kernels.split_heuristic import BLOCK_N, cdiv, normalise_splits

LOG2E = 1.4426950408889634  # softmax in base 2: exp(x) = exp2(x * log2(e))


@triton.jit
def _decode_split_kernel(
    Q, K_cache, V_cache, Block_table, Seq_lens, Num_splits, Work_seq, Work_split,
    Out_partial, Lse_partial, Out,
    sm_scale_log2,  # sm_scale * log2(e)
    stride_qb, stride_qh,  # q: [B, Hq, D], last stride 1
    stride_kp, stride_kt, stride_kh,  # k_cache: [pages, PAGE, Hkv, D], last stride 1
    stride_vp, stride_vt, stride_vh,
    stride_btb,  # block_table: [B, max_blocks], last stride 1
    stride_opw, stride_oph,  # out_partial: [W, Hq, D]
    stride_lpw,  # lse_partial: [W, Hq]
    stride_ob, stride_oh,  # out: [B, Hq, D]
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,  # tokens per KV page (cache BLOCK_SIZE)
    BLOCK_G: tl.constexpr,  # GROUP padded to a power of two >= 16 (tl.dot's minimum M)
    BLOCK_D: tl.constexpr,  # HEAD_DIM padded to a power of two
    BLOCK_N: tl.constexpr,  # KV tokens per loop iteration
    DIRECT: tl.constexpr,  # every sequence has one split: write Out, no partials
    IEEE_DOT: tl.constexpr,  # fp32 cache: exact fp32 dot instead of tf32
):
    pid_w = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.load(Work_seq + pid_w)
    split = tl.load(Work_split + pid_w)
    seq_len = tl.load(Seq_lens + seq)
    n_splits = tl.load(Num_splits + seq)

    # Same partition as split_heuristic.split_bounds: whole BLOCK_N tiles per split.
    blocks_per_split = tl.cdiv(tl.cdiv(seq_len, BLOCK_N), n_splits)
    start = split * blocks_per_split * BLOCK_N
    end = tl.minimum(start + blocks_per_split * BLOCK_N, seq_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    mask_g = offs_g < GROUP
    mask_d = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_g  # query heads of this KV head
    q_ptrs = Q + seq * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=mask_g[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_G, BLOCK_D]
    q = q.to(K_cache.dtype.element_ty)  # tl.dot wants one dtype; the cache's wins

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)  # running max, log2 units
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)  # running sum of exp2
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        # Page of each token from the block table; masked tokens read page 0, never used.
        # int64: page * stride_kp passes 2^31 elements in a large pool (e.g. 64 x 128k tokens).
        pages = tl.load(Block_table + seq * stride_btb + offs_n // PAGE, mask=mask_n, other=0).to(tl.int64)
        slots = offs_n % PAGE
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k_ptrs = K_cache + pages[:, None] * stride_kp + slots[:, None] * stride_kt + kv_head * stride_kh \
            + offs_d[None, :]
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        if IEEE_DOT:
            qk = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            qk = tl.dot(q, tl.trans(k))
        qk = qk * sm_scale_log2
        qk = tl.where(mask_n[None, :], qk, float("-inf"))  # [BLOCK_G, BLOCK_N]
        m_new = tl.maximum(m_i, tl.max(qk, 1))  # finite: every tile has >= 1 valid token
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v_ptrs = V_cache + pages[:, None] * stride_vp + slots[:, None] * stride_vt + kv_head * stride_vh \
            + offs_d[None, :]
        v = tl.load(v_ptrs, mask=kv_mask, other=0.0)  # masked slots read 0, so NaN garbage never enters
        if IEEE_DOT:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    out_mask = mask_g[:, None] & mask_d[None, :]
    if DIRECT:
        out_ptrs = Out + seq * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(out_ptrs, (acc / l_i[:, None]).to(Out.dtype.element_ty), mask=out_mask)
    else:
        # The wrapper never launches an empty split (normalise_splits); should one run
        # anyway it stores zeros and lse = -inf rather than 0/0.
        l_safe = tl.where(l_i > 0, l_i, 1.0)
        o_ptrs = Out_partial + pid_w * stride_opw + heads[:, None] * stride_oph + offs_d[None, :]
        tl.store(o_ptrs, acc / l_safe[:, None], mask=out_mask)
        tl.store(Lse_partial + pid_w * stride_lpw + heads, m_i + tl.log2(l_safe), mask=mask_g)


@triton.jit
def _decode_merge_kernel(
    Out_partial, Lse_partial, Split_offset, Num_splits, Out,
    stride_opw, stride_oph,  # out_partial: [W, Hq, D]
    stride_lpw,  # lse_partial: [W, Hq]
    stride_ob, stride_oh,  # out: [B, Hq, D]
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    first = tl.load(Split_offset + seq)
    n_splits = tl.load(Num_splits + seq)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM

    # Start from split 0 (every sequence has >= 1), then fold in the rest online.
    m = tl.load(Lse_partial + first * stride_lpw + head)  # log2-sum-exp, running max
    acc = tl.load(Out_partial + first * stride_opw + head * stride_oph + offs_d, mask=mask_d, other=0.0)
    denom = tl.exp2(m - m)  # 1.0, as a tensor
    for s in range(1, n_splits):
        w = first + s
        lse = tl.load(Lse_partial + w * stride_lpw + head)
        o = tl.load(Out_partial + w * stride_opw + head * stride_oph + offs_d, mask=mask_d, other=0.0)
        m_new = tl.maximum(m, lse)
        scale_old = tl.exp2(m - m_new)
        weight = tl.exp2(lse - m_new)
        acc = acc * scale_old + weight * o
        denom = denom * scale_old + weight
        m = m_new
    tl.store(Out + seq * stride_ob + head * stride_oh + offs_d, (acc / denom).to(Out.dtype.element_ty), mask=mask_d)


# Stage 1 streams K/V: 4 warps and 2 pipeline stages keep loads in flight per SM.
# Stage 2 reads <= max_splits x D floats per head: one warp is plenty.
STAGE1_LAUNCH = {"num_warps": 4, "num_stages": 2}
STAGE2_LAUNCH = {"num_warps": 1}


def stage1_constexprs(group: int, head_dim: int, page: int, block_n: int, direct: bool,
                      dtype: torch.dtype) -> dict[str, object]:
    return dict(GROUP=group, HEAD_DIM=head_dim, PAGE=page,
                BLOCK_G=max(16, triton.next_power_of_2(group)),  # tl.dot needs M >= 16
                BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_N=block_n, DIRECT=direct,
                IEEE_DOT=dtype == torch.float32)


_TRITON_TYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


def compile_for_target(dtype: torch.dtype, *, group: int, head_dim: int, page: int = 16, block_n: int = BLOCK_N,
                       direct: bool = False, arch: int = 90, q_dtype: torch.dtype | None = None) -> dict[str, int]:
    """Ahead-of-time compile of both kernels to a cubin for ``sm_<arch>``, without a GPU.

    Catches what the CPU interpreter cannot (typing, layouts, shared memory, ptxas) on
    GPU-less CI. Needs a process where Triton was imported without TRITON_INTERPRET.
    Returns the shared memory (bytes) each kernel needs.
    """
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    elem = _TRITON_TYPES[dtype]
    target = GPUTarget("cuda", arch, 32)
    q_elem = _TRITON_TYPES[q_dtype or dtype]
    pointers = {"Q": q_elem, "K_cache": elem, "V_cache": elem, "Out": q_elem, "Out_partial": "fp32",
                "Lse_partial": "fp32", "sm_scale_log2": "fp32"}

    def build(kernel, constexprs, options):
        signature = {}
        for name in kernel.arg_names:
            if name in constexprs:
                signature[name] = "constexpr"
            elif name == "sm_scale_log2":
                signature[name] = "fp32"
            elif name[0].isupper():  # pointer arguments are Capitalised
                signature[name] = "*" + pointers.get(name, "i32")
            else:
                signature[name] = "i32"
        return triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs), target=target,
                              options=options)

    meta1 = stage1_constexprs(group, head_dim, page, block_n, direct, dtype)
    stage1 = build(_decode_split_kernel, meta1, STAGE1_LAUNCH)
    stage2 = build(_decode_merge_kernel, {"HEAD_DIM": head_dim, "BLOCK_D": meta1["BLOCK_D"]}, STAGE2_LAUNCH)
    assert "cubin" in stage1.asm and "cubin" in stage2.asm
    return {"stage1_shared": stage1.metadata.shared, "stage2_shared": stage2.metadata.shared}


_interpreted: dict[object, object] = {}


@contextlib.contextmanager
def _interpreter_knob(device: torch.device):
    """On CPU, hold Triton's ``interpret`` knob on for the launch, then restore it.

    Triton consults the knob at launch too (e.g. its lazily imported gluon package
    asserts it), so an interpreted launch must see it set even when the process env
    was cleaned after ``import triton``. ``scope()`` restores knob and env variable.
    """
    if device.type == "cuda":
        yield
        return
    with triton.knobs.runtime.scope():
        triton.knobs.runtime.interpret = True
        yield


def _launchable(kernel, device: torch.device):
    """The kernel itself on CUDA; on CPU, the same function wrapped for Triton's interpreter.

    Wrapping here (instead of relying on TRITON_INTERPRET at decoration time) means this
    module behaves the same whether or not the variable is set when it is imported;
    only Triton's own library functions depend on the variable at ``import triton``.
    """
    if device.type == "cuda":
        return kernel
    from triton.runtime.interpreter import InterpretedFunction

    if isinstance(kernel, InterpretedFunction):
        return kernel
    if kernel not in _interpreted:
        _interpreted[kernel] = InterpretedFunction(kernel.fn)
    return _interpreted[kernel]


@dataclass(frozen=True)
class SplitPlan:
    """One decode step's work list, built once on the host and shared by every layer.

    Work item ``w`` is (``work_seq[w]``, ``work_split[w]``); ``split_offset[b]`` is the
    first item of sequence ``b``. The four index tensors live on the device, in one buffer.
    """

    lens: tuple[int, ...]  # tokens per sequence (host copy of seq_lens)
    splits: tuple[int, ...]  # KV splits per sequence, each in [1, blocks of work], none empty
    block_n: int
    work_seq: torch.Tensor  # [W] int32
    work_split: torch.Tensor  # [W] int32
    split_offset: torch.Tensor  # [B] int32
    num_splits: torch.Tensor  # [B] int32

    @property
    def num_work(self) -> int:
        return len(self.work_seq)

    @property
    def direct(self) -> bool:
        """Every sequence has one split: stage 1 writes the output, no merge."""
        return all(s == 1 for s in self.splits)


def make_split_plan(lens: Sequence[int], splits: Sequence[int], block_n: int, device: torch.device) -> SplitPlan:
    """Clamp ``splits`` to [1, blocks of work], drop empty trailing splits, build the work list."""
    assert len(splits) == len(lens), f"{len(splits)} split counts for a batch of {len(lens)}"
    assert all(n >= 1 for n in lens), "every sequence needs >= 1 token of context"
    assert block_n & (block_n - 1) == 0 and block_n >= 16, f"block_n={block_n} must be a power of two >= 16"
    splits = [normalise_splits(cdiv(n, block_n), int(s)) for s, n in zip(splits, lens)]
    batch = len(lens)
    counts = torch.tensor(splits, dtype=torch.int32)
    split_offset = torch.cumsum(counts, 0, dtype=torch.int32) - counts
    work_seq = torch.repeat_interleave(torch.arange(batch, dtype=torch.int32), counts)
    num_work = len(work_seq)
    work_split = torch.arange(num_work, dtype=torch.int32) - split_offset[work_seq.long()]
    # One host-to-device copy: [work_seq (W) | work_split (W) | split_offset (B) | num_splits (B)].
    meta = torch.cat([work_seq, work_split, split_offset, counts]).to(device)
    work_seq, work_split, split_offset, num_splits = meta.split([num_work, num_work, batch, batch])
    return SplitPlan(tuple(int(n) for n in lens), tuple(splits), block_n, work_seq, work_split, split_offset,
                     num_splits)


class LaunchOptions(TypedDict, total=False):
    """The optional launch arguments of :func:`triton_decode_attention`."""

    sm_scale: float | None  # softmax scale; None: 1 / sqrt(D)
    block_n: int  # KV positions per inner step (default BLOCK_N)
    poison_workspace: bool  # tests: NaN-fill the partial-output/LSE buffers first, so an unwritten partial shows


_LAUNCH_OPTIONS = frozenset(LaunchOptions.__annotations__)


def triton_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_table: torch.Tensor, seq_lens: torch.Tensor, splits: Sequence[int] | SplitPlan,
                            *, out: torch.Tensor | None = None, **launch: Unpack[LaunchOptions]) -> torch.Tensor:
    """Launch stage 1 (and stage 2 when any sequence is split); returns out: [B, Hq, D].

    splits: KV splits per sequence (from ``num_kv_splits`` or the caller), or a
    ``SplitPlan`` already built for this ``seq_lens`` (no host sync, no copy).
    out: written in place when given (tests pass it pre-filled with NaN).
    launch (:class:`LaunchOptions`): ``sm_scale``, ``block_n``, ``poison_workspace``.
    """
    if launch and not launch.keys() <= _LAUNCH_OPTIONS:
        raise TypeError(f"triton_decode_attention() got unexpected keyword arguments "
                        f"{sorted(launch.keys() - _LAUNCH_OPTIONS)}")
    sm_scale, block_n = launch.get("sm_scale"), launch.get("block_n", BLOCK_N)
    poison_workspace = launch.get("poison_workspace", False)
    batch, num_q_heads, num_kv_heads, head_dim, page = check_decode_inputs(q, k_cache, v_cache, block_table, seq_lens)
    assert q.device == k_cache.device == v_cache.device == block_table.device == seq_lens.device, \
        "q, caches, block_table and seq_lens must be on one device"
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1 and block_table.stride(-1) == 1, \
        "the head dim of q/k/v and the block axis of block_table must be contiguous"
    assert q.dtype in (torch.float16, torch.bfloat16, torch.float32), f"q dtype {q.dtype} not supported"
    assert k_cache.dtype in (torch.float16, torch.bfloat16, torch.float32), f"cache dtype {k_cache.dtype} not supported"
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.dtype == q.dtype and out.stride(-1) == 1, "out must be like q"
    if batch == 0:
        return out
    device = q.device
    plan = splits if isinstance(splits, SplitPlan) else make_split_plan(seq_lens.tolist(), splits, block_n, device)
    assert len(plan.lens) == batch and plan.block_n == block_n and plan.work_seq.device == device, "plan is for another batch"
    assert cdiv(max(plan.lens), page) <= block_table.shape[1], "block_table has fewer pages than seq_lens need"
    group = num_q_heads // num_kv_heads
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim)
    num_work, direct = plan.num_work, plan.direct
    work_seq, work_split, split_offset, num_splits = plan.work_seq, plan.work_split, plan.split_offset, plan.num_splits
    if direct:
        out_partial = torch.empty((1, 1, 1), dtype=torch.float32, device=device)  # unused
        lse_partial = torch.empty((1, 1), dtype=torch.float32, device=device)
    else:
        out_partial = torch.empty((num_work, num_q_heads, head_dim), dtype=torch.float32, device=device)
        lse_partial = torch.empty((num_work, num_q_heads), dtype=torch.float32, device=device)
        if poison_workspace:
            out_partial.fill_(float("nan"))
            lse_partial.fill_(float("nan"))

    # Grids: stage 1 one CTA per (work item, KV head); stage 2 one per (sequence, query head).
    meta1 = stage1_constexprs(group, head_dim, page, block_n, direct, k_cache.dtype)
    cuda = device.type == "cuda"
    with _interpreter_knob(device):
        _launchable(_decode_split_kernel, device)[(num_work, num_kv_heads)](
            q, k_cache, v_cache, block_table, seq_lens, num_splits, work_seq, work_split,
            out_partial, lse_partial, out,
            scale * LOG2E,
            q.stride(0), q.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            block_table.stride(0),
            out_partial.stride(0), out_partial.stride(1),
            lse_partial.stride(0),
            out.stride(0), out.stride(1),
            **meta1, **(STAGE1_LAUNCH if cuda else {}),
        )
        if not direct:
            _launchable(_decode_merge_kernel, device)[(batch, num_q_heads)](
                out_partial, lse_partial, split_offset, num_splits, out,
                out_partial.stride(0), out_partial.stride(1),
                lse_partial.stride(0),
                out.stride(0), out.stride(1),
                HEAD_DIM=head_dim, BLOCK_D=meta1["BLOCK_D"],
                **(STAGE2_LAUNCH if cuda else {}),
            )
    return out
