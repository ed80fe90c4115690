#!/usr/bin/env python
"""Multi-round agents at the cost of their new tokens (issue 21): pdstack's prefix cache on and off, and
llama.cpp's server with its prompt cache, in one run on the same GGUF.

    .venv/bin/python bench/agents_prefix.py [--agents 8] [--rounds 10] [--tool-tokens 200] [--max-tokens 32]
        [--llama-python /work/peers-venv/bin/python] [--systems on off llama] [--threads 2] [--dtype auto]
        [--weights auto]

Each of AGENTS agents holds one chat conversation. Every round it streams a chat completion of MAX_TOKENS
tokens (greedy, EOS ignored where the server allows), then appends the assistant's reply and a tool result of
about TOOL_TOKENS tokens, so every round resends the whole, longer history. Rounds run in lockstep: the
agents' round r are concurrent, round r+1 starts when all of round r ended, so each round's figures stand alone.

Measured per round: mean time to first token over the agents, and for pdstack the KV bytes prefill sent to
decode (the workers' own counter ``pdrt_kv_transfer_size_bytes_sum`` on prefill's /metrics, delta over the
round, per agent), and each round's wall time. Wall time is all rounds. pdstack: ``pdrt up --pairs 1 --threads
THREADS`` with SmolLM2 (fp32, CPU), with
``--prefix-cache`` and ``--no-prefix-cache``. llama.cpp: ``python -m llama_cpp.server`` (llama-cpp-python,
built from source for this CPU) on the same GGUF file, its RAM prompt cache on (``--cache true``), 2 threads.

Prints one table per system and the targets' ratios; ``--json`` writes the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time

import httpx

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "runtime"))

from pdruntime.util.ports import free_port, free_port_block  # noqa: E402
from pdruntime.util.sse import DONE, aiter_sse  # noqa: E402

WORDS = ("cache", "page", "token", "decode", "prefill", "router", "kernel", "tensor", "stream", "agent", "tool",
         "request", "latency", "budget", "chunk", "layer")


def tool_result(agent: int, rnd: int, tokens: int) -> str:
    """~``tokens`` tokens of tool output (grep-like lines)."""
    rng = random.Random(agent * 1000 + rnd)
    lines, n = [], 0
    while n < tokens:
        line = f"src/{rng.choice(WORDS)}_{rng.randint(0, 99)}.py:{rng.randint(1, 900)}: " + " ".join(
            rng.choice(WORDS) for _ in range(8))
        lines.append(line)
        n += 24  # measured: ~24 SmolLM2 tokens a line
    return "\n".join(lines)


def metric_sum(text: str, name: str) -> float:
    return sum(float(m.group(1)) for m in re.finditer(rf"^{name}(?:{{[^}}]*}})? ([0-9.eE+-]+)$", text, re.M))


class System:
    def __init__(self, name: str, argv: list[str], port: int, log_dir: str, prefill_url: str | None) -> None:
        self.name, self.argv, self.url, self.prefill_url = name, argv, f"http://127.0.0.1:{port}", prefill_url
        self.log = open(os.path.join(log_dir, f"{name}.log"), "w")
        self.proc: subprocess.Popen | None = None

    def start(self, ready_s: float = 600) -> str:
        self.proc = subprocess.Popen(self.argv, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        t0 = time.monotonic()
        while time.monotonic() - t0 < ready_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; see {self.log.name}")
            try:
                r = httpx.get(self.url + "/v1/models", timeout=5)
                if r.status_code == 200 and r.json().get("data"):
                    if self.prefill_url is None or httpx.get(self.url + "/health", timeout=5).status_code == 200:
                        return r.json()["data"][0]["id"]
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(1)
        raise RuntimeError(f"{self.name} not ready in {ready_s}s; see {self.log.name}")

    def kv_bytes(self) -> float | None:
        if self.prefill_url is None:
            return None
        return metric_sum(httpx.get(self.prefill_url + "/metrics", timeout=10).text, "pdrt_kv_transfer_size_bytes_sum")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.log.close()


async def one_round(client: httpx.AsyncClient, model: str, messages: list[dict], max_tokens: int,
                    pdstack: bool) -> tuple[float, str, int, int, float]:
    """Stream one completion: (seconds to the first token, the reply, prompt tokens, cached tokens, the
    monotonic time it ended)."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    if pdstack:
        body["ignore_eos"] = True
    t0 = time.monotonic()  # TTFT counts from the first attempt: a refusal's wait is part of it
    ttft, reply, usage = None, "", {}
    for _ in range(30):
        async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
            if resp.status_code in (429, 503) and resp.headers.get("retry-after"):
                await resp.aread()
                await asyncio.sleep(min(float(resp.headers["retry-after"]), 5.0))
                continue
            if resp.status_code != 200:
                raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
            async for ev in aiter_sse(resp.aiter_lines()):
                if ev == DONE:
                    break
                for ch in ev.get("choices") or ():
                    text = (ch.get("delta") or {}).get("content")
                    if text and ttft is None:
                        ttft = time.monotonic() - t0
                    reply += text or ""
                usage = ev.get("usage") or usage
            break
    cached = ((usage.get("prompt_tokens_details") or {}).get("cached_tokens")) or 0
    return ((ttft if ttft is not None else time.monotonic() - t0), reply, usage.get("prompt_tokens"), cached,
            time.monotonic())


async def run_system(sys_: System, model: str, args) -> dict:
    convs = [[{"role": "system", "content": "You are a coding agent. Call tools, read their output, then answer."},
              {"role": "user", "content": f"Task {a}: find where the KV cache pages are freed and fix the leak. "
                                          f"Repository listing:\n{tool_result(a, -1, args.tool_tokens)}"}]
             for a in range(args.agents)]  # round 1 carries a tool result too: every round adds ~TOOL_TOKENS
    rounds = []
    limits = httpx.Limits(max_connections=args.agents, max_keepalive_connections=args.agents)
    async with httpx.AsyncClient(base_url=sys_.url, timeout=600, limits=limits) as client:
        t0 = time.monotonic()
        for r in range(args.rounds):
            b0 = sys_.kv_bytes()
            r0 = time.monotonic()  # the round's wall time leaves out the two /metrics reads
            res = await asyncio.gather(*(one_round(client, model, convs[a], args.max_tokens, sys_.prefill_url is not None)
                                         for a in range(args.agents)))
            r1 = time.monotonic()
            b1 = sys_.kv_bytes()
            for a, (_, reply, *_) in enumerate(res):
                convs[a].append({"role": "assistant", "content": reply})
                convs[a].append({"role": "user", "content": "Tool result:\n" + tool_result(a, r, args.tool_tokens)})
            rounds.append({"round": r + 1, "ttft_s": sum(x[0] for x in res) / len(res), "wall_s": r1 - r0,
                           "ttfts_s": sorted(x[0] for x in res), "ends_s": sorted(x[4] - r0 for x in res),
                           "prompt_tokens": None if res[0][2] is None else sum(x[2] for x in res) / len(res),
                           "cached_tokens": sum(x[3] for x in res) / len(res),
                           "kv_bytes": None if b0 is None else (b1 - b0) / args.agents})
        wall = time.monotonic() - t0
    return {"system": sys_.name, "wall_s": wall, "rounds": rounds}


def systems(args, log_dir: str) -> list[System]:
    from pdruntime.model import default_model_path

    gguf = args.model or default_model_path()
    out = []
    for which in args.systems:
        port = free_port()
        if which in ("on", "off"):
            base = free_port_block(3)
            argv = [os.path.join(os.path.dirname(sys.executable), "pdrt"), "up", "--pairs", "1", "--port", str(port),
                    "--base-port", str(base), "--model", gguf, "--threads", str(args.threads), "--max-model-len", "8192",
                    "--kv-cache-mib", "2048", "--dtype", args.dtype, "--weights", args.weights,
                    "--prefix-cache" if which == "on" else "--no-prefix-cache"]
            out.append(System(f"pdstack, prefix cache {which}", argv, port, log_dir, f"http://127.0.0.1:{base}"))
        else:
            argv = [args.llama_python, "-m", "llama_cpp.server", "--model", gguf, "--port", str(port),
                    "--n_ctx", str(llama_n_ctx(args)), "--n_threads", "2", "--cache", "true", "--cache_type", "ram",
                    "--cache_size", str(args.llama_cache_mib << 20),
                    # its default cuts a running stream short ([DONE]) as soon as another request waits for the
                    # model: with concurrent agents every reply would end after a token or two, unsaved in the cache
                    "--interrupt_requests", "false"]
            out.append(System("llama.cpp server, prompt cache on", argv, port, log_dir, None))
    return out


def llama_n_ctx(args) -> int:
    """llama.cpp's context: the last round's prompt and reply (~50 tokens of template and task a round on top
    of the tool output), rounded up to a power of two. Its RAM cache saves the whole context state per
    request, so a context no larger than needed keeps each state small."""
    need = args.rounds * (args.tool_tokens + 50 + args.max_tokens) + args.tool_tokens + 100
    return max(2048, 1 << (need - 1).bit_length())


def report(results: list[dict]) -> str:
    out = []
    for res in results:
        out.append(f"\n{res['system']}: wall {res['wall_s']:.1f} s")
        out.append("| round | mean TTFT, s | round wall, s | prompt tokens | cached tokens | KV bytes / request |")
        out.append("|---:|---:|---:|---:|---:|---:|")
        for r in res["rounds"]:
            kv = "-" if r["kv_bytes"] is None else f"{r['kv_bytes'] / 1024:.0f} KiB"
            pt = "-" if r["prompt_tokens"] is None else f"{r['prompt_tokens']:.0f}"  # llama.cpp streams no usage
            out.append(f"| {r['round']} | {r['ttft_s']:.3f} | {r['wall_s']:.1f} | {pt} | {r['cached_tokens']:.0f} | {kv} |")
    by = {r["system"]: r for r in results}
    on, off = by.get("pdstack, prefix cache on"), by.get("pdstack, prefix cache off")
    llama = by.get("llama.cpp server, prompt cache on")
    out.append("")
    if on:
        out.append(f"cache on: round-{len(on['rounds'])} TTFT / round-1 TTFT = "
                   f"{on['rounds'][-1]['ttft_s'] / on['rounds'][0]['ttft_s']:.2f}x (target <= 1.5x)")
    if on and off:
        out.append(f"wall, cache off / cache on = {off['wall_s'] / on['wall_s']:.2f}x (target >= 3x)")
        kv_on = [r["kv_bytes"] for r in on["rounds"][1:]]
        kv_off = [r["kv_bytes"] for r in off["rounds"][1:]]
        out.append(f"KV bytes per request, rounds 2..: cache on {min(kv_on) / 1024:.0f}..{max(kv_on) / 1024:.0f} KiB, "
                   f"cache off {min(kv_off) / 1024:.0f}..{max(kv_off) / 1024:.0f} KiB")
    if on and llama:
        out.append(f"round-{len(on['rounds'])} TTFT, pdstack cache on / llama.cpp = "
                   f"{on['rounds'][-1]['ttft_s'] / llama['rounds'][-1]['ttft_s']:.2f}x (target <= 1x)")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--agents", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--tool-tokens", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--systems", nargs="+", default=["on", "off", "llama"], choices=["on", "off", "llama"])
    ap.add_argument("--llama-python", default="/work/peers-venv/bin/python",
                    help="a Python with llama-cpp-python[server] (built from source; not in make setup)")
    ap.add_argument("--llama-cache-mib", type=int, default=2048,
                    help="llama.cpp's RAM prompt cache (LRU, one state saved per request, ~23 KB a token for "
                         "SmolLM2, so 2 GiB keeps ~35 states of 2,500 tokens: every agent's latest, 8 agents). "
                         "The cap counts KV only: each state also holds an uncounted ~100 MB copy of logits")
    ap.add_argument("--threads", type=int, default=2,
                    help="pdstack's torch threads per worker (default 2: each worker may use both cores, as "
                         "llama.cpp's 2 threads do; the two workers' busy spells only partly overlap)")
    ap.add_argument("--dtype", default="auto", help="pdstack's --dtype (auto: fp32 on the CPU)")
    ap.add_argument("--weights", default="auto", choices=("auto", "fp32", "int4", "int8"),
                    help="pdstack's --weights (auto, pdrt up's default: int4 on the CPU)")
    ap.add_argument("--model", default=None, help="GGUF (default: the embedded SmolLM2)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    log_dir = tempfile.mkdtemp(prefix="agents-prefix-")
    print(f"{args.agents} agents x {args.rounds} rounds, +{args.tool_tokens} tool tokens and {args.max_tokens} new "
          f"tokens a round | {os.cpu_count()} CPUs | load avg {os.getloadavg()[0]:.2f} | logs {log_dir}")
    results = []
    for s in systems(args, log_dir):
        try:
            model = s.start()
            results.append(asyncio.run(run_system(s, model, args)))
        finally:
            s.stop()
        print(report(results[-1:]), flush=True)
    print(report(results))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)
    return results


if __name__ == "__main__":
    main()
