"""CUDA-graph decode, the parts a CPU can prove: bucket padding into static buffers (padding rows write only
the scratch page), capture failure -> eager decoding with one log line. The capture itself is a GPU test
(tests/engine/test_gpu_engine.py::test_cuda_graphs_on_and_off_give_the_same_tokens)."""

from __future__ import annotations

import logging

import pytest
import torch

from pdruntime.engine import SamplingParams
from pdruntime.engine.cuda_graphs import DecodeGraphs
from pdruntime.engine.kv_cache import KVCache

GREEDY = SamplingParams(max_tokens=9, temperature=0, ignore_eos=True)
PROMPTS = [[5, 9, 44, 101, 7], [17, 18], [3] * 11, [250, 251, 252], [60, 61, 62, 63, 64, 65, 66]]


class EagerGraph:
    """Stands in for a captured torch.cuda.CUDAGraph: replay() runs the same call on the same static buffers."""

    def __init__(self, graphs: DecodeGraphs, batch: int, out: torch.Tensor) -> None:
        self.graphs, self.batch, self.out = graphs, batch, out

    def replay(self) -> None:
        self.out.copy_(self.graphs._decode(self.batch, None))


def _with_fake_graphs(engine) -> DecodeGraphs:
    cfg = engine.model.config
    n = engine.pool.num_total
    engine.kv = KVCache(cfg.num_layers, n + 1, engine.config.block_size, cfg.num_kv_heads, cfg.head_dim)  # + scratch
    graphs = DecodeGraphs(engine.model, engine.kv, buckets=(1, 2, 4, 8), max_model_len=engine.max_model_len,
                          scratch_page=n)
    for b in graphs.buckets:
        out = torch.empty(b, cfg.vocab_size)  # the static logits a captured graph writes
        graphs.graphs[b] = (EagerGraph(graphs, b, out), out, None)
    engine.graphs = graphs
    return graphs


def test_bucketed_static_buffer_decode_equals_eager(make_engine):
    eager = make_engine(num_blocks=64)
    graphed = make_engine(num_blocks=64)
    graphs = _with_fake_graphs(graphed)
    with torch.inference_mode():
        graphed.kv.k[0][64].fill_(float("nan"))  # scratch page garbage must never reach a live sequence
    assert graphed.generate(PROMPTS, GREEDY) == eager.generate(PROMPTS, GREEDY)
    assert graphs.replays > 0  # the 5-sequence batch ran in the bucket of 8 (3 padding rows)
    graphed.check_accounting()


def test_no_bucket_fits_means_eager(make_engine):
    engine = make_engine(num_blocks=64)
    graphs = _with_fake_graphs(engine)
    tokens = torch.zeros(9, dtype=torch.int64)
    assert graphs.run(tokens, tokens, torch.zeros((9, 1), dtype=torch.int32), torch.ones(9, dtype=torch.int32)) is None


def test_capture_failure_falls_back_to_eager_with_one_log_line(make_engine, monkeypatch, caplog):
    engine = make_engine(num_blocks=64)

    def boom(self):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(DecodeGraphs, "capture", boom)
    with caplog.at_level(logging.WARNING, logger="pdruntime.engine"):
        engine._capture_graphs(64)
    assert engine.graphs is None
    assert engine.graphs_status.startswith("eager fallback (capture failed: RuntimeError")
    assert [r.message for r in caplog.records if "CUDA graphs" in r.message] == [
        "CUDA graphs: capture failed, decoding eagerly: RuntimeError: operation not permitted when stream is capturing"]
    assert engine.generate([[5, 9]], GREEDY)  # and it still serves


def test_torch_attention_backend_cannot_be_captured(make_engine):
    engine = make_engine(num_blocks=64)
    graphs = DecodeGraphs(engine.model, engine.kv, buckets=(1,), max_model_len=64, scratch_page=0)
    with pytest.raises(RuntimeError, match="cannot be captured; CUDA graphs need the Triton backend"):
        graphs._plan(1)


def test_tensor_parallel_ranks_agree_on_each_capture_step():
    """Under TP every rank reports each plan/capture step; one failure stops all of them together."""
    from pdruntime.engine.cuda_graphs import CaptureRefused

    votes = []

    def agree_all_ok(ok: bool) -> bool:
        votes.append(ok)
        return ok

    assert DecodeGraphs._agreed(agree_all_ok, lambda: "plan", "split plan for batch 8") == "plan"
    with pytest.raises(CaptureRefused, match="capture of batch 8 failed on another tensor-parallel rank"):
        DecodeGraphs._agreed(lambda ok: False, lambda: "graph", "capture of batch 8")

    def broken():
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing")

    with pytest.raises(CaptureRefused, match="failed on this rank: RuntimeError: CUDA error: operation not permitted"):
        DecodeGraphs._agreed(agree_all_ok, broken, "capture of batch 4")
    assert votes == [True, False]  # the failing rank still voted before raising
