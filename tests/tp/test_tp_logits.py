"""Tensor parallelism on the CPU: two gloo ranks (rank 0 here, rank 1 a real follower process started by
``load_for``) give the same logits as one process, within 1e-4 in fp32, for prefill and batched decode."""

from __future__ import annotations

import pytest
import torch

from pdruntime.engine import Engine, EngineConfig, SamplingParams, load_for
from pdruntime.model import ModelLoadError
from pdruntime.model.parallel import TPShard, shard_config

TOL = 1e-4  # max |diff| / max |logit|, fp32


@pytest.fixture(scope="module")
def engines(tiny_model):
    one = EngineConfig(num_blocks=64, block_size=4)
    two = EngineConfig(num_blocks=64, block_size=4, tensor_parallel_size=2)
    e1 = Engine(load_for(tiny_model, one), one)
    e2 = Engine(load_for(tiny_model, two), two)
    yield e1, e2
    e2.shutdown()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def test_tp2_shards_heads_and_kv(engines):
    e1, e2 = engines
    assert e2.tp_size == 2 and e2.describe()["tensor_parallel_size"] == 2
    assert e2.model.config.num_heads == e1.model.config.num_heads // 2
    assert e2.kv.num_kv_heads == e1.kv.num_kv_heads // 2  # each rank owns its KV heads' share of every page
    assert e2.model.layers[0].gate_up.weight.shape[0] == e1.model.layers[0].gate_up.weight.shape[0] // 2


def test_tp2_logits_equal_tp1_prefill_and_decode(engines):
    e1, e2 = engines
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 320, (n,), generator=gen) for n in (13, 6, 21)]
    with torch.inference_mode():
        tables = []
        for i, ids in enumerate(prompts):
            blocks = torch.arange(i * 16, i * 16 + 16)
            a = e1.model.prefill(ids, 0, e1.kv.k, e1.kv.v, blocks, all_logits=True)
            b = e2.model.prefill(ids, 0, e2.kv.k, e2.kv.v, blocks, all_logits=True)
            assert _rel(b, a) <= TOL, ("prefill", i, _rel(b, a))
            tables.append(blocks.to(torch.int32))
        table = torch.stack(tables)
        lens = [len(p) for p in prompts]
        tokens = torch.tensor([int(p[-1]) for p in prompts])
        for step in range(8):  # teacher-forced batched decode over the paged cache of both engines
            pos = torch.tensor(lens, dtype=torch.int64)
            seq_lens = (pos + 1).to(torch.int32)
            a = e1.model.decode(tokens, pos, e1.kv.k, e1.kv.v, table, seq_lens)
            b = e2.model.decode(tokens, pos, e2.kv.k, e2.kv.v, table, seq_lens)
            assert _rel(b, a) <= TOL, ("decode", step, _rel(b, a))
            tokens = a.argmax(-1)
            lens = [n + 1 for n in lens]


def test_tp2_engine_generates_the_same_greedy_tokens(engines):
    e1, e2 = engines
    greedy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    prompts = [[5, 9, 44, 101, 7, 3, 250], [17, 18, 19]]
    assert e2.generate(prompts, greedy) == e1.generate(prompts, greedy)


def test_tp2_gather_then_scatter_moves_every_ranks_heads(engines):
    """The KV-transfer path of a TP engine: pages gathered from both ranks and scattered into other pages
    decode exactly like the originals."""
    _, e2 = engines
    shards = e2.gather_pages([0, 1, 2])
    assert len(shards) == 2 and tuple(shards[1].k[0].shape) == (3, 4, 1, 16)
    e2.scatter_pages([40, 41, 42], shards)
    again = e2.gather_pages([40, 41, 42])
    for a, b in zip(shards, again):
        for x, y in zip(a.k + a.v, b.k + b.v):
            assert torch.equal(x, y)


def test_indivisible_tp_size_is_refused_with_what_is_accepted(tiny_model):
    from pdruntime.model.config import LlamaConfig

    cfg = LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=192, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16, max_position_embeddings=64)
    assert shard_config(cfg, 2).num_kv_heads == 1
    with pytest.raises(ModelLoadError, match=r"tensor_parallel_size=3 .*accepted: one of \[1, 2\]"):
        shard_config(cfg, 3)
    with pytest.raises(ValueError, match="outside a group"):
        TPShard(2, 2)
