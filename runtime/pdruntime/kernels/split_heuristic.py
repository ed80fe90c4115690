"""Split-K heuristic for paged decode attention (flash-decoding), as pure functions.

Decode attention reads every K/V byte of every sequence once per step, so it is
memory-bound: it is fast when every SM streams K/V at the same time. One CTA handles
one (sequence, KV head, split) and walks ``ceil(tokens / splits)`` tokens of K/V. With
few sequences (small batch, long context) there are too few CTAs to fill the GPU, so
the sequence is cut into splits whose partial results are merged by a second,
cheap kernel (log-sum-exp merge).

The knob that matters is how many CTAs to aim for (``target_ctas``). The incident
pdstack comes from was exactly this knob set by hand to 512 in a serve script: a value
that looked fine on short benchmarks and was suspected on long growing contexts. Here
it is explicit, validated (``RuntimeEnv``) and reported (``KernelConfig.as_dict``),
and the heuristic keeps three invariants whatever the knob says, all unit-tested:

* ``1 <= splits[i] <= max_splits``;
* ``splits[i] <= blocks[i]`` (a split never has less than one block of work);
* every split of every sequence is non-empty under the kernel's own partitioning
  (``split_bounds``), so no CTA is launched without work.
"""

from __future__ import annotations

from typing import Iterable, Sequence

# KV tokens one CTA consumes per loop iteration (the kernel's BLOCK_N). A "block of
# work" below is one such tile; a split smaller than one tile would only add merge cost.
BLOCK_N = 64

# Waves to aim for when the knob is 0 ("derive from the device"). Two waves let one
# CTA's tail overlap the next CTA's loads on the same SM, and keep the merge (stage 2)
# small; more waves only add partial outputs to merge.
DEFAULT_WAVES = 2


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def effective_target_ctas(target_ctas: int, num_sms: int) -> int:
    """CTAs to aim for, rounded up to whole waves of ``num_sms``.

    ``target_ctas == 0`` means "derive from the device": ``DEFAULT_WAVES`` waves. A
    partial last wave leaves SMs idle while the step waits for it, so any explicit
    target is rounded up to a multiple of ``num_sms``.
    """
    if num_sms < 1:
        raise ValueError(f"num_sms={num_sms} must be >= 1")
    if target_ctas < 0:
        raise ValueError(f"target_ctas={target_ctas} must be >= 0 (0 = derive from the device)")
    target = target_ctas if target_ctas > 0 else DEFAULT_WAVES * num_sms
    return cdiv(target, num_sms) * num_sms


def normalise_splits(num_blocks: int, splits: int) -> int:
    """The split count the kernel will actually run for ``splits`` requested.

    The kernel gives each split ``ceil(num_blocks / splits)`` blocks, so asking for
    e.g. 4 splits of 9 blocks yields splits of 3, 3, 3 and an empty fourth. Returning
    ``ceil(num_blocks / ceil(num_blocks / splits))`` (3 here) makes every split non-empty.
    """
    splits = max(1, min(splits, num_blocks))
    return cdiv(num_blocks, cdiv(num_blocks, splits))


def split_bounds(seq_len: int, splits: int, block_n: int = BLOCK_N) -> list[tuple[int, int]]:
    """Token ranges ``[start, end)`` of each split, exactly as the Triton kernel computes them."""
    num_blocks = cdiv(seq_len, block_n)
    blocks_per_split = cdiv(num_blocks, splits)
    bounds = []
    for split in range(splits):
        start = split * blocks_per_split * block_n
        end = min(start + blocks_per_split * block_n, seq_len)
        bounds.append((start, end))
    return bounds


def num_kv_splits(
    seq_lens: Iterable[int] | Sequence[int],
    num_sms: int,
    target_ctas: int,
    max_splits: int,
    *,
    num_kv_heads: int = 1,
    block_n: int = BLOCK_N,
) -> list[int]:
    """Per-sequence KV split counts for one decode step.

    seq_lens: tokens of context per sequence (each >= 1); a list or a CPU tensor.
    num_sms: streaming multiprocessors of the device (1 CTA slot per SM is assumed:
        the kernel is bandwidth-bound, more resident CTAs do not add bandwidth).
    target_ctas: CTAs to aim for per step, 0 = ``DEFAULT_WAVES`` x ``num_sms``.
    max_splits: upper bound per sequence (bounds the partial-output buffer).
    num_kv_heads: the grid has one CTA per (split, KV head); heads multiply CTAs.

    Returns ``splits`` with one entry per sequence; the grid has
    ``num_kv_heads * sum(splits)`` CTAs.
    """
    lens = [int(n) for n in seq_lens]
    if max_splits < 1:
        raise ValueError(f"max_splits={max_splits} must be >= 1")
    if num_kv_heads < 1:
        raise ValueError(f"num_kv_heads={num_kv_heads} must be >= 1")
    if any(n < 1 for n in lens):
        raise ValueError(f"every sequence length must be >= 1, got min {min(lens)}")
    if not lens:
        return []
    target = effective_target_ctas(target_ctas, num_sms)
    blocks = [cdiv(n, block_n) for n in lens]

    # CTA slots per KV head. When the batch alone fills the target there is nothing to
    # gain from splitting: each split adds a partial output write and a merge read.
    slots = target // num_kv_heads
    if len(lens) >= slots:
        return [1] * len(lens)

    # Balance work, not splits: every CTA gets about `chunk` blocks, so a long
    # sequence gets proportionally more splits than a short one in a mixed batch and
    # the step ends when the busiest CTA ends. Start from the ideal chunk and grow it
    # until the per-sequence rounding (ceil) fits in the slots, i.e. in whole waves.
    total_blocks = sum(blocks)
    chunk = max(1, cdiv(total_blocks, slots))
    while True:
        splits = [min(max_splits, cdiv(b, chunk)) for b in blocks]
        if sum(splits) <= slots or chunk >= max(blocks):
            break
        chunk += 1
    # Never more splits than blocks, and never an empty trailing split.
    return [normalise_splits(b, s) for b, s in zip(blocks, splits)]
