"""Agents soak: the incident's workload against a real `pdrt up` stack, with aborts and a decode killed mid-run.

Starts `pdrt up --pairs 2` (router + 2 PD pairs, supervised), then runs AGENTS concurrent agents. Each agent
holds one conversation of ROUNDS rounds over its own keep-alive connection (one httpx client, one
connection): every round streams a chat completion and then appends the assistant's reply and a
tool-call-like output (a JSON tool result that grows each round), so every round resends a longer context.

Faults, as in production:
  * with --burst N: at BURST_AT of the run, N concurrent 600-token one-shot completions beside the agents
    (overload), and with --long-prompt one prompt of 95% of the context; each burst answer must be a 200 or a
    429/503 with Retry-After (agents honour Retry-After too), and the long prompt must succeed;
  * ABORT_RATE of the requests are aborted by the client after their first token (the round is retried);
  * at KILL_AT of the run, pair 0's decode worker is SIGKILLed; `pdrt up` co-restarts the pair while the
    agents keep going (their failed rounds are retried after a short pause, and counted as errors surfaced).

After the run it waits for the stack to go idle and reads every worker's /debug/requests: live requests
and KV pages still held are leaks. Prints one table; exit status 1 on a hang or a leak.

    .venv/bin/python bench/agents_soak.py                         # 32 agents x 10 rounds, tiny test model
    .venv/bin/python bench/agents_soak.py --agents 8 --rounds 10 --json out.json
    .venv/bin/python bench/agents_soak.py --model PATH            # a real model (needs more than 2 cores)

Default model: the tiny random-weight test model (pdruntime.model.testing), so the soak fits a 2-core
machine: it measures the stack's reliability (hangs, leaks, error surfacing, recovery), not model speed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import httpx

from pdruntime.util.ports import free_port, free_port_block
from pdruntime.util.sse import DONE, aiter_sse

HANG_S = 120.0  # a round attempt that takes longer than its deadline + this margin is a hang


@dataclass
class Stats:
    rounds: int = 0
    attempts: int = 0
    aborted: int = 0
    hangs: int = 0
    errors: dict = field(default_factory=dict)  # "status: message prefix" -> count
    latencies: list = field(default_factory=list)  # seconds per completed round (successful attempt)
    max_context_chars: int = 0
    gave_up: int = 0  # agents stopped by a request error (4xx)
    refused: int = 0  # round attempts refused with 429/503 + Retry-After (the agent waits and asks again)

    def error(self, key: str) -> None:
        self.errors[key] = self.errors.get(key, 0) + 1


TOOLS = ("grep", "read_file", "run_tests", "list_dir", "search_docs")


def tool_output(agent: int, rnd: int, rng: random.Random) -> str:
    """A tool-call-like result that grows with the round: what agents paste back into their context."""
    tool = TOOLS[(agent + rnd) % len(TOOLS)]
    lines = [f"src/module_{rng.randint(0, 99)}.py:{rng.randint(1, 400)}: def fn_{rng.randint(0, 999)}()"
             for _ in range(1 + rnd // 2)]
    return json.dumps({"tool_call_id": f"call_{agent}_{rnd}", "tool": tool, "exit_code": 0, "output": lines})


async def run_agent(i: int, url: str, model: str, args, stats: Stats, stop_at: float) -> None:
    rng = random.Random(1000 + i)
    messages = [{"role": "system", "content": "You are a coding agent. Use tools, then answer."},
                {"role": "user", "content": f"Task {i}: find where the cache is flushed and fix the bug."}]
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)  # one keep-alive connection per agent
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=httpx.Timeout(args.deadline_s + HANG_S)) as client:
        rnd = 0
        while rnd < args.rounds and time.monotonic() < stop_at:
            body = {"model": model, "messages": messages, "max_tokens": args.max_tokens, "stream": True,
                    "temperature": 0.7, "seed": rng.randint(0, 1 << 30), "user": f"agent-{i}"}
            headers = {"X-Request-Timeout": str(args.deadline_s), "X-Client-Id": f"agent-{i}"}
            abort = rng.random() < args.abort_rate
            stats.attempts += 1
            t0 = time.monotonic()
            reply, err, done = "", None, False
            try:
                async with asyncio.timeout(args.deadline_s + HANG_S):
                    async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as resp:
                        if resp.status_code in (429, 503) and resp.headers.get("retry-after"):
                            stats.refused += 1  # back-pressure: wait as told (bounded) and ask again
                            await resp.aread()
                            await asyncio.sleep(min(float(resp.headers["retry-after"]), 5.0) * (0.5 + rng.random()))
                            continue
                        if resp.status_code != 200:
                            raw = await resp.aread()
                            try:
                                err = f"{resp.status_code}: {json.loads(raw)['error']['message'][:60]}"
                            except (ValueError, KeyError, TypeError):
                                err = f"{resp.status_code}: {raw[:60]!r}"
                        else:
                            async for ev in aiter_sse(resp.aiter_lines()):
                                if ev == DONE:
                                    done = True
                                    break
                                if "error" in ev:
                                    err = f"{ev['error'].get('status', 'sse')}: {ev['error']['message'][:60]}"
                                    break
                                for ch in ev.get("choices", ()):
                                    reply += ch.get("delta", {}).get("content") or ""
                                if abort and reply:
                                    break  # the client gives up after the first token: closes the stream
            except TimeoutError:
                stats.hangs += 1
                err = "hang"
            except httpx.HTTPError as exc:
                err = f"transport: {type(exc).__name__}"
            elapsed = time.monotonic() - t0
            if abort and err is None and not done:
                stats.aborted += 1
                continue  # the round is retried (the agent asks again)
            if err is not None or not done:
                stats.error(err or "stream ended without [DONE]")
                if err and err[:1] == "4" and not err.startswith("499"):
                    stats.gave_up += 1  # a request error: asking again would fail the same way
                    return
                await asyncio.sleep(0.5 + rng.random())  # an agent's retry pause
                continue
            stats.latencies.append(elapsed)
            stats.rounds += 1
            rnd += 1
            messages.append({"role": "assistant", "content": reply or "(no text)"})
            messages.append({"role": "user", "content": "Tool result:\n" + tool_output(i, rnd, rng)})
            stats.max_context_chars = max(stats.max_context_chars, sum(len(m["content"]) for m in messages))


async def one_shot(url: str, model: str, prompt: str, max_tokens: int, retries: int = 0) -> tuple[int, float, bool]:
    """A plain completion on its own connection: (status, seconds, whether a 429/503 carried Retry-After). With
    ``retries``, a refusal with Retry-After is waited out and asked again, as a client that honours it does."""
    t0 = time.monotonic()
    for attempt in range(retries + 1):
        try:
            async with httpx.AsyncClient(timeout=600) as client:
                r = await client.post(url + "/v1/completions", json={
                    "model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0})
        except httpx.HTTPError:
            return 0, time.monotonic() - t0, False
        ra = r.headers.get("retry-after")
        if r.status_code in (429, 503) and ra is not None and attempt < retries:
            await asyncio.sleep(min(float(ra), 5.0))
            continue
        return r.status_code, time.monotonic() - t0, ra is not None
    raise AssertionError("unreachable")


async def overload(url: str, model: str, args, stats: Stats, out: dict) -> None:
    """At BURST_AT of all rounds: BURST concurrent 600-token completions next to the agents, and (with
    --long-prompt) one prompt of 95% of the context. Every burst answer must be a 200 or a 429/503 with
    Retry-After; the long prompt must succeed, however long its prefill takes."""
    while stats.rounds < args.burst_at * args.agents * args.rounds:
        await asyncio.sleep(0.2)
    long_prompt = "pd " * int(args.context * 0.95 / 2) if args.long_prompt else None  # byte-level: ~2 tokens a word
    jobs = [one_shot(url, model, f"burst {i}: tell a long story", args.burst_tokens) for i in range(args.burst)]
    if long_prompt is not None:
        jobs.append(one_shot(url, model, long_prompt, 4, retries=30))  # the row is the watchdog's, not admission's
    res = await asyncio.gather(*jobs)
    burst = res[:args.burst]
    codes: dict[str, int] = {}
    for code, _, _ in burst:
        codes[str(code)] = codes.get(str(code), 0) + 1
    out["burst"] = {"requests": args.burst, "codes": codes,
                    "refusals_without_retry_after": sum(c in (429, 503) and not ra for c, _, ra in burst),
                    "slowest_refusal_s": round(max((t for c, t, _ in burst if c in (429, 503)), default=0.0), 2)}
    if long_prompt is not None:
        code, secs, _ = res[-1]
        out["long_prompt"] = {"status": code, "seconds": round(secs, 1)}


def worker_ports(base: int, pairs: int) -> list[tuple[str, int]]:
    return [(f"{role}-{i}", base + 3 * i + off) for i in range(pairs) for role, off in (("prefill", 0), ("decode", 1))]


def leaks(base: int, pairs: int, timeout_s: float = 120.0) -> tuple[int, int, list[dict]]:
    """(live requests, KV pages held) over every worker once idle, and the per-worker rows. Waits for
    workers that are still restarting; one that never answers counts as a leak (-1 rows)."""
    deadline = time.monotonic() + timeout_s
    while True:
        rows = []
        for name, port in worker_ports(base, pairs):
            try:
                d = httpx.get(f"http://127.0.0.1:{port}/debug/requests", timeout=10).json()
                rows.append({"worker": name, "live": d["live"], "free": d["pool"]["free"], "total": d["pool"]["total"]})
            except (httpx.HTTPError, ValueError, KeyError, TypeError):
                rows.append({"worker": name, "live": -1, "free": 0, "total": 0, "unreachable": True})
        live = sum(abs(r["live"]) for r in rows)
        held = sum(r["total"] - r["free"] for r in rows)
        if (live == 0 and held == 0) or time.monotonic() > deadline:
            return live, held, rows
        time.sleep(0.5)


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def start_up(args, port: int, base: int, log) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDRT_")}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    cmd = [sys.executable, "-m", "pdruntime.server", "up", "--pairs", str(args.pairs), "--port", str(port),
           "--base-port", str(base), "--model", args.model, "--num-blocks", str(args.num_blocks), "--threads", "1"]
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


async def soak(args) -> dict:
    port, base = free_port(), free_port_block(3 * args.pairs)
    log_path = os.path.join(args.log_dir, "pdrt-up.log")
    log = open(log_path, "w")
    up = start_up(args, port, base, log)
    url = f"http://127.0.0.1:{port}"
    try:
        t_start = time.monotonic()
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if up.poll() is not None or time.monotonic() - t_start > 300:
                raise RuntimeError(f"pdrt up did not become ready; see {log_path}")
            await asyncio.sleep(0.5)
        model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        dec0 = f"http://127.0.0.1:{base + 1}"
        old_instance = httpx.get(dec0 + "/health", timeout=5).json().get("instance")
        stats = Stats()
        t0 = time.monotonic()
        stop_at = t0 + args.max_run_s
        killed = {}

        async def killer() -> None:
            # kill once a KILL_AT share of all rounds completed (mid-run whatever the machine's speed)
            while stats.rounds < args.kill_at * args.agents * args.rounds:
                await asyncio.sleep(0.2)
            pid = httpx.get(dec0 + "/config", timeout=10).json()["server"]["pid"]
            os.kill(pid, signal.SIGKILL)
            killed.update(pid=pid, at_s=round(time.monotonic() - t0, 1), at_rounds=stats.rounds)

        ktask = asyncio.create_task(killer()) if args.kill_at < 1 else None
        loaded: dict = {}
        otask = asyncio.create_task(overload(url, model, args, stats, loaded)) if args.burst or args.long_prompt \
            else None
        await asyncio.gather(*(run_agent(i, url, model, args, stats, stop_at) for i in range(args.agents)))
        if otask is not None:
            await asyncio.wait_for(otask, 600)  # the burst began before the last round: it ends in its own time
        wall = time.monotonic() - t0
        if ktask is not None:
            ktask.cancel()
        live, held, rows = leaks(base, args.pairs)
        try:
            new_instance = httpx.get(dec0 + "/health", timeout=5).json().get("instance")
        except (httpx.HTTPError, ValueError):
            new_instance = None
        return {"agents": args.agents, "rounds_per_agent": args.rounds, "pairs": args.pairs,
                "rounds_completed": stats.rounds, "rounds_expected": args.agents * args.rounds,
                "attempts": stats.attempts, "client_aborts": stats.aborted, "hangs": stats.hangs,
                "agents_gave_up": stats.gave_up,
                "errors_surfaced": sum(stats.errors.values()), "errors": stats.errors,
                "leaked_live_requests": live, "leaked_pages": held, "workers": rows,
                "round_p50_s": round(pct(stats.latencies, 0.50), 3), "round_p99_s": round(pct(stats.latencies, 0.99), 3),
                "max_context_chars": stats.max_context_chars, "wall_s": round(wall, 1),
                "decode_killed": killed, "decode_co_restarted": bool(killed) and new_instance not in (None, old_instance),
                "refused_rounds": stats.refused, **loaded,
                "model": args.model_label, "log": log_path, "burst_tokens": args.burst_tokens}
    finally:
        up.send_signal(signal.SIGTERM)
        try:
            up.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(up.pid, signal.SIGKILL)
        log.close()


def table(r: dict) -> str:
    rows = [("agents x rounds (pairs)", f"{r['agents']} x {r['rounds_per_agent']} ({r['pairs']})"),
            ("rounds completed", f"{r['rounds_completed']} / {r['rounds_expected']}"),
            ("attempts (client aborts)", f"{r['attempts']} ({r['client_aborts']})"),
            ("hangs", r["hangs"]), ("errors surfaced", r["errors_surfaced"]),
            ("agents stopped by a 4xx", r["agents_gave_up"]),
            ("leaked pages (live requests)", f"{r['leaked_pages']} ({r['leaked_live_requests']})"),
            ("round latency p50 / p99 s", f"{r['round_p50_s']} / {r['round_p99_s']}"),
            ("largest context, chars", r["max_context_chars"]),
            ("decode killed at (s, rounds)", f"{r['decode_killed'].get('at_s')}, {r['decode_killed'].get('at_rounds')}"),
            ("pair co-restarted", r["decode_co_restarted"]),
            ("rounds refused with Retry-After (retried)", r["refused_rounds"])]
    if "burst" in r:
        b = r["burst"]
        rows += [(f"overload burst: {b['requests']} x {r['burst_tokens']} tokens", ", ".join(
            f"{n} x {c}" for c, n in sorted(b["codes"].items()))),
            ("burst refusals without Retry-After", b["refusals_without_retry_after"]),
            ("burst slowest refusal s", b["slowest_refusal_s"])]
    if "long_prompt" in r:
        rows.append(("long prompt (95% of context): status, s", f"{r['long_prompt']['status']}, "
                                                                 f"{r['long_prompt']['seconds']}"))
    rows += [("wall s", r["wall_s"]), ("model", r["model"])]
    w = max(len(k) for k, _ in rows)
    out = [f"{'metric':<{w}} | value", f"{'-' * w}-|------"] + [f"{k:<{w}} | {v}" for k, v in rows]
    if r["errors"]:
        out.append("errors: " + "; ".join(f"{k} x{v}" for k, v in sorted(r["errors"].items(), key=lambda kv: -kv[1])))
    return "\n".join(out)


def parse(argv: list[str] | None = None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--agents", type=int, default=32)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--pairs", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--abort-rate", type=float, default=0.05)
    p.add_argument("--kill-at", type=float, default=0.4, help="share of all rounds after which decode 0 is killed; 1 = never")
    p.add_argument("--deadline-s", type=float, default=120.0, help="X-Request-Timeout per round attempt")
    p.add_argument("--burst", type=int, default=0, help="overload: concurrent one-shot completions fired once")
    p.add_argument("--burst-tokens", type=int, default=600, help="max_tokens of each burst request")
    p.add_argument("--burst-at", type=float, default=0.6, help="share of all rounds after which the burst fires")
    p.add_argument("--long-prompt", action="store_true", help="with the burst: one prompt of 95%% of the context")
    p.add_argument("--context", type=int, default=16384, help="the model's context, tokens (--long-prompt)")
    p.add_argument("--max-run-s", type=float, default=1800.0)
    p.add_argument("--num-blocks", type=int, default=8192, help="KV pages per worker (16 tokens each)")
    p.add_argument("--model", default=None, help="default: the tiny random-weight test model")
    p.add_argument("--log-dir", default=None)
    p.add_argument("--json", default=None, help="also write the result here")
    args = p.parse_args(argv)
    args.log_dir = args.log_dir or tempfile.mkdtemp(prefix="agents-soak-")
    if args.model is None:
        from pdruntime.model.testing import write_tiny_checkpoint

        # a 16k context: 10 rounds of growing tool output fit (the tokenizer is byte-level, ~1.5 chars a token)
        args.model = str(write_tiny_checkpoint(os.path.join(args.log_dir, "tiny-model"), max_position=16384))
        args.model_label = "tiny random-weight test model (2 layers, hidden 64, 16k context)"
    else:
        args.model_label = args.model
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    # SIGTERM ends the run through the finally blocks, so `pdrt up` (and with it every worker) is stopped
    old = signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        result = asyncio.run(soak(args))
    finally:
        signal.signal(signal.SIGTERM, old)
    print(table(result), flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)
    return result


if __name__ == "__main__":
    r = main()
    bad_burst = r.get("burst", {}).get("refusals_without_retry_after") or any(
        c not in ("200", "429", "503") for c in r.get("burst", {}).get("codes", {}))
    sys.exit(1 if r["hangs"] or r["leaked_pages"] or r["leaked_live_requests"] or bad_burst
             or r.get("long_prompt", {}).get("status", 200) != 200 else 0)
