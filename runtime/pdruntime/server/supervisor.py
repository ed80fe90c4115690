"""Local supervision for `pdrt up`: a router plus N prefill/decode pairs as separate processes.

The co-restart rule holds locally too: when one worker of a pair dies, the survivor is stopped and the
pair restarts together (marked not-ready in the router's topology meanwhile), with backoff.
:func:`plan_restarts` is the pure decision; :class:`LocalStack` is the process shell around it.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import httpx
import yaml

log = logging.getLogger("pdruntime.up")

BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0)  # seconds before the n-th consecutive restart of a pair


@dataclass
class PairProcs:
    index: int
    prefill_port: int
    decode_port: int
    bootstrap_port: int
    prefill: subprocess.Popen | None = None
    decode: subprocess.Popen | None = None
    restarts: int = 0
    ready: bool = False
    phase: str = "starting"  # starting | running | backoff
    not_before: float = 0.0  # time.monotonic() before which a pair in backoff is not restarted


def plan_restarts(alive: dict[int, tuple[bool, bool]]) -> list[int]:
    """Pairs to co-restart: every pair where either worker is not alive. ``alive[index] = (prefill, decode)``."""
    return sorted(i for i, (p, d) in alive.items() if not (p and d))


def backoff_for(restarts: int) -> float:
    return BACKOFF_S[min(restarts - 1, len(BACKOFF_S) - 1)] if restarts > 0 else 0.0


def _alive(p: subprocess.Popen | None) -> bool:
    return p is not None and p.poll() is None


class LocalStack:
    def __init__(self, *, pairs: int = 1, host: str = "127.0.0.1", port: int = 8000, base_port: int = 8100,
                 model: str | None = None, worker_args: list[str] | None = None, extra_env: dict[str, str] | None = None,
                 log_dir: str | None = None) -> None:
        self.host, self.port = host, port
        self.model = model
        self.worker_args = worker_args or []
        self.workdir = tempfile.mkdtemp(prefix="pdrt-up-")
        self.log_dir = log_dir or self.workdir
        self.topology_path = os.path.join(self.workdir, "topology.yaml")
        self.env = {**os.environ, **(extra_env or {})}
        self.env.setdefault("PDRT_KV_AUTH_TOKEN", secrets.token_hex(16))  # per-run KV-transfer token
        if model:
            self.env["PDRT_MODEL"] = model
        self.pairs = [PairProcs(i, base_port + 3 * i, base_port + 3 * i + 1, base_port + 3 * i + 2) for i in range(pairs)]
        self.router: subprocess.Popen | None = None
        self.revision = 0

    # ---- processes ------------------------------------------------------------------------------
    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen:
        logf = open(os.path.join(self.log_dir, f"{name}.log"), "ab")
        cmd = [sys.executable, "-m", "pdruntime.server", "serve", *args]
        env = self.env
        if name == "router":  # each process gets only the secrets it uses: the router never touches KV
            env = {k: v for k, v in env.items() if k not in ("PDRT_KV_AUTH_TOKEN", "PDRT_KV_AUTH_TOKEN_FILE")}
        return subprocess.Popen(cmd, env=env, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)

    def _start_pair(self, pp: PairProcs) -> None:
        base = ["--host", self.host, *self.worker_args]
        if self.model:
            base += ["--model", self.model]
        pp.prefill = self._spawn(f"prefill-{pp.index}", ["--role", "prefill", "--port", str(pp.prefill_port),
                                                          "--bootstrap-port", str(pp.bootstrap_port), *base])
        pp.decode = self._spawn(f"decode-{pp.index}", ["--role", "decode", "--port", str(pp.decode_port), *base])
        pp.ready = False
        pp.phase = "starting"

    @staticmethod
    def _stop(p: subprocess.Popen | None, timeout: float = 5.0) -> None:
        if p is None or p.poll() is not None:
            return
        p.terminate()
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()

    def write_topology(self) -> None:
        self.revision += 1
        doc = {"version": 1, "revision": f"local-{self.revision}", "pairs": [
            {"index": pp.index, "ready": pp.ready,
             "prefill": {"url": f"http://{self.host}:{pp.prefill_port}", "bootstrap_host": self.host,
                         "bootstrap_port": pp.bootstrap_port},
             "decode": {"url": f"http://{self.host}:{pp.decode_port}"}} for pp in self.pairs]}
        tmp = self.topology_path + ".tmp"
        with open(tmp, "w") as fh:
            yaml.safe_dump(doc, fh)
        os.replace(tmp, self.topology_path)  # atomic, like a ConfigMap symlink swap

    def _healthy(self, port: int) -> bool:
        try:
            return httpx.get(f"http://{self.host}:{port}/health", timeout=1.0).status_code == 200
        except httpx.HTTPError:
            return False

    def start(self) -> None:
        for pp in self.pairs:
            self._start_pair(pp)
        self.write_topology()
        self.router = self._spawn("router", ["--role", "router", "--host", self.host, "--port", str(self.port),
                                             "--topology-file", self.topology_path])

    def wait_ready(self, timeout_s: float = 300.0) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.tick()
            if all(pp.ready for pp in self.pairs) and self._healthy(self.port):
                return True
            if not _alive(self.router):
                raise RuntimeError(f"router exited with {self.router.returncode}; see {self.log_dir}/router.log")
            time.sleep(0.5)
        return False

    def tick(self) -> list[int]:
        """One supervision pass: co-restart broken pairs, mark pairs ready once both workers are healthy."""
        now = time.monotonic()
        changed = False
        alive = {pp.index: (_alive(pp.prefill), _alive(pp.decode)) for pp in self.pairs}
        restarted = []
        for idx in plan_restarts(alive):
            pp = self.pairs[idx]
            if pp.phase != "backoff":
                # first notice: take the pair out of the router, stop the survivor, schedule the restart
                log.warning("pair %d: a worker exited (prefill alive=%s, decode alive=%s); restarting the pair together",
                            idx, *alive[idx])
                pp.ready = False
                changed = True
                self._stop(pp.prefill)
                self._stop(pp.decode)
                pp.restarts += 1
                pp.phase = "backoff"
                pp.not_before = now + backoff_for(pp.restarts)
            if now >= pp.not_before:
                self._start_pair(pp)
                restarted.append(idx)
        for pp in self.pairs:
            if not pp.ready and _alive(pp.prefill) and _alive(pp.decode) and \
                    self._healthy(pp.prefill_port) and self._healthy(pp.decode_port):
                pp.ready = True
                pp.phase = "running"
                changed = True
        if changed:
            self.write_topology()
        return restarted

    def stop(self) -> None:
        self._stop(self.router)
        for pp in self.pairs:
            self._stop(pp.prefill)
            self._stop(pp.decode)

    def pids(self) -> dict:
        return {"router": self.router.pid if self.router else None,
                "pairs": [{"index": pp.index, "prefill": pp.prefill.pid if pp.prefill else None,
                           "decode": pp.decode.pid if pp.decode else None, "ready": pp.ready,
                           "restarts": pp.restarts} for pp in self.pairs]}

    def run_forever(self) -> None:
        stop = {"now": False}

        def _sig(*_):
            stop["now"] = True

        signal.signal(signal.SIGINT, _sig)
        signal.signal(signal.SIGTERM, _sig)
        try:
            while not stop["now"]:
                self.tick()
                if not _alive(self.router):
                    log.warning("router exited (%s); restarting it", self.router.returncode)
                    self.router = self._spawn("router", ["--role", "router", "--host", self.host, "--port", str(self.port),
                                                         "--topology-file", self.topology_path])
                time.sleep(0.5)
        finally:
            self.stop()
