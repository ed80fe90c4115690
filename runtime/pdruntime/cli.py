"""``pdrt``: the runtime's command line.

``pdrt generate "PROMPT"`` runs the engine in-process and prints the completion; ``pdrt probe agents URL``
runs the multi-round agent probe against a router (stdlib + httpx only); ``serve``, ``up`` and ``chat`` come
from ``pdruntime.server.commands`` when that module is present.
"""

from __future__ import annotations

import argparse
import sys

from pdruntime.env import WEIGHT_FORMATS


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
    g.add_argument("--weights", choices=WEIGHT_FORMATS, default="fp32",
                   help="fp32: exact (default); int4: 4-bit blocks (the GGUF's own) run by pdstack's CPU kernels; "
                        "int8: torch's dynamic int8, only 55%% of SmolLM2's next-token choices match fp32's; auto: int4 "
                        "where the kernels run with AVX-512 VNNI, else fp32 (docs/benchmarks.md)")
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


def _at_least(lo: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer; accepted: an integer >= {lo}") from None
        if value < lo:
            raise argparse.ArgumentTypeError(f"{value} is out of range; accepted: an integer >= {lo}")
        return value
    return parse


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number; accepted: seconds > 0") from None
    if not value > 0 or value != value or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text} is not accepted; accepted: seconds > 0")
    return value


def _router_url(text: str) -> str:
    if not text.startswith(("http://", "https://")) or len(text.split("://", 1)[1].strip("/")) == 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not accepted; accepted: the router's http(s) URL, e.g. "
                                         "http://127.0.0.1:8000")
    return text


def _add_probe(subparsers) -> None:
    p = subparsers.add_parser("probe", help="probe a running router with workload-shaped traffic")
    kinds = p.add_subparsers(dest="probe", required=True, metavar="{agents}")
    a = kinds.add_parser("agents", help="N agents x R rounds of growing, tool-call-shaped context over keep-alive "
                         "connections; exit 1 on any hang or error",
                         description="Multi-round agent probe (pdruntime.probe_agents). Prints one line per round and, "
                         "on a hang, which round, which stage and how old (from the router's /debug/requests). "
                         "Exit status: 0 every round completed, 1 a hang or an error, 2 bad usage.")
    a.add_argument("url", type=_router_url, help="the router's URL, e.g. http://127.0.0.1:8000")
    a.add_argument("--agents", type=_at_least(1), default=8, help="concurrent agents, one connection each (default 8)")
    a.add_argument("--rounds", type=_at_least(1), default=10, help="rounds per agent (default 10)")
    a.add_argument("--round-timeout", type=_seconds, default=60.0, dest="round_timeout",
                   help="seconds a round may take before it counts as a hang (default 60)")
    a.add_argument("--max-tokens", type=_at_least(1), default=16, help="tokens per answer (default 16)")
    a.add_argument("--model", default=None, help="model id (default: the router's first model)")
    a.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer <key>'")
    a.add_argument("--pair", type=_at_least(0), default=None,
                   help="pin every request to group K (X-PDStack-Pair), canary or not; needs --admin-token-file unless "
                        "the router has no admin token and this is a loopback client")
    a.add_argument("--admin-token-file", default=None,
                   help="file holding the router's admin token (sent as X-PDStack-Admin-Token: pinning and "
                        "/debug/requests need it)")
    a.add_argument("-o", "--output", choices=("table", "json"), default="table")
    a.set_defaults(func=cmd_probe_agents)


def cmd_probe_agents(args: argparse.Namespace) -> int:
    import asyncio
    import json

    from pdruntime.probe_agents import format_table, run_agents_probe
    from pdruntime.util.headers import ADMIN_TOKEN_HEADER, PIN_HEADER

    headers: dict[str, str] = {}
    if args.admin_token_file:
        try:
            with open(args.admin_token_file, encoding="utf-8") as fh:
                token = fh.read().strip()
        except OSError as exc:
            print(f"pdrt probe agents: error: --admin-token-file {args.admin_token_file!r} cannot be read: {exc}",
                  file=sys.stderr)
            return 2
        if not token:
            print(f"pdrt probe agents: error: --admin-token-file {args.admin_token_file!r} is empty; accepted: a file "
                  "holding the router's admin token", file=sys.stderr)
            return 2
        headers[ADMIN_TOKEN_HEADER] = token
    if args.pair is not None:
        headers[PIN_HEADER] = str(args.pair)
    report = asyncio.run(run_agents_probe(args.url, agents=args.agents, rounds=args.rounds,
                                          round_timeout_s=args.round_timeout, max_tokens=args.max_tokens,
                                          headers=headers, model=args.model, api_key=args.api_key))
    if args.output == "json":
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print(format_table(report, args.agents))
    return 0 if report.ok else 1


def _engine_url(text: str) -> str:
    from urllib.parse import urlsplit

    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise argparse.ArgumentTypeError(f"{text!r} is not accepted; accepted: the engine's http(s) URL, e.g. "
                                         "http://127.0.0.1:8000")
    return text.rstrip("/")


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer; accepted: a port 1..65535") from None
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is out of range; accepted: a port 1..65535")
    return value


def _add_agent(subparsers) -> None:
    from pdruntime.agent import AGENT_PORT, ENGINES, ROLES

    a = subparsers.add_parser("agent", help="the pdstack sidecar beside an SGLang or vLLM worker: /health, "
                              "/config, /metrics, /debug/requests translated from the engine")
    a.add_argument("--engine", required=True, choices=ENGINES)
    a.add_argument("--role", required=True, choices=ROLES)
    a.add_argument("--port", type=_port, default=AGENT_PORT)
    a.add_argument("--host", default="0.0.0.0")
    a.add_argument("--engine-url", type=_engine_url, default="http://127.0.0.1:8000")
    a.add_argument("--process-match", action="append", default=None,
                   help="a substring of the engine's command line (repeatable; default per engine)")
    a.add_argument("--model-path", default=None, help="the weights (dir or file) to hash for /config")
    a.add_argument("--report-env", default="", help="extra env names for /config, comma-separated, NAME or PREFIX*")
    a.set_defaults(func=cmd_agent)


def cmd_agent(args: argparse.Namespace) -> int:
    from pdruntime.agent import DEFAULT_MATCH
    from pdruntime.agent.server import Agent, AgentConfig, make_server
    from pdruntime.env import ConfigError, parse_allow_list

    try:
        report = parse_allow_list(args.report_env)
    except ConfigError as exc:
        print(f"pdrt agent: --report-env: {exc}", file=sys.stderr)
        return 2
    cfg = AgentConfig(engine=args.engine, role=args.role, engine_url=args.engine_url,
                      matches=tuple(args.process_match or DEFAULT_MATCH[args.engine]),
                      model_path=args.model_path, report_env=report)
    server = make_server(Agent(cfg), args.host, args.port)
    print(f"pdrt agent: {args.engine} {args.role} on {args.host}:{server.server_address[1]}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdrt", description="pdstack runtime: engine, PD workers, router")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_probe(sub)
    _add_agent(sub)
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
