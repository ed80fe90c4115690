"""The engine end to end on the Triton decode-attention backend, on the CPU (Triton's interpreter): the same tokens
as the torch path. The kernel alone is tested in tests/kernels; this runs the engine's own wiring of it (backend
choice at load, the per-step split plan, paged caches across page boundaries, a batch of unequal lengths, forks
of n > 1), which otherwise only a GPU host executes.

Each backend runs in a fresh process: Triton's interpreter must be on before Triton's first import, and the
choice (``PDRT_ATTENTION_BACKEND``) is made once, at model load."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

# find_spec, not importorskip: importing Triton here, at collection, without TRITON_INTERPRET would turn its
# interpreter off for the whole pytest process (tests/kernels/conftest.py imports it first, with the variable set)
pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

_SCRIPT = r"""
import json, os, sys
if os.environ["PDRT_ATTENTION_BACKEND"] == "triton":
    import triton  # noqa: F401  (TRITON_INTERPRET=1 is set: the interpreter is on from the first import)
import torch
from pdruntime.engine import Engine, EngineConfig, SamplingParams
from pdruntime.env import RuntimeEnv
from pdruntime.model import load_model

torch.manual_seed(0)
loaded = load_model(sys.argv[1], env=RuntimeEnv.from_environ())
eng = Engine(loaded, EngineConfig(num_blocks=64, block_size=4))
prompts = [[1, 2, 3, 4, 5], [7, 8, 9, 10, 11, 12, 13, 14, 15], [20, 21]]  # unequal, across page boundaries
greedy = eng.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
sp = lambda seed: SamplingParams(max_tokens=6, temperature=0.8, seed=seed, ignore_eos=True)
eng.add_request("f0", [30, 31, 32], sp(7), forks=[("f1", sp(8)), ("f2", sp(9))])  # n = 3: forks of one prompt
forks = {"f0": [], "f1": [], "f2": []}
while eng.has_work():
    for o in eng.step():
        forks[o.request_id] += o.new_token_ids
print(json.dumps({"backend": loaded.model.attention_backend, "greedy": greedy, "forks": forks}))
"""


def _run(backend: str, model: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PDRT_", "TRITON_"))}
    env.update({"PDRT_ATTENTION_BACKEND": backend, "OMP_NUM_THREADS": "1"})
    if backend == "triton":
        env["TRITON_INTERPRET"] = "1"
    p = subprocess.run([sys.executable, "-c", _SCRIPT, model], env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_the_engine_on_triton_under_the_interpreter_gives_the_torch_paths_tokens(tiny_model):
    triton_run, torch_run = _run("triton", tiny_model), _run("torch", tiny_model)
    assert triton_run["backend"] == "kernels.decode_attention[triton]"
    assert torch_run["backend"] == "kernels.decode_attention[torch]"
    assert [len(t) for t in triton_run["greedy"]] == [12, 12, 12]
    assert triton_run["greedy"] == torch_run["greedy"]
    assert [len(v) for v in triton_run["forks"].values()] == [6, 6, 6]
    assert triton_run["forks"] == torch_run["forks"]
