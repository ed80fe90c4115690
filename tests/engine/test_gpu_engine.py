"""The engine on a CUDA GPU (``gpu`` marker; skipped with the reason on hosts without one).

Run by ``make gpu-check`` (bench/gpu_check.py). Models are seeded random checkpoints written on the spot:
GPU hosts may have no package index and little disk.

* bf16 on CUDA vs fp32 on CPU: per position max |logit diff| / max |fp32 logit| <= BF16_TOL, and the same
  greedy token wherever fp32's top-2 margin exceeds 2 x BF16_TOL x max |logit| (there bf16's error cannot
  reorder them);
* the Triton decode-attention path equals the torch path on CUDA;
* CUDA graphs on and off give the same tokens (and graphs were really replayed);
* TP=2 over NCCL equals TP=1, with CUDA graphs captured on both ranks (needs 2 GPUs);
* a PD pair on loopback with its KV cache on the GPU streams a chat completion.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from pdruntime.engine import Engine, EngineConfig, SamplingParams, load_for
from pdruntime.env import RuntimeEnv
from pdruntime.model.testing import write_tiny_checkpoint

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)")]

BF16_TOL = 0.05  # this model in bf16 on CPU: 0.024 worst, 0.015 mean (measured); CUDA bf16 accumulates in fp32 too
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
PROMPTS = [[(7 * i + 3 * j) % 997 + 3 for j in range(n)] for i, n in enumerate((37, 5, 120, 64, 9))]


@pytest.fixture(scope="module")
def realistic_dir(tmp_path_factory) -> str:
    """A seeded random Llama of realistic proportions, small enough to write and load fast."""
    return write_realistic_checkpoint(str(tmp_path_factory.mktemp("gpu-model")))


def write_realistic_checkpoint(path: str) -> str:
    """~62M parameters (250 MB): Llama proportions (head_dim 128, GQA 4:1, MLP 2.75x), 4 layers, 8k vocab."""
    return write_tiny_checkpoint(path, seed=7, num_layers=4, hidden_size=1024, num_heads=8, num_kv_heads=2,
                                 vocab_size=8192, intermediate_size=2816, max_position=4096, weight_std=1024 ** -0.5)


def _engine(path: str, **kw) -> Engine:
    env = kw.pop("env", None)
    cfg = EngineConfig(num_blocks=kw.pop("num_blocks", 512), block_size=16, max_num_seqs=8, **kw)
    return Engine(load_for(path, cfg, env=env), cfg)


def _teacher_forced(engine: Engine) -> torch.Tensor:
    """[5 prompts, 16 positions, V] fp32 logits on the host: 8 positions of prefill, then 8 batched decode steps."""
    model, kv, dev = engine.model, engine.kv, engine.device
    ids = [p[:16] for p in PROMPTS if len(p) >= 16] + [(PROMPTS[1] * 4)[:16], (PROMPTS[4] * 2)[:16]]
    table = torch.arange(len(ids), dtype=torch.int32).view(-1, 1)  # one 16-token page per prompt
    with torch.inference_mode():
        rows = [model.prefill(torch.tensor(p[:8]), 0, kv.k, kv.v, table[i].long(), all_logits=True).cpu()
                for i, p in enumerate(ids)]
        steps = []
        for pos in range(8, 16):
            n = len(ids)
            steps.append(model.decode(torch.tensor([p[pos - 1] for p in ids], device=dev),
                                      torch.full((n,), pos - 1, device=dev), kv.k, kv.v, table.to(dev),
                                      torch.full((n,), pos, dtype=torch.int32, device=dev)).cpu())
    return torch.stack([torch.cat([rows[i], torch.stack([s[i] for s in steps])]) for i in range(len(ids))])


def test_bf16_cuda_matches_fp32_cpu(realistic_dir):
    ref = _teacher_forced(_engine(realistic_dir))
    gpu = _engine(realistic_dir, device="cuda:0", dtype="bf16")
    assert gpu.kv.k[0].is_cuda and gpu.kv.k[0].dtype == torch.bfloat16
    assert gpu.describe()["attention_kernel"]["backend"] == "triton"
    got = _teacher_forced(gpu)
    scale = ref.abs().amax(-1)
    rel = (got - ref).abs().amax(-1) / scale
    assert float(rel.max()) <= BF16_TOL, float(rel.max())
    top2 = ref.topk(2, dim=-1).values
    clear = (top2[..., 0] - top2[..., 1]) > 2 * BF16_TOL * scale
    assert int(clear.sum()) > 0, "no position has a clear top-2 margin; the model is too flat to check greedy"
    assert torch.equal(got.argmax(-1)[clear], ref.argmax(-1)[clear])


def test_triton_path_equals_torch_path_on_cuda(realistic_dir):
    tri = _engine(realistic_dir, device="cuda:0", dtype="bf16", env=RuntimeEnv(attention_backend="triton"))
    ref = _engine(realistic_dir, device="cuda:0", dtype="bf16", env=RuntimeEnv(attention_backend="torch"))
    assert "triton" in tri.model.attention_backend and "torch" in ref.model.attention_backend
    a, b = _teacher_forced(tri), _teacher_forced(ref)
    assert float(((a - b).abs().amax(-1) / b.abs().amax(-1)).max()) <= 0.02
    assert tri.generate(PROMPTS, GREEDY) == ref.generate(PROMPTS, GREEDY)


def test_cuda_graphs_on_and_off_give_the_same_tokens(realistic_dir):
    on = _engine(realistic_dir, device="cuda:0", dtype="bf16", cuda_graphs=True)
    off = _engine(realistic_dir, device="cuda:0", dtype="bf16", cuda_graphs=False)
    assert on.graphs is not None, on.graphs_status  # captured, not the eager fallback
    assert on.describe()["cuda_graphs"].startswith("on")
    got = on.generate(PROMPTS, GREEDY)  # a batch of 5 replays the bucket of 8 with 3 padding rows
    assert on.graphs.replays > 0
    assert got == off.generate(PROMPTS, GREEDY)
    on.check_accounting()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs for TP=2 over NCCL")
def test_tp2_nccl_equals_tp1(realistic_dir):
    one = _engine(realistic_dir, device="cuda:0", dtype="bf16", cuda_graphs=False)
    two = _engine(realistic_dir, device="cuda:0", dtype="bf16", cuda_graphs=True, tensor_parallel_size=2)
    try:
        assert two.graphs is not None, two.graphs_status  # both ranks captured (NCCL all-reduces in the graphs)
        a, b = _teacher_forced(two), _teacher_forced(one)
        assert float(((a - b).abs().amax(-1) / b.abs().amax(-1)).max()) <= 0.05
        assert two.generate(PROMPTS, GREEDY) == one.generate(PROMPTS, GREEDY)
        assert two.graphs.replays > 0
        shards = two.gather_pages([0, 1])
        two.scatter_pages([100, 101], shards)
        assert all(torch.equal(x, y) for s, t in zip(shards, two.gather_pages([100, 101])) for x, y in zip(s.k, t.k))
    finally:
        two.shutdown()


def test_pd_on_loopback_with_gpu_kv_streams_a_chat_completion(tmp_path):
    import httpx

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "pd"))
    from pd_harness import base_env, free_port, spawn, wait_healthy

    model = write_tiny_checkpoint(str(tmp_path / "model"), hidden_size=256, num_heads=4, num_kv_heads=2,
                                  num_layers=2)
    env = base_env()
    pp, dp, bp, rp = free_port(), free_port(), free_port(), free_port()
    flags = ["--model", model, "--device", "cuda:0", "--dtype", "bf16", "--num-blocks", "256"]
    procs = [spawn("prefill", ["--role", "prefill", "--port", str(pp), "--bootstrap-port", str(bp), *flags], env,
                   str(tmp_path), pp),
             spawn("decode", ["--role", "decode", "--port", str(dp), *flags], env, str(tmp_path), dp),
             spawn("router", ["--role", "router", "--port", str(rp), "--prefill", f"http://127.0.0.1:{pp}",
                              "--decode", f"http://127.0.0.1:{dp}", "--bootstrap-ports", str(bp)], env, str(tmp_path), rp)]
    try:
        wait_healthy(procs, timeout=300)
        cfg = httpx.get(f"http://127.0.0.1:{dp}/config", timeout=30).json()["engine"]
        assert cfg["device"] == "cuda:0" and cfg["dtype"] == "bfloat16" and cfg["kv_pages"] == 256
        body = {"model": httpx.get(f"http://127.0.0.1:{rp}/v1/models", timeout=30).json()["data"][0]["id"],
                "messages": [{"role": "user", "content": "Say something."}], "max_tokens": 16, "temperature": 0,
                "stream": True}
        pieces = []
        with httpx.stream("POST", f"http://127.0.0.1:{rp}/v1/chat/completions", json=body, timeout=120) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    ev = json.loads(line[6:])
                    assert "error" not in ev, ev
                    pieces += [c.get("delta", {}).get("content") or "" for c in ev.get("choices", [])]
        assert "".join(pieces)
        metrics = httpx.get(f"http://127.0.0.1:{dp}/metrics", timeout=30).text
        assert any(line.startswith("pdrt_kv_transfer_bytes_total") and float(line.rsplit(" ", 1)[1]) > 0
                   for line in metrics.splitlines())
    finally:
        for p in procs:
            p.stop()
