"""Batched token sampling: penalties, logit bias, grammar masks, temperature, top-k, top-p, min-p, logprobs.

Every step samples the whole batch with tensor operations (no per-row loop over the vocabulary):

1. ``logits`` [B, V] (the engine's, any device) -> fp32.
2. logprobs (rows that asked): ``log_softmax`` of the engine's raw logits, chosen token + top-n (OpenAI/vLLM
   semantics: the model's distribution, before penalties and temperature).
3. processors, only when some row uses them: repetition penalty (HF/vLLM: seen tokens of prompt + output,
   ``l > 0 ? l / r : l * r``), frequency and presence penalties (OpenAI: ``l - f * count - p * (count > 0)`` over
   output tokens), logit bias (added), grammar bitmask (disallowed tokens -> -inf).
4. greedy rows: argmax. Sampled rows: ``l / T``; candidates from one ``topk`` of the widest k needed (top-k, or
   a 256-wide probe for top-p that falls back to a full sort only when the probe's mass is short of top_p);
   min-p keeps ``p >= min_p * p_max``; one inverse-CDF draw per row.

Randomness is counter-based: row i draws ``u = splitmix64(seed_i, step_i)`` in [0, 1), so a request's tokens
depend on its seed and position only, never on what else is in the batch, and a decode worker continues a
prefill worker's sequence with the same draws (PD equals monolithic under a seed).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence as Seq

import torch

from .config import SamplingParams

TOP_P_PROBE = 256  # candidates tried before a full sort for top-p-only rows (T <= 1 rarely needs more)
_NEG_INF = float("-inf")
_M64 = (1 << 64) - 1


def _s64(x: int) -> int:
    """An unsigned 64-bit constant as the signed int64 torch stores."""
    x &= _M64
    return x - (1 << 64) if x >= 1 << 63 else x


_GOLDEN, _MIX1, _MIX2 = _s64(0x9E3779B97F4A7C15), _s64(0xBF58476D1CE4E5B9), _s64(0x94D049BB133111EB)


def _lsr(z: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def uniform_draws(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """splitmix64(seed + (step + 1) * golden) -> fp64 in [0, 1). seeds, steps: int64 [B] (same device)."""
    z = seeds + (steps + 1) * _GOLDEN
    z = (z ^ _lsr(z, 30)) * _MIX1
    z = (z ^ _lsr(z, 27)) * _MIX2
    z = z ^ _lsr(z, 31)
    return _lsr(z, 11).double() / float(1 << 53)


@dataclass
class Row:
    """What the sampler needs from one sequence (the engine passes its Sequence objects, which have these)."""

    params: SamplingParams
    seed: int = 0  # the request's seed (drawn at admission when the client gave none)
    prompt_ids: Seq[int] = ()
    output_ids: Seq[int] = ()  # tokens generated so far; the token being sampled is output number len(output_ids)
    token_mask: torch.Tensor | None = None  # int32 [ceil(V / 32)] bitmask of allowed tokens (grammar), or None


@dataclass
class Sampled:
    tokens: list[int]
    # per row: None, or (logprob of the chosen token, [(token id, logprob)] top-n, best first)
    logprobs: list[tuple[float, list[tuple[int, float]]] | None]


def unpack_bitmask(mask: torch.Tensor, vocab: int) -> torch.Tensor:
    """int32 [B, W] (bit j of word w allows token 32 w + j) -> bool [B, vocab]."""
    bits = torch.arange(32, device=mask.device, dtype=torch.int32)
    allowed = ((mask.unsqueeze(-1) >> bits) & 1).bool().reshape(mask.shape[0], -1)
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]))
    return allowed[:, :vocab]


def _padded_ids(rows: list[Any], idx: list[int], device, *, prompt: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """([len(idx), L] int64 token ids of each row's output (and prompt), [len(idx), L] bool real-not-padding).
    Padding repeats the row's first id (harmless for scatter of equal values; masked for scatter_add)."""
    seqs = [list(rows[i].output_ids) + (list(rows[i].prompt_ids) if prompt else []) for i in idx]
    width = max(1, max(len(s) for s in seqs))
    ids = torch.zeros((len(idx), width), dtype=torch.int64)
    real = torch.zeros((len(idx), width), dtype=torch.bool)
    for j, s in enumerate(seqs):
        if s:
            ids[j, : len(s)] = torch.tensor(s, dtype=torch.int64)
            ids[j, len(s):] = s[0]
            real[j, : len(s)] = True
    return ids.to(device), real.to(device)


def apply_processors(logits: torch.Tensor, rows: list[Any]) -> torch.Tensor:
    """Penalties, logit bias and grammar masks of the rows that use them (in place on fp32 ``logits`` [B, V]).
    Penalties touch only the tokens a row has seen (gather / scatter over its history, not [B, V] counts)."""
    B, V = logits.shape
    dev = logits.device
    rep = [i for i, r in enumerate(rows) if r.params.repetition_penalty != 1.0
           and (len(r.output_ids) or len(r.prompt_ids))]
    if rep:
        ids, _ = _padded_ids(rows, rep, dev, prompt=True)
        r = torch.tensor([rows[i].params.repetition_penalty for i in rep], dtype=torch.float32, device=dev)[:, None]
        ri = torch.tensor(rep, device=dev)
        seen = logits[ri[:, None], ids]  # [R, L]: every copy of a token gets the same new value
        logits[ri[:, None], ids] = torch.where(seen > 0, seen / r, seen * r)
    fp = [i for i, r in enumerate(rows) if (r.params.frequency_penalty or r.params.presence_penalty) and len(r.output_ids)]
    if fp:
        ids, real = _padded_ids(rows, fp, dev, prompt=False)
        f = torch.tensor([rows[i].params.frequency_penalty for i in fp], dtype=torch.float32, device=dev)[:, None]
        p = torch.tensor([rows[i].params.presence_penalty for i in fp], dtype=torch.float32, device=dev)[:, None]
        ri = torch.tensor(fp, device=dev)[:, None]
        logits[ri, ids] = logits[ri, ids] - p  # presence: once per distinct token (copies write the same value)
        sub = logits[ri.squeeze(1)]
        sub.scatter_add_(1, ids, (-f).expand_as(ids.float()) * real)  # frequency: once per occurrence
        logits[ri.squeeze(1)] = sub
    bias = [(i, t, b) for i, r in enumerate(rows) for t, b in r.params.logit_bias]
    if bias:
        ri = torch.tensor([x[0] for x in bias], device=dev)
        ti = torch.tensor([x[1] for x in bias], device=dev)
        logits.index_put_((ri, ti), torch.tensor([x[2] for x in bias], dtype=torch.float32, device=dev), accumulate=True)
    masked = [i for i, r in enumerate(rows) if getattr(r, "token_mask", None) is not None]
    if masked:
        allowed = unpack_bitmask(torch.stack([rows[i].token_mask for i in masked]).to(dev), V)
        logits[masked] = logits[masked].masked_fill(~allowed, _NEG_INF)
    return logits


def _candidates(scaled: torch.Tensor, params: list[SamplingParams]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(values [S, K] best first, token ids [S, K] or None when K = V unsorted) holding every candidate a row may
    keep under its top-k / top-p; the narrowest that suffices (no full sort when a top-k does)."""
    V = scaled.shape[1]
    ks = [p.top_k if 0 < p.top_k < V else V for p in params]
    need_p = [p.top_p < 1.0 for p in params]
    if not any(need_p) and max(ks) == V:
        return scaled, None  # temperature / min-p only: the full row, unsorted
    widest = max((k for k, np_ in zip(ks, need_p) if k < V or not np_), default=0)
    if any(np_ and k == V for k, np_ in zip(ks, need_p)):  # top-p without top-k: probe first
        widest = max(widest, min(TOP_P_PROBE, V))
        vals, idx = torch.topk(scaled, widest, dim=-1)
        mass = torch.exp(torch.logsumexp(vals, -1) - torch.logsumexp(scaled, -1))  # share of the probe
        tp = torch.tensor([p.top_p for p in params], device=scaled.device)
        unbounded = torch.tensor([np_ and k == V for k, np_ in zip(ks, need_p)], device=scaled.device)
        if bool((unbounded & (mass < tp)).any()):
            vals, idx = torch.sort(scaled, dim=-1, descending=True)
        return vals, idx
    return torch.topk(scaled, widest, dim=-1)


def _sample_rows(logits: torch.Tensor, params: list[SamplingParams], seeds: torch.Tensor,
                 steps: torch.Tensor) -> torch.Tensor:
    """Sampled rows: logits [S, V] fp32 (processed) -> token ids [S] (int64, on logits' device)."""
    S, V = logits.shape
    dev = logits.device
    temp = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=dev)[:, None]
    scaled = logits / temp
    vals, idx = _candidates(scaled, params)
    K = vals.shape[1]
    probs = torch.softmax(vals, dim=-1)  # over the candidates: same ratios as the full softmax
    pos = torch.arange(K, device=dev)[None, :]
    keep = torch.ones_like(probs, dtype=torch.bool)
    if idx is not None:
        k = torch.tensor([p.top_k if 0 < p.top_k < V else V for p in params], device=dev)[:, None]
        keep &= pos < k
        kept = torch.where(keep, probs, torch.zeros_like(probs))
        kept = kept / kept.sum(-1, keepdim=True)  # top-p is over the top-k-renormalised distribution
        top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev)[:, None]
        # the smallest prefix whose mass reaches top_p (always at least one token)
        keep &= (kept.cumsum(-1) - kept) < top_p
    min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=dev)[:, None]
    if bool((min_p > 0).any()):
        keep &= probs >= min_p * probs.max(dim=-1, keepdim=True).values
    probs = torch.where(keep, probs, torch.zeros_like(probs))
    cdf = probs.double().cumsum(-1)
    u = uniform_draws(seeds, steps).to(dev) * cdf[:, -1]
    pick = torch.searchsorted(cdf, u[:, None], right=True).clamp_(max=K - 1).squeeze(1)
    return pick if idx is None else idx.gather(1, pick[:, None]).squeeze(1)


def sample_batch(logits: torch.Tensor, rows: list[Any]) -> Sampled:
    """logits: [B, V] (any device/dtype) -> one token per row, plus logprobs for the rows that asked.

    ``rows[i]`` has ``params``, ``seed``, ``prompt_ids``, ``output_ids`` and optionally ``token_mask`` (see
    :class:`Row`). One host read at the end for the whole batch."""
    logits = logits.float()
    B, V = logits.shape
    params = [r.params for r in rows]
    want_lp = [i for i, p in enumerate(params) if p.logprobs is not None]
    raw_lp = torch.log_softmax(logits[want_lp], dim=-1) if want_lp else None
    if any(p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty or p.logit_bias for p in params) \
            or any(getattr(r, "token_mask", None) is not None for r in rows):
        logits = apply_processors(logits.clone(), rows)
    tokens = torch.argmax(logits, dim=-1)
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if sampled:
        dev = logits.device
        seeds = torch.tensor([_s64(rows[i].seed) for i in sampled], dtype=torch.int64, device=dev)
        steps = torch.tensor([len(rows[i].output_ids) for i in sampled], dtype=torch.int64, device=dev)
        tokens[sampled] = _sample_rows(logits[sampled], [params[i] for i in sampled], seeds, steps)
    out: list[tuple[float, list[tuple[int, float]]] | None] = [None] * B
    if want_lp:
        n = max(params[i].logprobs for i in want_lp)
        chosen = raw_lp.gather(1, tokens[want_lp][:, None]).squeeze(1).tolist()
        top_v, top_i = (torch.topk(raw_lp, n, dim=-1) if n else (raw_lp[:, :0], raw_lp[:, :0].long()))
        top_v, top_i = top_v.tolist(), top_i.tolist()
        for j, i in enumerate(want_lp):
            k = params[i].logprobs
            out[i] = (chosen[j], list(zip(top_i[j][:k], top_v[j][:k])))
    return Sampled(tokens.tolist(), out)


def sample_one(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None, *,
               seed: int | None = None, step: int = 0, output_ids: Seq[int] = (), prompt_ids: Seq[int] = ()) -> int:
    """One row: logits [V] -> token id (the batch path on a batch of one; ``seed`` None draws one from
    ``generator``)."""
    if seed is None:
        seed = int(torch.randint(0, 1 << 62, (1,), generator=generator)) if generator is not None else 0
    row = Row(params, seed=seed, prompt_ids=prompt_ids, output_ids=list(output_ids) or [0] * step)
    return sample_batch(logits[None, :], [row]).tokens[0]
