"""Kernel tests: Triton on CUDA when present, else Triton's CPU interpreter.

What Triton 3.x reads, and when (checked on triton 3.9 in this venv):

* ``TRITON_INTERPRET`` is read through ``triton.knobs.runtime.interpret`` each time a
  ``@triton.jit`` decorator runs. Triton's own library functions (``tl.max``,
  ``tl.sum``, ``tl.cdiv``...) are decorated when ``triton`` is first imported, so the
  variable must be set before that first import or interpreted kernels fail with
  "Cannot call @triton.jit'd outside of the scope of a kernel".
* The knob is read again at launch (e.g. Triton's lazily imported gluon package asserts
  it on the first interpreted launch); ``triton_decode_attention`` sets the knob around
  its CPU launches itself, so the process environment does not have to keep it.
* pdstack's own kernels are wrapped for the interpreter at launch when their tensors
  are on CPU, so it does not matter whether they were decorated with the variable set.

So this file sets ``TRITON_INTERPRET=1`` only around the first ``import triton`` (at
import time, before any kernel test module runs) and restores the environment at
once: other tests in the same pytest process see the environment they started with,
and ``PDRT_ATTENTION_BACKEND=auto`` never picks the interpreter anyway. No other
pdstack module imports Triton at import time (``pdruntime.kernels`` loads it lazily),
so in a normal ``make test`` run Triton is first imported here. If something did
import Triton earlier without the variable, ``TRITON_MODE`` says so and the Triton
tests re-run in a fresh process (``test_triton_sweep_in_fresh_process``).
"""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch

UNAVAILABLE = "unavailable"


def _prepare_triton() -> str:
    """``"cuda"``, ``"interpreter"`` or ``"unavailable: <reason>"``."""
    if importlib.util.find_spec("triton") is None:
        return f"{UNAVAILABLE}: triton is not installed"
    if torch.cuda.is_available():
        return "cuda"
    if "triton" not in sys.modules:
        previous = os.environ.get("TRITON_INTERPRET")
        os.environ["TRITON_INTERPRET"] = "1"
        try:
            import triton.language  # noqa: F401  (decorates Triton's library for the interpreter)
        finally:
            if previous is None:
                del os.environ["TRITON_INTERPRET"]
            else:
                os.environ["TRITON_INTERPRET"] = previous
    from pdruntime.kernels.decode_attention import triton_interpreter_active

    if triton_interpreter_active():
        return "interpreter"
    return f"{UNAVAILABLE}: triton was imported before tests/kernels/conftest.py without TRITON_INTERPRET=1"


TRITON_MODE = _prepare_triton()


@pytest.fixture(scope="session")
def triton_mode() -> str:
    return TRITON_MODE


@pytest.fixture(scope="session")
def triton_device(triton_mode: str) -> torch.device:
    """Device the Triton tests run on; skips when they run in a fresh process instead."""
    if triton_mode.startswith(UNAVAILABLE):
        pytest.skip(f"Triton cannot run in this process ({triton_mode}); "
                    "test_triton_sweep_in_fresh_process runs these tests in a fresh one")
    return torch.device("cuda" if triton_mode == "cuda" else "cpu")


def make_paged_case(lens: list[int], *, num_kv_heads: int, group: int, head_dim: int, page: int,
                    dtype: torch.dtype = torch.float32, seed: int = 0, device: torch.device | str = "cpu"):
    """Random paged decode inputs shaped like the engine's, with hostile padding.

    Pages are scattered over a pool larger than needed. Every slot no sequence owns,
    including slots past each length inside its last page, holds NaN, and block-table
    entries past a sequence's pages hold an out-of-range page id: a kernel that reads
    anything it should not shows NaN or faults.
    Returns ``q, k_cache, v_cache, block_table, seq_lens``.
    """
    gen = torch.Generator().manual_seed(seed)
    batch = len(lens)
    pages_needed = [-(-n // page) for n in lens]
    max_pages = max(pages_needed) + 2
    pool = sum(pages_needed) + 3
    k_cache = torch.full((pool, page, num_kv_heads, head_dim), float("nan"), dtype=torch.float64)
    v_cache = torch.full_like(k_cache, float("nan"))
    block_table = torch.full((batch, max_pages), pool + 1000, dtype=torch.int32)
    order = torch.randperm(pool, generator=gen)
    used = 0
    for b, n in enumerate(lens):
        ids = order[used:used + pages_needed[b]]
        used += pages_needed[b]
        block_table[b, :len(ids)] = ids.to(torch.int32)
        for t in range(pages_needed[b]):
            filled = min(page, n - t * page)
            k_cache[ids[t], :filled] = torch.randn(filled, num_kv_heads, head_dim, generator=gen, dtype=torch.float64)
            v_cache[ids[t], :filled] = torch.randn(filled, num_kv_heads, head_dim, generator=gen, dtype=torch.float64)
    q = torch.randn(batch, num_kv_heads * group, head_dim, generator=gen, dtype=torch.float64)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    return (q.to(dtype).to(device), k_cache.to(dtype).to(device), v_cache.to(dtype).to(device),
            block_table.to(device), seq_lens.to(device))


@pytest.fixture(scope="session")
def paged_case():
    return make_paged_case


def max_row_rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max over (sequence, head) of ``max|out - ref| / max|ref|`` along the head dim; NaN -> inf."""
    out64 = out.detach().cpu().double()
    err = (out64 - ref).abs().amax(-1) / ref.abs().amax(-1).clamp_min(1e-30)
    return float("inf") if torch.isnan(out64).any() else float(err.max())


@pytest.fixture(scope="session")
def rel_err():
    return max_row_rel_err
