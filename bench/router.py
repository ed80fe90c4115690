"""pdstack's router against sglang-router 0.3.2 in front of the same workers, measured in one run.

Two kinds of workers, each a prefill and a decode process on 127.0.0.1:

- **no-op workers** (this file's ``noop`` subcommand, one asyncio process per worker): every completion is
  answered at once with the bytes a pdrt worker sends for a 1-token completion (SGLang's ``/generate`` stream
  for pdstack's router, OpenAI's ``/v1/completions`` JSON for sglang-router), so what is measured is the routers'
  own cost per request;
- **pdrt workers** (``pdrt serve``, the tiny random test model on the CPU): a real PD request, prefill, KV transfer
  over the wire and decode, behind each router.

The routers: ``pdrt serve --role router`` (pdstack) and ``python -m sglang_router.launch_router
--pd-disaggregation`` (the Rust router from PyPI's ``sglang-router``, round robin), both started against the same
worker URLs. Load: ``wrk`` (C, one thread) posting a non-streamed 1-token ``/v1/completions``; concurrency 1
for latency (p50, p99, and the p50 the router adds over the decode worker's own answer), concurrency 16 for
requests/s. CPU: the router process's user+system seconds (``/proc/PID/stat``) per 1,000 requests, at concurrency
1 and at 16 apart (at 1 every request pays its own wake-ups; at 16 a busy process shares them); the same for the
prefill and decode workers together (what each router's requests cost the workers it shares the CPUs with).
Rounds interleave the routers (A B A B); the table gives medians over rounds and the ratio pdstack / sglang.

    .venv/bin/python bench/router.py [--seconds 6] [--rounds 3] [--workers noop pdrt] [--instructions]

``--instructions`` also counts each router's user-space instructions per request on the no-op workers under
valgrind's callgrind: on a shared host, where the time figures above swing by a quarter from one run to the
next, this count repeats to within a fraction of a percent.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import httpx

from pdruntime.util.ports import free_port

HERE = os.path.dirname(os.path.abspath(__file__))
BODY = {"model": "tiny", "prompt": "Say hi", "max_tokens": 1, "temperature": 0}
CLK = os.sysconf("SC_CLK_TCK")

# sglang-router without importing the ``sglang`` package that make setup installs (tests/pd/test_sglang_router.py)
LAUNCH_SGLANG_ROUTER = ["-c", "import sys; sys.modules['sglang'] = None; "
                              "from sglang_router.launch_router import main; main()"]


# ---------------------------------------------------------------- the no-op worker
def _http(status: str, body: bytes, ctype: str) -> bytes:
    return (f"HTTP/1.1 {status}\r\ncontent-type: {ctype}\r\ncontent-length: {len(body)}\r\n\r\n").encode() + body


def _generate_reply(req: dict, role: str) -> bytes:
    rid = req.get("rid") or "r"
    meta = {"id": rid, "prompt_tokens": 2, "completion_tokens": 1, "finish_reason": {"type": "length"},
            "cached_tokens": 0}
    if role == "prefill" or not req.get("stream"):
        return _http("200 OK", json.dumps({"text": "H", "token_ids": [42], "meta_info": meta}).encode(),
                     "application/json")
    ev = {"text": "H", "delta": "H", "token_ids": [42], "meta_info": meta}
    return _http("200 OK", b"data: " + json.dumps(ev).encode() + b"\n\ndata: [DONE]\n\n",
                 "text/event-stream; charset=utf-8")


def _completion_reply(req: dict) -> bytes:
    out = {"id": "cmpl-noop", "object": "text_completion", "created": int(time.time()), "model": "tiny",
           "choices": [{"index": 0, "text": "H", "finish_reason": "length", "logprobs": None}],
           "usage": {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3}}
    if req.get("stream"):
        return _http("200 OK", b"data: " + json.dumps(out).encode() + b"\n\ndata: [DONE]\n\n",
                     "text/event-stream; charset=utf-8")
    return _http("200 OK", json.dumps(out).encode(), "application/json")


GETS = {
    "/health": b"{}",
    "/health_generate": b"{}",
    "/get_model_info": json.dumps({"model_path": "tiny", "model_name": "tiny", "is_generation": True}).encode(),
    "/model_info": json.dumps({"model_path": "tiny", "model_name": "tiny", "is_generation": True}).encode(),
    "/get_server_info": json.dumps({"disaggregation_mode": "null", "tp_size": 1, "dp_size": 1}).encode(),
    "/server_info": json.dumps({"disaggregation_mode": "null", "tp_size": 1, "dp_size": 1}).encode(),
    "/v1/models": json.dumps({"object": "list", "data": [{"id": "tiny", "object": "model"}]}).encode(),
    "/metrics": b"",
}


async def _serve_noop(role: str, port: int) -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                line, *headers = head.decode("latin-1").split("\r\n")
                try:
                    method, path, _ = line.split(" ", 2)
                except ValueError:  # not HTTP/1.1: say what came, and hang up
                    print(f"noop {role}: not a request line: {head[:300]!r}", flush=True)
                    return
                length = 0
                for h in headers:
                    if h[:15].lower() == "content-length:":
                        length = int(h[15:])
                body = await reader.readexactly(length) if length else b""
                path = path.split("?", 1)[0]
                if method == "GET":
                    out = _http("200 OK", GETS[path], "application/json") if path in GETS else \
                        _http("404 Not Found", b"{}", "application/json")
                else:
                    req = json.loads(body) if body else {}
                    if path == "/generate":
                        out = _generate_reply(req, role)
                    elif path in ("/v1/completions", "/v1/chat/completions"):
                        out = _completion_reply(req)
                    else:
                        out = _http("200 OK", b"{}", "application/json")
                writer.write(out)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", port, backlog=1024)
    async with server:
        await server.serve_forever()


# ---------------------------------------------------------------- processes
class Stack:
    def __init__(self, log_dir: str) -> None:
        self.log_dir = log_dir
        self.procs: dict[str, subprocess.Popen] = {}
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("PDRT_")}
        self.env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", NO_PROXY="127.0.0.1,localhost",
                        no_proxy="127.0.0.1,localhost")

    def spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        log = open(os.path.join(self.log_dir, name + ".log"), "wb")
        self.procs[name] = subprocess.Popen(argv, env=self.env, stdout=log, stderr=subprocess.STDOUT)
        return self.procs[name]

    def stop(self, name: str) -> None:
        p = self.procs.pop(name, None)
        if p is not None and p.poll() is None:
            p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)

    def stop_all(self) -> None:
        for name in list(self.procs):
            self.stop(name)

    def log_tail(self, name: str) -> str:
        with open(os.path.join(self.log_dir, name + ".log"), errors="replace") as fh:
            return fh.read()[-3000:]


def wait_ok(url: str, proc: subprocess.Popen, what: str, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited during start-up")
        try:
            r = httpx.post(url + "/v1/completions", json=BODY, timeout=10) if what.endswith("router") else \
                httpx.get(url + "/health", timeout=5)
            if r.status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{what} at {url} did not answer within {timeout:.0f}s")


def start_workers(stack: Stack, kind: str, model: str | None) -> tuple[str, str, int]:
    pp, dp, bp = free_port(), free_port(), free_port()
    if kind == "noop":
        for role, port in (("prefill", pp), ("decode", dp)):
            stack.spawn(f"noop-{role}", [sys.executable, os.path.abspath(__file__), "noop", role, str(port)])
    else:
        common = ["--model", model, "--served-model-name", "tiny", "--device", "cpu", "--num-blocks", "512",
                  "--block-size", "16", "--max-num-seqs", "32"]
        stack.spawn("pdrt-prefill", [sys.executable, "-m", "pdruntime.server", "serve", "--role", "prefill",
                                     "--host", "127.0.0.1", "--port", str(pp), "--bootstrap-port", str(bp), *common])
        stack.spawn("pdrt-decode", [sys.executable, "-m", "pdruntime.server", "serve", "--role", "decode",
                                    "--host", "127.0.0.1", "--port", str(dp), *common])
    p_url, d_url = f"http://127.0.0.1:{pp}", f"http://127.0.0.1:{dp}"
    for name, url in ((f"{kind}-prefill", p_url), (f"{kind}-decode", d_url)):
        wait_ok(url, stack.procs[name], name)
    return p_url, d_url, bp


def start_router(stack: Stack, which: str, p_url: str, d_url: str, bp: int, wrap: tuple[str, ...] = (),
                 name: str | None = None, timeout: float = 180, processes: int = 1) -> str:
    """Start ``which`` router in front of the workers (``wrap``: an argv prefix, e.g. valgrind's; ``processes``:
    pdstack's ``--router-processes``); its URL."""
    port = free_port()
    if which.startswith("pdstack"):
        argv = [sys.executable, "-m", "pdruntime.server", "serve", "--role", "router", "--host", "127.0.0.1",
                "--port", str(port), "--prefill", p_url, "--decode", d_url, "--bootstrap-ports", str(bp),
                "--log-level", "warning", "--router-processes", str(processes)]
    else:
        argv = [sys.executable, *LAUNCH_SGLANG_ROUTER, "--pd-disaggregation", "--prefill", p_url, str(bp),
                "--decode", d_url, "--host", "127.0.0.1", "--port", str(port), "--prometheus-host", "127.0.0.1",
                "--prometheus-port", str(free_port()), "--policy", "round_robin", "--worker-startup-timeout-secs",
                "60", "--worker-startup-check-interval", "1", "--log-level", "warn"]
    url = f"http://127.0.0.1:{port}"
    wait_ok(url, stack.spawn(name or f"router-{which}", [*wrap, *argv]), f"{which} router", timeout)
    return url


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid``'s threads and its live child processes' (a router's processes)."""
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    own = (int(fields[11]) + int(fields[12])) / CLK  # utime, stime
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as fh:
            children = [int(c) for c in fh.read().split()]
    except OSError:
        children = []
    return own + sum(cpu_seconds(c) for c in children)


# ---------------------------------------------------------------- load
WRK_LUA = """wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = [[{body}]]
"""
_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3}


def _ms(text: str) -> float:
    m = re.fullmatch(r"([\d.]+)(us|ms|s)", text)
    if not m:
        raise ValueError(f"wrk latency {text!r}")
    return float(m.group(1)) * _UNITS[m.group(2)]


def wrk(url: str, conns: int, seconds: float, script: str) -> dict:
    out = subprocess.run(["wrk", "-t1", f"-c{conns}", f"-d{seconds:g}s", "--latency", "-s", script,
                          url + "/v1/completions"], capture_output=True, text=True, timeout=seconds + 60).stdout
    lat = dict(re.findall(r"^\s+(50|99)%\s+(\S+)$", out, re.M))
    reqs = int(re.search(r"(\d+) requests in", out).group(1))
    bad = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    errors = re.search(r"Socket errors: (.*)$", out, re.M)
    return {"requests": reqs, "rps": float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1)),
            "p50_ms": _ms(lat["50"]), "p99_ms": _ms(lat["99"]), "non2xx": int(bad.group(1)) if bad else 0,
            "socket_errors": errors.group(1) if errors else None}


def measure(url: str, pid: int | None, seconds: float, script: str, workers: tuple[int, ...] = ()) -> dict:
    """wrk at 1 and 16 connections; CPU seconds per 1,000 requests of the router (``pid``) and of the ``workers``,
    each concurrency apart: at 1 a request pays its own wake-ups, at 16 a busy event loop shares them."""
    def cpu() -> tuple[float, float]:
        return (cpu_seconds(pid) if pid else 0.0), sum(cpu_seconds(w) for w in workers)

    def per_1k(before: tuple[float, float], after: tuple[float, float], n: int) -> tuple[float, float]:
        if not n:
            return float("nan"), float("nan")
        return 1000 * (after[0] - before[0]) / n, 1000 * (after[1] - before[1]) / n

    c0 = cpu()
    lat = wrk(url, 1, seconds, script)
    c1 = cpu()
    thr = wrk(url, 16, seconds, script)
    c16 = cpu()
    cpu1, wcpu1 = per_1k(c0, c1, lat["requests"])
    cpu16, wcpu16 = per_1k(c1, c16, thr["requests"])
    return {"p50_ms": lat["p50_ms"], "p99_ms": lat["p99_ms"], "rps16": thr["rps"], "p50_16_ms": thr["p50_ms"],
            "cpu_per_1k_c1": cpu1, "cpu_per_1k_c16": cpu16, "workers_cpu_per_1k_c1": wcpu1,
            "workers_cpu_per_1k_c16": wcpu16, "requests": lat["requests"] + thr["requests"],
            "failed": lat["non2xx"] + thr["non2xx"], "socket_errors": lat["socket_errors"] or thr["socket_errors"]}


def _dumped_instructions(folder: str, prefix: str) -> int | None:
    """Instructions in callgrind's dumps named ``prefix*`` (each file's last line, ``totals:``), None until every
    dump found is complete."""
    total, found = 0, False
    for f in os.listdir(folder):
        if f.startswith(prefix):
            with open(os.path.join(folder, f)) as fh:
                lines = fh.read().splitlines()
            if not lines or not lines[-1].startswith("totals:"):
                return None
            total += int(lines[-1].split()[1])
            found = True
    return total if found else None


def instructions_per_request(stack: Stack, which: str, p_url: str, d_url: str, bp: int, seconds: float,
                             script: str) -> dict:
    """User-space instructions per request of ``which`` router at 16 connections, counted by valgrind's callgrind:
    the same count on a quiet host and on a busy one (the time figures swing with the host's other load), for
    the router's own code and the libraries it runs (Python and its C extensions; Rust and its crates); what
    the kernel does for its system calls is not counted. Instrumentation is on only while wrk runs, after a
    warm-up; the count is over every thread of the process."""
    out = os.path.join(stack.log_dir, f"callgrind.{which}")
    name = f"callgrind-{which}"
    url = start_router(stack, which, p_url, d_url, bp, name=name, timeout=600,
                       wrap=("valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}.%p"))
    pid = stack.procs[name].pid
    try:
        wrk(url, 16, 3, script)  # warm: connections pooled, code paths taken once
        subprocess.run(["callgrind_control", "-i", "on", str(pid)], capture_output=True, check=True, timeout=60)
        run = wrk(url, 16, seconds, script)
        subprocess.run(["callgrind_control", "-i", "off", str(pid)], capture_output=True, check=True, timeout=60)
        subprocess.run(["callgrind_control", "-d", str(pid)], capture_output=True, check=True, timeout=60)
        total, deadline = None, time.monotonic() + 60
        while total is None and time.monotonic() < deadline:  # the dump is written after the command returns
            time.sleep(0.5)
            total = _dumped_instructions(stack.log_dir, f"{os.path.basename(out)}.{pid}.")  # -d's dumps: .PID.N
        if total is None:
            raise RuntimeError(f"callgrind wrote no complete dump of the {which} router under {stack.log_dir}")
    finally:
        stack.stop(name)
    return {"requests": run["requests"], "instructions": total, "per_request": total / max(1, run["requests"]),
            "failed": run["non2xx"]}


def med(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "noop":
        asyncio.run(_serve_noop(sys.argv[2], int(sys.argv[3])))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=6.0, help="seconds per wrk run (default 6)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    ap.add_argument("--workers", nargs="+", choices=("noop", "pdrt"), default=["noop", "pdrt"])
    ap.add_argument("--router-processes", type=int, nargs="+", default=[1, 2],
                    help="pdstack router processes to measure, each a router of its own (default 1 2: "
                         "--router-processes 1, then 2)")
    ap.add_argument("--json", help="also write the rows here")
    ap.add_argument("--instructions", action="store_true",
                    help="also count each router's user-space instructions per request on the no-op workers under "
                         "valgrind's callgrind (a figure the host's other load does not move; needs valgrind)")
    args = ap.parse_args()
    if args.instructions and not (shutil.which("valgrind") and shutil.which("callgrind_control")):
        print("bench/router.py: error: --instructions needs valgrind and callgrind_control; accepted: Debian's "
              "valgrind (apt-get install valgrind)", file=sys.stderr)
        return 2
    if not subprocess.run(["sh", "-c", "command -v wrk"], capture_output=True).stdout:
        print("bench/router.py: error: wrk is not installed; accepted: Debian's wrk (apt-get install wrk)",
              file=sys.stderr)
        return 2
    load_start = " ".join(f"{x:.1f}" for x in os.getloadavg())
    log_dir = tempfile.mkdtemp(prefix="bench-router-")
    script = os.path.join(log_dir, "post.lua")
    with open(script, "w") as fh:
        fh.write(WRK_LUA.format(body=json.dumps(BODY)))
    stack = Stack(log_dir)
    #: the routers measured, by name -> pdstack's router processes (sglang-router: its own threads)
    processes = {f"pdstack-{n}p" if n > 1 else "pdstack": n for n in args.router_processes}
    routers = [*processes, "sglang"]
    results: dict[tuple[str, str], list[dict]] = {}
    counted: dict[str, dict] = {}
    try:
        model = None
        if "pdrt" in args.workers:
            from pdruntime.model.testing import write_tiny_checkpoint
            model = write_tiny_checkpoint(os.path.join(log_dir, "tiny"))
        for kind in args.workers:
            p_url, d_url, bp = start_workers(stack, kind, model)
            urls = {which: start_router(stack, which, p_url, d_url, bp, processes=processes.get(which, 1))
                    for which in routers}
            pids = {which: stack.procs[f"router-{which}"].pid for which in urls}
            worker_pids = tuple(p.pid for name, p in stack.procs.items() if name.startswith(kind))
            for r in range(args.rounds):
                order = routers if r % 2 == 0 else routers[::-1]
                if kind == "noop":  # the decode worker's own answer: what a router adds is measured over it
                    results.setdefault((kind, "direct"), []).append(measure(d_url, None, args.seconds, script))
                for which in order:
                    row = measure(urls[which], pids[which], args.seconds, script, worker_pids)
                    results.setdefault((kind, which), []).append(row)
                    print(f"{kind} round {r + 1} {which}: p50 {row['p50_ms']:.2f} ms, {row['rps16']:.0f} req/s at 16, "
                          f"{row['cpu_per_1k_c1']:.2f} / {row['cpu_per_1k_c16']:.2f} CPU s / 1k at 1 / 16, "
                          f"{row['failed']} failed, load {os.getloadavg()[0]:.1f}",
                          flush=True)
            for which in routers:
                stack.stop(f"router-{which}")
            if kind == "noop" and args.instructions:
                for which in ("pdstack", "sglang"):
                    counted[which] = instructions_per_request(stack, which, p_url, d_url, bp, 2 * args.seconds,
                                                              script)
                    print(f"{which}: {counted[which]['per_request']:,.0f} user-space instructions per request "
                          f"({counted[which]['requests']} requests)", flush=True)
            for name in [n for n in stack.procs if n.startswith(kind)]:
                stack.stop(name)
    finally:
        stack.stop_all()

    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    loop = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"  # as server/router/server.py chooses
    print(f"\nrouter cost: pdstack router ({loop} loop) vs sglang-router 0.3.2, non-streamed 1-token /v1/completions, "
          f"wrk 1 thread; medians of {args.rounds} interleaved rounds of {args.seconds:g} s; {os.cpu_count()} CPUs "
          f"({platform.processor() or platform.machine()}), load average {load_start} at the start, {load} at the end")
    print("| workers | router | p50 c=1 ms | added p50 ms | p99 c=1 ms | req/s c=16 | p50 c=16 ms | CPU s / 1k c=1 | "
          "CPU s / 1k c=16 | workers' CPU s / 1k c=1 | workers' CPU s / 1k c=16 | failed |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    cpu_keys = ("cpu_per_1k_c1", "cpu_per_1k_c16", "workers_cpu_per_1k_c1", "workers_cpu_per_1k_c16")
    for kind in args.workers:
        direct = med(results[(kind, "direct")], "p50_ms") if (kind, "direct") in results else None
        for which in routers:
            rows = results[(kind, which)]
            added = f"{med(rows, 'p50_ms') - direct:.2f}" if direct is not None else "-"
            cpus = " | ".join(f"{med(rows, k):.3f}" for k in cpu_keys)
            print(f"| {kind} | {which} | {med(rows, 'p50_ms'):.2f} | {added} | {med(rows, 'p99_ms'):.2f} | "
                  f"{med(rows, 'rps16'):.0f} | {med(rows, 'p50_16_ms'):.2f} | {cpus} | "
                  f"{sum(r['failed'] for r in rows)} |")
        b = results[(kind, "sglang")]
        for which in routers[:-1]:
            a = results[(kind, which)]
            ratios = " | ".join(f"{med(a, k) / med(b, k):.2f}x" for k in cpu_keys)
            print(f"| {kind} | {which} / sglang | {med(a, 'p50_ms') / med(b, 'p50_ms'):.2f}x | "
                  f"{med(a, 'p50_ms') - med(b, 'p50_ms'):+.2f} ms | | {med(a, 'rps16') / med(b, 'rps16'):.2f}x | | "
                  f"{ratios} | |")
    if counted:
        a, b = counted["pdstack"]["per_request"], counted["sglang"]["per_request"]
        print(f"\nuser-space instructions per request (valgrind callgrind, no-op workers, wrk -c16 for "
              f"{2 * args.seconds:g} s under instrumentation; the kernel's work for system calls is not counted)")
        print("| router | instructions / request | requests counted | failed |")
        print("|---|---:|---:|---:|")
        for which in ("pdstack", "sglang"):
            c = counted[which]
            print(f"| {which} | {c['per_request']:,.0f} | {c['requests']} | {c['failed']} |")
        print(f"| pdstack / sglang | {a / b:.2f}x | | |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({**{f"{k[0]}/{k[1]}": v for k, v in results.items()},
                       **{f"instructions/{k}": v for k, v in counted.items()}}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
