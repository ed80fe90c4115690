"""One dedicated thread owns the (non-thread-safe) engine.

asyncio handlers submit commands (``call(fn)`` -> awaitable result of ``fn(engine)``) and register a
sink per request id; the thread drains commands, runs ``engine.step()`` while there is work, and hands
each step's outputs to the event loop in one ``call_soon_threadsafe``. When idle it blocks on the
command queue, so an idle engine costs nothing.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from typing import Any, Callable

log = logging.getLogger("pdruntime.engine_runner")

_STOP = object()


class EngineRunner:
    def __init__(self, engine: Any, loop: asyncio.AbstractEventLoop, *, on_step: Callable[[dict, int], None] | None = None) -> None:
        self.engine = engine
        self.loop = loop
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, Callable[[Any], None]] = {}  # rid -> callback(StepOutput), loop thread only
        self._on_step = on_step  # (engine stats, batch size) -> None, called in the loop thread
        self.step_delay_s = 0.0  # test hook: sleep after each step (slows decode so tests can observe it)
        self.steps = 0
        self.last_stats: dict = {}
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

    # ---- loop-thread API -----------------------------------------------------------------
    def call(self, fn: Callable[[Any], Any]) -> asyncio.Future:
        """Run ``fn(engine)`` on the engine thread; returns a loop future with its result."""
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
            sink = self._sinks.get(out.request_id)
            if sink is not None:
                sink(out)

    def _run_command(self, item: Any) -> bool:
        if item is _STOP:
            return False
        fn, fut = item
        try:
            result = fn(self.engine)
        except BaseException as exc:  # delivered to the awaiting handler
            self.loop.call_soon_threadsafe(self._resolve, fut, False, exc)
        else:
            self.loop.call_soon_threadsafe(self._resolve, fut, True, result)
        return True

    def _run(self) -> None:
        engine = self.engine
        while True:
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
            try:
                outputs = engine.step()
            except Exception:
                log.exception("engine.step() failed")
                outputs = []
            self.steps += 1
            for out in outputs:
                if out.finish_reason == "prefill_done" and out.request_id in self._sinks:
                    self.ready_pages[out.request_id] = engine.pages(out.request_id)
            stats = engine.stats()
            self.loop.call_soon_threadsafe(self._dispatch, outputs, stats, int(stats.get("num_running", 0)))
            if self.step_delay_s > 0:
                time.sleep(self.step_delay_s)
