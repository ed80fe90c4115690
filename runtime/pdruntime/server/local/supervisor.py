"""Local supervision for `pdrt up`: a router plus N prefill/decode pairs as separate processes.

The co-restart rule holds locally too: when one worker of a pair dies, the survivor is stopped and the
pair restarts together (marked not-ready in the router's topology meanwhile), with backoff.
:func:`plan_restarts` is the pure decision; :class:`LocalStack` is the process shell around it.

`pdrt up` owns its children (issue 13, defect 4):

* they die with it: each child asks the kernel for SIGKILL when its parent dies (``PR_SET_PDEATHSIG``,
  set between fork and exec), and also watches its parent pid itself (``PDRT_PARENT_PID``,
  :func:`watch_parent`), so a SIGKILLed `pdrt up` leaves no orphans;
* it refuses to start over ports in use, naming the port and the process holding it (:func:`busy_ports`);
* a health check only counts when the server answers with the instance id this supervisor gave it
  (``PDRT_INSTANCE_ID``), never an orphan's or a stranger's;
* every restart (router or pair) backs off exponentially up to a cap (:func:`backoff_for`), and the count
  resets once the process stayed healthy for :data:`RESET_AFTER_S` (:func:`restarts_after`).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import httpx
import yaml

from pdruntime.util.backoff import capped_backoff

log = logging.getLogger("pdruntime.up")

GROUP_INDEX_STRIDE = 1000  # router entry c of group k has index k + 1000 * c (as the operator renders it)

BACKOFF_BASE_S = 1.0  # seconds before the first restart; doubles per consecutive restart
BACKOFF_CAP_S = 30.0  # ... up to this
RESET_AFTER_S = 60.0  # healthy this long -> the restart count starts over
PR_SET_PDEATHSIG = 1  # linux/prctl.h
PORTS_IN_USE_EXIT = 3  # `pdrt up` exit status when a port it needs is taken


@dataclass
class Member:
    """A worker of a P:D group beyond its first prefill and first decode (``pdrt up --prefill N --decode M``)."""

    role: str  # prefill | decode
    member: int  # 1.. within its role
    port: int
    bootstrap_port: int | None = None  # prefill only
    proc: subprocess.Popen | None = None
    instance: str = ""


def group_ports(base: int, prefill: int, decode: int) -> tuple[tuple[int, int, int], list[Member]]:
    """Ports of one group from ``base``: (first prefill HTTP, first decode HTTP, first bootstrap) as for a
    pair (base, base+1, base+2), then each further prefill (HTTP, bootstrap) and each further decode (HTTP)."""
    extra: list[Member] = []
    nxt = base + 3
    for m in range(1, prefill):
        extra.append(Member("prefill", m, nxt, nxt + 1))
        nxt += 2
    for m in range(1, decode):
        extra.append(Member("decode", m, nxt))
        nxt += 1
    return (base, base + 1, base + 2), extra


def group_stride(prefill: int, decode: int) -> int:
    """Ports one group takes: 2 per prefill (HTTP + KV bootstrap), 1 per decode (3 for a pair)."""
    return 2 * prefill + decode


@dataclass
class PairProcs:
    """One P:D group's processes (a pair: one prefill and one decode; ``extra`` holds further members)."""

    index: int
    prefill_port: int
    decode_port: int
    bootstrap_port: int
    prefill: subprocess.Popen | None = None
    decode: subprocess.Popen | None = None
    extra: list[Member] = field(default_factory=list)
    restarts: int = 0
    ready: bool = False
    phase: str = "starting"  # starting | running | backoff
    not_before: float = 0.0  # time.monotonic() before which a pair in backoff is not restarted
    healthy_since: float | None = None  # time.monotonic() when it last became ready
    instances: tuple[str, str] = ("", "")  # PDRT_INSTANCE_ID given to (prefill, decode)


def plan_restarts(alive: dict[int, tuple[bool, bool]]) -> list[int]:
    """Pairs to co-restart: every pair where either worker is not alive. ``alive[index] = (prefill, decode)``."""
    return sorted(i for i, (p, d) in alive.items() if not (p and d))


def backoff_for(restarts: int, base_s: float = BACKOFF_BASE_S, cap_s: float = BACKOFF_CAP_S) -> float:
    """Seconds before the ``restarts``-th consecutive restart: base * 2**(n-1), capped; 0 before any."""
    return capped_backoff(restarts, base_s, cap_s)


def restarts_after(restarts: int, healthy_since: float | None, now: float, reset_after_s: float = RESET_AFTER_S) -> int:
    """The consecutive-restart count to use now: back to 0 once healthy for ``reset_after_s``."""
    if healthy_since is not None and now - healthy_since >= reset_after_s:
        return 0
    return restarts


# ---- children die with their parent ------------------------------------------------------------------

def die_with_parent(parent_pid: int) -> Callable[[], None]:
    """preexec_fn: ask the kernel to SIGKILL this child when its parent (thread) dies; if the parent is
    already gone (it died between fork and here), exit now."""

    def preexec() -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass  # not Linux: the child's own parent watch (watch_parent) still applies
        if os.getppid() != parent_pid:
            os._exit(1)

    return preexec


def watch_parent(parent_pid: int, interval_s: float = 1.0) -> threading.Thread:
    """In a child of `pdrt up`: exit when the parent is gone (re-parented), in case PDEATHSIG is unavailable."""

    def run() -> None:
        while True:
            if os.getppid() != parent_pid:
                log.error("parent pdrt up (pid %d) is gone; exiting so no orphan keeps its ports", parent_pid)
                logging.shutdown()
                os._exit(1)
            time.sleep(interval_s)

    t = threading.Thread(target=run, name="parent-watch", daemon=True)
    t.start()
    return t


# ---- ports ---------------------------------------------------------------------------------------------

def listening_inodes(port: int, tables: dict[str, str]) -> set[str]:
    """Socket inodes listening on ``port`` in /proc/net/tcp{,6} text (``tables``: name -> contents)."""
    inodes = set()
    for text in tables.values():
        for line in text.splitlines()[1:]:
            cols = line.split()
            if len(cols) < 10 or cols[3] != "0A":  # 0A = TCP_LISTEN
                continue
            if int(cols[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(cols[9])
    return inodes


def port_holder(port: int) -> str:
    """Who listens on ``port``: "pid N (cmdline)", or a reason it cannot be told."""
    tables = {}
    for name in ("tcp", "tcp6"):
        try:
            with open(f"/proc/net/{name}") as fh:
                tables[name] = fh.read()
        except OSError:
            pass
    inodes = listening_inodes(port, tables)
    if not inodes:
        return "a process this user cannot see"
    targets = {f"socket:[{i}]" for i in inodes}
    for pid in (d for d in os.listdir("/proc") if d.isdigit()):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") in targets:
                    with open(f"/proc/{pid}/cmdline", "rb") as fh:
                        cmd = fh.read().replace(b"\0", b" ").decode(errors="replace").strip()
                    return f"pid {pid} ({cmd[:200]})"
            except OSError:
                continue
    return "a process this user cannot see"


def busy_ports(host: str, ports: dict[int, str]) -> list[str]:
    """One message per port of ``ports`` (port -> what it is for) that cannot be bound on ``host``."""
    out = []
    for port, what in ports.items():
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: TIME_WAIT is not "in use"
            try:
                s.bind((host, port))
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE:
                    out.append(f"port {port} ({what}) on {host} cannot be bound: {exc}")
                else:
                    out.append(f"port {port} ({what}) on {host} is in use by {port_holder(port)}")
    return out


def _alive(p: subprocess.Popen | None) -> bool:
    return p is not None and p.poll() is None


@dataclass(frozen=True)
class StackSpec:
    """What ``pdrt up`` runs: ``pairs`` groups of ``prefill`` P and ``decode`` D workers from ``base_port`` (each group
    :func:`group_stride` ports), the router on ``port``, and how restarts back off."""

    pairs: int = 1
    prefill: int = 1
    decode: int = 1
    host: str = "127.0.0.1"
    port: int = 8000
    base_port: int = 8100
    model: str | None = None
    worker_args: tuple[str, ...] | list[str] = ()  # passed to every `pdrt serve` worker
    router_args: tuple[str, ...] | list[str] = ()  # passed to the router's `pdrt serve` (routing policy flags)
    extra_env: dict[str, str] | None = None
    log_dir: str | None = None  # None: the stack's temporary work dir
    backoff_base_s: float = BACKOFF_BASE_S
    backoff_cap_s: float = BACKOFF_CAP_S
    reset_after_s: float = RESET_AFTER_S

    def __post_init__(self) -> None:
        if self.prefill < 1 or self.decode < 1:
            raise ValueError(f"--prefill {self.prefill} --decode {self.decode}: accepted: at least one of each per "
                             "group")


class LocalStack:
    def __init__(self, **spec: Any) -> None:
        """``spec``: the fields of :class:`StackSpec` (TypeError for any other, ValueError for a bad group)."""
        sp = StackSpec(**spec)
        host, port, model = sp.host, sp.port, sp.model
        self.host, self.port = host, port
        self.model = model
        self.worker_args = list(sp.worker_args or ())
        self.router_args = list(sp.router_args or ())
        self.workdir = tempfile.mkdtemp(prefix="pdrt-up-")
        self.log_dir = sp.log_dir or self.workdir
        self.topology_path = os.path.join(self.workdir, "topology.yaml")
        self.env = {**os.environ, **(sp.extra_env or {})}
        self.env.setdefault("PDRT_KV_AUTH_TOKEN", secrets.token_hex(16))  # per-run KV-transfer token
        self.env["PDRT_PARENT_PID"] = str(os.getpid())
        if model:
            self.env["PDRT_MODEL"] = model
        self.run_id = secrets.token_hex(4)
        self.spawned = 0
        self.backoff_base_s, self.backoff_cap_s = sp.backoff_base_s, sp.backoff_cap_s
        self.reset_after_s = sp.reset_after_s
        stride = group_stride(sp.prefill, sp.decode)
        self.pairs = []
        for i in range(sp.pairs):
            first, extra = group_ports(sp.base_port + stride * i, sp.prefill, sp.decode)
            self.pairs.append(PairProcs(i, *first, extra=extra))
        self.router: subprocess.Popen | None = None
        self.router_instance = ""
        self.router_restarts = 0
        self.router_not_before: float | None = None  # set while a router restart waits out its backoff
        self.router_healthy_since: float | None = None
        self.revision = 0

    # ---- ports ------------------------------------------------------------------------------------
    def ports(self) -> dict[int, str]:
        out = {self.port: "router HTTP"}
        for pp in self.pairs:
            out[pp.prefill_port] = f"pair {pp.index} prefill HTTP"
            out[pp.decode_port] = f"pair {pp.index} decode HTTP"
            out[pp.bootstrap_port] = f"pair {pp.index} prefill KV bootstrap"
            for m in pp.extra:
                out[m.port] = f"group {pp.index} {m.role}-{m.member} HTTP"
                if m.bootstrap_port is not None:
                    out[m.bootstrap_port] = f"group {pp.index} {m.role}-{m.member} KV bootstrap"
        return out

    def check_ports(self) -> list[str]:
        """Messages for ports this stack needs that are taken (empty: all free)."""
        return busy_ports(self.host, self.ports())

    # ---- processes ------------------------------------------------------------------------------
    def _spawn(self, name: str, args: list[str]) -> tuple[subprocess.Popen, str]:
        """Start ``pdrt serve ARGS``; it dies with this process. -> (process, the instance id it reports)."""
        self.spawned += 1
        instance = f"up-{self.run_id}-{name}-{self.spawned}"
        logf = open(os.path.join(self.log_dir, f"{name}.log"), "ab")
        cmd = [sys.executable, "-m", "pdruntime.server", "serve", *args]
        env = {**self.env, "PDRT_INSTANCE_ID": instance}
        if name == "router":  # each process gets only the secrets it uses: the router never touches KV
            env = {k: v for k, v in env.items() if k not in ("PDRT_KV_AUTH_TOKEN", "PDRT_KV_AUTH_TOKEN_FILE")}
        proc = subprocess.Popen(cmd, env=env, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=die_with_parent(os.getpid()))
        logf.close()
        return proc, instance

    def _start_pair(self, pp: PairProcs) -> None:
        base = ["--host", self.host, *self.worker_args]
        if self.model:
            base += ["--model", self.model]
        pp.prefill, pre_id = self._spawn(f"prefill-{pp.index}", ["--role", "prefill", "--port", str(pp.prefill_port),
                                                                 "--bootstrap-port", str(pp.bootstrap_port), *base])
        pp.decode, dec_id = self._spawn(f"decode-{pp.index}", ["--role", "decode", "--port", str(pp.decode_port), *base])
        for m in pp.extra:
            args = ["--role", m.role, "--port", str(m.port)]
            if m.bootstrap_port is not None:
                args += ["--bootstrap-port", str(m.bootstrap_port)]
            m.proc, m.instance = self._spawn(f"{m.role}-{pp.index}-{m.member}", [*args, *base])
        pp.instances = (pre_id, dec_id)
        pp.ready = False
        pp.healthy_since = None
        pp.phase = "starting"

    def _start_router(self) -> None:
        self.router, self.router_instance = self._spawn(
            "router", ["--role", "router", "--host", self.host, "--port", str(self.port),
                       "--topology-file", self.topology_path, *self.router_args])
        self.router_healthy_since = None

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
        doc = {"version": 1, "revision": f"local-{self.revision}", "pairs": []}
        for pp in self.pairs:
            prefills = [(pp.prefill_port, pp.bootstrap_port)] + [(m.port, m.bootstrap_port) for m in pp.extra
                                                                 if m.role == "prefill"]
            decodes = [pp.decode_port] + [m.port for m in pp.extra if m.role == "decode"]
            # one router entry per (prefill, decode) of the group: the router dispatches within the group
            for c, ((pport, bport), dport) in enumerate((p, d) for p in prefills for d in decodes):
                entry = {"index": pp.index + GROUP_INDEX_STRIDE * c, "ready": pp.ready,
                         "prefill": {"url": f"http://{self.host}:{pport}", "bootstrap_host": self.host,
                                     "bootstrap_port": bport},
                         "decode": {"url": f"http://{self.host}:{dport}"}}
                if pp.extra:
                    entry["group"] = pp.index
                doc["pairs"].append(entry)
        tmp = self.topology_path + ".tmp"
        with open(tmp, "w") as fh:
            yaml.safe_dump(doc, fh)
        os.replace(tmp, self.topology_path)  # atomic, like a ConfigMap symlink swap

    def _healthy(self, port: int, instance: str | None = None) -> bool:
        """/health answers 200, from the instance this stack started (not an orphan or a stranger on the port)."""
        try:
            r = httpx.get(f"http://{self.host}:{port}/health", timeout=1.0)
        except httpx.HTTPError:
            return False
        if r.status_code != 200:
            return False
        if instance is None:
            return True
        try:
            got = r.json().get("instance")
        except (ValueError, AttributeError):
            got = None
        if got != instance:
            log.warning("port %d answers as instance %r, not ours (%r): another process holds it", port, got, instance)
            return False
        return True

    def start(self) -> None:
        for pp in self.pairs:
            self._start_pair(pp)
        self.write_topology()
        self._start_router()

    def wait_ready(self, timeout_s: float = 300.0) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.tick()
            if all(pp.ready for pp in self.pairs) and self._healthy(self.port, self.router_instance):
                return True
            if not _alive(self.router):
                raise RuntimeError(f"router exited with {self.router.returncode}; see {self.log_dir}/router.log")
            time.sleep(0.1)
        return False

    def tick(self, now: float | None = None) -> list[int]:
        """One supervision pass: co-restart broken pairs (with backoff), mark pairs ready once both workers
        answer healthy as themselves."""
        now = time.monotonic() if now is None else now
        changed = False
        alive = {pp.index: (_alive(pp.prefill) and all(_alive(m.proc) for m in pp.extra if m.role == "prefill"),
                            _alive(pp.decode) and all(_alive(m.proc) for m in pp.extra if m.role == "decode"))
                 for pp in self.pairs}
        restarted = []
        for idx in plan_restarts(alive):
            pp = self.pairs[idx]
            if pp.phase != "backoff":
                # first notice: take the pair out of the router, stop the survivor, schedule the restart
                pp.restarts = restarts_after(pp.restarts, pp.healthy_since, now, self.reset_after_s) + 1
                delay = backoff_for(pp.restarts, self.backoff_base_s, self.backoff_cap_s)
                codes = tuple(None if p is None else p.poll() for p in (pp.prefill, pp.decode))
                log.warning("pair %d: a worker exited (prefill exit=%s, decode exit=%s); restarting the pair together "
                            "in %.1fs (restart %d in a row)", idx, *codes, delay, pp.restarts)
                pp.ready = False
                pp.healthy_since = None
                changed = True
                self._stop(pp.prefill)
                self._stop(pp.decode)
                for m in pp.extra:  # the whole group restarts together
                    self._stop(m.proc)
                pp.phase = "backoff"
                pp.not_before = now + delay
            if now >= pp.not_before:
                self._start_pair(pp)
                restarted.append(idx)
        for pp in self.pairs:
            if not pp.ready and _alive(pp.prefill) and _alive(pp.decode) and \
                    self._healthy(pp.prefill_port, pp.instances[0]) and self._healthy(pp.decode_port, pp.instances[1]) \
                    and all(_alive(m.proc) and self._healthy(m.port, m.instance) for m in pp.extra):
                pp.ready = True
                pp.phase = "running"
                pp.healthy_since = now
                changed = True
        if changed:
            self.write_topology()
        return restarted

    def tick_router(self, now: float | None = None) -> bool:
        """Restart an exited router after its backoff. True when it was (re)started in this pass."""
        now = time.monotonic() if now is None else now
        if _alive(self.router):
            if self.router_healthy_since is None and self._healthy(self.port, self.router_instance):
                self.router_healthy_since = now
            return False
        if self.router_not_before is None:
            self.router_restarts = restarts_after(self.router_restarts, self.router_healthy_since, now,
                                                  self.reset_after_s) + 1
            delay = backoff_for(self.router_restarts, self.backoff_base_s, self.backoff_cap_s)
            log.warning("router exited (%s); restarting it in %.1fs (restart %d in a row)",
                        None if self.router is None else self.router.returncode, delay, self.router_restarts)
            self.router_not_before = now + delay
        if now < self.router_not_before:
            return False
        self.router_not_before = None
        self._start_router()
        return True

    def stop(self) -> None:
        self._stop(self.router)
        for pp in self.pairs:
            self._stop(pp.prefill)
            self._stop(pp.decode)
            for m in pp.extra:
                self._stop(m.proc)

    def pids(self) -> dict:
        return {"router": self.router.pid if self.router else None,
                "pairs": [{"index": pp.index, "prefill": pp.prefill.pid if pp.prefill else None,
                           "decode": pp.decode.pid if pp.decode else None, "ready": pp.ready,
                           "restarts": pp.restarts,
                           **({"members": {f"{m.role}-{m.member}": m.proc.pid if m.proc else None for m in pp.extra}}
                              if pp.extra else {})} for pp in self.pairs]}

    def run_forever(self) -> None:
        stop = {"now": False}

        def _sig(*_):
            stop["now"] = True

        signal.signal(signal.SIGINT, _sig)
        signal.signal(signal.SIGTERM, _sig)
        try:
            while not stop["now"]:
                self.tick()
                self.tick_router()
                time.sleep(0.5)
        finally:
            self.stop()
