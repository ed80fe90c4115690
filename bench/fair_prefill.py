#!/usr/bin/env python
"""Prefill chunk splits: a short request behind an 8k-token prompt, and equal prompts arriving together.

    .venv/bin/python bench/fair_prefill.py [--long-tokens 8000] [--short-tokens 16] [--chunk 512] [--threads 2]
        [--equal 8] [--equal-tokens 250]

SmolLM2-135M-Instruct (fp32, CPU), one engine, prefix cache off. Three splits of each step's prompt-token
budget, in the same run on the same engine:

* pdstack's (engine/scheduler.py ``prefill_grants``): fewest remaining tokens first, above a floor of an
  eighth of an equal share for every prompt;
* max-min equal shares (issue 20's split);
* first-come-first-served (the scheduler before issue 20: the earliest prompt takes the whole budget).

Scenario 1: the long prompt is admitted and takes one chunk; then the short request arrives. Measured: the
short request's first token (engine steps after its arrival, seconds, chunk-times = seconds / the seconds of
a long-only chunk step measured in the same run) and the long prompt's time to first token.
Scenario 2 (the agents' case): EQUAL prompts of EQUAL_TOKENS tokens arrive together. Measured: their mean and
last time to first token.

Prints markdown tables and the ratios.
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import torch


def fcfs_chunks(remaining: list[int], budget: int) -> list[int]:
    """The earlier scheduler's split: in admission order, each prompt takes all it can of what is left."""
    out = []
    for r in remaining:
        g = min(r, budget)
        out.append(g)
        budget -= g
    return out


def max_min_chunks(remaining: list[int], budget: int) -> list[int]:
    """Issue 20's split: water-filling, every prompt an equal share, what the small ones leave shared again."""
    grant, open_, left = [0] * len(remaining), [i for i, r in enumerate(remaining) if r > 0], budget
    while open_ and left > 0:
        share, extra = divmod(left, len(open_))
        still = []
        for rank, i in enumerate(open_):
            give = min(remaining[i] - grant[i], share + (1 if rank < extra else 0))
            grant[i] += give
            left -= give
            if grant[i] < remaining[i]:
                still.append(i)
        if len(still) == len(open_):
            break
        open_ = still
    return grant


def equal_run(engine, prompts: list[list[int]]) -> dict:
    from pdruntime.engine import SamplingParams

    p = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    for n, ids in enumerate(prompts):
        engine.add_request(f"eq{n}", ids, p)
    t0, first = time.perf_counter(), {}
    while engine.has_work():
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            if o.new_token_ids and o.request_id not in first:
                first[o.request_id] = now - t0
    engine.pool.assert_no_leaks()
    return {"mean_s": sum(first.values()) / len(first), "last_s": max(first.values())}


def one_run(engine, long_ids: list[int], short_ids: list[int]) -> dict:
    from pdruntime.engine import SamplingParams

    p = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    engine.add_request("long", long_ids, p)
    t0 = time.perf_counter()
    engine.step()  # the long prompt's first chunk, alone: one chunk-time
    chunk_s = time.perf_counter() - t0
    engine.add_request("short", short_ids, p)
    arrived = time.perf_counter()
    steps, short_s, long_s = 0, None, None
    while engine.has_work():
        outs = engine.step()
        steps += short_s is None
        now = time.perf_counter()
        for o in outs:
            if o.new_token_ids and o.request_id == "short" and short_s is None:
                short_s = now - arrived
            if o.new_token_ids and o.request_id == "long" and long_s is None:
                long_s = now - t0
    engine.pool.assert_no_leaks()
    return {"steps": steps, "short_s": short_s, "chunk_s": chunk_s, "long_s": long_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--long-tokens", type=int, default=8000)
    ap.add_argument("--short-tokens", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=512, help="--max-prefill-tokens: the step's prompt-token budget")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--equal", type=int, default=8, help="scenario 2: prompts arriving together")
    ap.add_argument("--equal-tokens", type=int, default=250)
    ap.add_argument("--model", default=None, help="GGUF path (default: embedded SmolLM2)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from pdruntime.engine import Engine, EngineConfig
    from pdruntime.engine import scheduler
    from pdruntime.model import default_model_path, load_model

    path = args.model or default_model_path()
    loaded = load_model(path)
    kv_mib = max(256, (args.long_tokens + 1024) * 30 * 2 * 3 * 64 * 4 // (1 << 20) + 64)
    engine = Engine(loaded, EngineConfig(max_prefill_tokens=args.chunk, kv_cache_mib=kv_mib, prefix_cache=False))
    text = "The quick brown fox jumps over the lazy dog while the KV cache fills page after page. "
    ids = loaded.tokenizer.encode(text * (args.long_tokens // 15 + 2))
    long_ids, short_ids = ids[:args.long_tokens], loaded.tokenizer.encode("Q: " + text)[:args.short_tokens]
    from pdruntime.engine import SamplingParams

    engine.generate([short_ids], SamplingParams(max_tokens=2, temperature=0))  # warm-up
    load = os.getloadavg()[0]
    print(f"model: {os.path.basename(path)} fp32 | torch {torch.__version__} | threads {torch.get_num_threads()} | "
          f"{platform.machine()} | {os.cpu_count()} CPUs | load avg at start {load:.2f} | long prompt "
          f"{len(long_ids)} tokens, short {len(short_ids)} tokens, chunk {args.chunk}\n")
    ours = scheduler.prefill_grants
    splits = (("fewest-left first + floor (pdstack)", ours), ("max-min equal shares (issue 20)", max_min_chunks),
              ("FCFS (before issue 20)", fcfs_chunks))
    equal = [loaded.tokenizer.encode(f"Agent {n}: " + text * (args.equal_tokens // 15 + 2))[:args.equal_tokens]
             for n in range(args.equal)]
    rows, eq = {}, {}
    for name, split in splits:
        scheduler.prefill_grants = split
        try:
            rows[name] = one_run(engine, long_ids, short_ids)
            eq[name] = equal_run(engine, equal)
        finally:
            scheduler.prefill_grants = ours
    print("| chunk split | short TTFT, steps | short TTFT, s | short TTFT, chunk-times | long TTFT, s |")
    print("|---|---:|---:|---:|---:|")
    for name, r in rows.items():
        print(f"| {name} | {r['steps']} | {r['short_s']:.3f} | {r['short_s'] / r['chunk_s']:.2f} | {r['long_s']:.2f} |")
    print(f"\n{args.equal} prompts of {args.equal_tokens} tokens arriving together:\n")
    print("| chunk split | mean TTFT, s | last TTFT, s |")
    print("|---|---:|---:|")
    for name, r in eq.items():
        print(f"| {name} | {r['mean_s']:.2f} | {r['last_s']:.2f} |")
    f, m, b = (rows[n] for n, _ in splits)
    ef, em = (eq[n] for n, _ in splits[:2])
    print(f"\nshort request's TTFT: FCFS / pdstack = {b['short_s'] / f['short_s']:.1f}x, max-min / pdstack = "
          f"{m['short_s'] / f['short_s']:.2f}x; the long prompt's TTFT: pdstack / FCFS = {f['long_s'] / b['long_s']:.2f}x; "
          f"equal prompts' mean TTFT: max-min / pdstack = {em['mean_s'] / ef['mean_s']:.2f}x | load avg at end "
          f"{os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
