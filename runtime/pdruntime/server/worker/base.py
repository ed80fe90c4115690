"""What prefill and decode workers share: engine + runner thread, watchdog, metrics and the common
endpoints (/health, /metrics, /config, /debug/requests, /[get_]model_info, /[get_]server_info, /abort_request)."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from pdruntime.disagg.watchdog import Clock, OffsetClock, Watchdog
from pdruntime.engine import InvalidRequest
from pdruntime.engine.engine import CANARY_PREFIX
from pdruntime.env import RuntimeEnv
from pdruntime.server.edge import BodyGuard, instance_id, lifespan_app, log_unexpected, metrics_response
from pdruntime.server.metrics import Metrics
from pdruntime.server.openai.format import OpenAIShape
from pdruntime.server.openai.schemas import (MAX_BODY_BYTES, ApiError, WorkerChatRequest, WorkerCompletionRequest,
                                             generate_from_openai, parse_body, validate)
from pdruntime.server.worker.engine_commands import PageOwners
from pdruntime.util.aio import within
from pdruntime.server.worker.engine_runner import EngineRunner, FailurePolicy
from pdruntime.server.worker.faults import TestHooks
from pdruntime.server.worker.lease import pd_fields
from pdruntime.util.headers import REQUEST_ID_HEADER
from pdruntime.server.worker.prompts import PromptBuilder, client_of, request_id

log = logging.getLogger("pdruntime.worker")
PAGE_OWNERS_WAIT_S = 0.5  # seconds a scrape or /debug/requests waits for the engine thread's page snapshot


@dataclass(frozen=True)
class WorkerOptions:
    """How a worker serves (``pdrt serve`` flags): its address, model name, sampling defaults, tool-call parser."""

    host: str = "127.0.0.1"
    port: int = 8000
    clock: Clock | None = None  # None: monotonic (an advanceable OffsetClock with PDRT_TEST_HOOKS)
    served_model_name: str | None = None  # None: the model file's name
    generation_config: str = "auto"  # auto | none | a generation_config.json path
    tool_call_parser: str = "auto"


class WorkerBase:
    """Subclasses (prefill, decode) provide ``queues`` (a StageTable of their requests), ``_fail(req, reason,
    cause=...)`` (idempotent: fail one request and free what it holds), ``abort``, ``start_role``/``stop_role``."""

    role = "worker"

    def __init__(self, loaded: Any, engine: Any, env: RuntimeEnv, options: WorkerOptions | None = None) -> None:
        opts = options or WorkerOptions()
        served_model_name = opts.served_model_name
        self.loaded = loaded
        self.engine = engine
        self.env = env
        self.host, self.port = opts.host, opts.port
        self.clock = opts.clock or (OffsetClock() if env.test_hooks else Clock())
        self.metrics = Metrics(self.role)
        self.orphaned_pages = 0  # the last page-ownership snapshot's count (pdrt_kv_pages_orphaned)
        self.watchdog = Watchdog(self.role, self.clock, env.watchdog_tick_s,
                                 on_fired=lambda role, phase: self.metrics.watchdog_fired.labels(role, phase).inc())
        self.hooks = TestHooks()
        self.kv_token = env.resolve_kv_auth_token()
        self.max_model_len = int(engine.config.max_model_len or loaded.info.max_position_embeddings)
        from pdruntime.engine.defaults import resolve as resolve_defaults

        self.generation_defaults = resolve_defaults(opts.generation_config, getattr(loaded.info, "path", None),
                                                    served_model_name or loaded.info.name)
        self.prompts = PromptBuilder(loaded.tokenizer, self.max_model_len, getattr(loaded.info, "vocab_size", None),
                                     defaults=self.generation_defaults, tool_parser=opts.tool_call_parser)
        self.runner: EngineRunner | None = None
        self.ready = False
        self.started_at = time.time()
        self.model_name = served_model_name or loaded.info.name
        self.instance_id = instance_id(env)  # in /health: supervisors check the server they reach is theirs

    # ---- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        policy = FailurePolicy(max_consecutive=self.env.engine_max_step_failures,
                               exit_grace_s=self.env.engine_failure_exit_grace_s)
        self.runner = EngineRunner(self.engine, asyncio.get_running_loop(), on_step=self._on_step, policy=policy,
                                   on_request_error=self._on_engine_error, on_fatal=self._on_engine_fatal,
                                   on_step_error=lambda v: self.metrics.engine_step_errors.labels(self.role, v).inc())
        self.metrics.engine_healthy.labels(self.role).set(1)
        self.runner.start()
        self.metrics.update_pool(self.runner.last_stats)
        self.watchdog.start()
        await self.start_role()
        self.ready = True
        log.info("%s worker ready on %s:%d (model %s)", self.role, self.host, self.port, self.model_name)

    async def stop(self) -> None:
        self.ready = False
        await self.stop_role()
        for _, req in self.queues.items():
            self._fail(req, "server shutting down", cause="shutdown", code="shutting_down")
        await self.watchdog.stop()
        if self.runner is not None:
            await asyncio.to_thread(self.runner.stop)

    async def start_role(self) -> None: ...

    async def stop_role(self) -> None: ...

    def _on_engine_error(self, rid: str, message: str, status: int, code: str | None = None) -> None:
        """The engine failed one request (alone, or with its whole step): the client gets ``status`` and ``code``
        (the request's own cause, e.g. ``unsatisfiable_schema``; None: ``engine_error``)."""
        req = self.queues.get(rid)
        if req is not None:
            self._fail(req, message, cause="engine_error", status=status, code=code or "engine_error")

    def _on_engine_fatal(self, reason: str) -> None:
        """Too many failing steps: /health turns 503 and every live request fails now (the process exits soon)."""
        self.metrics.engine_healthy.labels(self.role).set(0)
        for _, req in list(self.queues.items()):
            self._fail(req, f"worker unhealthy: {reason}", cause="engine_error", status=503, code="engine_unhealthy")

    def _on_step(self, stats: dict, batch: int) -> None:
        self.metrics.running_batch.labels(self.role).set(stats.get("num_running", 0))
        if batch > 0:
            self.metrics.batch_size.labels(self.role).observe(batch)
        self.metrics.update_pool(stats)

    # ---- views -----------------------------------------------------------------------------
    def debug_rows(self) -> list[dict]:
        """One row per live request: id, room, client, stage, transfer state, ages in seconds, tokens generated
        so far and ``idle_s`` (seconds since its last progress: what a stall detector reads)."""
        now = self.clock.now()
        rows = []
        for stage, r in self.queues.items():
            tokens, progressed_at = self.progress(r)
            rows.append({"id": r.rid, "room": r.room, "client": r.client, "stage": stage,
                         "state": r.status.state.label, "age_s": round(now - r.created_at, 3),
                         "in_state_s": round(now - r.status.since(), 3), "tokens": tokens,
                         "idle_s": round(now - progressed_at, 3), "prompt_tokens": len(r.prompt_ids),
                         **self.debug_extra(r)})
        return rows

    def progress(self, req: Any) -> tuple[int, float]:
        """(tokens generated so far, watchdog-clock time of its last progress): arrival or a transfer-state change
        (every stage change comes with one); decode adds its last generated token."""
        return 0, max(req.created_at, req.status.since())

    def oldest_by_stage(self) -> dict[str, float]:
        """Age in seconds of the oldest live request per stage (stages with none are absent)."""
        now = self.clock.now()
        out: dict[str, float] = {}
        for stage, r in self.queues.items():
            out[stage] = max(out.get(stage, 0.0), now - r.created_at)
        return out

    def debug_extra(self, req: Any) -> dict:
        return {}

    def owner_of(self, engine_id: str) -> str:
        """The worker request an engine sequence belongs to (decode forks map to their request)."""
        return engine_id

    async def page_ownership(self) -> tuple[dict[str, int], int]:
        """({live request id: pages its sequences hold}, pages held by no live request). A sequence whose worker
        request is gone counts as orphaned, as do pages no sequence holds; the engine's own failure-isolation
        canaries are owned by the engine."""
        if self.runner is None or not self.runner.alive():
            return {}, 0
        try:  # a view must never wait on a busy or wedged engine thread: the last snapshot stands then
            owners, unheld = await within(self.runner.call(PageOwners()), PAGE_OWNERS_WAIT_S)
        except Exception:  # noqa: BLE001 - timeout, or the engine gave up (EngineUnhealthy): no new snapshot
            return {}, self.orphaned_pages
        held: dict[str, int] = {}
        orphaned = unheld
        for eid, n in owners.items():
            rid = self.owner_of(eid)
            if rid in self.queues or eid.startswith(CANARY_PREFIX):
                held[rid] = held.get(rid, 0) + n
            else:
                orphaned += n
        self.orphaned_pages = orphaned
        self.metrics.pages_orphaned.labels(self.role).set(orphaned)
        return held, orphaned

    def queue_counts(self) -> dict[str, int]:
        return self.queues.counts()

    def pool(self) -> dict:
        stats = self.runner.last_stats if self.runner else {}
        return {"free": stats.get("blocks_free"), "total": stats.get("blocks_total")}

    def config(self) -> dict:
        return {"role": self.role, "engine": _jsonable(self.engine.describe()), "env": self.env.as_config(),
                "engine_health": self.runner.health() if self.runner is not None else None,
                "server": {"host": self.host, "port": self.port, "pid": os.getpid()},
                "kv_auth": "enabled" if self.kv_token else "disabled", "sampling_defaults": self.generation_defaults.as_dict(),
                "tool_call_parser": self.prompts.tool_parser,
                # not "model": /server_info carries this dict, and SGLang's router reads "model" there as a
                # string (an object makes it drop the worker's metadata: tests/pd/test_sglang_router.py)
                "model_file": {"path": self.loaded.info.path, "sha256": self.loaded.info.sha256}, **self.role_config()}

    def role_config(self) -> dict:
        return {}

    def _fail_unexpected(self, req: Any, exc: Exception, what: str) -> None:
        """An exception no specific handler claimed: the engine's InvalidRequest is the client's 400, else a 500."""
        if isinstance(exc, InvalidRequest):
            self._fail(req, f"engine rejected the request: {exc}", status=400, code=exc.code)
        else:
            log_unexpected(f"{what} of rid={req.rid}", exc)  # type and frames only: messages can quote the prompt
            self._fail(req, f"internal error ({type(exc).__name__}) in {what}", status=500, code="internal_error")

    async def abort(self, rid: str, cause: str) -> bool:
        """Fail a live request (HTTP 499 to its handler) and free what it holds; False if unknown."""
        req = self.queues.get(rid)
        if req is None:
            return False
        self._fail(req, f"aborted ({cause})", cause=cause, status=499, code="aborted")
        return True

    # ---- app -------------------------------------------------------------------------------
    def build_app(self) -> FastAPI:
        app = lifespan_app(f"pdrt {self.role} worker", self.start, self.stop)
        app.add_middleware(BodyGuard, max_bytes=MAX_BODY_BYTES)
        info = self.loaded.info

        @app.get("/health")
        async def health() -> JSONResponse:
            if self.runner is not None and self.runner.fatal_reason is not None:
                return JSONResponse({"status": "unhealthy", "reason": self.runner.fatal_reason, "role": self.role,
                                     "instance": self.instance_id}, status_code=503)
            ok = self.ready and self.runner is not None and self.runner.alive()
            return JSONResponse({"status": "ok" if ok else "starting", "role": self.role, "instance": self.instance_id},
                                status_code=200 if ok else 503)

        @app.get("/metrics")
        async def metrics():
            await self.page_ownership()
            counts = self.queue_counts()
            gauge = self.metrics.prefill_queue if self.role == "prefill" else self.metrics.decode_queue
            for q, n in counts.items():
                gauge.labels(q).set(n)
            self.metrics.live.labels(self.role).set(sum(counts.values()))
            self.metrics.set_oldest_age(self.oldest_by_stage())
            return metrics_response(self.metrics.render())

        @app.get("/config")
        async def config():
            return self.config()

        @app.get("/debug/requests")
        async def debug_requests():
            held, orphaned = await self.page_ownership()
            rows = self.debug_rows()
            for row in rows:
                row["pages"] = held.get(row["id"], 0)
            return {"role": self.role, "url": f"http://{self.host}:{self.port}", "live": len(rows), "requests": rows,
                    "queues": self.queue_counts(), "pool": {**self.pool(), "orphaned": orphaned},
                    "watchdog_ticks": self.watchdog.ticks,
                    "armed": [{"key": d.key, "phase": d.phase, "age_s": round(self.clock.now() - d.started_at, 3),
                               "timeout_s": d.timeout_s} for d in self.watchdog.armed()]}

        @app.get("/model_info")  # SGLang's current name; routers fall back to /get_model_info
        @app.get("/get_model_info")
        async def get_model_info():
            return {"model_path": info.path, "model_name": self.model_name, "tokenizer_path": info.path,
                    "is_generation": True, "sha256": info.sha256, "max_model_len": self.max_model_len,
                    "sampling_defaults": self.generation_defaults.as_dict(), "tool_call_parser": self.prompts.tool_parser}

        @app.get("/server_info")  # SGLang's current name; routers fall back to /get_server_info
        @app.get("/get_server_info")
        async def get_server_info():
            return {"version": "pdrt-0.1", "disaggregation_mode": self.role, "model_path": info.path,
                    "max_total_num_tokens": self.engine.pool.num_total * self.engine.config.block_size,
                    "max_model_len": self.max_model_len, **self.config()}

        @app.post("/abort_request")
        async def abort_request(request: Request):
            body = parse_body(await request.body())
            rid = body.get("rid")
            if not isinstance(rid, str):
                raise ApiError(400, "rid: a request id string is required", param="rid")
            return {"rid": rid, "aborted": await self.abort(rid, "abort_request")}

        if self.env.test_hooks:
            @app.post("/debug/test")
            async def test_hooks(request: Request):
                """Test-only (PDRT_TEST_HOOKS=1): advance the watchdog clock, slow steps, stall transfers."""
                body = parse_body(await request.body())
                if "advance_clock_s" in body:
                    self.clock.advance(float(body["advance_clock_s"]))
                if "step_delay_s" in body and self.runner is not None:
                    self.runner.step_delay_s = float(body["step_delay_s"])
                for name in ("inject_step_errors", "inject_oom", "poison_seed", "hold_steps"):  # engine step faults
                    if name in body and self.runner is not None:
                        setattr(self.runner, name, body[name])
                for name in ("stall_transfers", "stall_prefill", "corrupt_kv_chunk"):
                    if name in body:
                        setattr(self.hooks, name, int(body[name]))
                return {"clock": self.clock.now(), "step_delay_s": self.runner.step_delay_s if self.runner else 0,
                        "stall_transfers": self.hooks.stall_transfers, "stall_prefill": self.hooks.stall_prefill}

        @app.post("/v1/chat/completions")
        async def v1_chat(request: Request):
            return await self.openai(request, chat=True)

        @app.post("/v1/completions")
        async def v1_completions(request: Request):
            return await self.openai(request, chat=False)

        @app.get("/v1/models")
        async def v1_models():
            return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": int(self.started_at),
                                                "owned_by": "pdstack", "root": info.path,
                                                "max_model_len": self.max_model_len,
                                                "sampling_defaults": self.generation_defaults.as_dict()}]}

        self.add_routes(app)
        return app

    # ---- OpenAI routes (as SGLang workers serve them; a PD router sends each to both workers) -----------
    async def openai(self, request: Request, chat: bool):
        """A worker's /v1 route: an OpenAI body as SGLang's router sends it (bootstrap fields, arrays of n for chat
        n > 1) or as vLLM's proxy does (kv_transfer_params, worker/lease.py), or a plain one."""
        oreq = validate(WorkerChatRequest if chat else WorkerCompletionRequest, parse_body(await request.body()))
        self._check_model(oreq.model)
        held = False
        if oreq.kv_transfer_params is not None:
            pd, held = pd_fields(oreq.kv_transfer_params, self.role, request.headers.get(REQUEST_ID_HEADER))
        else:
            pd = oreq.first_pd()
        greq = generate_from_openai(oreq, pd)
        if oreq.n > 1 and greq.bootstrap_room is None:
            raise ApiError(400, "n > 1 on a worker's /v1 route is supported for PD requests only; accepted: n = 1 here, "
                           "or n > 1 with bootstrap fields (a PD router's request: one prefill, n forked decode "
                           "sequences) or /generate with sampling_params.n", param="n", code="unsupported_parameter")
        parser = self.prompts.tool_parser if chat and oreq.tools and oreq.tool_choice != "none" else None
        shape = OpenAIShape(chat, ("chatcmpl-" if chat else "cmpl-") + request_id(greq), self.model_name, int(time.time()),
                            tool_parser=parser, echo=oreq.prompt_text() if not chat and oreq.echo else None)
        opts = oreq.stream_options
        usage = (bool(opts and opts.include_usage), bool(opts and opts.continuous_usage_stats))
        hints = self.leg_hints(request)
        if held:
            hints["held"] = True
        self.inject_faults(request, greq)
        return await self.run_generate(greq, client_of(request), shape, usage, **hints)

    def leg_hints(self, request: Request) -> dict:
        """run_generate's keywords from the router's hint headers (each role reads its own)."""
        return {}

    def inject_faults(self, request: Request, greq: Any) -> None:
        """Test-only fault knobs of a role (faults.py), for /generate and the /v1 routes alike; none by default."""

    def _check_model(self, model: str) -> None:
        path = str(self.loaded.info.path or "")
        base = os.path.basename(path.rstrip("/"))
        if model not in (self.model_name, path, base, os.path.splitext(base)[0]):
            raise ApiError(404, f"model {model!r} does not exist here; accepted: {self.model_name}", param="model",
                           code="model_not_found")

    async def run_generate(self, greq: Any, client: str, shape: Any = None, usage: tuple[bool, bool] = (False, False),
                           **hints: Any):
        """One request; ``usage``: (include_usage, continuous_usage_stats) of an OpenAI stream."""
        raise NotImplementedError

    def add_routes(self, app: FastAPI) -> None:
        raise NotImplementedError


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    return str(obj)
