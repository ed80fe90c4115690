"""Device and dtype are the engine configuration's: resolved once, passed to loader, KV cache and kernels.

Includes the regression test for the GPU-host bug: with CUDA reported available, a worker started with
``--device cpu`` must still serve (the attention backend follows the engine's device, not the host)."""

from __future__ import annotations

import argparse

import pytest
import torch

from pdruntime.engine import Engine, EngineConfig, SamplingParams, load_for
from pdruntime.engine.device import (bucket_for, cuda_graph_buckets, kv_cache_blocks, rank_device, resolve_device,
                                     resolve_dtype)
from pdruntime.model import load_model


@pytest.mark.parametrize("requested, avail, count, want", [
    ("auto", False, 0, "cpu"), ("auto", True, 2, "cuda:0"), ("cpu", True, 2, "cpu"), ("CPU", False, 0, "cpu"),
    ("cuda", True, 1, "cuda:0"), ("cuda:1", True, 2, "cuda:1"),
])
def test_resolve_device(requested, avail, count, want):
    assert resolve_device(requested, cuda_available=avail, cuda_count=count) == want


@pytest.mark.parametrize("requested, avail, count, match", [
    ("cuda", False, 0, "no usable CUDA device; accepted here: cpu or auto"),
    ("cuda:2", True, 2, "accepted: cuda:0..cuda:1"),
    ("tpu", True, 1, "accepted: auto, cpu, cuda, cuda:N"), ("cuda:x", True, 1, "accepted: auto, cpu"),
])
def test_resolve_device_refusals_say_what_is_accepted(requested, avail, count, match):
    with pytest.raises(ValueError, match=match):
        resolve_device(requested, cuda_available=avail, cuda_count=count)


@pytest.mark.parametrize("requested, device, want", [
    ("auto", "cpu", "fp32"), ("auto", "cuda:0", "bf16"), ("bf16", "cpu", "bf16"), ("fp16", "cuda:3", "fp16"),
    ("float32", "cuda:0", "fp32"), ("bfloat16", "cpu", "bf16"),
])
def test_resolve_dtype(requested, device, want):
    assert resolve_dtype(requested, device) == want


def test_resolve_dtype_refusal():
    with pytest.raises(ValueError, match="accepted: auto, bf16, fp16, fp32"):
        resolve_dtype("int4", "cpu")


@pytest.mark.parametrize("kw, want", [  # pages of 1 MiB
    (dict(num_blocks=7, kv_cache_mib=1, free_bytes=10 << 30), (7, "num_blocks")),  # explicit pages win
    (dict(num_blocks=None, kv_cache_mib=3, free_bytes=10 << 30), (3, "kv_cache_mib=3")),  # then explicit MiB
    (dict(num_blocks=None, kv_cache_mib=None, free_bytes=1 << 30), (512, "kv_cache_memory_fraction=0.5 of 1024 MiB free")),
    (dict(num_blocks=None, kv_cache_mib=None, free_bytes=None), (512, "default 512 MiB")),  # CPU default
])
def test_kv_cache_blocks_precedence(kw, want):
    assert kv_cache_blocks(1 << 20, useful_blocks=100_000, memory_fraction=0.5, **kw) == want


def test_kv_cache_blocks_never_exceed_what_max_num_seqs_can_use():
    assert kv_cache_blocks(1024, useful_blocks=10, num_blocks=None, kv_cache_mib=None, memory_fraction=0.9,
                           free_bytes=80 << 30) == (10, "kv_cache_memory_fraction=0.9 of 81920 MiB free")


def test_graph_buckets_and_rank_devices():
    assert cuda_graph_buckets(64) == (1, 2, 4, 8, 16, 32, 48, 64)
    assert cuda_graph_buckets(3) == (1, 2, 3)
    assert bucket_for(5, (1, 2, 4, 8)) == 8 and bucket_for(9, (1, 2, 4, 8)) is None
    assert [rank_device("cuda:2", r) for r in range(3)] == ["cuda:2", "cuda:3", "cuda:4"]
    assert rank_device("cpu", 3) == "cpu"


def test_engine_config_resolve_and_validation():
    cfg = EngineConfig.resolve(device="auto", dtype="auto", cuda_available=False, cuda_count=0)
    assert (cfg.device, cfg.dtype, cfg.cuda_graphs, cfg.torch_dtype) == ("cpu", "fp32", False, torch.float32)
    gpu = EngineConfig.resolve(cuda_available=True, cuda_count=8, tensor_parallel_size=4)
    assert (gpu.device, gpu.dtype, gpu.cuda_graphs) == ("cuda:0", "bf16", True)
    with pytest.raises(ValueError, match="needs devices cuda:6..cuda:9, but this host has 8"):
        EngineConfig.resolve(device="cuda:6", cuda_available=True, cuda_count=8, tensor_parallel_size=4)
    with pytest.raises(ValueError, match="--cuda-graphs needs a CUDA device"):
        EngineConfig.resolve(device="cpu", cuda_graphs=True)
    with pytest.raises(ValueError, match=r"kv_cache_memory_fraction=1.5 is invalid; accepted: a number in \(0, 1\]"):
        EngineConfig(kv_cache_memory_fraction=1.5)
    with pytest.raises(ValueError, match="device='cuda' is invalid"):
        EngineConfig(device="cuda")


def test_engine_refuses_a_model_loaded_for_another_dtype(tiny_model):
    loaded = load_model(tiny_model, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="loaded as torch.bfloat16 on cpu but the engine is configured for torch.float32"):
        Engine(loaded, EngineConfig(num_blocks=16))


def _serve_args(tiny_model: str, *extra: str) -> argparse.Namespace:
    from pdruntime.cli import build_parser

    return build_parser().parse_args(["serve", "--role", "decode", "--model", tiny_model, "--num-blocks", "64",
                                      "--port", "0", *extra])


def test_device_cpu_serves_on_a_host_that_reports_cuda(tiny_model, monkeypatch):
    """Regression: on a CUDA host the backend used to be picked from the host (Triton) while the engine ran on
    the CPU, and the first decode step raised. With --device cpu the engine must serve, whatever the host says."""
    from fastapi.testclient import TestClient

    from pdruntime.env import RuntimeEnv
    from pdruntime.server.commands import build_server

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    app, worker = build_server(_serve_args(tiny_model, "--device", "cpu"), RuntimeEnv())
    with TestClient(app) as client:
        r = client.post("/generate", json={"input_ids": [5, 9, 44, 101], "sampling_params": {
            "max_new_tokens": 6, "temperature": 0, "ignore_eos": True}})
        assert r.status_code == 200, r.text
        assert r.json()["meta_info"]["completion_tokens"] == 6
        cfg = client.get("/config").json()["engine"]
    assert cfg["device"] == "cpu" and cfg["dtype"] == "float32" and cfg["engine"]["cuda_graphs"] is False
    assert cfg["attention_kernel"]["backend"] in ("cpu", "torch") and cfg["attention_kernel"]["device"] == "cpu"
    assert cfg["kv_pages"] == 64 and cfg["max_full_context_seqs"] >= 0 and cfg["weight_bytes"] > 0


def test_auto_device_would_pick_cuda_on_such_a_host_and_fail_loudly_here(tiny_model, monkeypatch):
    """The flip side: ``auto`` follows the host, so it resolves to cuda:0 there (and loading onto a CUDA device
    this CPU-only torch lacks fails at start-up with an error, never at the first decode step)."""
    from pdruntime.server.commands import _engine_config

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    cfg = _engine_config(_serve_args(tiny_model))
    assert (cfg.device, cfg.dtype, cfg.cuda_graphs) == ("cuda:0", "bf16", True)
    prefill = _serve_args(tiny_model)
    prefill.role = "prefill"
    assert _engine_config(prefill).cuda_graphs is False  # prefill never decodes: nothing to capture


def test_bad_device_flag_is_a_clear_start_up_error(tiny_model, capsys):
    from pdruntime.server.commands import cmd_serve

    args = _serve_args(tiny_model, "--device", "tpu")
    args.log_level = "warning"
    assert cmd_serve(args) == 2
    assert "device 'tpu' is not accepted; accepted: auto, cpu, cuda, cuda:N" in capsys.readouterr().err


def test_generate_cli_takes_device_and_dtype(tiny_model, capsys):
    from pdruntime.cli import main

    assert main(["generate", "hello", "--model", tiny_model, "--device", "cpu", "--dtype", "bf16",
                 "--max-tokens", "4", "--verbose"]) == 0
    err = capsys.readouterr().err
    assert '"dtype": "bfloat16"' in err and '"device": "cpu"' in err


def test_kv_cache_and_weights_follow_the_config_dtype(tiny_model):
    cfg = EngineConfig(num_blocks=32, block_size=4, dtype="fp16")
    engine = Engine(load_for(tiny_model, cfg), cfg)
    assert engine.kv.k[0].dtype == torch.float16 and engine.model.embed.dtype == torch.float16
    out = engine.generate([[5, 9, 44]], SamplingParams(max_tokens=4, temperature=0.8, seed=3, ignore_eos=True))
    assert len(out[0]) == 4
    assert engine.describe()["dtype"] == "float16"


def test_checkpoints_are_read_one_tensor_at_a_time(tiny_model, monkeypatch):
    """Safetensors are read lazily: each tensor once, when the model copies it (converted and moved right
    away), never the whole checkpoint up front; membership checks read nothing."""
    from pdruntime.model import loader

    reads: list[str] = []
    original = loader._LazyTensors.__getitem__

    def spy(self, name):
        reads.append(name)
        return original(self, name)

    monkeypatch.setattr(loader._LazyTensors, "__getitem__", spy)
    lazy = loader._LazyTensors([f"{tiny_model}/model.safetensors"])
    assert "lm_head.weight" in lazy and "nope" not in lazy and reads == []
    load_model(tiny_model, dtype=torch.bfloat16)
    assert sorted(reads) == sorted(set(reads)) and len(reads) == len(lazy)  # every tensor exactly once
