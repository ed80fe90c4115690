#!/usr/bin/env python
"""Decode throughput on CPU: pdstack engine vs HF transformers `generate` and llama.cpp, same model, same run.

    .venv/bin/python bench/decode_cpu.py [--max-tokens 64] [--threads 2] [--weights int4 fp32] [--repeat 3]

SmolLM2-135M-Instruct (the embedded Q4_1 GGUF: int4 keeps its 4-bit blocks for pdstack's CPU kernels, fp32, int8
and bf16 dequantise it) at batch 1 and with 16 concurrent sequences. Every system generates exactly --max-tokens tokens per sequence (EOS ignored / suppressed),
greedy, from the same prompts; tokens/s = generated tokens / wall time including prefill.

llama.cpp (``llama-cpp-python``, when installed) reads the same GGUF as 4-bit, with ``--threads`` threads
(default 2). Its server serves one sequence at a time (one slot), so its "16 concurrent" figure is the 16
sequences one after another in-process: the most its server can give 16 clients, less the HTTP.
Rounds interleave the systems; the table gives the median round and the ratios to transformers and llama.cpp.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
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


FORMATS = ("fp32", "int4", "int8", "bf16")  # bf16: --dtype bf16 (the GGUF dequantised to bf16, bf16 KV cache)


def load_format(path: str, fmt: str):
    """The model in one of FORMATS: a --weights format, or bf16 as pdrt's --dtype bf16 loads it."""
    from pdruntime.model import load_model

    return load_model(path, dtype=torch.bfloat16) if fmt == "bf16" else load_model(path, weights=fmt)


def engine_for(loaded, fmt: str, max_seqs: int):
    """An engine over a model load_format loaded as ``fmt`` (its config's dtype is the model's)."""
    from pdruntime.engine import Engine, EngineConfig

    return Engine(loaded, EngineConfig(max_num_seqs=max_seqs, kv_cache_mib=256, dtype="bf16" if fmt == "bf16" else "fp32"))


def make_engine(path: str, weights: str, max_seqs: int):
    return engine_for(load_format(path, weights), weights, max_seqs)


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


def make_llama(path: str, threads: int):
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    return Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=512, n_batch=512,
                 verbose=False)


def bench_llama(llm, prompts: list[list[int]], max_tokens: int) -> float:
    """Greedy, ``max_tokens`` per prompt (``Llama.generate`` does not stop at EOS), one prompt at a time, no KV
    reuse between prompts (``reset``)."""
    t0 = time.perf_counter()
    n = 0
    for p in prompts:
        llm.reset()
        for i, _ in enumerate(llm.generate(p, temp=0.0, top_k=1, reset=True)):
            n += 1
            if i + 1 >= max_tokens:
                break
    dt = time.perf_counter() - t0
    assert n == len(prompts) * max_tokens
    return n / dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--weights", nargs="+", default=["int4", "fp32"], choices=FORMATS)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--model", default=None, help="GGUF path (default: embedded SmolLM2)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="interleaved rounds per system; the median round counts")
    ap.add_argument("--no-llama", action="store_true", help="leave llama.cpp out even when it is installed")
    ap.add_argument("--kernel-march", default="native",
                    help="-march of pdstack's CPU kernels (default native); x86-64-v3 measures the portable build an "
                         "AVX2-only CPU gets (with ATEN_CPU_CAPABILITY=avx2 to hold torch to AVX2 too)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.kernel_march != "native":
        from pdruntime.kernels.cpu import native

        native.CFLAGS = tuple(f"-march={args.kernel_march}" if f == "-march=native" else f for f in native.CFLAGS)
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
          f"{load[0]:.2f} | {args.max_tokens} new tokens per sequence, greedy | median of {args.repeat}\n")
    engines = {w: make_engine(path, w, max(args.batch)) for w in args.weights}
    llama = None if args.no_llama else make_llama(path, args.threads or 2)
    rows = []
    for b in args.batch:
        prompts = [all_prompts[i % len(all_prompts)] for i in range(b)]
        runs: dict[str, list[float]] = {}
        for _ in range(args.repeat):  # interleaved, so slow phases of background load hit every system
            runs.setdefault("hf", []).append(bench_hf(hf, prompts, args.max_tokens, pad_id=2))
            if llama is not None:
                runs.setdefault("llama", []).append(bench_llama(llama, prompts, args.max_tokens))
            for w, engine in engines.items():
                runs.setdefault(w, []).append(bench_ours(engine, prompts, args.max_tokens))
        med = {k: statistics.median(v) for k, v in runs.items()}
        names = {"hf": "transformers generate (fp32)", "llama": f"llama.cpp (Q4_1 GGUF, {args.threads or 2} threads)",
                 **{w: f"pdstack engine ({w})" for w in args.weights}}
        for k in ["hf", *(["llama"] if llama is not None else []), *args.weights]:
            rows.append((b, names[k], med[k], med[k] / med["hf"], med[k] / med["llama"] if llama is not None else None))
    print("| sequences | system | tokens/s (median) | vs transformers | vs llama.cpp |")
    print("|---:|---|---:|---:|---:|")
    for b, name, tps, ratio, vs_llama in rows:
        print(f"| {b} | {name} | {tps:.1f} | {ratio:.2f}x | {f'{vs_llama:.2f}x' if vs_llama is not None else '-'} |")
    try:
        print(f"\nload avg at end {os.getloadavg()[0]:.2f}")
    except OSError:
        pass


if __name__ == "__main__":
    main()
