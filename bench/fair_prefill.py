#!/usr/bin/env python
"""Fair prefill: a short request's time to first token while an 8k-token prompt prefills (issue 20).

    .venv/bin/python bench/fair_prefill.py [--long-tokens 8000] [--short-tokens 16] [--chunk 512] [--threads 2]

SmolLM2-135M-Instruct (fp32, CPU), one engine, prefix cache off. The long prompt is admitted and takes one
chunk; then the short request arrives. Measured, for pdstack's max-min fair chunk split
(engine/scheduler.py ``fair_chunks``) and, in the same run on the same engine, for first-come-first-served
chunking (the scheduler before issue 20: the earliest prompt takes the whole budget):

* the short request's first token: engine steps after its arrival, seconds, and chunk-times (seconds / the
  mean seconds of a long-only chunk step measured in the same run);
* the long prompt's time to first token (what fairness costs it).

Prints a markdown table and the ratio FCFS / fair.
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
    fair = scheduler.fair_chunks
    rows = {}
    for name, split in (("fair (pdstack)", fair), ("FCFS (before)", fcfs_chunks)):
        scheduler.fair_chunks = split
        try:
            rows[name] = one_run(engine, long_ids, short_ids)
        finally:
            scheduler.fair_chunks = fair
    print("| chunk split | short TTFT, steps | short TTFT, s | short TTFT, chunk-times | long TTFT, s |")
    print("|---|---:|---:|---:|---:|")
    for name, r in rows.items():
        print(f"| {name} | {r['steps']} | {r['short_s']:.3f} | {r['short_s'] / r['chunk_s']:.2f} | {r['long_s']:.2f} |")
    f, b = rows["fair (pdstack)"], rows["FCFS (before)"]
    print(f"\nshort request's TTFT: FCFS / fair = {b['short_s'] / f['short_s']:.1f}x; the long prompt's TTFT: fair / "
          f"FCFS = {f['long_s'] / b['long_s']:.2f}x | load avg at end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
