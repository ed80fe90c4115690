"""Prefill on the CPU: time to the first token of one long prompt, pdstack's engine against llama.cpp's prompt
processing on the same GGUF, in the same run.

    .venv/bin/python bench/prefill_cpu.py [--tokens 1000 4000] [--threads 2] [--repeat 3] [--weights int4 fp32]

The prompt is the same token ids for both (SmolLM2's tokenizer, a text repeated to the length). pdstack: the engine
(each --weights format, its default chunked prefill; int4 dequantises each weight for the chunk's matmul)
generating 1 token, greedy, prefix cache off so every round computes the whole prompt. llama.cpp (llama-cpp-python, the GGUF read as 4-bit, ``--threads`` threads, ``n_batch`` 512, its KV reset
every round): ``eval`` of the prompt then its first sampled token. Rounds interleave the two; the table gives
the medians and the ratio (llama.cpp's seconds / pdstack's: above 1 means pdstack is faster).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import torch

TEXT = ("Prefill and decode run on different workers: prefill computes the prompt's KV cache, sends it over the "
        "wire, and decode generates from it while the next prompt is prefilled. ")


def prompt_ids(tok, n: int) -> list[int]:
    ids: list[int] = []
    while len(ids) < n:
        ids += tok.encode(TEXT)
    return ids[:n]


def ours(engine, ids: list[int]) -> float:
    from pdruntime.engine import SamplingParams

    t0 = time.perf_counter()
    out = engine.generate([ids], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    dt = time.perf_counter() - t0
    assert len(out[0]) == 1
    engine.pool.assert_no_leaks()
    return dt


def llama(llm, ids: list[int]) -> float:
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(ids)
    llm.sample(temp=0.0, top_k=1)
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1000, 4000])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--model", default=None, help="GGUF path (default: the embedded SmolLM2)")
    ap.add_argument("--weights", nargs="+", default=["int4", "fp32"], choices=("fp32", "int4", "int8"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from llama_cpp import Llama

    from pdruntime.engine import Engine, EngineConfig
    from pdruntime.model import default_model_path, load_model

    path = args.model or default_model_path()
    ctx = max(args.tokens) + 64
    systems = []
    for w in args.weights:
        loaded = load_model(path, weights=w)
        systems.append((f"pdstack {w}", ours, Engine(loaded, EngineConfig(max_num_seqs=1, kv_cache_mib=512,
                                                                          max_model_len=ctx, prefix_cache=False))))
    llm = Llama(model_path=path, n_threads=args.threads, n_threads_batch=args.threads, n_ctx=ctx, n_batch=512,
                verbose=False)
    systems.append(("llama.cpp", llama, llm))
    prompts = {n: prompt_ids(loaded.tokenizer, n) for n in args.tokens}
    for _, fn, obj in systems:  # warm-up
        fn(obj, prompts[min(args.tokens)][:64])
    runs: dict[tuple[int, str], list[float]] = {}
    for r in range(args.repeat):
        for n, ids in prompts.items():
            for name, fn, obj in (systems if r % 2 == 0 else systems[::-1]):
                runs.setdefault((n, name), []).append(fn(obj, ids))
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"prefill to the first token: {os.path.basename(path)}; pdstack {'/'.join(args.weights)} (torch "
          f"{torch.__version__}) vs llama.cpp Q4_1; {args.threads} threads; medians of {args.repeat} interleaved rounds; "
          f"{os.cpu_count()} CPUs ({platform.processor() or platform.machine()}), load average {load}")
    print("| prompt tokens | system | s | tokens/s | speed / llama.cpp |")
    print("|---:|---|---:|---:|---:|")
    for n in args.tokens:
        base = statistics.median(runs[(n, "llama.cpp")])
        for name, _, _ in systems:
            a = statistics.median(runs[(n, name)])
            print(f"| {n} | {name} | {a:.2f} | {n / a:.0f} | {base / a:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
