"""Prefill worker: registers rooms, waits for its decode peer, prefills, serves the KV, frees on receipt.

Request path (one HTTP handler + one bootstrap connection per request)::

    POST /generate (bootstrap_room)  -> bootstrap queue   [watchdog: bootstrap, until decode attaches]
    decode attaches on --bootstrap-port -> waiting queue  (engine: add_request(prefill_only=True))
    engine prefill_done (KV ready)   -> inflight queue    [watchdog: transfer, KV ready -> receipt]
    decode ACKs                      -> Success: pages released, HTTP handler answers 200
    any failure / watchdog / abort   -> Failed: pages freed, peer connection closed, HTTP answers 5xx
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from pdruntime.disagg import transfer, wire
from pdruntime.disagg.prefill_queues import PrefillQueues, PrefillRequest
from pdruntime.disagg.states import TransferState, TransferStatus
from pdruntime.disagg.wire import KVHeader, WireError
from pdruntime.server.common import client_of, read_generate, request_id
from pdruntime.server.schemas import ApiError, error_body
from pdruntime.server.worker_base import WorkerBase

log = logging.getLogger("pdruntime.prefill")

# seconds an attach may wait for its room to be registered: routers send both legs at once, so decode
# can attach a moment before the prefill request arrives; longer than that is a wrong room
ATTACH_GRACE_S = 2.0
# KV-wire ERROR reason "request_failed:<status>": prefill failed the request itself (a 4xx), not the pair
REQUEST_FAILED = "request_failed"


class TransferFailed(Exception):
    def __init__(self, reason: str, status: int = 503) -> None:
        super().__init__(reason)
        self.reason = reason
        self.status = status


class PrefillWorker(WorkerBase):
    role = "prefill"

    def __init__(self, *a: Any, bootstrap_host: str = "0.0.0.0", bootstrap_port: int = 8998, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.bootstrap_host = bootstrap_host
        self.bootstrap_port = bootstrap_port
        self.queues = PrefillQueues()
        self._server: asyncio.AbstractServer | None = None
        self.layout = None
        self.model_sha = self.loaded.info.sha256 or ""

    async def start_role(self) -> None:
        self.layout = transfer.layout_of(self.engine.kv)
        self._server = await asyncio.start_server(self._on_connection, self.bootstrap_host, self.bootstrap_port)
        if self.bootstrap_port == 0:
            self.bootstrap_port = self._server.sockets[0].getsockname()[1]
        if not self.kv_token:
            log.warning("KV-transfer auth is disabled (no PDRT_KV_AUTH_TOKEN / PDRT_KV_AUTH_TOKEN_FILE)")

    async def stop_role(self) -> None:
        if self._server is not None:
            self._server.close()

    def role_config(self) -> dict:
        return {"bootstrap": {"host": self.bootstrap_host, "port": self.bootstrap_port},
                "watchdog": {"bootstrap_timeout_s": self.env.bootstrap_timeout_s,
                             "transfer_timeout_s": self.env.transfer_timeout_s, "tick_s": self.env.watchdog_tick_s}}

    # ---- failure and cleanup (idempotent) ----------------------------------------------------
    def _fail(self, req: PrefillRequest, reason: str, *, cause: str = "peer_failure", status: int = 503) -> None:
        if not req.status.fail(self.clock.now(), reason):
            return
        self.watchdog.disarm(req.rid)
        if req.writer is not None:
            if 400 <= status < 500 and status != 499:
                # a request error (e.g. the engine failed it alone): tell decode why, so its leg fails as this
                # request's error and not as a lost peer (which a router counts against the pair)
                asyncio.get_running_loop().create_task(transfer.send_error(req.writer, f"{REQUEST_FAILED}:{status}", reason))
            else:
                req.writer.close()
        if req.in_engine and self.runner is not None:
            self.runner.call(lambda e, rid=req.rid: e.abort(rid))  # frees prefill_done / running / waiting pages
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
            req.done.set_exception(TransferFailed(reason, status))
        log.warning("prefill request failed: rid=%s room=%s reason=%s", req.rid, req.room, reason)

    def _on_watchdog(self, req: PrefillRequest, phase: str) -> None:
        if phase == "bootstrap":
            self._fail(req, f"bootstrap timeout: decode did not attach within {self.env.bootstrap_timeout_s}s",
                       cause="watchdog", status=504)
        else:
            self._fail(req, f"transfer timeout: decode did not confirm receipt within {self.env.transfer_timeout_s}s",
                       cause="watchdog", status=504)

    # ---- HTTP side ---------------------------------------------------------------------------
    async def generate(self, request: Request) -> JSONResponse:
        greq = await read_generate(request)
        if greq.bootstrap_room is None:
            raise ApiError(400, "a prefill worker serves only PD requests; accepted: a body with bootstrap_room "
                           "(and bootstrap_host/bootstrap_port) as sent by a PD router", param="bootstrap_room")
        prompt = self.prompts.prompt_ids(greq)
        params = self.prompts.sampling(greq, len(prompt))
        loop = asyncio.get_running_loop()
        req = PrefillRequest(rid=request_id(greq), room=int(greq.bootstrap_room), client=client_of(request),
                             prompt_ids=prompt, params=params, created_at=self.clock.now(),
                             status=TransferStatus(self.clock.now()), done=loop.create_future())
        try:
            self.queues.register(req)
        except KeyError as exc:
            raise ApiError(409, str(exc), param="bootstrap_room", code="room_in_use") from None
        self.watchdog.arm(req.rid, "bootstrap", self.env.bootstrap_timeout_s,
                          lambda d, r=req: self._on_watchdog(r, "bootstrap"), ids=f"rid={req.rid} room={req.room}")
        outcome = "ok"
        try:
            await req.done
        except TransferFailed as exc:
            outcome = "failed"
            return JSONResponse(error_body(exc.status, f"prefill of request {req.rid} failed: {exc.reason}",
                                           type="server_error", code="transfer_failed"), status_code=exc.status)
        except asyncio.CancelledError:  # the router (or client) went away
            outcome = "aborted"
            self._fail(req, "client disconnected", cause="client_disconnect", status=499)
            raise
        finally:
            self.metrics.requests.labels(self.role, self.metrics.clients.label(req.client), outcome).inc()
            self.metrics.e2e.labels(self.role).observe(self.clock.now() - req.created_at)
        first = req.first_token_id
        return JSONResponse({"text": self.loaded.tokenizer.decode([first]) if first is not None else "",
                             "meta_info": {"id": req.rid, "prompt_tokens": len(prompt), "completion_tokens": 1,
                                           "kv_bytes": req.bytes_sent, "finish_reason": {"type": "prefill_done"}}})

    def add_routes(self, app: FastAPI) -> None:
        app.post("/generate")(self.generate)

    # ---- bootstrap (KV transfer) side ----------------------------------------------------------
    def _reject(self, reason: str) -> None:
        self.metrics.transfer_rejected.labels(reason).inc()

    async def _on_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            att = await transfer.accept_attach(reader, writer, self.kv_token)
        except WireError as exc:
            self._reject(exc.reason)
            log.warning("KV attach rejected: %s", exc)
            await transfer.send_error(writer, exc.reason, exc.message)
            return
        except (asyncio.IncompleteReadError, asyncio.TimeoutError, OSError) as exc:
            self._reject("protocol")
            log.warning("KV attach failed: %r", exc)
            writer.close()
            return
        req = await self.queues.wait_room(att.room, min(self.env.bootstrap_timeout_s, ATTACH_GRACE_S))
        if req is None or req.rid != att.rid and att.rid:
            self._reject("unknown_room")
            await transfer.send_error(writer, "unknown_room", f"no live request for room {att.room} (rid {att.rid})")
            return
        if req.writer is not None or req.status.state is not TransferState.BOOTSTRAPPING:
            self._reject("mismatch")
            await transfer.send_error(writer, "mismatch", f"room {att.room} already has a decode peer")
            return
        if att.num_tokens != len(req.prompt_ids) or att.prompt_crc != wire.prompt_crc(req.prompt_ids):
            self._reject("mismatch")
            await transfer.send_error(writer, "mismatch", f"room {att.room}: decode tokenized {att.num_tokens} tokens, "
                                      f"prefill {len(req.prompt_ids)} (or the token checksum differs)")
            self._fail(req, "decode peer's prompt does not match", status=502)
            return
        await self._serve(req, reader, writer)

    async def _serve(self, req: PrefillRequest, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        req.writer = writer
        self.watchdog.disarm(req.rid, "bootstrap")
        req.status.advance(TransferState.WAITING_FOR_INPUT, self.clock.now())
        self.queues.move(req.rid, "waiting")
        try:
            if self.hooks.take("stall_prefill"):
                await asyncio.shield(req.done)  # test hook: hold before the engine until failed/aborted
            req.kv_ready = loop.create_future()
            self.runner.set_sink(req.rid, lambda out, r=req: self._on_output(r, out))
            self.metrics.queue_time.labels(self.role).observe(self.clock.now() - req.created_at)
            req.in_engine = True
            await self.runner.call(lambda e, r=req: e.add_request(r.rid, r.prompt_ids, r.params, prefill_only=True))
            first = await req.kv_ready
            pages = self.runner.ready_pages.pop(req.rid, None)
            blocks, ntok = pages if pages is not None else await self.runner.call(lambda e, rid=req.rid: e.pages(rid))
            if req.status.state.terminal:
                return
            req.first_token_id = first
            req.status.advance(TransferState.TRANSFERRING, self.clock.now())
            self.queues.move(req.rid, "inflight")
            t0 = self.clock.now()
            self.watchdog.arm(req.rid, "transfer", self.env.transfer_timeout_s,
                              lambda d, r=req: self._on_watchdog(r, "transfer"), ids=f"rid={req.rid} room={req.room}")
            nl, hkv, hd, dt = self.layout
            header = KVHeader(room=req.room, rid=req.rid, num_tokens=ntok, first_token_id=int(first), num_layers=nl,
                              num_kv_heads=hkv, head_dim=hd, dtype=dt, chunk_tokens=wire.chunk_tokens_for(hkv * hd * wire.dtype_size(dt)),
                              prompt_crc=wire.prompt_crc(req.prompt_ids), model_sha256=self.model_sha)
            slots = transfer.flat_slots(blocks, self.engine.config.block_size, ntok)
            chunks = transfer.gather_chunks(self.engine.kv, slots, header.chunk_tokens)
            req.bytes_sent = await transfer.send_kv(reader, writer, header, chunks)
            if req.status.state.terminal:
                return
            # receipt confirmed: the transfer phase (and its watchdog) ends here, before any decoding
            self.watchdog.disarm(req.rid, "transfer")
            req.status.advance(TransferState.SUCCESS, self.clock.now())
            await self.runner.call(lambda e, rid=req.rid: e.release(rid))
            self.runner.drop_sink(req.rid)
            self.queues.finish(req)
            self.metrics.transfers.labels(self.role, "success").inc()
            self.metrics.transfer_seconds.labels(self.role).observe(self.clock.now() - t0)
            self.metrics.transfer_bytes.labels(self.role).observe(req.bytes_sent)
            if not req.done.done():
                req.done.set_result(None)
            writer.close()
        except WireError as exc:
            self._fail(req, f"KV transfer failed: {exc}", status=502)
        except (asyncio.IncompleteReadError, ConnectionError, OSError) as exc:
            self._fail(req, f"decode peer connection lost during {req.status.state.label}: {type(exc).__name__}", status=502)
        except TransferFailed:
            pass  # already failed (watchdog, abort, engine)
        except Exception as exc:
            self._fail_unexpected(req, exc, "prefill transfer")

    def _on_output(self, req: PrefillRequest, out: Any) -> None:
        if out.finish_reason == "prefill_done":
            if req.kv_ready is not None and not req.kv_ready.done():
                req.kv_ready.set_result(out.new_token_ids[0])
        elif out.finished:
            self._fail(req, f"engine finished the prefill with {out.finish_reason!r}")
