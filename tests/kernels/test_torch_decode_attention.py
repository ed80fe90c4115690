"""The vectorised torch path (CPU serving path and fallback) against the float64 oracle."""

from __future__ import annotations

import itertools

import pytest
import torch

from pdruntime.kernels import reference
from pdruntime.kernels.decode_attention import KernelConfig, decode_attention
from pdruntime.kernels.reference import reference_decode_attention, torch_decode_attention

TORCH_CFG = KernelConfig(backend="torch", device="cpu", num_sms=1, target_ctas=0, max_splits=32)

# The torch path is cheap, so this is the full grid over batch x GQA x head dim x page.
GRID = list(itertools.product((1, 3, 8), (1, 3, 8), (64, 128), (16, 7)))


@pytest.mark.parametrize("batch, group, head_dim, page", GRID)
def test_matches_float64_reference(batch, group, head_dim, page, paged_case, rel_err):
    lens = [(1, 2048, 17, 16, 300, 65, 1000, 2)[j % 8] for j in range(batch)]
    q, k, v, bt, seq_lens = paged_case(lens, num_kv_heads=2, group=group, head_dim=head_dim, page=page,
                                       seed=batch * 100 + group)
    out = torch.full_like(q, float("nan"))
    assert decode_attention(q, k, v, bt, seq_lens, config=TORCH_CFG, out=out) is out
    assert rel_err(out, reference_decode_attention(q, k, v, bt, seq_lens)) <= 1e-5


def test_batch_chunking_for_long_contexts_gives_the_same_answer(paged_case, rel_err, monkeypatch):
    # A tiny gather budget forces one sequence per chunk.
    q, k, v, bt, seq_lens = paged_case([3000, 5, 1, 700], num_kv_heads=3, group=3, head_dim=64, page=16, seed=4)
    ref = reference_decode_attention(q, k, v, bt, seq_lens)
    monkeypatch.setattr(reference, "_GATHER_BUDGET", 1)
    assert rel_err(torch_decode_attention(q, k, v, bt, seq_lens), ref) <= 1e-5


@pytest.mark.parametrize("dtype, tol", [(torch.float16, 2e-3), (torch.bfloat16, 1e-2), (torch.float64, 1e-12)])
def test_low_and_high_precision_inputs(dtype, tol, paged_case, rel_err):
    q, k, v, bt, seq_lens = paged_case([40, 513, 1], num_kv_heads=3, group=3, head_dim=64, page=16, dtype=dtype, seed=8)
    out = torch_decode_attention(q, k, v, bt, seq_lens)
    assert out.dtype == dtype
    assert rel_err(out, reference_decode_attention(q, k, v, bt, seq_lens)) <= tol


def test_sm_scale_is_applied(paged_case, rel_err):
    q, k, v, bt, seq_lens = paged_case([33, 200], num_kv_heads=1, group=4, head_dim=64, page=16, seed=6)
    ref = reference_decode_attention(q, k, v, bt, seq_lens, sm_scale=0.05)
    assert rel_err(torch_decode_attention(q, k, v, bt, seq_lens, sm_scale=0.05), ref) <= 1e-5
    assert rel_err(torch_decode_attention(q, k, v, bt, seq_lens), ref) > 1e-2  # the default scale differs


def test_oracle_agrees_with_dense_sdpa():
    # The oracle itself, checked against torch's SDPA on a dense (one page per sequence) cache.
    torch.manual_seed(0)
    q = torch.randn(2, 6, 64, dtype=torch.float64)
    k = torch.randn(2, 50, 2, 64, dtype=torch.float64)
    v = torch.randn(2, 50, 2, 64, dtype=torch.float64)
    bt = torch.tensor([[0], [1]], dtype=torch.int32)
    lens = torch.tensor([50, 50], dtype=torch.int32)
    kk = k.transpose(1, 2).repeat_interleave(3, dim=1)  # [B, Hq, L, D]
    vv = v.transpose(1, 2).repeat_interleave(3, dim=1)
    dense = torch.nn.functional.scaled_dot_product_attention(q[:, :, None], kk, vv)[:, :, 0]
    torch.testing.assert_close(reference_decode_attention(q, k, v, bt, lens), dense)


def test_layout_mistakes_are_rejected(paged_case):
    q, k, v, bt, seq_lens = paged_case([10], num_kv_heads=2, group=2, head_dim=64, page=16)
    with pytest.raises(AssertionError, match="int32"):
        torch_decode_attention(q, k, v, bt.long(), seq_lens)
    with pytest.raises(AssertionError, match="multiple"):
        torch_decode_attention(q[:, :3], k, v, bt, seq_lens)
    with pytest.raises(AssertionError, match=">= 1 token"):
        torch_decode_attention(q, k, v, bt, torch.zeros_like(seq_lens))


def test_garbage_past_the_length_never_leaks_but_nan_inside_does(paged_case, rel_err):
    # paged_case fills every unowned slot with NaN: the masked path must ignore them.
    lens = [5, 40, 17]
    q, k, v, bt, seq_lens = paged_case(lens, num_kv_heads=1, group=3, head_dim=64, page=16, seed=12)
    ref = reference_decode_attention(q, k, v, bt, seq_lens)
    assert rel_err(torch_decode_attention(q, k, v, bt, seq_lens), ref) <= 1e-5
    # Same pool with finite garbage instead of NaN: the fast path (no V masking) is exact too.
    k2 = torch.nan_to_num(k, nan=1e4)
    v2 = torch.nan_to_num(v, nan=-1e4)
    assert rel_err(torch_decode_attention(q, k2, v2, bt, seq_lens), ref) <= 1e-5
    # A NaN inside a sequence is real data: it must show in that sequence only.
    page, slot = int(bt[1, 1]), 3  # token 19 of sequence 1
    v2[page, slot, 0, 0] = float("nan")
    out = torch_decode_attention(q, k2, v2, bt, seq_lens)
    assert torch.isnan(out[1]).any() and not torch.isnan(out[[0, 2]]).any()


def test_query_dtype_may_differ_from_the_cache(paged_case, rel_err):
    q, k, v, bt, seq_lens = paged_case([30, 100], num_kv_heads=1, group=3, head_dim=64, page=16,
                                       dtype=torch.bfloat16, seed=13)
    out = torch_decode_attention(q.float(), k, v, bt, seq_lens)
    assert out.dtype == torch.float32
    assert rel_err(out, reference_decode_attention(q, k, v, bt, seq_lens)) <= 1e-2


def test_inference_mode_and_normal_calls_share_the_workspace(paged_case, rel_err):
    # The engine's decode step runs under torch.inference_mode(); tests and tools do not.
    # Gather buffers first allocated in one mode must stay writable in the other.
    q, k, v, bt, seq_lens = paged_case([100, 37], num_kv_heads=1, group=3, head_dim=64, page=16, seed=14)
    ref = reference_decode_attention(q, k, v, bt, seq_lens)
    big = paged_case([3000, 20], num_kv_heads=1, group=3, head_dim=64, page=16, seed=15)
    with torch.inference_mode():
        torch_decode_attention(*big)  # grows the buffers inside inference mode
        assert rel_err(torch_decode_attention(q, k, v, bt, seq_lens), ref) <= 1e-5
    assert rel_err(torch_decode_attention(q, k, v, bt, seq_lens), ref) <= 1e-5
    with torch.inference_mode():
        assert rel_err(torch_decode_attention(q, k, v, bt, seq_lens), ref) <= 1e-5
