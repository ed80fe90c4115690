#!/usr/bin/env python
"""Decode throughput on CPU: pdstack engine vs HF transformers `generate`, same model, same run.

    .venv/bin/python bench/decode_cpu.py [--max-tokens 64] [--threads 2] [--weights fp32 int8]

SmolLM2-135M-Instruct (the embedded Q4_1 GGUF, dequantised) at batch 1 and with 16 concurrent
sequences. Every system generates exactly --max-tokens tokens per sequence (EOS ignored / suppressed),
greedy, from the same prompts; tokens/s = generated tokens / wall time including prefill.
Prints a markdown table with the ratio to transformers.
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import torch

PROMPTS = [
    "The capital of France is", "Write a haiku about the sea.", "def quicksort(arr):",
    "Explain what a KV cache is in one paragraph.", "Once upon a time, in a small village,",
    "List three uses of copper:", "The theory of relativity states that", "SELECT name FROM users WHERE",
    "Translate to French: good morning, my friend.", "The best way to learn a language is",
    "import numpy as np\n\n# compute the mean of", "Q: What is 17 times 3?\nA:", "Dear hiring manager,",
    "The mitochondria is", "In 1969, the first humans", "Here is a recipe for pancakes:",
]


def make_engine(path: str, weights: str, max_seqs: int):
    from pdruntime.engine import Engine, EngineConfig
    from pdruntime.model import load_model

    return Engine(load_model(path, weights=weights), EngineConfig(max_num_seqs=max_seqs, kv_cache_mib=256))


def bench_ours(engine, prompts: list[list[int]], max_tokens: int) -> float:
    from pdruntime.engine import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    engine.generate(prompts, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))  # warm-up
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    dt = time.perf_counter() - t0
    assert all(len(o) == max_tokens for o in outs)
    engine.pool.assert_no_leaks()
    return sum(len(o) for o in outs) / dt


def bench_hf(model, prompts: list[list[int]], max_tokens: int, pad_id: int) -> float:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding, as batched generate expects
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    kw = dict(attention_mask=mask, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
              pad_token_id=pad_id)
    with torch.inference_mode():
        model.generate(ids, **{**kw, "max_new_tokens": 4, "min_new_tokens": 4})  # warm-up
        t0 = time.perf_counter()
        out = model.generate(ids, **kw)
        dt = time.perf_counter() - t0
    assert out.shape[1] - width == max_tokens
    return len(prompts) * max_tokens / dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--weights", nargs="+", default=["fp32", "int8"], choices=["fp32", "int8"])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--model", default=None, help="GGUF path (default: embedded SmolLM2)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="interleaved rounds per system; the best round counts (damps noise from other load)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    from pdruntime.model import default_model_path, load_model

    path = args.model or default_model_path()
    tok = load_model(path).tokenizer
    all_prompts = [tok.encode(p) for p in PROMPTS]
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                              dtype=torch.float32).eval()
    try:
        load = os.getloadavg()
    except OSError:
        load = (float("nan"),) * 3
    print(f"model: {os.path.basename(path)} | torch {torch.__version__} | threads {torch.get_num_threads()} | "
          f"{platform.processor() or platform.machine()} | {os.cpu_count()} CPUs | load avg at start "
          f"{load[0]:.2f} | {args.max_tokens} new tokens per sequence, greedy | best of {args.repeat}\n")
    engines = {w: make_engine(path, w, max(args.batch)) for w in args.weights}
    rows = []
    for b in args.batch:
        prompts = [all_prompts[i % len(all_prompts)] for i in range(b)]
        best: dict[str, float] = {}
        for _ in range(args.repeat):  # interleaved, so slow phases of background load hit every system
            best["hf"] = max(best.get("hf", 0.0), bench_hf(hf, prompts, args.max_tokens, pad_id=2))
            for w, engine in engines.items():
                best[w] = max(best.get(w, 0.0), bench_ours(engine, prompts, args.max_tokens))
        rows.append((b, "transformers generate (fp32)", best["hf"], 1.0))
        for w in args.weights:
            rows.append((b, f"pdstack engine ({w})", best[w], best[w] / best["hf"]))
    print("| sequences | system | tokens/s | vs transformers |")
    print("|---:|---|---:|---:|")
    for b, name, tps, ratio in rows:
        print(f"| {b} | {name} | {tps:.1f} | {ratio:.2f}x |")
    try:
        print(f"\nload avg at end {os.getloadavg()[0]:.2f}")
    except OSError:
        pass


if __name__ == "__main__":
    main()
