"""``pdrt``: the runtime's command line.

``pdrt generate "PROMPT"`` runs the engine in-process and prints the completion; ``serve``, ``up``
and ``chat`` come from ``pdruntime.server.commands`` when that module is present.
"""

from __future__ import annotations

import argparse
import sys


def _add_generate(subparsers) -> None:
    g = subparsers.add_parser("generate", help="generate a completion in-process and print it")
    g.add_argument("prompt", help="prompt text (with --chat: the user message)")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--system", default=None, help="with --chat: a system message")
    g.add_argument("--model", default=None, help="GGUF file or HF-layout dir (default: PDRT_MODEL, else SmolLM2)")
    g.add_argument("--weights", choices=("fp32", "int8"), default="fp32",
                   help="int8 = dynamic-quantised Linear layers (faster on CPU, not bit-exact)")
    g.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    g.add_argument("--device", default="auto", help="auto (cuda:0 when CUDA is available, else cpu) | cpu | cuda | cuda:N")
    g.add_argument("--dtype", default="auto", help="auto (bf16 on CUDA, fp32 on cpu) | bf16 | fp16 | fp32")
    g.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="decode CUDA graphs (default: on with CUDA)")
    g.add_argument("--tensor-parallel-size", type=int, default=1, help="ranks sharding heads and MLP")
    g.add_argument("--verbose", action="store_true", help="print timing and engine config to stderr")
    g.set_defaults(func=cmd_generate)


def cmd_generate(args: argparse.Namespace) -> int:
    import json
    import time

    import torch

    from pdruntime.engine import Engine, EngineConfig, InvalidRequest, SamplingParams, load_for
    from pdruntime.env import ConfigError, RuntimeEnv
    from pdruntime.model import ModelLoadError

    try:
        if args.threads:
            torch.set_num_threads(args.threads)
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                                top_p=args.top_p, seed=args.seed, stop=tuple(args.stop), ignore_eos=args.ignore_eos)
        env = RuntimeEnv.from_environ()
        t0 = time.perf_counter()
        config = EngineConfig.resolve(device=args.device, dtype=args.dtype, cuda_graphs=args.cuda_graphs,
                                      max_num_seqs=1, tensor_parallel_size=args.tensor_parallel_size)
        loaded = load_for(args.model or env.model, config, weights=args.weights, threads=args.threads, env=env)
        tok = loaded.tokenizer
        text = args.prompt
        if args.chat:
            msgs = ([{"role": "system", "content": args.system}] if args.system else []) + [
                {"role": "user", "content": text}]
            text = tok.apply_chat_template(msgs, add_generation_prompt=True)
        ids = tok.encode(text)
        engine = Engine(loaded, config)
        engine.add_request("cli", ids, params)
        t1 = time.perf_counter()
        n = 0
        while engine.has_work():
            for out in engine.step():
                n += len(out.new_token_ids)
                sys.stdout.write(out.text_delta)
                sys.stdout.flush()
        sys.stdout.write("\n")
        if args.verbose:
            dt = time.perf_counter() - t1
            print(f"[pdrt] load {t1 - t0:.1f}s, {len(ids)} prompt tokens, {n} generated in {dt:.2f}s "
                  f"({n / dt:.1f} tok/s)", file=sys.stderr)
            print(json.dumps(engine.describe(), default=str), file=sys.stderr)
        engine.shutdown()
        return 0
    except (ModelLoadError, InvalidRequest, ConfigError, ValueError) as exc:
        print(f"pdrt generate: error: {exc}", file=sys.stderr)
        return 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdrt", description="pdstack runtime: engine, PD workers, router")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    try:
        from pdruntime.server import commands
    except ImportError as exc:
        if exc.name not in ("pdruntime.server.commands", "pdruntime.server"):
            raise
    else:
        commands.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
