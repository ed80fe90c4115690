"""The Triton kernels compile to GPU machine code (cubin) for real targets, without a GPU.

The CPU interpreter runs kernels as numpy code: it cannot see typing errors, layout
or shared-memory limits, or ptxas failures, which only show when compiling for a
device. Triton compiles ahead of time for a named target with no GPU present, so this
test does that for Ampere (sm_80), Hopper (sm_90) and Blackwell (sm_100). It runs in a
fresh process because this pytest process has Triton in interpreter mode (conftest.py),
where compiling is not possible; its own Triton cache dir keeps it honest (no reuse).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

# (cache dtype, group, head_dim, direct, arch, query dtype): each dtype, GQA ratio 1/3/8,
# both head dims, both stage-1 modes, three architectures and a query dtype that differs
# from the cache's appear at least once.
TARGETS = [
    ("float16", 8, 128, False, 90, "float16"),
    ("bfloat16", 3, 64, True, 80, "bfloat16"),
    ("float32", 1, 128, False, 90, "float32"),
    ("float16", 3, 64, False, 100, "float32"),
]
# Smallest shared memory per block among the targets (sm_80: 163 KiB opt-in, 48 KiB default).
SHARED_LIMIT = 163 * 1024

SCRIPT = """
import json, sys, torch
from pdruntime.kernels.triton_decode_attention import compile_for_target
out = []
for dtype, group, head_dim, direct, arch, q_dtype in json.loads(sys.argv[1]):
    info = compile_for_target(getattr(torch, dtype), group=group, head_dim=head_dim, direct=direct, arch=arch,
                              q_dtype=getattr(torch, q_dtype))
    out.append(info)
print("RESULT " + json.dumps(out))
"""


def test_kernels_compile_to_cubin_for_gpu_targets(tmp_path):
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    proc = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(TARGETS)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    results = json.loads(line[len("RESULT "):])
    assert len(results) == len(TARGETS)
    for target, info in zip(TARGETS, results):
        assert 0 < info["stage1_shared"] <= SHARED_LIMIT, (target, info)
        assert info["stage2_shared"] <= SHARED_LIMIT, (target, info)
