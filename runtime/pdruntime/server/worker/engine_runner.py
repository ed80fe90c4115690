"""One dedicated thread owns the (non-thread-safe) engine, and contains its failures.

asyncio handlers submit commands (``call(fn)`` -> awaitable result of ``fn(engine)``) and register a
sink per request id; the thread drains commands, runs ``engine.step()`` while there is work, and hands
each step's outputs to the event loop in one ``call_soon_threadsafe``. When idle it blocks on the
command queue, so an idle engine costs nothing.

A step that raises never spins (issue 8 item 6, issue 13 "engine isolation"):

* the failed step is retried at once **in parts** (bisection over the request ids it ran). Parts that
  succeed advance their requests by their one step, so a clean request loses at most that one step's
  retry; a request that still fails when run alone is failed alone (HTTP 422, not a pair failure);
* when every part fails the error is not tied to one request: the step's requests fail with a 500
  (a pair failure), the runner backs off (:func:`step_backoff`), and after ``max_consecutive`` such
  rounds in a row the worker is unhealthy (``fatal_reason``: /health 503) and the process exits with
  :data:`ENGINE_FAILED_EXIT_CODE` so the pod (or ``pdrt up``) restarts the pair;
* device out-of-memory (``torch.cuda.OutOfMemoryError``) rejects the requests it cannot run with a
  clear 503 and never counts towards the exit.

:func:`isolation_verdict` and :func:`step_backoff` are the pure decisions; the thread is the shell.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from pdruntime.util.backoff import capped_backoff

log = logging.getLogger("pdruntime.engine_runner")

_STOP = object()
ENGINE_FAILED_EXIT_CODE = 70  # EX_SOFTWARE: the engine kept failing; restart the process (and its pair)
REQUEST_ERROR_STATUS = 422  # a request that fails alone: another pair would fail it too, not a pair failure
STEP_ERROR_STATUS = 500  # a step failure not tied to one request: counts against the pair
OOM_STATUS = 503  # out of device memory: retry later or elsewhere


class EngineUnhealthy(RuntimeError):
    """The runner gave up on its engine (too many consecutive failing steps)."""


def _oom_types() -> tuple[type, ...]:
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a runtime dependency
        return (MemoryError,)
    return (torch.cuda.OutOfMemoryError, MemoryError)


def is_oom(exc: BaseException) -> bool:
    return isinstance(exc, _oom_types())


@dataclass(frozen=True)
class FailurePolicy:
    """How the runner treats failing steps (from PDRT_ENGINE_* / --engine-max-step-failures)."""

    max_consecutive: int = 5  # failing rounds not tied to a request, in a row, before the worker gives up
    backoff_base_s: float = 0.05  # sleep after the 1st failing round; doubles per round
    backoff_cap_s: float = 2.0  # ... up to this (bounds the failing-step rate at >= 1 / cap per second)
    exit_grace_s: float = 2.0  # unhealthy -> exit: failed requests reach their clients, probes see the 503
    exit_code: int | None = ENGINE_FAILED_EXIT_CODE  # None: mark unhealthy but keep the process (unit tests)

    def __post_init__(self) -> None:
        if isinstance(self.max_consecutive, bool) or not isinstance(self.max_consecutive, int) or self.max_consecutive < 1:
            raise ValueError(f"max_consecutive={self.max_consecutive!r}; accepted: an integer >= 1")
        if not 0 <= self.backoff_base_s <= self.backoff_cap_s:
            raise ValueError("accepted: 0 <= backoff_base_s <= backoff_cap_s")


def step_backoff(consecutive: int, policy: FailurePolicy) -> float:
    """Seconds to wait after the ``consecutive``-th failing round in a row: base * 2**(n-1), capped."""
    return capped_backoff(consecutive, policy.backoff_base_s, policy.backoff_cap_s)


def isolation_verdict(num_suspects: int, num_culprits: int, parts_ok: int, oom: bool) -> str:
    """What a failed step was, after its retry in parts.

    ``request``: some requests failed alone while others ran, so the failure is theirs (fail them alone; a
    lone request is run against a one-token canary step for this). ``transient``: every part ran, nobody
    failed. ``oom``: out of device memory and no part could run. ``step``: no part (nor the canary) could run,
    so the failure is not tied to one request."""
    if parts_ok > 0:
        return "request" if num_culprits else "transient"
    return "oom" if oom else "step"


class EngineRunner:
    def __init__(self, engine: Any, loop: asyncio.AbstractEventLoop, *, on_step: Callable[[dict, int], None] | None = None,
                 policy: FailurePolicy | None = None,
                 on_request_error: Callable[[str, str, int, str | None], None] | None = None,
                 on_step_error: Callable[[str], None] | None = None,
                 on_fatal: Callable[[str], None] | None = None) -> None:
        self.engine = engine
        self.loop = loop
        self.policy = policy or FailurePolicy()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, Callable[[Any], None]] = {}  # rid -> callback(StepOutput), loop thread only
        self._on_step = on_step  # (engine stats, batch size) -> None, called in the loop thread
        self._on_request_error = on_request_error  # (rid, message, HTTP status, API code or None), loop thread
        self._on_step_error = on_step_error  # (verdict) per failing round, loop thread
        self._on_fatal = on_fatal  # (reason), loop thread, once
        self.step_delay_s = 0.0  # test hook: sleep after each step (slows decode so tests can observe it)
        # test hooks (PDRT_TEST_HOOKS=1): make steps raise
        self.inject_step_errors = 0  # the next N engine.step calls raise (not tied to a request)
        self.inject_oom = False  # ... with torch.cuda.OutOfMemoryError instead of RuntimeError
        self.poison_seed: int | None = None  # every step running a request with this seed raises
        self.hold_steps = False  # run commands but do not step (queued requests then share the next step)
        self.steps = 0
        self.failed_rounds = 0
        self.consecutive_failures = 0
        self.errors_by_verdict: dict[str, int] = {}
        self.last_error: str | None = None
        self.fatal_reason: str | None = None
        self.last_stats: dict = {}
        self._error_status: dict[str, int] = {}  # rid -> HTTP status of an engine "error" output
        self._counted: set[str] = set()  # rids failed by an isolation round (already counted in the metric)
        # prefill: pages of each request whose KV just became ready, read on the engine thread in the same
        # step (saves a command round trip, which would wait behind the next prefill step)
        self.ready_pages: dict[str, tuple[list[int], int]] = {}
        self._thread = threading.Thread(target=self._run, name="engine-runner", daemon=True)

    def start(self) -> None:
        self.last_stats = self.engine.stats()
        self._thread.start()

    def stop(self) -> None:
        self._commands.put(_STOP)
        self._thread.join(timeout=10)

    def alive(self) -> bool:
        return self._thread.is_alive() and self.fatal_reason is None

    def health(self) -> dict:
        """For /health and /config: the failure counters and, once given up, why."""
        return {"healthy": self.fatal_reason is None, "reason": self.fatal_reason,
                "consecutive_failed_steps": self.consecutive_failures, "failed_steps": self.failed_rounds,
                "failed_steps_by_verdict": dict(self.errors_by_verdict), "last_error": self.last_error,
                "max_consecutive_failed_steps": self.policy.max_consecutive}

    # ---- loop-thread API -----------------------------------------------------------------
    def call(self, fn: Callable[[Any], Any]) -> asyncio.Future:
        """Run ``fn(engine)`` on the engine thread (a command of :mod:`.engine_commands`, or any callable);
        returns a loop future with its result. Commands run in the order they were sent."""
        fut = self.loop.create_future()
        self._commands.put((fn, fut))
        return fut

    def set_sink(self, rid: str, sink: Callable[[Any], None]) -> None:
        self._sinks[rid] = sink

    def drop_sink(self, rid: str) -> None:
        self._sinks.pop(rid, None)
        self.ready_pages.pop(rid, None)

    # ---- engine thread -------------------------------------------------------------------
    def _resolve(self, fut: asyncio.Future, ok: bool, value: Any) -> None:
        if fut.done():
            return
        if ok:
            fut.set_result(value)
        else:
            fut.set_exception(value)

    def _dispatch(self, outputs: list, stats: dict, batch: int) -> None:
        self.last_stats = stats
        if self._on_step is not None:
            self._on_step(stats, batch)
        for out in outputs:
            if getattr(out, "finish_reason", None) == "error":
                status = self._error_status.pop(out.request_id, REQUEST_ERROR_STATUS)
                code = getattr(out, "error_code", None)  # the request's own cause (its grammar): a 400, not the engine's
                if code is not None:
                    status = 400
                elif status == REQUEST_ERROR_STATUS and out.request_id not in self._counted and self._on_step_error:
                    self._on_step_error("request")  # failed alone inside the engine (its own sampling)
                self._counted.discard(out.request_id)
                self.drop_sink(out.request_id)
                if self._on_request_error is not None:
                    self._on_request_error(out.request_id, out.error or "engine error", status, code)
                continue
            sink = self._sinks.get(out.request_id)
            if sink is not None:
                sink(out)

    def _run_command(self, item: Any) -> bool:
        if item is _STOP:
            return False
        fn, fut = item
        if self.fatal_reason is not None:
            self.loop.call_soon_threadsafe(self._resolve, fut, False, EngineUnhealthy(self.fatal_reason))
            return True
        try:
            result = fn(self.engine)
        except BaseException as exc:  # delivered to the awaiting handler
            self.loop.call_soon_threadsafe(self._resolve, fut, False, exc)
        else:
            self.loop.call_soon_threadsafe(self._resolve, fut, True, result)
        return True

    def _engine_step(self, only: set[str] | None = None) -> list:
        """engine.step, through the test hooks that make it raise."""
        if self.inject_step_errors > 0:
            self.inject_step_errors -= 1
            if self.inject_oom:
                import torch

                raise torch.cuda.OutOfMemoryError("CUDA out of memory (injected by PDRT_TEST_HOOKS)")
            raise RuntimeError("injected engine step failure (PDRT_TEST_HOOKS)")
        if self.poison_seed is not None:
            ids = only if only is not None else self.engine.step_request_ids()
            seqs = getattr(self.engine, "_seqs", {})
            if any(getattr(getattr(seqs.get(r), "params", None), "seed", None) == self.poison_seed for r in ids):
                raise RuntimeError(f"injected failure of every step running a request with seed={self.poison_seed}")
        return self.engine.step() if only is None else self.engine.step(only=only)

    def _isolate(self, exc: Exception) -> tuple[list, str]:
        """Retry a failed step in parts (bisection). Returns (outputs, verdict); fails culprits in the engine."""
        engine = self.engine
        ids = list(engine.step_request_ids()) if hasattr(engine, "step_request_ids") else []
        outputs: list = []
        culprits: list[tuple[str, BaseException]] = []
        parts_ok = 0
        oom = is_oom(exc)
        work = [ids[: len(ids) // 2], ids[len(ids) // 2:]] if len(ids) > 1 else []
        if len(ids) == 1:  # alone: a canary step tells the request's fault from the engine's
            culprits.append((ids[0], exc))
            canary_ok, canary_out = self._canary()
            parts_ok += canary_ok
            outputs.extend(canary_out)
        while work:
            live = set(engine.step_request_ids())
            part = [r for r in work.pop(0) if r in live]
            if not part:
                continue
            try:
                outputs.extend(self._engine_step(set(part)))
                parts_ok += 1
            except Exception as sub:  # noqa: BLE001 - every failure is classified below
                oom = oom or is_oom(sub)
                if len(part) == 1:
                    culprits.append((part[0], sub))
                else:
                    work[:0] = [part[: len(part) // 2], part[len(part) // 2:]]
        verdict = isolation_verdict(len(ids), len(culprits), parts_ok, oom)
        what = f"{type(exc).__name__}: {exc}"
        if verdict == "request":
            for rid, cexc in culprits:
                kind = "out of device memory" if is_oom(cexc) else "failed"
                msg = (f"the engine {kind} running this request alone ({type(cexc).__name__}: {cexc}); it was "
                       f"failed on its own and the {len(ids) - len(culprits)} other request(s) of its step went on")
                log.error("engine step failed (%s); isolated to rid=%s, failed it alone", what, rid)
                self._fail_in_engine(rid, msg, OOM_STATUS if is_oom(cexc) else REQUEST_ERROR_STATUS)
        elif verdict == "transient":
            log.warning("engine step failed once (%s); its retry in %d parts succeeded", what, parts_ok)
        else:
            status = OOM_STATUS if verdict == "oom" else STEP_ERROR_STATUS
            for rid in ids:
                msg = (f"engine out of device memory ({what}); request rejected to free memory, retry later"
                       if verdict == "oom" else
                       f"engine step failed ({what}), not tied to one request; "
                       f"{self.consecutive_failures + 1} failing step(s) in a row")
                self._fail_in_engine(rid, msg, status)
        return outputs, verdict

    def _canary(self) -> tuple[bool, list]:
        """Step a one-token request alone (through the same hooks). -> (it ran, other outputs it carried)."""
        add = getattr(self.engine, "add_canary", None)
        if add is None:
            return False, []
        try:
            rid = add()
        except Exception:  # noqa: BLE001 - an engine that cannot even admit a canary is not healthy
            return False, []
        try:
            outs, ok = self._engine_step({rid}), True
        except Exception:  # noqa: BLE001 - the canary failed too: the engine is at fault
            outs, ok = [], False
        return ok, self.engine.drop_canary(rid, outs)

    def _fail_in_engine(self, rid: str, msg: str, status: int) -> None:
        self._error_status[rid] = status
        self._counted.add(rid)
        if not self.engine.fail_request(rid, msg):
            self._error_status.pop(rid, None)
            self._counted.discard(rid)

    def _step(self) -> list:
        try:
            outputs = self._engine_step()
        except Exception as exc:  # noqa: BLE001 - contained: isolate, fail, back off, maybe give up
            return self._on_failed_step(exc)
        self.consecutive_failures = 0
        return outputs

    def _on_failed_step(self, exc: Exception) -> list:
        self.failed_rounds += 1
        self.last_error = f"{type(exc).__name__}: {exc}"
        if self.failed_rounds <= 3 or self.failed_rounds % 100 == 0:
            log.error("engine.step() failed (round %d)", self.failed_rounds, exc_info=exc)
        if is_oom(exc):
            _empty_device_cache()
        outputs, verdict = self._isolate(exc)
        self.errors_by_verdict[verdict] = self.errors_by_verdict.get(verdict, 0) + 1
        if self._on_step_error is not None:
            self.loop.call_soon_threadsafe(self._on_step_error, verdict)
        outputs.extend(self.engine.take_pending())  # the failures just decided, delivered now
        if verdict in ("request", "transient"):
            self.consecutive_failures = 0
            return outputs
        if verdict == "oom":
            log.warning("engine out of device memory (%s): rejected the requests that did not fit even alone; "
                        "the worker keeps serving", self.last_error)
            _empty_device_cache()
            return outputs
        self.consecutive_failures += 1
        log.warning("engine step failed (%s), not tied to one request: its requests failed; %d/%d failing steps in "
                    "a row; backing off %.2fs", self.last_error, self.consecutive_failures, self.policy.max_consecutive,
                    step_backoff(self.consecutive_failures, self.policy))
        if self.consecutive_failures >= self.policy.max_consecutive:
            # this round's failures reach their clients first (with the step's own error), then the rest
            self.loop.call_soon_threadsafe(self._dispatch, outputs, self.engine.stats(), 0)
            outputs = []
            self._give_up(f"{self.consecutive_failures} consecutive engine steps failed, not tied to one request; "
                          f"last: {self.last_error}")
            return outputs
        time.sleep(step_backoff(self.consecutive_failures, self.policy))
        return outputs

    def _give_up(self, reason: str) -> None:
        self.fatal_reason = reason
        log.critical("worker unhealthy: %s; exiting with %s in %.1fs so the pair restarts", reason,
                     self.policy.exit_code, self.policy.exit_grace_s)
        if self._on_fatal is not None:
            self.loop.call_soon_threadsafe(self._on_fatal, reason)
        if self.policy.exit_code is not None:
            code = self.policy.exit_code

            def _exit() -> None:
                logging.shutdown()
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)

            timer = threading.Timer(self.policy.exit_grace_s, _exit)
            timer.daemon = True
            timer.start()

    def _run(self) -> None:
        engine = self.engine
        while True:
            if self.fatal_reason is not None:  # given up: answer commands with the reason, never step again
                if not self._run_command(self._commands.get()):
                    return
                continue
            if self.hold_steps:  # test hook: admit work, do not step yet
                try:
                    item = self._commands.get(timeout=0.02)
                except queue.Empty:
                    continue
                if not self._run_command(item):
                    return
                continue
            # idle: block until a command arrives; busy: take what is queued and step
            if not engine.has_work():
                if not self._run_command(self._commands.get()):
                    return
            while True:
                try:
                    item = self._commands.get_nowait()
                except queue.Empty:
                    break
                if not self._run_command(item):
                    return
            if not engine.has_work():
                self.loop.call_soon_threadsafe(self._dispatch, [], engine.stats(), 0)
                continue
            if self.hold_steps:
                continue
            outputs = self._step()
            self.steps += 1
            for out in outputs:
                if out.finish_reason == "prefill_done" and out.request_id in self._sinks:
                    self.ready_pages[out.request_id] = engine.pages(out.request_id)
            stats = engine.stats()
            self.loop.call_soon_threadsafe(self._dispatch, outputs, stats, int(stats.get("num_running", 0)))
            if self.step_delay_s > 0:
                time.sleep(self.step_delay_s)


def _empty_device_cache() -> None:
    try:
        import torch

        if torch.cuda.is_initialized():
            torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001 - best effort
        pass
