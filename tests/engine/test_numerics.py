"""Our Llama (paged KV, fused QKV/gate-up) vs HF transformers LlamaForCausalLM on the same random weights."""

from __future__ import annotations

import random

import torch

from pdruntime.engine import Engine, EngineConfig, SamplingParams
from pdruntime.engine.kv_cache import KVCache

from .helpers import hf_greedy, hf_reference, rel_err

TOL = 1e-4


def _kv(model, num_blocks=64, block=4):
    c = model.config
    return KVCache(c.num_layers, num_blocks, block, c.num_kv_heads, c.head_dim)


def test_prefill_logits_match_hf(tiny, tiny_model):
    hf = hf_reference(tiny_model)
    model = tiny.model
    gen = torch.Generator().manual_seed(1)
    for length in (1, 7, 33):
        ids = torch.randint(0, model.config.vocab_size, (length,), generator=gen)
        kv = _kv(model)
        blocks = torch.randperm(64, generator=gen)  # scattered pages
        with torch.inference_mode():
            ours = model.prefill(ids, 0, kv.k, kv.v, blocks, all_logits=True)
            ref = hf(ids[None]).logits[0].float()
        assert ours.shape == ref.shape
        assert rel_err(ours, ref) <= TOL, (length, rel_err(ours, ref))


def test_chunked_prefill_matches_hf(tiny, tiny_model):
    """A prompt prefilled in chunks (attending to cached pages of earlier chunks) equals one HF forward."""
    hf = hf_reference(tiny_model)
    model = tiny.model
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, model.config.vocab_size, (29,), generator=gen)
    kv = _kv(model)
    blocks = torch.randperm(64, generator=gen)
    with torch.inference_mode():
        ref = hf(ids[None]).logits[0].float()
        parts = []
        for start, end in ((0, 5), (5, 6), (6, 19), (19, 29)):
            parts.append(model.prefill(ids[start:end], start, kv.k, kv.v, blocks, all_logits=True))
    assert rel_err(torch.cat(parts), ref) <= TOL


def test_batched_decode_32_steps_matches_hf(tiny, tiny_model):
    """4 sequences of different lengths decode 32 teacher-forced steps as one batch over paged KV."""
    hf = hf_reference(tiny_model)
    model = tiny.model
    cfg = model.config
    rng = random.Random(3)
    block, num_blocks = 4, 128
    kv = _kv(model, num_blocks, block)
    free = list(range(num_blocks))
    rng.shuffle(free)
    lengths = [3, 9, 17, 30]
    seqs = [[rng.randrange(cfg.vocab_size) for _ in range(n)] for n in lengths]
    pages = [[free.pop() for _ in range(-(-(n + 32) // block))] for n in lengths]
    steps = 32
    ours: list[list[torch.Tensor]] = [[] for _ in seqs]
    with torch.inference_mode():
        for i, s in enumerate(seqs):
            ours[i].append(model.prefill(torch.tensor(s), 0, kv.k, kv.v, torch.tensor(pages[i])))
        width = max(len(p) for p in pages)
        table = torch.zeros((len(seqs), width), dtype=torch.int32)
        for i, p in enumerate(pages):
            table[i, : len(p)] = torch.tensor(p, dtype=torch.int32)
        for _ in range(steps):
            new = [rng.randrange(cfg.vocab_size) for _ in seqs]
            positions = torch.tensor([len(s) for s in seqs])
            for s, t in zip(seqs, new):
                s.append(t)
            logits = model.decode(torch.tensor(new), positions, kv.k, kv.v, table, (positions + 1).to(torch.int32))
            for i in range(len(seqs)):
                ours[i].append(logits[i])
        for i, s in enumerate(seqs):
            ref = hf(torch.tensor(s)[None]).logits[0].float()
            # ours[i][0] is the prefill's last-token logits, then one per decode step
            got = torch.stack(ours[i])
            want = ref[lengths[i] - 1:]
            assert got.shape == want.shape
            assert rel_err(got, want) <= TOL, (i, rel_err(got, want))


def test_engine_greedy_equals_hf_generate(tiny, tiny_model):
    """End to end through the scheduler (batched, chunked prefill, paged decode) vs HF greedy generate."""
    hf = hf_reference(tiny_model)
    engine = Engine(tiny, EngineConfig(block_size=4, num_blocks=128, max_prefill_tokens=8))
    prompts = [tiny.tokenizer.encode(t) for t in ("Paged attention", "The quick brown fox jumps over", "0")]
    outs = engine.generate(prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out == hf_greedy(hf, prompt, 24)
    engine.pool.assert_no_leaks()


def test_rope_scaling_variants_match_hf(tmp_path):
    """Llama-3 and linear RoPE frequency scaling from config.json agree with transformers."""
    import json

    from pdruntime.model import load_model
    from pdruntime.model.testing import write_tiny_checkpoint

    for scaling in ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 64}, {"rope_type": "linear", "factor": 4.0}):
        d = write_tiny_checkpoint(str(tmp_path / scaling["rope_type"]), seed=5, num_heads=2, num_kv_heads=1,
                                  hidden_size=64, rope_theta=500000.0)
        cfg_path = tmp_path / scaling["rope_type"] / "config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg["rope_scaling"] = scaling
        cfg_path.write_text(json.dumps(cfg))
        ours = load_model(d)
        assert dict(ours.model.config.rope_scaling)["rope_type"] == scaling["rope_type"]
        hf = hf_reference(d)
        ids = torch.randint(0, 300, (40,), generator=torch.Generator().manual_seed(0))
        kv = _kv(ours.model)
        with torch.inference_mode():
            got = ours.model.prefill(ids, 0, kv.k, kv.v, torch.arange(64), all_logits=True)
            want = hf(ids[None]).logits[0].float()
        assert rel_err(got, want) <= TOL, (scaling["rope_type"], rel_err(got, want))


def test_batched_prefill_of_several_sequences_matches_hf(tiny, tiny_model):
    """Chunks of three sequences (one continuing from cached pages) in one forward equal HF per sequence."""
    from pdruntime.model.llama import PrefillChunk

    hf = hf_reference(tiny_model)
    model = tiny.model
    gen = torch.Generator().manual_seed(4)
    kv = _kv(model, 64, 4)
    pages = torch.randperm(64, generator=gen).split(16)
    seqs = [torch.randint(0, model.config.vocab_size, (n,), generator=gen) for n in (11, 1, 23)]
    with torch.inference_mode():
        model.prefill(seqs[2][:9], 0, kv.k, kv.v, pages[2])  # earlier chunk of sequence 2
        got = model.prefill_batch([PrefillChunk(seqs[0], 0, pages[0]), PrefillChunk(seqs[1], 0, pages[1]),
                                   PrefillChunk(seqs[2][9:], 9, pages[2])], kv.k, kv.v, all_logits=True)
        for i, s in enumerate(seqs):
            want = hf(s[None]).logits[0].float()
            if i == 2:
                want = want[9:]
            assert rel_err(got[i], want) <= TOL, (i, rel_err(got[i], want))
