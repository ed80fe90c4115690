"""The router on several processes: ``pdrt serve --role router --router-processes N``.

One Python process keeps one core busy at most. With ``N`` > 1 the command becomes a small supervisor that starts
``N`` router processes on the same port (``SO_REUSEPORT``: the kernel spreads new connections over them by their
addresses; a connection stays with the process that accepted it). What one process kept for the whole router is
shared or split:

* **admission**: each process admits ``max_pending_per_pair // N`` requests per pair before their first token, and
  queues ``max_queued_requests // N``; together they never hold more than one process did (``N`` may not exceed
  ``--max-pending-per-pair``). With few client connections the split refuses sooner than one process would;
  such a router has no use for more than one process anyway;
* **breakers**: a pair that trips in one process is opened in every process (each then closes it on its own trial);
* **topology**: a push (``POST /admin/topology``) that one process takes is relayed to the others before it is
  answered, every process polls the topology file, and a process (re)started later takes the newest topology its
  siblings run;
* **what is read**: ``/metrics`` (counters and histograms summed, gauges summed or, for states and ages, their
  maximum), ``/debug/requests`` (every process's rows, each with its ``process``) and ``/config``
  (``inflight_by_pair`` summed; ``topology_version`` the lowest any process runs, ``-1`` while one does not answer,
  so that the operator deletes a drained pair only once every process has it draining) answer for the whole
  router, whichever process takes the request;
* ``/health`` and ``/v1/models`` answer for the process that takes them (each probes the workers itself).

The processes talk over Unix sockets in a folder only the supervisor's user can enter: one JSON line asks, one JSON
line answers (:class:`Peers`). The supervisor restarts a process that exits (capped backoff); one that exits before
it ever listened (a port in use, say) stops the whole router with its exit status. SIGTERM or SIGINT goes to every
process, each drains as one router does, and the supervisor exits once all have.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric

from pdruntime.util.aio import detach, within

log = logging.getLogger("pdruntime.router.processes")

MAX_PROCESSES = 64
ASK_TIMEOUT_S = 2.0  # one sibling's answer to a question (it answers from memory)
LINE_LIMIT = 64 << 20  # bytes in one answer (a /debug/requests of a very busy process)
RESTART_BASE_S, RESTART_CAP_S = 0.5, 30.0  # a process that exits is restarted after this backoff
RESET_AFTER_S = 60.0  # a process that ran this long restarts without backoff again
#: gauges whose processes' values are merged by their maximum: states (0/1) and ages; every other gauge (live
#: requests, queued requests, open connections, outstanding requests per pair) is a count, summed
GAUGES_BY_MAX = frozenset({"pdrt_oldest_live_request_age_seconds", "pdrt_router_circuit_open",
                           "pdrt_router_pair_stale", "pdrt_router_pairs"})

Handler = Callable[[Any], Awaitable[Any]]


# ---- what the processes tell each other (JSON: dataclasses.asdict one way, ``Cls(**body)`` the other) --------------
@dataclass(frozen=True)
class ProcessView:
    """One process's part of the router's ``/config`` (op ``config``)."""

    topology_version: int
    draining: list[int]
    inflight_by_pair: dict[str, int]  # pair index (a JSON key) -> requests in flight there


@dataclass(frozen=True)
class Trip:
    """A breaker that tripped (op ``trip``): pair ``pair``, while it is these workers."""

    pair: int
    prefill: str
    decode: str


def check_count(n: int, max_pending: int, port: int) -> None:
    """ValueError naming the flags when ``n`` router processes cannot share ``port`` or split the admission bounds."""
    if not 1 <= n <= MAX_PROCESSES:
        raise ValueError(f"--router-processes {n} is not accepted; accepted: 1..{MAX_PROCESSES}")
    if n > 1 and port == 0:
        raise ValueError(f"--router-processes {n} needs a fixed --port (with 0 each process would get a port of "
                         "its own); accepted: --port 1..65535")
    if n > max_pending:
        raise ValueError(f"--router-processes {n} needs --max-pending-per-pair >= {n} (each process admits an equal "
                         f"share of the bound, at least one request per pair; it is {max_pending})")


def socket_path(folder: str, index: int) -> str:
    """Where router process ``index`` answers its siblings (it appears once the process serves)."""
    return os.path.join(folder, f"{index}.sock")


BUILDING = ".new"  # a file's name while it is made, before it is renamed whole into place (sockets, counts)


class Peers:
    """This router process (``index`` of ``count``) and its siblings, reached over ``folder``'s Unix sockets."""

    def __init__(self, index: int, count: int, folder: str) -> None:
        if not 0 <= index < count:
            raise ValueError(f"process index {index} is not accepted; accepted: 0..{count - 1}")
        self.index, self.count, self.folder = index, count, folder
        self._server: asyncio.AbstractServer | None = None

    def path(self, index: int) -> str:
        return socket_path(self.folder, index)

    @property
    def others(self) -> list[int]:
        return [i for i in range(self.count) if i != self.index]

    # ---- answering -----------------------------------------------------------------------------
    async def open(self, handlers: dict[str, Handler]) -> None:
        """Answer siblings' questions (``{"op": name, "body": ...}`` -> ``handlers[name](body)``). The socket appears
        once this process serves: the supervisor reads that as "started"."""
        async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                ask = json.loads(await reader.readline())
                handler = handlers.get(ask.get("op"))
                if handler is None:
                    reply = {"error": f"unknown op {ask.get('op')!r}; accepted: {', '.join(sorted(handlers))}"}
                else:
                    reply = {"ok": await handler(ask.get("body"))}
            except Exception as exc:  # a sibling's bad question must not take this process down
                log.warning("a sibling's question failed: %s: %s", type(exc).__name__, exc)
                reply = {"error": f"{type(exc).__name__}: {exc}"}
            with contextlib.suppress(ConnectionError):
                writer.write(json.dumps(reply).encode() + b"\n")
                await writer.drain()
            writer.close()

        path = self.path(self.index)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # a previous run of this process index
        tmp = path + BUILDING
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        self._server = await asyncio.start_unix_server(answer, tmp, limit=LINE_LIMIT)
        os.rename(tmp, path)  # whole or absent: a sibling never connects to a half-made socket

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path(self.index))
            with contextlib.suppress(Exception):
                await self._server.wait_closed()

    # ---- asking --------------------------------------------------------------------------------
    async def ask_one(self, index: int, op: str, body: Any = None, timeout: float = ASK_TIMEOUT_S) -> Any:
        """Sibling ``index``'s answer to ``op``; raises OSError (unreachable), TimeoutError or RuntimeError."""
        async def exchange() -> Any:
            reader, writer = await asyncio.open_unix_connection(self.path(index), limit=LINE_LIMIT)
            try:
                writer.write(json.dumps({"op": op, "body": body}).encode() + b"\n")
                await writer.drain()
                line = await reader.readline()
            finally:
                writer.close()
            if not line:
                raise ConnectionResetError(f"router process {index} closed without answering {op!r}")
            reply = json.loads(line)
            if "error" in reply:
                raise RuntimeError(f"router process {index} refused {op!r}: {reply['error']}")
            return reply["ok"]

        return await within(exchange(), timeout)

    async def ask(self, op: str, body: Any = None) -> dict[int, Any]:
        """Every sibling's answer to ``op``, by process index; an exception in place of a sibling's that failed."""
        others = self.others
        got = await asyncio.gather(*(self.ask_one(i, op, body) for i in others), return_exceptions=True)
        for i, res in zip(others, got):
            if isinstance(res, BaseException) and not isinstance(res, Exception):
                raise res  # a cancellation of the asker
            if isinstance(res, Exception):  # a sibling not (yet) started has no socket: no news
                log.log(logging.DEBUG if isinstance(res, FileNotFoundError) else logging.WARNING,
                        "router process %d did not answer %r: %s", i, op, res)
        return dict(zip(others, got))

    @property
    def _counts_path(self) -> str:
        """Where this process index leaves its counts for a successor (:meth:`keep_counts`)."""
        return os.path.join(self.folder, f"{self.index}.counts.json")

    def keep_counts(self, fams: list) -> None:
        """Leave this process's counts (:func:`counts_only`) where a successor of the same index finds them: summed
        over the processes, a counter that restarted at zero would fall, which ``rate()`` reads as a reset of the
        whole router's counter and counts the others' totals again."""
        path = self._counts_path
        with open(path + BUILDING, "w") as fh:
            json.dump(counts_only(fams), fh)
        os.replace(path + BUILDING, path)

    def counts_before(self) -> list:
        """The counts a predecessor of this process index left (:meth:`keep_counts`); [] for the first."""
        try:
            with open(self._counts_path) as fh:
                return json.load(fh)
        except (OSError, ValueError):
            return []

    def tell(self, op: str, body: Any = None) -> None:
        """Send ``op`` to every sibling without waiting for their answers (a breaker that tripped)."""
        detach(self.ask(op, body))


# ---- /metrics of the whole router ----------------------------------------------------------------
def families(registry: CollectorRegistry) -> list:
    """A registry's samples as JSON-able lists: [name, type, help, unit, [[sample name, labels, value], ...]]."""
    return [[m.name, m.type, m.documentation, m.unit, [[s.name, s.labels, s.value] for s in m.samples]]
            for m in registry.collect()]


def merge(parts: list[list]) -> list:
    """Several processes' :func:`families` as one: a sample's values summed (gauges in :data:`GAUGES_BY_MAX`: their
    maximum), in the first process's order, samples only others have after them."""
    merged: dict[str, tuple[str, str, str, dict[tuple, list]]] = {}
    for fams in parts:
        for name, typ, doc, unit, samples in fams:
            fam = merged.setdefault(name, (typ, doc, unit, {}))
            by_max = typ == "gauge" and name in GAUGES_BY_MAX
            values = fam[3]
            for sample, labels, value in samples:
                key = (sample, tuple(labels.items()))
                had = values.get(key)
                if had is None:
                    values[key] = [sample, labels, value]
                else:
                    had[2] = max(had[2], value) if by_max else had[2] + value
    return [[name, typ, doc, unit, list(values.values())] for name, (typ, doc, unit, values) in merged.items()]


def exposition(fams: list) -> bytes:
    """:func:`families` in Prometheus' text format, as prometheus_client renders a registry."""
    class Families:
        def collect(self):
            for name, typ, doc, unit, samples in fams:
                m = Metric(name, doc, typ, unit)
                for sample, labels, value in samples:
                    m.add_sample(sample, labels, value)
                yield m

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Families())
    return generate_latest(registry)


def counts_only(fams: list) -> list:
    """The counters and histograms of :func:`families`: what a restarted process carries on from its predecessor
    (a gauge is a present state, not a count)."""
    return [f for f in fams if f[1] in ("counter", "histogram")]


# ---- the supervisor ------------------------------------------------------------------------------
SUN_PATH_MAX = 107  # bytes in a Unix socket's path (sun_path is 108, NUL included)


def sockets_folder() -> str:
    """A new folder (mode 0700: only this user reaches the processes' sockets) whose sockets' paths fit a Unix
    address: under TMPDIR, else /tmp or /dev/shm where TMPDIR is too deep (a pod's /tmp mounted deep in a host
    folder, say). ValueError when none will do."""
    tried = []
    for base in (tempfile.gettempdir(), "/tmp", "/dev/shm"):
        longest = socket_path(os.path.join(base, "pdrt-router-xxxxxxxx"), MAX_PROCESSES - 1) + BUILDING
        if len(longest.encode()) > SUN_PATH_MAX:
            tried.append(f"{base} (too deep)")
            continue
        try:
            return tempfile.mkdtemp(prefix="pdrt-router-", dir=base)
        except OSError as exc:
            tried.append(f"{base} ({exc.strerror})")
    raise ValueError(f"--router-processes: no folder for the processes' sockets; tried {', '.join(tried)}; accepted: "
                     f"TMPDIR a writable folder whose path is short enough for a Unix socket ({SUN_PATH_MAX} bytes)")


def supervise(argv: list[str], count: int) -> int:
    """Run ``pdrt ARGV`` as ``count`` router processes and supervise them (the module docstring); -> exit status."""
    try:
        folder = sockets_folder()
    except ValueError as exc:
        log.error("%s", exc)
        return 2
    from pdruntime.server.local.supervisor import backoff_for, die_with_parent, restarts_after

    procs: list[subprocess.Popen | None] = [None] * count
    started: list[float] = [0.0] * count
    restarts = [0] * count
    due: list[float | None] = [None] * count  # a process's restart time while it waits for one
    served = [False] * count  # its socket appeared: it listened (an exit before that is a start-up failure)
    signals = 0

    def spawn(i: int) -> None:
        cmd = [sys.executable, "-m", "pdruntime.server", *argv, "--process-index", str(i), "--peer-dir", folder]
        procs[i] = subprocess.Popen(cmd, preexec_fn=die_with_parent(os.getpid()))
        started[i], due[i] = time.monotonic(), None

    def forward(signum: int, _frame: Any) -> None:
        nonlocal signals
        signals += 1
        for p in procs:
            if p is not None and p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.send_signal(signal.SIGTERM if signals == 1 else signal.SIGINT)

    old = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    status = 0
    try:
        for i in range(count):
            spawn(i)
        log.info("router: %d processes (pids %s), siblings' sockets in %s", count,
                 ", ".join(str(p.pid) for p in procs if p is not None), folder)
        while True:
            now = time.monotonic()
            for i, p in enumerate(procs):
                if p is None or p.poll() is None:
                    if p is None and not signals and due[i] is not None and now >= due[i]:
                        spawn(i)
                    elif p is not None and not served[i]:
                        served[i] = os.path.exists(socket_path(folder, i))
                    continue
                rc, procs[i] = p.returncode, None
                if signals:
                    status = status or rc
                    continue
                if not served[i]:
                    log.error("router process %d exited with status %d before it served; stopping the router", i, rc)
                    status = rc or 1
                    forward(signal.SIGTERM, None)
                    continue
                restarts[i] = restarts_after(restarts[i], started[i], now, RESET_AFTER_S) + 1
                wait = backoff_for(restarts[i], RESTART_BASE_S, RESTART_CAP_S)
                log.error("router process %d (pid %d) exited with status %d; restarting it in %.1fs", i, p.pid, rc, wait)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(socket_path(folder, i))
                due[i] = now + wait
            if signals and all(p is None for p in procs):
                return status
            time.sleep(0.1)
    finally:
        for p in procs:
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
        for s, h in old.items():
            signal.signal(s, h)
        shutil.rmtree(folder, ignore_errors=True)
