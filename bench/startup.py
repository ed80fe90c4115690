"""``pdrt up`` to the first streamed token: what a user waits for after ``make run``.

    .venv/bin/python bench/startup.py [--repeat 3] [--tree OLD_CHECKOUT ...] [-- PDRT_UP_ARGS...]

Each round starts ``pdrt up`` (the default model, one pair, on free ports) as a fresh process, then polls the
router with a streamed chat completion until one answers; it prints the seconds from the process's start to
``pdrt up``'s "ready" line, and to the first streamed token of that first request, then stops the stack.
With ``--tree``, each round also runs that checkout's ``pdrt up`` (its ``runtime/`` first on PYTHONPATH, the same
venv), alternating which goes first, so before and after are measured side by side. The medians go in a table.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time

import httpx

from pdruntime.util.ports import free_port
from pdruntime.util.sse import DONE, iter_sse


def first_token(url: str) -> bool:
    try:
        models = httpx.get(url + "/v1/models", timeout=10)
        if models.status_code != 200:
            return False
        model = models.json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError):
        return False
    body = {"model": model, "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 4, "stream": True}
    try:
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
            if r.status_code != 200:
                return False
            for ev in iter_sse(r.iter_lines()):
                if ev == DONE:
                    return False
                if any(c.get("delta", {}).get("content") for c in ev.get("choices", [])):
                    return True
    except httpx.HTTPError:
        return False
    return False  # pragma: no cover


def one_round(extra: list[str], tree: str | None = None) -> tuple[float, float]:
    port, base = free_port(), free_port()
    env = dict(os.environ)
    if tree:
        env["PYTHONPATH"] = os.path.join(os.path.abspath(tree), "runtime")
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "pdruntime.cli", "up", "--port", str(port), "--base-port",
                             str(base), *extra], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env=env)
    ready: list[float] = []
    lines: list[str] = []

    def watch() -> None:
        for line in proc.stdout:
            lines.append(line)
            if not ready and "ready" in line.lower():
                ready.append(time.monotonic() - t0)

    threading.Thread(target=watch, daemon=True).start()
    url = f"http://127.0.0.1:{port}"
    try:
        while time.monotonic() - t0 < 600:
            if proc.poll() is not None:
                time.sleep(0.2)
                raise RuntimeError(f"pdrt up exited ({proc.returncode}): {''.join(lines)[-2000:]}")
            if first_token(url):
                return (ready[0] if ready else float("nan")), time.monotonic() - t0
            time.sleep(0.1)
        raise RuntimeError("no first token within 600 s")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(30)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--tree", action="append", default=[], help="another checkout to measure alongside this one")
    ap.add_argument("up_args", nargs="*", help="extra `pdrt up` arguments (after --)")
    args = ap.parse_args()
    trees: list[str | None] = [None, *args.tree]
    rows: dict[str | None, list[tuple[float, float]]] = {t: [] for t in trees}
    for i in range(args.repeat):
        for t in (trees if i % 2 == 0 else trees[::-1]):
            rows[t].append(one_round(args.up_args, t))
            print(f"round {i + 1} {t or 'this tree'}: ready line {rows[t][-1][0]:.1f} s, first streamed token "
                  f"{rows[t][-1][1]:.1f} s", flush=True)
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"\n`pdrt up {' '.join(args.up_args)}` to the first streamed token, medians of {args.repeat} interleaved "
          f"rounds; {os.cpu_count()} CPUs, load average {load}")
    print("| tree | to the ready line s | to the first streamed token s |")
    print("|---|---:|---:|")
    for t in trees:
        print(f"| {t or 'this tree'} | {statistics.median(r[0] for r in rows[t]):.1f} | "
              f"{statistics.median(r[1] for r in rows[t]):.1f} |")
    print(json.dumps({str(t): r for t, r in rows.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
