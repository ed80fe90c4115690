"""Helpers that start real pdrt processes on loopback with a tiny random model.

The shared stack (router + one PD pair, the ``stack`` fixture of tests/support/tiny_stack.py) is module-scoped, or
one per pytest process for the ``SHARED_STACK`` modules: a module's tests that do not kill processes share it. Tests
that kill workers start their own pair and router.
Watchdog timeouts are short via PDRT_* env, and PDRT_TEST_HOOKS=1 enables the workers' test-only POST /debug/test
(advance the watchdog clock, slow engine steps, stall transfers).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Iterator

import httpx

from pdruntime.util.ports import free_port

KV_TOKEN = "pd-test-token"
TIMEOUTS = {  # seconds; short so failures show quickly, long enough for a loaded 2-core machine
    "PDRT_BOOTSTRAP_TIMEOUT_S": "4",
    "PDRT_TRANSFER_TIMEOUT_S": "3",
    "PDRT_DECODE_TRANSFER_TIMEOUT_S": "6",
    "PDRT_PREFILL_STALL_S": "6",
    "PDRT_WATCHDOG_TICK_S": "0.1",
}
WORKER_FLAGS = ["--num-blocks", "1024", "--block-size", "16", "--max-num-seqs", "64"]


def base_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDRT_")}
    env.update(TIMEOUTS)
    env.update({"PDRT_TEST_HOOKS": "1", "PDRT_KV_AUTH_TOKEN": KV_TOKEN, "OMP_NUM_THREADS": "1",
                "PYTHONUNBUFFERED": "1"})
    env.update(extra)
    return env


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log: str
    url: str

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGKILL)
            self.popen.wait(10)

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()

    def log_text(self) -> str:
        with open(self.log, errors="replace") as fh:
            return fh.read()


def spawn(name: str, args: list[str], env: dict, log_dir: str, port: int) -> Proc:
    log = os.path.join(log_dir, f"{name}.log")
    fh = open(log, "wb")
    p = subprocess.Popen([sys.executable, "-m", "pdruntime.server", "serve", *args], env=env, stdout=fh,
                         stderr=subprocess.STDOUT)
    return Proc(name, p, log, f"http://127.0.0.1:{port}")


def wait_healthy(procs: list[Proc], timeout: float = 120.0, path: str = "/health") -> None:
    """Wait until every process answers 200 on ``path`` (``/metrics`` for a router whose pairs are down)."""
    deadline = time.monotonic() + timeout
    pending = list(procs)
    while pending:
        for p in list(pending):
            if p.popen.poll() is not None:
                raise RuntimeError(f"{p.name} exited with {p.popen.returncode}:\n{p.log_text()[-3000:]}")
            try:
                if httpx.get(p.url + path, timeout=2).status_code == 200:
                    pending.remove(p)
            except httpx.HTTPError:
                pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"not healthy after {timeout}s: {[p.name for p in pending]}")
        time.sleep(0.2)


def metric(proc: Proc, name: str, labels: dict | None = None) -> float:
    """Sum of the samples of ``name`` on ``proc``'s /metrics whose labels include ``labels``."""
    text = httpx.get(proc.url + "/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        m = re.match(r"^([a-zA-Z_:]+)(\{(.*)\})? (\S+)$", line)
        if not m or m.group(1) != name:
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(3) or ""))
        if all(got.get(k) == v for k, v in (labels or {}).items()):
            total += float(m.group(4))
    return total


def hooks(proc: Proc, **kw) -> dict:
    """Set a worker's test hooks (POST /debug/test, PDRT_TEST_HOOKS=1)."""
    r = httpx.post(proc.url + "/debug/test", json=kw, timeout=10)
    r.raise_for_status()
    return r.json()


def start_worker(tmp_dir: str, model: str, role: str, *, env_extra: dict | None = None) -> Proc:
    """One worker (``role``: prefill or decode) serving ``model`` on loopback, healthy, for a test that talks to
    that worker alone (no router, no peer: two process start-ups fewer than a stack). The caller stops it."""
    port = free_port()
    args = ["--role", role, "--port", str(port), "--model", model, *WORKER_FLAGS]
    if role == "prefill":
        args += ["--bootstrap-port", str(free_port())]
    proc = spawn(role, args, base_env(**(env_extra or {})), tmp_dir, port)
    try:
        wait_healthy([proc])
    except BaseException:
        proc.stop()
        raise
    return proc


@dataclass
class Stack:
    router: Proc
    prefill: Proc
    decode: Proc
    bootstrap_port: int
    model: str
    procs: list[Proc] = field(default_factory=list)

    def stop(self) -> None:
        for p in self.procs:
            p.stop()

    def metric(self, proc: Proc, name: str, labels: dict | None = None) -> float:
        return metric(proc, name, labels)

    def debug(self, proc: Proc) -> dict:
        return httpx.get(proc.url + "/debug/requests", timeout=10).json()

    def hooks(self, proc: Proc, **kw) -> dict:
        return hooks(proc, **kw)

    def wait_idle(self, timeout: float = 20.0) -> tuple[dict, dict]:
        """Wait until neither worker has a live request and both pools are fully free."""
        deadline = time.monotonic() + timeout
        while True:
            p, d = self.debug(self.prefill), self.debug(self.decode)
            idle = all(x["live"] == 0 and x["pool"]["free"] == x["pool"]["total"] for x in (p, d))
            if idle or time.monotonic() > deadline:
                return p, d
            time.sleep(0.1)


    def leftovers(self, timeout: float = 20.0) -> dict:
        """What traffic left behind once it settled (polled up to ``timeout`` s): live requests, KV pages in use,
        an open breaker, requests outstanding at the router. Empty when clean."""
        deadline = time.monotonic() + timeout
        while True:
            left = {f"{proc.name} {what}": v for proc in (self.prefill, self.decode) for doc in [self.debug(proc)]
                    for what, v in (("live", doc["live"]), ("pages in use", doc["pool"]["total"] - doc["pool"]["free"]))
                    if v}
            left.update({f"router {what}": v for what, v in (
                ("live", self.debug(self.router)["live"]),
                ("breaker open", self.metric(self.router, "pdrt_router_circuit_open")),
                ("outstanding", self.metric(self.router, "pdrt_router_pair_outstanding_requests"))) if v})
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.1)


def start_stack(tmp_dir: str, model: str, *, env_extra: dict | None = None, router_flags: list[str] = ()) -> Stack:
    env = base_env(**(env_extra or {}))
    pp, dp, bp, rp = free_port(), free_port(), free_port(), free_port()
    prefill = spawn("prefill", ["--role", "prefill", "--port", str(pp), "--bootstrap-port", str(bp), "--model", model,
                                *WORKER_FLAGS], env, tmp_dir, pp)
    decode = spawn("decode", ["--role", "decode", "--port", str(dp), "--model", model, *WORKER_FLAGS], env, tmp_dir, dp)
    router = spawn("router", ["--role", "router", "--port", str(rp), "--prefill", f"http://127.0.0.1:{pp}",
                              "--decode", f"http://127.0.0.1:{dp}", "--bootstrap-ports", str(bp), *router_flags],
                   env, tmp_dir, rp)
    stack = Stack(router, prefill, decode, bp, model, [router, prefill, decode])
    try:
        wait_healthy([prefill, decode, router])
    except BaseException:
        stack.stop()
        raise
    return stack


@contextlib.contextmanager
def router_at(tmp_dir: str, prefill_url: str, decode_url: str, bootstrap_port: int, *flags: str,
              name: str = "router-extra") -> Iterator[Proc]:
    """Another router (its own ``flags``, e.g. ``--worker-protocol vllm``) in front of one pair's workers, healthy,
    stopped on exit."""
    port = free_port()
    r = spawn(name, ["--role", "router", "--port", str(port), "--prefill", prefill_url, "--decode", decode_url,
                     "--bootstrap-ports", str(bootstrap_port), *flags], base_env(), tmp_dir, port)
    try:
        wait_healthy([r])
        yield r
    finally:
        r.stop()


def wait_for(pred, timeout: float, what: str, *, every: float = 0.05):
    """Poll ``pred`` until it returns something truthy (returned); fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}"
        time.sleep(every)


def stop_up(proc: subprocess.Popen, timeout: float = 30.0) -> None:
    """Stop a ``pdrt up`` as an operator would (SIGTERM: it stops its children); if it hangs, kill its whole
    session and fail the test."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise


@dataclass
class PairsStack(Stack):
    """A router in front of several PD pairs (``prefill``/``decode``: pair 0's; ``pairs[i]``: pair i's)."""

    pairs: list[tuple[Proc, Proc]] = field(default_factory=list)


def start_pairs(tmp_dir: str, model: str, pairs: list[dict], *, router_flags: list[str] = ()) -> PairsStack:
    """Router + one PD pair per entry of ``pairs``, routed by a topology file. Each entry may set ``canary``
    (bool, the topology flag) and ``decode_env`` (extra env for that pair's decode worker)."""
    import yaml

    env = base_env()
    procs: list[Proc] = []
    workers: list[tuple[Proc, Proc]] = []
    topo = []
    for i, spec in enumerate(pairs):
        pp, dp, bp = free_port(), free_port(), free_port()
        pre = spawn(f"prefill{i}", ["--role", "prefill", "--port", str(pp), "--bootstrap-port", str(bp), "--model",
                                    model, *WORKER_FLAGS], env, tmp_dir, pp)
        dec = spawn(f"decode{i}", ["--role", "decode", "--port", str(dp), "--model", model, *WORKER_FLAGS],
                    {**env, **spec.get("decode_env", {})}, tmp_dir, dp)
        procs += [pre, dec]
        workers.append((pre, dec))
        topo.append({"index": i, "canary": bool(spec.get("canary", False)),
                     "prefill": {"url": pre.url, "bootstrap_port": bp}, "decode": {"url": dec.url}})
    path = os.path.join(tmp_dir, "topology.yaml")
    with open(path, "w") as fh:
        yaml.safe_dump({"version": 1, "revision": "test", "pairs": topo}, fh)
    rp = free_port()
    router = spawn("router", ["--role", "router", "--port", str(rp), "--topology-file", path, *router_flags], env,
                   tmp_dir, rp)
    procs.append(router)
    stack = PairsStack(router, workers[0][0], workers[0][1], 0, model, procs, workers)
    try:
        wait_healthy(procs)  # the router's /health needs a ready non-canary pair
    except BaseException:
        stack.stop()
        raise
    return stack
