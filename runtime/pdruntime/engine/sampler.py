"""Token sampling: greedy, temperature, top-k, top-p, with an optional per-request generator."""

from __future__ import annotations

import torch

from .config import SamplingParams


def sample_one(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """logits: [V] fp32 -> token id. Greedy when temperature == 0 (or top_k == 1)."""
    if params.greedy:
        return int(torch.argmax(logits))
    if logits.device.type != "cpu":
        logits = logits.float().cpu()  # per-request generators live on the host: same draws on any device
    scaled = logits / params.temperature
    if params.top_k and params.top_k < scaled.shape[0]:
        vals, idx = torch.topk(scaled, params.top_k)
    else:
        vals, idx = torch.sort(scaled, descending=True)
    probs = torch.softmax(vals, dim=-1)
    if params.top_p < 1.0:
        # keep the smallest prefix whose mass reaches top_p (always at least one token)
        cum = torch.cumsum(probs, dim=-1)
        keep = (cum - probs) < params.top_p
        probs = torch.where(keep, probs, torch.zeros_like(probs))
    choice = torch.multinomial(probs, 1, generator=generator)
    return int(idx[choice])


def sample_batch(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[int]:
    """logits: [B, V] fp32 -> B token ids. Greedy rows share one argmax."""
    greedy = torch.argmax(logits, dim=-1).tolist()  # one host read for the whole batch
    return [greedy[i] if p.greedy else sample_one(logits[i], p, generators[i]) for i, p in enumerate(params)]
