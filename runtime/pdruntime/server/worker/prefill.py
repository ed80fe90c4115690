"""Prefill worker: registers rooms, waits for its decode peer, prefills, serves the KV, frees on receipt.

Request path (one HTTP handler + one bootstrap connection per request)::

    POST /generate (bootstrap_room)  -> bootstrap queue   [watchdog: bootstrap, until decode attaches]
    decode attaches on --bootstrap-port -> waiting queue  (engine: add_request(prefill_only=True))
    engine prefill_done (KV ready)   -> inflight queue    [watchdog: transfer, KV ready -> receipt]
    decode ACKs                      -> Success: pages released, HTTP handler answers 200
    any failure / watchdog / abort   -> Failed: pages freed, peer connection closed, HTTP answers 5xx

n > 1 (``sampling_params.n``) changes nothing here: the prompt is prefilled and sent once, and the first token
sampled here (with the request's seed) and its logprobs are choice 0's; the decode worker forks the other choices
off the transferred pages and samples their first tokens itself (see worker/decode.py).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from pdruntime.disagg import transfer, wire
from pdruntime.disagg.prefill_queues import PrefillQueues, PrefillRequest
from pdruntime.disagg.prefill_rate import PrefillRate, verdict
from pdruntime.disagg.states import TransferState, TransferStatus
from pdruntime.disagg.wire import WireError
from pdruntime.server.openai.events import TokenEvent
from pdruntime.server.openai.format import OpenAIShape, logprob_entries, prompt_logprob_entries
from pdruntime.server.openai.schemas import ApiError, GenerateRequest, error_body
from pdruntime.server.worker.base import WorkerBase
from pdruntime.server.worker.engine_commands import Abort, AddRequest, GatherPages, Pages, Release, RequestGone
from pdruntime.server.worker.lease import KV_LEASE_S, advertised_host, answer_params
from pdruntime.server.worker.prompts import client_of, read_generate, request_id
from pdruntime.util.headers import DEADLINE_HEADER
from pdruntime.util.periodic import PeriodicTask

log = logging.getLogger("pdruntime.prefill")

REJECT_LOG_INTERVAL_S = 10.0  # seconds between WARNING lines about rejected KV pulls (the rest are counted)
PROGRESS_INTERVAL_S = 1.0  # seconds between PROGRESS reports to a waiting decode (its stall limit is far longer)
# KV-wire ERROR reason "request_failed:<status>:<code>": prefill failed the request itself (a 4xx), not the pair
REQUEST_FAILED = "request_failed"


def _seconds_left(raw: str | None) -> float | None:
    """The router's X-PDStack-Deadline-S; None when absent or unreadable (then nothing is refused for time)."""
    try:
        v = float(raw) if raw is not None else None
    except ValueError:
        return None
    return v if v is not None and v >= 0 else None


class TransferFailed(Exception):
    """A prefill request failed: ``status`` (HTTP) and ``code``, the cause's name (``transfer_failed`` for the KV
    transfer and its watchdogs; the engine's or the request's own otherwise, e.g. ``unsatisfiable_schema``)."""

    def __init__(self, reason: str, status: int = 503, code: str = "transfer_failed") -> None:
        super().__init__(reason)
        self.reason = reason
        self.status = status
        self.code = code


class PrefillWorker(WorkerBase):
    role = "prefill"

    def __init__(self, *a: Any, bootstrap_host: str = "0.0.0.0", bootstrap_port: int = 8998,
                 kv_lease_s: float = KV_LEASE_S) -> None:
        super().__init__(*a)
        self.bootstrap_host = bootstrap_host
        self.bootstrap_port = bootstrap_port
        self.kv_lease_s = kv_lease_s  # seconds a held (vLLM-protocol) KV waits for its decode
        self.queues = PrefillQueues()
        self.rate = PrefillRate()  # prompt tokens/s computed, measured under backlog: admission by deadline
        self._server: transfer.BootstrapServer | None = None
        self.layout: wire.KVLayout | None = None
        self.reject_log = transfer.LogLimiter(REJECT_LOG_INTERVAL_S)
        self.model_sha = self.loaded.info.sha256 or ""

    async def start_role(self) -> None:
        tp = self.engine.tp_size  # one wire shard per tensor-parallel rank; every rank's cache has rank 0's shape
        self.layouts = [transfer.layout_of(self.engine.kv, r, tp) for r in range(tp)]
        self.layout = self.layouts[0]
        self.cache_namespace = self.engine.kv_namespace  # decode's held KV is this prefill's only if theirs agrees
        self._server = await transfer.BootstrapServer.start(self.bootstrap_host, self.bootstrap_port, self._on_connection)
        self.bootstrap_port = self._server.port
        self._progress = PeriodicTask(self._report_progress, PROGRESS_INTERVAL_S, name="prefill-progress")
        self._progress.start()
        if not self.kv_token:
            log.warning("KV-transfer auth is disabled (no PDRT_KV_AUTH_TOKEN / PDRT_KV_AUTH_TOKEN_FILE)")

    async def stop_role(self) -> None:
        if self._server is not None:
            self._server.close()
        if getattr(self, "_progress", None) is not None:
            await self._progress.stop()

    def _report_progress(self) -> None:
        """Every attached request still before its KV is ready tells its decode how far prefill got (prompt
        tokens computed, engine steps): decode's stall watchdog fails a prefill that stops advancing, never
        a long one that advances. A frozen process sends nothing, which is the point."""
        progress = self.runner.last_stats.get("prefill_progress", {}) if self.runner is not None else {}
        steps = self.runner.steps if self.runner is not None else 0
        now = self.clock.now()
        for stage, req in self.queues.items():
            done = progress.get(req.rid, 0)
            if done > req.computed_tokens:  # this worker's own rows show it too (the operator's stall sweep)
                req.computed_tokens, req.computed_at = done, now
            conn = req.writer
            if stage != "waiting" or conn is None or conn.closed or req.kv_ready is None or req.kv_ready.done():
                continue
            if req.progress_send is not None and not req.progress_send.done():
                continue  # the previous report is still being written
            req.progress_send = asyncio.get_running_loop().create_task(
                _quietly(transfer.send_progress(conn, done, steps)))
        if self.runner is not None:
            self.rate.observe(now, int(self.runner.last_stats.get("num_prefill_tokens", 0)), sum(self.backlog()))

    def backlog(self) -> list[int]:
        """Prompt tokens each request before its KV is ready still has to compute (cache hits counted in: high)."""
        return [max(0, len(r.prompt_ids) - r.computed_tokens) for stage, r in self.queues.items()
                if stage in ("bootstrap", "waiting")]

    def progress(self, req: PrefillRequest) -> tuple[int, float]:
        """A long prompt whose chunks advance is progressing: its last advance counts as much as a stage change."""
        at = super().progress(req)[1]
        return 0, max(at, req.computed_at or at)

    def role_config(self) -> dict:
        return {"bootstrap": {"host": self.bootstrap_host, "port": self.bootstrap_port},
                "kv_lease_s": self.kv_lease_s,
                "watchdog": {"bootstrap_timeout_s": self.env.bootstrap_timeout_s,
                             "transfer_timeout_s": self.env.transfer_timeout_s, "tick_s": self.env.watchdog_tick_s}}

    def debug_extra(self, req: PrefillRequest) -> dict:
        return {"cached_tokens": req.cached_tokens, "kv_skipped_tokens": req.skipped_tokens,
                **(req.kv_stats.row() if req.kv_stats is not None else {})}

    # ---- failure and cleanup (idempotent) ----------------------------------------------------
    def _fail(self, req: PrefillRequest, reason: str, *, cause: str = "peer_failure", status: int = 503,
              code: str = "transfer_failed") -> None:
        if not req.status.fail(self.clock.now(), reason):
            return
        self.watchdog.disarm(req.rid)
        if req.writer is not None:
            if 400 <= status < 500 and status != 499:
                # a request error (e.g. the engine failed it alone): tell decode why, so its leg fails as this
                # request's error and not as a lost peer (which a router counts against the pair)
                asyncio.get_running_loop().create_task(
                    transfer.send_error(req.writer, f"{REQUEST_FAILED}:{status}:{code}", reason))
            else:
                req.writer.close()
        if req.in_engine and self.runner is not None:
            self.runner.call(Abort((req.rid,)))  # frees prefill_done / running / waiting pages
            self.runner.drop_sink(req.rid)
        if req.kv_ready is not None and not req.kv_ready.done():
            req.kv_ready.set_exception(TransferFailed(reason))
            req.kv_ready.exception()  # mark retrieved
        self.queues.finish(req)
        self.metrics.transfers.labels(self.role, "failed").inc()
        self.metrics.transfer_failures.labels(self.role, cause).inc()
        if cause in ("client_disconnect", "abort_request", "watchdog"):
            self.metrics.aborts.labels(self.role, cause).inc()
        if not req.done.done():
            req.done.set_exception(TransferFailed(reason, status, code))
        log.warning("prefill request failed: rid=%s room=%s reason=%s", req.rid, req.room, reason)

    def _on_watchdog(self, req: PrefillRequest, phase: str) -> None:
        if phase == "lease":
            self._fail(req, f"KV lease expired: no decode pulled the held KV within {self.kv_lease_s:g}s (--kv-lease-s)",
                       cause="watchdog", status=504)
        elif phase == "bootstrap":
            self._fail(req, f"bootstrap timeout: decode did not attach within {self.env.bootstrap_timeout_s}s",
                       cause="watchdog", status=504)
        else:
            self._fail(req, f"transfer timeout: decode did not confirm receipt within {self.env.transfer_timeout_s}s",
                       cause="watchdog", status=504)

    # ---- HTTP side ---------------------------------------------------------------------------
    async def generate(self, request: Request) -> JSONResponse:
        return await self.run_generate(await read_generate(request), client_of(request), **self.leg_hints(request))

    def leg_hints(self, request: Request) -> dict:
        return {"seconds_left": _seconds_left(request.headers.get(DEADLINE_HEADER)), "host": request.url.hostname}

    async def run_generate(self, greq: GenerateRequest, client: str, shape: OpenAIShape | None = None,
                           usage: tuple[bool, bool] = (False, False), *, seconds_left: float | None = None,
                           held: bool = False, host: str | None = None) -> JSONResponse:
        """Prefill one PD request; answers once decode has the KV (OpenAI-shaped with ``shape``: the /v1 routes,
        whose body SGLang's router sends to both legs; it answers the client from decode's). ``seconds_left``: of
        the request's deadline, as pdrt's router sends it; a request that cannot make it is refused now. ``held``:
        vLLM's protocol, answered once the KV is computed and held (:meth:`_hold`); ``host``: how the caller reached
        this worker (the KV address a held request names when the bootstrap port listens on every address)."""
        if greq.bootstrap_room is None:
            raise ApiError(400, "a prefill worker serves only PD requests; accepted: a body with bootstrap_room "
                           "(and bootstrap_host/bootstrap_port) as sent by a PD router", param="bootstrap_room")
        prompt = self.prompts.prompt_ids(greq)
        params = self.prompts.sampling(greq, len(prompt))
        refusal = verdict(self.rate.tokens_per_s, len(prompt), self.backlog(), seconds_left)
        if refusal is not None:
            self.metrics.refused.labels(self.role, refusal.code).inc()
            raise ApiError(refusal.status, refusal.message, code=refusal.code,
                           type="server_overloaded" if refusal.retry_after else "invalid_request_error",
                           headers={"Retry-After": str(refusal.retry_after)} if refusal.retry_after else None)
        loop = asyncio.get_running_loop()
        req = PrefillRequest(rid=request_id(greq), room=int(greq.bootstrap_room), client=client,
                             prompt_ids=prompt, params=params, created_at=self.clock.now(),
                             status=TransferStatus(self.clock.now()), done=loop.create_future())
        try:
            self.queues.register(req)
        except KeyError as exc:
            raise ApiError(409, str(exc), param="bootstrap_room", code="room_in_use") from None
        if held:
            return await self._hold(req, shape, host)
        self.watchdog.arm(req.rid, "bootstrap", self.env.bootstrap_timeout_s,
                          lambda d, r=req: self._on_watchdog(r, "bootstrap"), ids=f"rid={req.rid} room={req.room}")
        outcome = "ok"
        try:
            await req.done
        except TransferFailed as exc:
            outcome = "failed"
            return _failure(req, exc)
        except asyncio.CancelledError:  # the router (or client) went away
            outcome = "aborted"
            self._fail(req, "client disconnected", cause="client_disconnect", status=499, code="aborted")
            raise
        finally:
            self.metrics.requests.labels(self.role, self.metrics.clients.label(req.client), outcome).inc()
            self.metrics.e2e.labels(self.role).observe(self.clock.now() - req.created_at)
        result = self._answer(req)
        return JSONResponse(result if shape is None else shape.final(result["text"], TokenEvent.from_json(result)))

    def _answer(self, req: PrefillRequest) -> dict:
        """The SGLang-shaped answer of a prefilled request: its first token, counts and logprobs."""
        first, prompt, params = req.first_token_id, req.prompt_ids, req.params
        text = self.loaded.tokenizer.decode([first]) if first is not None else ""
        result = {"text": text, "meta_info": {"id": req.rid, "prompt_tokens": len(prompt), "completion_tokens": 1,
                                              "cached_tokens": req.cached_tokens, "kv_bytes": req.bytes_sent,
                                              "finish_reason": {"type": "prefill_done"}}}
        if params.logprobs is not None:  # the router puts these on decode's first token
            result["meta_info"]["first_token_id"] = first
            result["meta_info"]["output_token_logprobs"] = logprob_entries(self.loaded.tokenizer, [first],
                                                                           [req.first_logprobs])
        if params.prompt_logprobs is not None:  # echo: the prompt's, first token None (nothing predicts it)
            result["meta_info"]["input_token_logprobs"] = prompt_logprob_entries(
                self.loaded.tokenizer, prompt, getattr(req, "prompt_logprobs", None))
        return result

    async def _hold(self, req: PrefillRequest, shape: OpenAIShape | None, host: str | None) -> JSONResponse:
        """vLLM's remote-decode prefill (worker/lease.py): compute the prompt now, hold its KV under the lease
        (``kv_lease_s``: the watchdog frees it if no decode attaches) and answer with ``kv_transfer_params`` naming
        this worker's KV address and the held request; the decode the router sends next pulls it (:meth:`_serve`)."""
        req.done.add_done_callback(_retrieved)  # nobody awaits it: its outcome is the transfer's
        req.status.advance(TransferState.WAITING_FOR_INPUT, self.clock.now())
        self.queues.move(req.rid, "waiting")
        outcome = "failed"
        try:
            blocks, ntok, first = await self._compute(req)
            if req.status.state.terminal:
                raise TransferFailed("failed while prefilling")
            req.first_token_id, req.held_pages = first, (blocks, ntok)
            self.queues.move(req.rid, "inflight")
            self.watchdog.arm(req.rid, "lease", self.kv_lease_s, lambda d, r=req: self._on_watchdog(r, "lease"),
                              ids=f"rid={req.rid} room={req.room}")
            outcome = "ok"
        except (TransferFailed, RequestGone) as exc:
            return _failure(req, req.done.exception() if req.done.done() else exc)
        except asyncio.CancelledError:  # the router went away before the KV was held: nothing will pull it
            outcome = "aborted"
            self._fail(req, "client disconnected", cause="client_disconnect", status=499, code="aborted")
            raise
        except Exception as exc:
            self._fail_unexpected(req, exc, "held prefill")
            return _failure(req, req.done.exception())
        finally:
            self.metrics.requests.labels(self.role, self.metrics.clients.label(req.client), outcome).inc()
        result = self._answer(req)
        body = result if shape is None else shape.final(result["text"], TokenEvent.from_json(result))
        body["kv_transfer_params"] = answer_params(
            rid=req.rid, host=advertised_host(self.bootstrap_host, host), port=self.bootstrap_port,
            engine_id=self.instance_id, pages=blocks, tp_size=self.engine.tp_size)
        return JSONResponse(body)

    async def _compute(self, req: PrefillRequest) -> tuple[list[int], int, int]:
        """Prefill the prompt in the engine: -> (its pages, its tokens, the first token id) once the KV is ready.
        Raises TransferFailed (failed meanwhile) or RequestGone (failed before the engine took it)."""
        req.kv_ready = asyncio.get_running_loop().create_future()
        self.runner.set_sink(req.rid, lambda out, r=req: self._on_output(r, out))
        self.metrics.queue_time.labels(self.role).observe(self.clock.now() - req.created_at)
        req.in_engine = True
        await self.runner.call(AddRequest(req, prefill_only=True))
        first = await req.kv_ready
        pages = self.runner.ready_pages.pop(req.rid, None)
        if pages is None:
            if req.status.state.terminal:  # failed (aborted) since its KV became ready: the engine has let it go
                raise TransferFailed("failed while prefilling")
            pages = await self.runner.call(Pages(req.rid))  # queued before any Abort a later failure queues
        blocks, ntok = pages
        return blocks, ntok, first

    def add_routes(self, app: FastAPI) -> None:
        app.post("/generate")(self.generate)

    # ---- bootstrap (KV transfer) side ----------------------------------------------------------
    async def _reject(self, conn: transfer.KVConn, reason: str, message: str) -> None:
        """Refuse a KV pull: ERROR frame to the peer, counted by reason, at most one WARNING per interval.
        Messages name rooms and rids, never credentials."""
        self.metrics.transfer_rejected.labels(reason).inc()
        emit, suppressed = self.reject_log.allow(self.clock.now())
        if emit:
            log.warning("KV pull rejected (%s): %s%s", reason, message[:300],  # peer-controlled text: bounded
                        f" [{suppressed} more rejections suppressed in the last {REJECT_LOG_INTERVAL_S:.0f}s]"
                        if suppressed else "")
        await transfer.send_error(conn, reason, message)

    async def _on_connection(self, conn: transfer.KVConn) -> None:
        try:
            att = await transfer.accept_attach(conn, self.kv_token)
        except WireError as exc:
            await self._reject(conn, exc.reason if exc.reason == "auth" else "protocol", exc.message)
            return
        tp_msg = wire.tp_mismatch(self.layout.tp_size, att.tp_size) or wire.rank_mismatch(
            tuple(lay.tp_rank for lay in self.layouts), att.tp_ranks)  # rank 0 serves every rank's shard
        if tp_msg:  # refused at bootstrap, before any prefill work
            await self._reject(conn, "mismatch", f"room {att.room}: {tp_msg}")
            return
        # an authenticated decode may attach before the router's prefill request arrives (both legs go at once,
        # and a busy prefill reads its HTTP requests late): wait for the room as long as bootstrap may take
        req = await self.queues.wait_room(att.room, self.env.bootstrap_timeout_s)
        if req is None or req.rid != att.rid and att.rid:
            await self._reject(conn, "unknown_room", f"no live request for room {att.room} (rid {att.rid})")
            return
        waiting = req.status.state is TransferState.BOOTSTRAPPING or (
            req.held_pages is not None and req.status.state is TransferState.WAITING_FOR_INPUT)  # vLLM: KV held
        if req.writer is not None or not waiting:
            await self._reject(conn, "mismatch", f"room {att.room} already has a decode peer")
            return
        if att.num_tokens != len(req.prompt_ids) or att.prompt_crc != wire.prompt_crc(req.prompt_ids):
            await self._reject(conn, "mismatch", f"room {att.room}: decode tokenized {att.num_tokens} tokens, "
                               f"prefill {len(req.prompt_ids)} (or the token checksum differs)")
            self._fail(req, "decode peer's prompt does not match", status=502)
            return
        await self._serve(req, conn)

    async def _serve(self, req: PrefillRequest, conn: transfer.KVConn) -> None:
        req.writer = conn
        req.kv_stats = conn.stats
        try:
            if req.held_pages is not None:  # vLLM protocol: computed and held; the lease ends as decode attaches
                self.watchdog.disarm(req.rid, "lease")
                (blocks, ntok), first = req.held_pages, req.first_token_id
            else:
                self.watchdog.disarm(req.rid, "bootstrap")
                req.status.advance(TransferState.WAITING_FOR_INPUT, self.clock.now())
                self.queues.move(req.rid, "waiting")
                if self.hooks.take("stall_prefill"):
                    await asyncio.shield(req.done)  # test hook: hold before the engine until failed/aborted
                blocks, ntok, first = await self._compute(req)
            if req.status.state.terminal:
                return
            req.first_token_id = first
            req.status.advance(TransferState.TRANSFERRING, self.clock.now())
            self.queues.move(req.rid, "inflight")
            t0 = self.clock.now()
            self.watchdog.arm(req.rid, "transfer", self.env.transfer_timeout_s,
                              lambda d, r=req: self._on_watchdog(r, "transfer"), ids=f"rid={req.rid} room={req.room}")
            header = self._header(req, conn.attach, ntok, first)
            sent = blocks[header.skip_pages:header.num_pages]  # decode holds the pages before these
            if self.engine.tp_size > 1:  # rank 0 gathers every rank's pages (a collective, on the engine thread)
                shards = await self.runner.call(GatherPages(tuple(sent)))
                sources = [transfer.ShardSource(kv, range(len(sent)), lay) for kv, lay in zip(shards, self.layouts)]
            else:
                sources = [transfer.ShardSource(self.engine.kv, sent, self.layout)]
            stats = await transfer.send_kv(conn, header, sources, corrupt_first_chunk=self.hooks.take("corrupt_kv_chunk"))
            req.bytes_sent = stats.bytes
            if req.status.state.terminal:
                return
            # receipt confirmed: the transfer phase (and its watchdog) ends here, before any decoding
            self.watchdog.disarm(req.rid, "transfer")
            req.status.advance(TransferState.SUCCESS, self.clock.now())
            await self.runner.call(Release(req.rid))
            self.runner.drop_sink(req.rid)
            self.queues.finish(req)
            self.metrics.transfers.labels(self.role, "success").inc()
            self.metrics.transfer_seconds.labels(self.role).observe(self.clock.now() - t0)
            self.metrics.transfer_bytes.labels(self.role).observe(req.bytes_sent)
            self.metrics.transfer_bytes_total.labels(self.role).inc(req.bytes_sent)
            self.metrics.transfer_saved_bytes.labels(self.role).inc(header.saved_bytes)
            self.metrics.transfer_wire_seconds.labels(self.role).observe(stats.seconds)
            if not req.done.done():
                req.done.set_result(None)
            conn.close()
        except WireError as exc:
            self._fail(req, f"KV transfer failed: {exc}", status=502)
        except OSError as exc:
            self._fail(req, f"decode peer connection lost during {req.status.state.label}: {type(exc).__name__}", status=502)
        except TransferFailed:
            pass  # already failed (watchdog, abort, engine)
        except RequestGone:
            self.runner.drop_sink(req.rid)  # failed before the engine took it: nothing else to free
        except Exception as exc:
            self._fail_unexpected(req, exc, "prefill transfer")

    def _header(self, req: PrefillRequest, att: wire.Attach, ntok: int, first: int) -> wire.KVHeader:
        """The HEADER of a request whose KV is ready: the pages decode lacks (the delta), or all of them when the
        delta does not apply (counted by reason)."""
        skip, why = wire.delta_skip_pages(att, self.layout.page_size, self.cache_namespace)
        if why is not None:
            self.metrics.kv_delta_fallbacks.labels(self.role, why).inc()
            log.info("KV delta not used for rid=%s room=%s (%s): decode holds %d tokens; sending all %d", req.rid,
                     req.room, why, att.held_tokens, ntok)
        req.skipped_tokens = skip * self.layout.page_size
        header = transfer.make_header(req.room, req.rid, ntok, first, wire.prompt_crc(req.prompt_ids), self.model_sha,
                                      self.layouts, att.checksums)
        return replace(header, skip_pages=skip, cached_tokens=min(req.cached_tokens or 0, ntok))

    def _on_output(self, req: PrefillRequest, out: Any) -> None:
        if out.finish_reason == "prefill_done":
            req.cached_tokens = out.cached_tokens or 0
            if req.kv_ready is not None and not req.kv_ready.done():
                req.first_logprobs = (out.logprobs or [None])[0]  # the first token's logprobs: prefill's to report
                req.prompt_logprobs = out.prompt_logprobs
                req.kv_ready.set_result(out.new_token_ids[0])
        elif out.finished:
            self._fail(req, f"engine finished the prefill with {out.finish_reason!r}", code="engine_error")


async def _quietly(aw) -> None:
    """A best-effort send: a broken connection is the transfer's business, reported where it is awaited."""
    try:
        await aw
    except (WireError, OSError):
        pass


def _failure(req: PrefillRequest, exc: BaseException) -> JSONResponse:
    """A failed prefill's answer: its status and code (TransferFailed's; 503 for anything else)."""
    status, code = getattr(exc, "status", 503), getattr(exc, "code", "transfer_failed")
    kind = "invalid_request_error" if 400 <= status < 500 else "server_error"
    reason = getattr(exc, "reason", None) or str(exc)
    return JSONResponse(error_body(status, f"prefill of request {req.rid} failed: {reason}", type=kind, code=code),
                        status_code=status)


def _retrieved(fut: asyncio.Future) -> None:
    """A done-callback: mark a future's exception retrieved (its failure is reported elsewhere)."""
    if not fut.cancelled():
        fut.exception()
