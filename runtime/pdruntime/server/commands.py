"""`pdrt serve`, `pdrt up`, `pdrt chat` (added to the pdrt CLI by ``register(subparsers)``)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any

from pdruntime.agent import AGENT_PORT
from pdruntime.env import WEIGHT_FORMATS
from pdruntime.server import connections
from pdruntime.server.router import admission
from pdruntime.server.worker.lease import KV_LEASE_S

ROLES = ("prefill", "decode", "router")


def _engine_flags(p: argparse.ArgumentParser, weights: str) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--weights", choices=WEIGHT_FORMATS, default=weights,
                   help=f"weight format (default {weights}): fp32 (the model's dtype, exact); int4 (CPU, fp32: 4-bit "
                        "blocks, the GGUF's own, run by pdstack's native kernels, ~98%% of next-token choices as "
                        "fp32's, docs/benchmarks.md); int8 (CPU: torch's dynamic int8, 55%%); auto: int4 where the "
                        "kernels run with AVX-512 VNNI (their portable build is slower than fp32), else fp32")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV page")
    g.add_argument("--num-blocks", type=int, default=None, help="KV pages (default: from --kv-cache-mib)")
    g.add_argument("--kv-cache-mib", type=int, default=None, help="KV budget in MiB when --num-blocks is not given")
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-prefill-tokens", type=int, default=512, help="chunked-prefill chunk, tokens")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--threads", type=int, default=None, help="torch CPU threads per worker (shared CPUs: 1)")
    g.add_argument("--device", default="auto", help="auto (cuda:0 when CUDA is available, else cpu) | cpu | cuda | cuda:N")
    g.add_argument("--dtype", default="auto", help="auto (bf16 on CUDA, fp32 on cpu) | bf16 | fp16 | fp32")
    g.add_argument("--kv-cache-memory-fraction", type=float, default=None,
                   help="CUDA: share of free device memory (after the weights load) for the KV cache, in (0, 1]; "
                        "default 0.85; --kv-cache-mib / --num-blocks win")
    g.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="capture decode steps as CUDA graphs per batch bucket (default: on with CUDA, off on cpu)")
    g.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="ranks sharding attention heads and MLP (one process and one GPU each; gloo on cpu)")
    g.add_argument("--prefix-cache", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse cached KV pages of earlier prompts and outputs (size: --prefix-cache-max-pages)")
    g.add_argument("--prefix-cache-max-pages", type=int, default=None, help="cached KV pages at most (default: all)")
    g.add_argument("--engine-max-step-failures", type=int, default=None,
                   help="consecutive failing engine steps (not tied to one request) before the worker reports 503 "
                        "and exits 70 (default: PDRT_ENGINE_MAX_STEP_FAILURES, else 5)")
    g.add_argument("--generation-config", default="auto",
                   help="default sampling parameters: auto (the checkpoint's generation_config.json, else the model's "
                        "documented defaults), none (OpenAI API defaults), or a PATH to a generation_config.json")
    g.add_argument("--tool-call-parser", default="auto", choices=("auto", "hermes", "llama3_json"),
                   help="how tool calls are written and parsed (auto: from the chat template)")
    g.add_argument("--served-model-name", default=None,
                   help="model id clients send (default: the GGUF file name without its quant tag, or the HF dir name)")


def _number(ok, accepted: str, kind=float):
    """An argparse type: ``kind(text)`` when ``ok`` holds for it, else an error naming what is accepted."""

    def parse(text: str):
        try:
            v = kind(text) if kind is float or text.isdigit() else None
        except ValueError:
            v = None
        if v is None or v != v or not ok(v):  # v != v: NaN
            raise argparse.ArgumentTypeError(f"{text!r} is invalid; accepted: {accepted}")
        return v

    return parse


_positive_float = _number(lambda v: v > 0, "a number of seconds > 0")
_nonnegative_float = _number(lambda v: v >= 0, "a number of seconds >= 0")
_count = _number(lambda v: v >= 0, "an integer >= 0", int)
_positive_int = _number(lambda v: v >= 1, "an integer >= 1", int)
_fraction = _number(lambda v: 0 <= v <= 1, "a number in [0, 1]")
_ratio = _number(lambda v: v >= 1, "a number >= 1")
_port_or_zero = _number(lambda v: 0 <= v <= 65535, "a port in [0, 65535] (0: the worker URL itself)", int)


def _worker_protocol_flag(p: argparse.ArgumentParser, what: str) -> None:
    from pdruntime.server.router.protocol import WORKER_PROTOCOLS

    p.add_argument("--worker-protocol", choices=WORKER_PROTOCOLS, default="pdrt",
                   help=f"{what}: how the router dispatches PD to the workers: pdrt (/generate, bootstrap room), sglang "
                        "(sglang-router's OpenAI body with bootstrap fields to both), vllm (vLLM's kv_transfer_params "
                        "exchange: prefill, then decode)")


def _routing_flags(p: argparse.ArgumentParser) -> None:
    from pdruntime.server.router.policy import ROUTING_POLICIES, RoutingConfig

    d = RoutingConfig()
    g = p.add_argument_group("router: routing policy")
    g.add_argument("--routing-policy", choices=ROUTING_POLICIES, default=d.policy,
                   help="least-load: sticky by conversation, else the least outstanding pair; round-robin: each pair "
                        "in turn; prefix: the pair that holds the longest prefix of the prompt, within the load bound")
    g.add_argument("--balance-abs-threshold", type=_count, default=d.balance_abs_threshold,
                   help="prefix: the load bound holds when the busiest pair has more than this many outstanding "
                        "requests above the idlest ...")
    g.add_argument("--balance-rel-threshold", type=_ratio, default=d.balance_rel_threshold,
                   help="... and more than this many times its load; then least-load decides")
    g.add_argument("--cache-threshold", type=_fraction, default=d.cache_threshold,
                   help="prefix: share of the prompt a pair must hold to win on its prefix (else least-load)")
    g.add_argument("--prefix-tree-max-chars", type=_positive_int, default=d.tree_max_chars,
                   help="prefix: prompt characters remembered per pair (LRU)")


def routing_config(args: argparse.Namespace):
    """The router's RoutingConfig from its flags (ValueError naming the flag when a value is refused)."""
    from pdruntime.server.router.policy import RoutingConfig

    try:
        return RoutingConfig(args.routing_policy, args.balance_abs_threshold, args.balance_rel_threshold,
                             args.cache_threshold, args.prefix_tree_max_chars)
    except ValueError as exc:
        raise ValueError(f"router routing flags: {exc}") from None


def _router_args(args: argparse.Namespace) -> list[str]:
    """`pdrt up`'s routing flags, checked here, for its router's `pdrt serve --role router`."""
    r = routing_config(args)
    return ["--routing-policy", r.policy, "--balance-abs-threshold", str(r.balance_abs_threshold),
            "--balance-rel-threshold", str(r.balance_rel_threshold), "--cache-threshold", str(r.cache_threshold),
            "--prefix-tree-max-chars", str(r.tree_max_chars)]


def register(subparsers: Any) -> None:
    serve = subparsers.add_parser("serve", help="run one server: prefill worker, decode worker or router")
    serve.add_argument("--role", choices=ROLES, required=True)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--bootstrap-port", type=int, default=8998, help="prefill: KV-transfer (bootstrap) port")
    serve.add_argument("--model", default=None, help="GGUF file or HF-layout dir (default: PDRT_MODEL, else SmolLM2)")
    serve.add_argument("--topology-file", default=None, help="router: hot-reloaded topology YAML")
    serve.add_argument("--prefill", action="append", default=[], help="router: prefill worker URL (repeat per pair)")
    serve.add_argument("--decode", action="append", default=[], help="router: decode worker URL (repeat per pair)")
    serve.add_argument("--bootstrap-ports", type=int, action="append", default=[], help="router: per-pair bootstrap port")
    serve.add_argument("--request-timeout-s", type=float, default=600.0, help="router: per-request deadline, seconds")
    serve.add_argument("--api-key-file", default=None,
                       help="router: API keys, one per line, optionally 'KEY NAME' (the name attributes the client)")
    serve.add_argument("--admin-token-file", default=None,
                       help="router: token for /config and /debug/* (without one they answer loopback clients only)")
    serve.add_argument("--body-timeout-s", type=float, default=30.0, help="router: seconds to receive a request body")
    serve.add_argument("--breaker-cooldown-s", type=float, default=5.0, help="router: seconds a tripped pair rests")
    serve.add_argument("--max-pending-per-pair", type=_positive_int, default=admission.MAX_PENDING,
                       help="router: requests a pair holds between dispatch and their first token; more wait in "
                            "the router's queue")
    serve.add_argument("--admission-wait-s", type=_nonnegative_float, default=admission.WAIT_S,
                       help="router: seconds a request waits for a pair with room before a 429 with Retry-After")
    serve.add_argument("--max-queued-requests", type=_count, default=admission.MAX_QUEUED,
                       help="router: requests waiting for a pair at once; beyond it a 429 at arrival")
    serve.add_argument("--header-timeout-s", type=_positive_float, default=connections.HEADER_TIMEOUT_S,
                       help="seconds a connection may take to send a whole request head (from connecting, or from "
                            "the first byte of its next request); then it is closed")
    serve.add_argument("--max-connections", type=_positive_int, default=connections.MAX_CONNECTIONS,
                       help="open connections per server; beyond it the largest holder's oldest idle one is closed")
    serve.add_argument("--max-connections-per-client", type=_positive_int,
                       default=connections.MAX_CONNECTIONS_PER_CLIENT,
                       help="open connections per client address; beyond it that client's oldest idle one is closed")
    serve.add_argument("--router-processes", type=_positive_int, default=1,
                       help="router: processes serving the port (SO_REUSEPORT), each on its own core; they split "
                            "the admission bounds and share breakers, topology, /metrics, /config and "
                            "/debug/requests (docs/router.md)")
    serve.add_argument("--process-index", type=int, default=None, help=argparse.SUPPRESS)  # set by the supervisor
    serve.add_argument("--peer-dir", default=None, help=argparse.SUPPRESS)  # set by the supervisor
    serve.add_argument("--log-level", default="info")
    _worker_protocol_flag(serve, "router")
    serve.add_argument("--worker-agent-port", type=_port_or_zero, default=AGENT_PORT,
                       help="router, --worker-protocol sglang|vllm: port of the pdstack sidecar (pdrt agent) on each "
                            "worker's host, where /config and /debug/requests are read; 0: the worker URL itself")
    serve.add_argument("--kv-lease-s", type=_positive_float, default=KV_LEASE_S,
                       help="prefill: seconds it holds the KV of a vLLM-protocol prefill (kv_transfer_params "
                            "do_remote_decode) for its decode to pull; then the pages are freed (one unrenewed span, as "
                            "older vLLM's VLLM_NIXL_ABORT_REQUEST_TIMEOUT)")
    _routing_flags(serve)
    _engine_flags(serve, "fp32")
    serve.set_defaults(func=cmd_serve, handler=cmd_serve)

    up = subparsers.add_parser("up", help="run the whole PD stack locally (router + N pairs) and supervise it")
    up.add_argument("--pairs", type=int, default=1, help="P:D groups (a pair is a 1P:1D group)")
    up.add_argument("--prefill", type=int, default=1, help="prefill workers per group")
    up.add_argument("--decode", type=int, default=1, help="decode workers per group")
    up.add_argument("--host", default="127.0.0.1")
    up.add_argument("--port", type=int, default=8000, help="router port")
    up.add_argument("--base-port", type=int, default=8100, help="first worker port (3 per pair)")
    up.add_argument("--model", default=None)
    up.add_argument("--ready-timeout-s", type=float, default=600.0)
    up.add_argument("--router-processes", type=_positive_int, default=1,
                    help="the router's processes (pdrt serve --role router --router-processes; docs/router.md)")
    _worker_protocol_flag(up, "the router")
    _routing_flags(up)
    _engine_flags(up, "auto")
    up.set_defaults(func=cmd_up, handler=cmd_up)

    chat = subparsers.add_parser("chat", help="chat with a running router (pdrt up)")
    chat.add_argument("message", nargs="?", default=None, help="one message; omit for an interactive session")
    chat.add_argument("--url", default="http://127.0.0.1:8000")
    chat.add_argument("--model", default=None, help="default: the router's first model")
    chat.add_argument("--max-tokens", type=int, default=256)
    chat.add_argument("--temperature", type=float, default=None,
                      help="default: the model's own (GET /v1/models shows sampling_defaults)")
    chat.set_defaults(func=cmd_chat, handler=cmd_chat)


def _engine_config(args: argparse.Namespace):
    """The engine configuration from the flags: the one place ``auto`` device and dtype are resolved."""
    from pdruntime.engine import EngineConfig

    kw: dict[str, Any] = {"block_size": args.block_size, "num_blocks": args.num_blocks, "max_num_seqs": args.max_num_seqs,
                          "max_prefill_tokens": args.max_prefill_tokens, "max_model_len": args.max_model_len,
                          "kv_cache_mib": args.kv_cache_mib, "tensor_parallel_size": args.tensor_parallel_size,
                          "prefix_cache": getattr(args, "prefix_cache", True),
                          "prefix_cache_max_pages": getattr(args, "prefix_cache_max_pages", None)}
    if args.kv_cache_memory_fraction is not None:
        kw["kv_cache_memory_fraction"] = args.kv_cache_memory_fraction
    graphs = args.cuda_graphs
    if graphs is None and getattr(args, "role", None) == "prefill":
        graphs = False  # a prefill worker never runs a decode step: nothing to capture
    return EngineConfig.resolve(device=args.device, dtype=args.dtype, cuda_graphs=graphs, **kw)


def _worker_args(args: argparse.Namespace) -> list[str]:
    out = ["--block-size", str(args.block_size), "--max-num-seqs", str(args.max_num_seqs),
           "--max-prefill-tokens", str(args.max_prefill_tokens)]
    for flag, v in (("--num-blocks", args.num_blocks), ("--kv-cache-mib", args.kv_cache_mib),
                    ("--max-model-len", args.max_model_len), ("--threads", args.threads),
                    ("--served-model-name", args.served_model_name),
                    ("--kv-cache-memory-fraction", args.kv_cache_memory_fraction),
                    ("--engine-max-step-failures", args.engine_max_step_failures),
                    ("--prefix-cache-max-pages", getattr(args, "prefix_cache_max_pages", None))):
        if v is not None:
            out += [flag, str(v)]
    out += ["--device", args.device, "--dtype", args.dtype, "--weights", args.weights,
            "--tensor-parallel-size", str(args.tensor_parallel_size),
            "--generation-config", getattr(args, "generation_config", "auto"),
            "--tool-call-parser", getattr(args, "tool_call_parser", "auto")]
    if args.cuda_graphs is not None:
        out.append("--cuda-graphs" if args.cuda_graphs else "--no-cuda-graphs")
    if not getattr(args, "prefix_cache", True):
        out.append("--no-prefix-cache")
    return out


def build_server(args: argparse.Namespace, env=None):
    """-> (app, role object). Loads the model and engine for workers."""
    from pdruntime.env import RuntimeEnv

    env = env or RuntimeEnv.from_environ()
    if getattr(args, "engine_max_step_failures", None) is not None:
        if args.engine_max_step_failures < 1:
            raise ValueError(f"--engine-max-step-failures={args.engine_max_step_failures}; accepted: an integer >= 1")
        env = env.replace(engine_max_step_failures=args.engine_max_step_failures)
    if args.role == "router":
        from pdruntime.server.router.app import Router, RouterConfig
        from pdruntime.server.router.topology import topology_from_flags

        topo = topology_from_flags(args.prefill, args.decode, args.bootstrap_ports) if args.prefill or args.decode else None
        if topo is None and not args.topology_file:
            raise SystemExit("pdrt serve --role router needs --topology-file FILE or --prefill URL --decode URL")
        from pdruntime.server.router.auth import parse_api_keys

        def secret_file(path: str, what: str) -> str:
            try:
                with open(path, encoding="utf-8") as fh:
                    return fh.read()
            except OSError as exc:
                raise ValueError(f"{what} {path!r} cannot be read: {exc.strerror}") from None

        keys = parse_api_keys(secret_file(args.api_key_file, "--api-key-file"), args.api_key_file) \
            if args.api_key_file else {}
        admin = secret_file(args.admin_token_file, "--admin-token-file").strip() if args.admin_token_file else None
        if admin == "":
            raise ValueError(f"--admin-token-file {args.admin_token_file!r} is empty; accepted: a file holding the token")
        cfg = RouterConfig(request_timeout_s=args.request_timeout_s, body_timeout_s=args.body_timeout_s,
                           breaker_cooldown_s=args.breaker_cooldown_s, api_keys=keys, admin_token=admin,
                           max_pending_per_pair=args.max_pending_per_pair, admission_wait_s=args.admission_wait_s,
                           max_queued_requests=args.max_queued_requests, routing=routing_config(args),
                           worker_protocol=args.worker_protocol, worker_agent_port=args.worker_agent_port)
        from pdruntime.server.router.processes import Peers, check_count

        check_count(args.router_processes, args.max_pending_per_pair, args.port)
        peers = Peers(args.process_index, args.router_processes, args.peer_dir) if args.peer_dir else None
        router = Router(env, topology=topo, topology_file=args.topology_file, config=cfg, host=args.host, port=args.port,
                        peers=peers)
        return router.build_app(), router
    from pdruntime.engine import Engine, load_for

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    config = _engine_config(args)
    loaded = load_for(args.model or env.model, config, weights=args.weights, threads=args.threads, env=env)
    engine = Engine(loaded, config)
    from pdruntime.server.worker.base import WorkerOptions

    opts = WorkerOptions(host=args.host, port=args.port, served_model_name=args.served_model_name,
                         generation_config=args.generation_config, tool_call_parser=args.tool_call_parser)
    if args.role == "prefill":
        from pdruntime.server.worker.prefill import PrefillWorker

        worker = PrefillWorker(loaded, engine, env, opts, bootstrap_host=args.host, bootstrap_port=args.bootstrap_port,
                               kv_lease_s=args.kv_lease_s)
    else:
        from pdruntime.server.worker.decode import DecodeWorker

        worker = DecodeWorker(loaded, engine, env, opts)
    return worker.build_app(), worker


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per upstream call is noise
    from pdruntime.env import RuntimeEnv
    from pdruntime.server.local.supervisor import watch_parent

    parent = RuntimeEnv.from_environ().parent_pid
    if parent:
        watch_parent(parent)  # started by `pdrt up`: die with it (PR_SET_PDEATHSIG covers the same on Linux)
    try:
        limits = connections.ConnectionLimits(args.header_timeout_s, args.max_connections,
                                              args.max_connections_per_client)
        app, server = build_server(args)
    except Exception as exc:  # the router must not import torch just to name ModelLoadError
        if not isinstance(exc, ValueError) and type(exc).__name__ != "ModelLoadError":
            raise
        print(f"pdrt serve --role {args.role}: error: {exc}", file=sys.stderr)
        return 2
    if args.role == "router" and args.router_processes > 1 and args.peer_dir is None:
        from pdruntime.server.router.processes import supervise

        return supervise(sys.argv[1:], args.router_processes)  # the flags are checked above, once for all
    if args.role == "router":  # its own server: the completion routes without uvicorn's and FastAPI's layers
        from pdruntime.server.router.server import run

        run(server, app, args.host, args.port, limits)
        return 0
    # keep-alive above the router's client idle expiry (30 s), so a worker never closes a connection
    # the router is about to reuse
    m = server.metrics
    protocol = connections.guarded_protocol(limits, on_close=lambda why: m.connections_closed.labels(why).inc(),
                                            on_count=m.connections_open.set)
    # loop="asyncio": uvicorn's default ("auto") takes uvloop whenever it is installed (uvicorn[standard], vLLM's
    # deps), and the connection guard and every timing in docs/reliability.md are measured on asyncio's own loop.
    # (The KV wire's "peer stalled" failures under uvloop are fixed in the wire itself, KVConn._blocking_again,
    # and tests/pd/test_wire_bulk.py runs a transfer under uvloop: the pin is no longer needed for them.)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False, timeout_keep_alive=75,
                http=protocol, loop="asyncio")
    return 0


def cmd_up(args: argparse.Namespace) -> int:
    from pdruntime.server.local.supervisor import PORTS_IN_USE_EXIT, LocalStack

    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # health polls
    try:
        stack = LocalStack(pairs=args.pairs, prefill=args.prefill, decode=args.decode, host=args.host, port=args.port,
                           base_port=args.base_port, model=args.model, worker_args=_worker_args(args),
                           router_args=_router_args(args) + ["--worker-protocol", args.worker_protocol,
                                                             "--worker-agent-port", "0",
                                                             "--router-processes", str(args.router_processes)])
    except ValueError as exc:
        print(f"pdrt up: {exc}", file=sys.stderr)
        return 2
    busy = stack.check_ports()
    if busy:  # never run over orphans or strangers: their health checks would pass for ours
        for msg in busy:
            print(f"pdrt up: {msg}", file=sys.stderr)
        print("pdrt up: refusing to start; stop those processes or choose other ports (--port, --base-port)",
              file=sys.stderr)
        return PORTS_IN_USE_EXIT
    if args.model is None:
        from pdruntime.model import default_model_path

        try:
            default_model_path()
        except Exception as exc:  # ModelLoadError names the path and the pip command
            print(f"pdrt up: {exc}", file=sys.stderr)
            return 2
    shape = "PD pair(s)" if (args.prefill, args.decode) == (1, 1) else f"{args.prefill}P:{args.decode}D group(s)"
    print(f"pdrt up: starting a router and {args.pairs} {shape}; logs in {stack.log_dir}", flush=True)
    stack.start()
    try:
        if not stack.wait_ready(args.ready_timeout_s):
            print(f"pdrt up: not ready after {args.ready_timeout_s:.0f}s; see logs in {stack.log_dir}", file=sys.stderr)
            stack.stop()
            return 1
    except (RuntimeError, KeyboardInterrupt) as exc:
        print(f"pdrt up: {exc}", file=sys.stderr)
        stack.stop()
        return 1
    url = f"http://{args.host}:{args.port}"
    import httpx

    models = httpx.get(url + "/v1/models", timeout=10).json().get("data", [])
    model = models[0]["id"] if models else "default"
    # no sampling fields: the model's defaults apply (GET /v1/models reports them)
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "What is the capital of France?"}],
                       "max_tokens": 64, "stream": True})
    print(f"\npdrt up: ready at {url}  (router + {args.pairs} pair(s); Ctrl-C stops everything)\n", flush=True)
    print(f"curl -N {url}/v1/chat/completions -H 'Content-Type: application/json' -d '{body}'\n", flush=True)
    print(f"live requests:  curl {url}/debug/requests      chat:  pdrt chat --url {url}\n", flush=True)
    stack.run_forever()
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    import httpx

    from pdruntime.util.sse import DONE, iter_sse

    url = args.url.rstrip("/")
    try:
        model = args.model or httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
        print(f"pdrt chat: cannot reach a router at {url} ({exc}); start one with `pdrt up`", file=sys.stderr)
        return 2
    history: list[dict] = []

    def turn(text: str) -> int:
        history.append({"role": "user", "content": text})
        body = {"model": model, "messages": history, "max_tokens": args.max_tokens, "stream": True, "user": "pdrt-chat"}
        if args.temperature is not None:  # else the model's defaults apply (SmolLM2: T 0.2, top_p 0.9)
            body["temperature"] = args.temperature
        reply = ""
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=None) as resp:
            if resp.status_code != 200:
                print(f"error {resp.status_code}: {resp.read().decode(errors='replace')}", file=sys.stderr)
                history.pop()
                return 1
            for ev in iter_sse(resp.iter_lines()):
                if ev == DONE:
                    continue
                if "error" in ev:
                    print(f"\n[error: {ev['error'].get('message')}]", file=sys.stderr)
                    return 1
                for ch in ev.get("choices", []):
                    piece = ch.get("delta", {}).get("content") or ""
                    reply += piece
                    print(piece, end="", flush=True)
        print()
        history.append({"role": "assistant", "content": reply})
        return 0

    if args.message is not None:
        return turn(args.message)
    print(f"pdrt chat with {model} at {url} (Ctrl-D to quit)")
    while True:
        try:
            text = input("> ")
        except EOFError:
            print()
            return 0
        if text.strip():
            turn(text)


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry (``python -m pdruntime.server``), same subcommands as ``pdrt``."""
    parser = argparse.ArgumentParser(prog="pdrt")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)
