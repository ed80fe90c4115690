"""Triton paged split-K decode attention against the float64 oracle.

Runs on CUDA when present, else under Triton's CPU interpreter (see conftest.py).
Every run writes into an output pre-filled with NaN and NaN-poisoned partial buffers,
over a KV pool whose unowned slots are NaN, so an element the kernel fails to write,
or a slot it reads but should not, fails the check (NaN never passes: it counts as
an infinite error).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from pdruntime.kernels.decode_attention import KernelConfig, decode_attention
from pdruntime.kernels.reference import reference_decode_attention
from pdruntime.kernels.split_heuristic import num_kv_splits

# Sampled sweep. The full grid (5 batches x 3 GQA ratios x 2 head dims x 6 split
# settings x 3 page sizes x 2 KV-head counts x lengths) is ~1000 interpreter runs, far
# over the ~3 minute budget on 2 shared cores. Case i takes value i mod len(axis) of
# every axis instead, so 18 cases cover every value of every axis, and the axis
# lengths (5, 3, 2, 6, 3, 2) are not all multiples of each other, so values meet
# different partners. Lengths come from a pool of block-boundary values (1, 63, 64,
# 65, 2047, 2048, ...) with a per-case stride, so batches mix lengths.
BATCHES = (1, 2, 3, 5, 8)
GROUPS = (1, 3, 8)  # GQA ratio Hq / Hkv
HEAD_DIMS = (64, 128)
SPLITS = (None, 1, 2, 3, 7, 32)  # None: the heuristic's choice on a 16-SM device
PAGES = (16, 32, 8)  # tokens per KV page (cache BLOCK_SIZE)
KV_HEADS = (1, 2)
LENGTH_POOL = (1, 2, 15, 16, 17, 63, 64, 65, 127, 129, 300, 1000, 2047, 2048)
NUM_CASES = 18


def _case(i: int) -> dict:
    batch = BATCHES[i % len(BATCHES)]
    lens = [LENGTH_POOL[(5 * i + 3 * j) % len(LENGTH_POOL)] for j in range(batch)]
    return dict(lens=lens, group=GROUPS[i % len(GROUPS)], head_dim=HEAD_DIMS[i % len(HEAD_DIMS)],
                splits=SPLITS[i % len(SPLITS)], page=PAGES[i % len(PAGES)], num_kv_heads=KV_HEADS[i % len(KV_HEADS)])


CASES = [_case(i) for i in range(NUM_CASES)]


def _coverage() -> dict[str, set]:
    return {axis: {c[axis] if axis != "lens" else len(c["lens"]) for c in CASES}
            for axis in ("lens", "group", "head_dim", "splits", "page", "num_kv_heads")}


def test_sampled_sweep_covers_every_axis_value():
    seen = _coverage()
    assert seen["lens"] == set(BATCHES)
    assert seen["group"] == set(GROUPS)
    assert seen["head_dim"] == set(HEAD_DIMS)
    assert seen["splits"] == set(SPLITS)
    assert seen["page"] == set(PAGES)
    assert seen["num_kv_heads"] == set(KV_HEADS)
    lens = {n for c in CASES for n in c["lens"]}
    assert {1, 2048} <= lens and any(n % 16 for n in lens) and any(len(set(c["lens"])) > 1 for c in CASES)


def _triton_config(device: torch.device, num_sms: int = 16, target_ctas: int = 0, max_splits: int = 32) -> KernelConfig:
    return KernelConfig(backend="triton", device=device.type, num_sms=num_sms, target_ctas=target_ctas,
                        max_splits=max_splits, triton_interpreter=device.type == "cpu")


def _run_poisoned(triton_device, q, k_cache, v_cache, block_table, seq_lens, splits):
    from pdruntime.kernels.triton_decode_attention import triton_decode_attention

    out = torch.full_like(q, float("nan"))
    got = triton_decode_attention(q, k_cache, v_cache, block_table, seq_lens, splits, out=out, poison_workspace=True)
    assert got is out
    return out


@pytest.mark.parametrize("case", CASES, ids=[
    f"b{len(c['lens'])}-g{c['group']}-d{c['head_dim']}-s{c['splits']}-p{c['page']}-h{c['num_kv_heads']}" for c in CASES])
def test_matches_float64_reference(case, triton_device, paged_case, rel_err):
    q, k, v, bt, lens = paged_case(case["lens"], num_kv_heads=case["num_kv_heads"], group=case["group"],
                                   head_dim=case["head_dim"], page=case["page"], seed=len(case["lens"]) * 31 + case["page"],
                                   device=triton_device)
    if case["splits"] is None:
        splits = num_kv_splits(case["lens"], 16, 0, 32, num_kv_heads=case["num_kv_heads"])
    else:
        splits = [case["splits"]] * len(case["lens"])
    out = _run_poisoned(triton_device, q, k, v, bt, lens, splits)
    ref = reference_decode_attention(q.cpu(), k.cpu(), v.cpu(), bt.cpu(), lens.cpu())
    assert rel_err(out, ref) <= 1e-3, f"splits={splits}"


def test_every_split_count_gives_the_same_answer(triton_device, paged_case, rel_err):
    # One 1000-token sequence (16 tiles of 64) at split counts 1..16 and past its blocks.
    q, k, v, bt, lens = paged_case([1000], num_kv_heads=1, group=4, head_dim=64, page=16, seed=7, device=triton_device)
    ref = reference_decode_attention(q.cpu(), k.cpu(), v.cpu(), bt.cpu(), lens.cpu())
    for splits in (1, 2, 3, 4, 5, 6, 9, 15, 16, 17, 1000):
        out = _run_poisoned(triton_device, q, k, v, bt, lens, [splits])
        assert rel_err(out, ref) <= 1e-3, f"splits={splits}"


def test_length_one_with_many_requested_splits(triton_device, paged_case, rel_err):
    q, k, v, bt, lens = paged_case([1, 1, 1], num_kv_heads=2, group=3, head_dim=64, page=16, seed=3, device=triton_device)
    ref = reference_decode_attention(q.cpu(), k.cpu(), v.cpu(), bt.cpu(), lens.cpu())
    assert rel_err(_run_poisoned(triton_device, q, k, v, bt, lens, [32, 32, 32]), ref) <= 1e-3
    # A single token attends only to itself: out == its V, exactly up to rounding.
    torch.testing.assert_close(ref, v.cpu().double()[bt.cpu()[:, 0].long(), 0].repeat_interleave(3, dim=1))


def test_long_context_32k_with_the_incident_target(triton_device, paged_case, rel_err):
    # >= 32k tokens next to a short sequence, split by the heuristic with target 512 CTAs
    # on a 132-SM device (the knob value from the incident): every split must be correct.
    lens_list = [32768 + 37, 5]
    q, k, v, bt, lens = paged_case(lens_list, num_kv_heads=1, group=3, head_dim=64, page=16, seed=11,
                                   device=triton_device)
    splits = num_kv_splits(lens_list, 132, 512, 32, num_kv_heads=1)
    # 514 tiles of 64 tokens capped at 32 splits -> 17 tiles per split -> 31 non-empty splits.
    assert splits == [31, 1]
    ref = reference_decode_attention(q.cpu(), k.cpu(), v.cpu(), bt.cpu(), lens.cpu())
    assert rel_err(_run_poisoned(triton_device, q, k, v, bt, lens, splits), ref) <= 1e-3


def test_fp16_cache(triton_device, paged_case, rel_err):
    q, k, v, bt, lens = paged_case([70, 300, 1], num_kv_heads=2, group=3, head_dim=64, page=16, dtype=torch.float16,
                                   seed=5, device=triton_device)
    ref = reference_decode_attention(q.cpu(), k.cpu(), v.cpu(), bt.cpu(), lens.cpu())
    out = _run_poisoned(triton_device, q, k, v, bt, lens, [1, 3, 1])
    assert out.dtype == torch.float16
    assert rel_err(out, ref) <= 1e-2  # fp16 output rounding (2^-11) plus fp16 probabilities in P @ V


def test_fp32_query_over_fp16_cache(triton_device, paged_case, rel_err):
    q, k, v, bt, lens = paged_case([40, 130], num_kv_heads=1, group=3, head_dim=64, page=16, dtype=torch.float16,
                                   seed=23, device=triton_device)
    ref = reference_decode_attention(q.cpu(), k.cpu(), v.cpu(), bt.cpu(), lens.cpu())
    out = _run_poisoned(triton_device, q.float(), k, v, bt, lens, [1, 2])
    assert out.dtype == torch.float32 and rel_err(out, ref) <= 1e-2


def test_public_entry_point_dispatches_to_triton(triton_device, paged_case, rel_err, monkeypatch):
    from pdruntime.kernels import triton_decode_attention as module

    calls = []
    real = module.triton_decode_attention
    monkeypatch.setattr(module, "triton_decode_attention", lambda *a, **kw: calls.append(a[5]) or real(*a, **kw))
    q, k, v, bt, lens = paged_case([129, 2000], num_kv_heads=1, group=8, head_dim=128, page=16, seed=2,
                                   device=triton_device)
    out = torch.full_like(q, float("nan"))
    got = decode_attention(q, k, v, bt, lens, config=_triton_config(triton_device, num_sms=8), out=out)
    assert got is out and len(calls) == 1 and calls[0].splits == tuple(num_kv_splits([129, 2000], 8, 0, 32))
    ref = reference_decode_attention(q.cpu(), k.cpu(), v.cpu(), bt.cpu(), lens.cpu())
    assert rel_err(out, ref) <= 1e-3
    # num_splits as an int and as a per-sequence list.
    assert rel_err(decode_attention(q, k, v, bt, lens, num_splits=4, config=_triton_config(triton_device)), ref) <= 1e-3
    assert rel_err(decode_attention(q, k, v, bt, lens, num_splits=[1, 5], sm_scale=None,
                                    config=_triton_config(triton_device)), ref) <= 1e-3


def test_split_plan_is_built_once_per_step_and_follows_seq_lens(triton_device, paged_case, rel_err, monkeypatch):
    # Layers of one step share seq_lens: the heuristic (and its host read) runs once.
    # Writing seq_lens in place, or passing a new tensor, must give a fresh plan.
    from pdruntime.kernels import decode_attention as da

    runs = []
    real = da.num_kv_splits
    monkeypatch.setattr(da, "num_kv_splits", lambda lens, *a, **kw: runs.append(list(lens)) or real(lens, *a, **kw))
    monkeypatch.setattr(da, "_plan_cache", da._PlanCache())
    cfg = _triton_config(triton_device, num_sms=4)
    q, k, v, bt, lens = paged_case([200, 700], num_kv_heads=1, group=3, head_dim=64, page=16, seed=21,
                                   device=triton_device)
    for _ in range(3):  # three "layers"
        out = decode_attention(q, k, v, bt, lens, config=cfg)
    assert runs == [[200, 700]]
    assert rel_err(out, reference_decode_attention(q.cpu(), k.cpu(), v.cpu(), bt.cpu(), lens.cpu())) <= 1e-3
    lens -= 1  # in place: the next step is one token shorter (pages stay valid)
    out = decode_attention(q, k, v, bt, lens, config=cfg)
    assert runs[-1] == [199, 699]
    assert rel_err(out, reference_decode_attention(q.cpu(), k.cpu(), v.cpu(), bt.cpu(), lens.cpu())) <= 1e-3
    fresh = torch.tensor([5, 64], dtype=torch.int32, device=triton_device)
    out = decode_attention(q, k, v, bt, fresh, config=cfg)
    assert runs[-1] == [5, 64] and len(runs) == 3
    assert rel_err(out, reference_decode_attention(q.cpu(), k.cpu(), v.cpu(), bt.cpu(), fresh.cpu())) <= 1e-3


def test_split_plan_under_inference_mode_follows_in_place_writes(triton_device, paged_case, rel_err, monkeypatch):
    # The engine's step runs under torch.inference_mode(): seq_lens is then an inference
    # tensor without a version counter, and an in-place write must still give a new plan.
    from pdruntime.kernels import decode_attention as da

    monkeypatch.setattr(da, "_plan_cache", da._PlanCache())
    cfg = _triton_config(triton_device, num_sms=4)
    q, k, v, bt, lens = paged_case([300, 70], num_kv_heads=1, group=3, head_dim=64, page=16, seed=22,
                                   device=triton_device)
    with torch.inference_mode():
        step_lens = lens.clone()
        assert step_lens.is_inference()
        for _ in range(2):
            out = decode_attention(q, k, v, bt, step_lens, config=cfg)
        assert rel_err(out, reference_decode_attention(q.cpu(), k.cpu(), v.cpu(), bt.cpu(), lens.cpu())) <= 1e-3
        step_lens -= 64  # in place, no version counter to bump
        out = decode_attention(q, k, v, bt, step_lens, config=cfg)
    expected = reference_decode_attention(q.cpu(), k.cpu(), v.cpu(), bt.cpu(), (lens - 64).cpu())
    assert rel_err(out, expected) <= 1e-3


def test_grids_group_query_heads_and_skip_the_merge_when_unsplit(triton_device, paged_case, monkeypatch):
    # GQA grouping: stage 1 runs one CTA per (work item, KV head), each loading its K/V
    # tile once for all G query heads, not one CTA per query head. Stage 2 runs only
    # when some sequence is split.
    from pdruntime.kernels import triton_decode_attention as module

    grids = []
    real = module._launchable

    class Recorder:
        def __init__(self, kernel, device):
            self.name, self.launcher = kernel.fn.__name__, real(kernel, device)

        def __getitem__(self, grid):
            grids.append((self.name, tuple(grid)))
            return self.launcher[grid]

    monkeypatch.setattr(module, "_launchable", Recorder)
    q, k, v, bt, lens = paged_case([300, 10, 129], num_kv_heads=2, group=8, head_dim=64, page=16, seed=24,
                                   device=triton_device)
    _run_poisoned(triton_device, q, k, v, bt, lens, [5, 1, 3])  # 300 tokens = 5 tiles; 129 = 3 tiles
    assert grids == [("_decode_split_kernel", (5 + 1 + 3, 2)), ("_decode_merge_kernel", (3, 16))]
    grids.clear()
    _run_poisoned(triton_device, q, k, v, bt, lens, [1, 1, 1])
    assert grids == [("_decode_split_kernel", (3, 2))]


def test_custom_sm_scale(triton_device, paged_case, rel_err):
    q, k, v, bt, lens = paged_case([90], num_kv_heads=1, group=1, head_dim=64, page=16, seed=9, device=triton_device)
    ref = reference_decode_attention(q.cpu(), k.cpu(), v.cpu(), bt.cpu(), lens.cpu(), sm_scale=0.3)
    out = decode_attention(q, k, v, bt, lens, sm_scale=0.3, num_splits=2, config=_triton_config(triton_device))
    assert rel_err(out, ref) <= 1e-3


def test_triton_sweep_in_fresh_process(triton_mode):
    """Fallback: when Triton was imported in this process before the interpreter could be
    enabled, run this file in a fresh interpreter process instead of skipping it."""
    if not triton_mode.startswith("unavailable: triton was imported"):
        pytest.skip(f"Triton tests run in this process ({triton_mode})")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider",
                           "-k", "not fresh_process"], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
