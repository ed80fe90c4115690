"""Decode worker: admits against its own pool, pulls the KV from prefill, joins the batch, streams.

    POST /generate (bootstrap_*)  -> prealloc queue  (reserve pages; waits for freed pages if the pool is full)
    pages reserved                 -> transfer queue  [watchdog: decode_transfer, until the KV is verified]
    KV verified + ACK sent         -> running queue   (engine: add_prefilled; streams tokens)
    finished / failed / aborted    -> removed, pages freed by the engine

Without bootstrap fields the worker runs the request monolithically (prefill + decode here); the
benchmark uses that to compare PD against the same engine undisaggregated.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from pdruntime.disagg import transfer, wire
from pdruntime.disagg.decode_queues import DecodeQueues, DecodeRequest
from pdruntime.disagg.states import TransferState, TransferStatus
from pdruntime.disagg.wire import WireError
from pdruntime.server.common import (SSE_DONE, GuardedStream, client_of, finish_reason_json, read_generate,
                                     request_id, sse)
from pdruntime.server.faults import STALL_THIS_REQUEST, ConnectionStall, connection_of
from pdruntime.server.openai_format import OpenAIShape, logprob_entries
from pdruntime.server.schemas import ApiError, GenerateRequest, error_body
from pdruntime.server.worker_base import WorkerBase

log = logging.getLogger("pdruntime.decode")


class DecodeFailed(Exception):
    def __init__(self, reason: str, status: int = 502) -> None:
        super().__init__(reason)
        self.reason = reason
        self.status = status


class EarlyToken:
    """The first token, streamed as soon as decode holds the KV (see DecodeWorker._early_first_token)."""

    early = True
    finished = False
    finish_reason = None

    def __init__(self, token_id: int, text: str) -> None:
        self.new_token_ids = [token_id]
        self.text_delta = text


class DecodeWorker(WorkerBase):
    role = "decode"

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.queues = DecodeQueues()
        self.pages_freed = asyncio.Event()
        self.layout = None
        self.model_sha = self.loaded.info.sha256 or ""
        self.stall_fault = ConnectionStall(self.env.fault_decode_stall_after) if self.env.fault_decode_stall_after else None
        if self.stall_fault is not None:
            log.warning("TEST-ONLY FAULT KNOB ON: PDRT_FAULT_DECODE_STALL_AFTER=%d: every PD request after the %d-th on "
                        "one connection stalls in decode (never in production)", self.stall_fault.after,
                        self.stall_fault.after)

    async def start_role(self) -> None:
        tp = self.engine.tp_size  # one wire shard per tensor-parallel rank; every rank's cache has rank 0's shape
        self.layouts = [transfer.layout_of(self.engine.kv, r, tp) for r in range(tp)]
        self.layout = self.layouts[0]
        self.pages_freed = asyncio.Event()

    def role_config(self) -> dict:
        return {"watchdog": {"decode_transfer_timeout_s": self.env.decode_transfer_timeout_s,
                             "tick_s": self.env.watchdog_tick_s}}

    def progress(self, req: DecodeRequest) -> tuple[int, float]:
        at = super().progress(req)[1]
        return req.completion_tokens, max(at, req.last_token_at or at)

    def debug_extra(self, req: DecodeRequest) -> dict:
        return {"completion_tokens": req.completion_tokens, **(req.kv_stats.row() if req.kv_stats is not None else {})}

    # ---- failure and cleanup (idempotent) ----------------------------------------------------
    def _fail(self, req: DecodeRequest, reason: str, *, cause: str = "peer_failure", status: int = 502) -> None:
        if req.failure is not None or req.rid not in self.queues:
            return
        req.failure = reason
        if not req.status.state.terminal:
            req.status.fail(self.clock.now(), reason)
            self.metrics.transfers.labels(self.role, "failed").inc()
            self.metrics.transfer_failures.labels(self.role, cause).inc()
        self.watchdog.disarm(req.rid)
        if req.writer is not None:
            req.writer.close()
        if req.task is not None and req.task is not asyncio.current_task():
            req.task.cancel()
        def free_pages(rid: str = req.rid) -> None:
            if self.runner is not None:
                # always: a reserve() may be queued on the engine thread but not yet answered; the engine runs
                # commands in order, so this abort lands after it and frees those pages (unknown ids: no-op)
                self.runner.call(lambda e: e.abort(rid))
                self.runner.drop_sink(rid)
            self._pages_freed()

        self.queues.remove(req.rid)
        if req.writer is not None:  # a KV receive may still be writing into the pages: free them after it stops
            req.writer.after_io(free_pages)
        else:
            free_pages()
        if cause in ("client_disconnect", "abort_request", "watchdog"):
            self.metrics.aborts.labels(self.role, cause).inc()
        req.outputs.put_nowait(DecodeFailed(reason, status))
        log.warning("decode request failed: rid=%s room=%s reason=%s", req.rid, req.room, reason)

    def _pages_freed(self) -> None:
        self.pages_freed.set()
        self.pages_freed = asyncio.Event()

    # ---- transfer ------------------------------------------------------------------------------
    async def _reserve(self, req: DecodeRequest) -> list[int]:
        from pdruntime.engine import OutOfBlocks

        deadline = time.monotonic() + self.env.decode_transfer_timeout_s
        while True:
            event = self.pages_freed
            try:
                return await self.runner.call(lambda e, r=req: e.reserve(r.rid, len(r.prompt_ids)))
            except OutOfBlocks as exc:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise DecodeFailed(f"decode KV pool is full: {exc}", 503) from None
                try:
                    await asyncio.wait_for(event.wait(), min(left, 0.5))
                except asyncio.TimeoutError:
                    pass

    async def _pull(self, req: DecodeRequest) -> None:
        try:
            blocks = await self._reserve(req)
            req.reserved = True
            self.queues.move(req.rid, "transfer")
            t0 = self.clock.now()
            self.watchdog.arm(req.rid, "decode_transfer", self.env.decode_transfer_timeout_s,
                              lambda d, r=req: self._fail(r, f"decode transfer timeout: no verified KV within "
                                                          f"{self.env.decode_transfer_timeout_s}s", cause="watchdog", status=504),
                              ids=f"rid={req.rid} room={req.room}")
            expected = self.layouts  # one shard per TP rank this connection carries
            att = wire.Attach(req.room, req.rid, len(req.prompt_ids), wire.prompt_crc(req.prompt_ids),
                              tp_size=self.layout.tp_size, tp_ranks=tuple(lay.tp_rank for lay in expected))
            conn = req.writer = await transfer.open_attach(req.bootstrap_host, req.bootstrap_port, self.kv_token, att)
            req.kv_stats = conn.stats
            req.status.advance(TransferState.WAITING_FOR_INPUT, self.clock.now())
            header = await transfer.recv_header(conn)
            if self.hooks.take("stall_transfers"):
                # test hook: read the HEADER, then stop reading (a stuck transfer; the peer never gets its ACK)
                req.status.advance(TransferState.TRANSFERRING, self.clock.now())
                await asyncio.Event().wait()
            try:
                transfer.check_header(header, att, expected, self.model_sha)  # mismatch: both sides fail + free
                req.status.advance(TransferState.TRANSFERRING, self.clock.now())
                if self.engine.tp_size > 1:  # host staging per rank, then rank 0 scatters to its peers
                    if header.num_pages > len(blocks):
                        raise WireError("mismatch", f"prefill sends {header.num_pages} pages, decode reserved {len(blocks)}")
                    staged = self.engine.empty_pages(header.num_pages)
                    sinks = [transfer.ShardSink(kv, range(header.num_pages), lay) for kv, lay in zip(staged, expected)]
                else:
                    sinks = [transfer.ShardSink(self.engine.kv, blocks, self.layout)]
                stats = await transfer.recv_kv(conn, header, sinks)
                if self.engine.tp_size > 1:
                    await self.runner.call(lambda e, b=blocks[:header.num_pages], s=staged: e.scatter_pages(b, s))
            except WireError as exc:
                if exc.reason not in ("closed", "timeout"):
                    await transfer.send_error(conn, exc.reason, exc.message)  # prefill fails with the same reason
                raise
            conn.close()
            req.writer = None
            nbytes = stats.bytes
            self.watchdog.disarm(req.rid, "decode_transfer")
            req.status.advance(TransferState.SUCCESS, self.clock.now())
            req.bytes_received = nbytes
            self.metrics.transfers.labels(self.role, "success").inc()
            self.metrics.transfer_seconds.labels(self.role).observe(self.clock.now() - t0)
            self.metrics.transfer_bytes.labels(self.role).observe(nbytes)
            self.metrics.transfer_bytes_total.labels(self.role).inc(nbytes)
            self.metrics.transfer_wire_seconds.labels(self.role).observe(stats.seconds)
            if STALL_THIS_REQUEST.get():  # test-only fault knob: KV held, no token ever, no watchdog armed
                self.queues.move(req.rid, "running")
                await asyncio.Event().wait()  # until _fail (abort, client gone) cancels this task
            self.runner.set_sink(req.rid, lambda out, r=req: self._on_output(r, out))
            early = self._early_first_token(req, header.first_token_id)
            if early is not None:  # queued before the engine can report anything for this request
                req.outputs.put_nowait(early)
            await self.runner.call(lambda e, r=req, f=header.first_token_id: e.add_prefilled(r.rid, r.prompt_ids, f, r.params))
            req.in_engine = True
            self.queues.move(req.rid, "running")
            # the engine reports the first token (sampled by prefill) with its first decode step
            self.metrics.queue_time.labels(self.role).observe(self.clock.now() - req.created_at)
        except asyncio.CancelledError:
            raise
        except DecodeFailed as exc:
            self._fail(req, exc.reason, status=exc.status)
        except WireError as exc:
            status = _request_failed_status(exc.reason)
            if status is not None:  # prefill failed the request itself: its error, not the pair's
                self._fail(req, exc.message, cause="engine_error", status=status)
            else:
                self._fail(req, f"KV transfer failed: {exc}", status=502)
        except (asyncio.IncompleteReadError, ConnectionError, OSError, asyncio.TimeoutError) as exc:
            self._fail(req, f"prefill peer unreachable or lost during {req.status.state.label}: {type(exc).__name__} {exc}",
                       status=502)
        except Exception as exc:
            self._fail_unexpected(req, exc, "decode transfer")

    def _early_first_token(self, req: DecodeRequest, first: int) -> "EarlyToken | None":
        """The token prefill sampled, to stream now instead of with the engine's next step (which reports it
        together with the second token). Only where its text cannot change with what follows: no stop
        strings, not EOS, not the last token, a complete UTF-8 character."""
        p = req.params
        if p.stop or p.max_tokens <= 1 or (first in self.loaded.tokenizer.eos_token_ids and not p.ignore_eos) \
                or p.logprobs is not None or p.grammar is not None or first in p.stop_token_ids:
            return None
        text = self.loaded.tokenizer.decode([first])
        if "\ufffd" in text:
            return None
        return EarlyToken(first, text)

    async def _monolithic(self, req: DecodeRequest) -> None:
        try:
            self.runner.set_sink(req.rid, lambda out, r=req: self._on_output(r, out))
            req.in_engine = True
            self.queues.move(req.rid, "running")
            await self.runner.call(lambda e, r=req: e.add_request(r.rid, r.prompt_ids, r.params))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._fail_unexpected(req, exc, "monolithic admission")

    def _on_output(self, req: DecodeRequest, out: Any) -> None:
        req.outputs.put_nowait(out)
        if out.finished:
            self.runner.drop_sink(req.rid)
            self.queues.remove(req.rid)
            self._pages_freed()

    # ---- HTTP ----------------------------------------------------------------------------------
    async def generate(self, request: Request):
        greq = await read_generate(request)
        if self.stall_fault is not None and greq.bootstrap_room is not None:
            STALL_THIS_REQUEST.set(self.stall_fault.admit(connection_of(request.headers, request.scope)))
        return await self.run_generate(greq, client_of(request))

    async def run_generate(self, greq: GenerateRequest, client: str, shape: OpenAIShape | None = None,
                           include_usage: bool = False):
        """One request, SGLang-shaped events (``shape`` None: /generate) or OpenAI-shaped (the /v1 routes)."""
        prompt = self.prompts.prompt_ids(greq)
        params = self.prompts.sampling(greq, len(prompt))
        pd = greq.bootstrap_room is not None
        if pd and (not greq.bootstrap_host or not greq.bootstrap_port):
            raise ApiError(400, "bootstrap_room needs bootstrap_host and bootstrap_port", param="bootstrap_host")
        now = self.clock.now()
        req = DecodeRequest(rid=request_id(greq), room=int(greq.bootstrap_room or 0), client=client,
                            prompt_ids=prompt, params=params, bootstrap_host=greq.bootstrap_host or "",
                            bootstrap_port=int(greq.bootstrap_port or 0), created_at=now, status=TransferStatus(now))
        try:
            self.queues.put(req.rid, req, "prealloc")
        except KeyError as exc:
            raise ApiError(409, str(exc), param="rid", code="duplicate_request") from None
        req.task = asyncio.get_running_loop().create_task(self._pull(req) if pd else self._monolithic(req))
        t_arrival = time.monotonic()
        client_label = self.metrics.clients.label(req.client)

        async def events() -> AsyncIterator[dict]:
            text = ""
            last = None
            early: EarlyToken | None = None
            while True:
                item = await req.outputs.get()
                if isinstance(item, DecodeFailed):
                    raise item
                if early is not None:  # the engine's first report repeats the early token: drop it once
                    item = _without_early(item, early)
                    early = None
                elif isinstance(item, EarlyToken):
                    early = item
                ts = time.monotonic()
                if item.new_token_ids:
                    if last is None:
                        self.metrics.ttft.labels(self.role).observe(ts - t_arrival)
                    else:
                        self.metrics.itl.labels(self.role).observe(ts - last)
                    last = ts
                    req.completion_tokens += len(item.new_token_ids)
                    req.last_token_at = self.clock.now()
                    self.metrics.tokens.labels(self.role, client_label).inc(len(item.new_token_ids))
                text += item.text_delta
                reason = item.finish_reason if item.finished else None
                ev = {"text": text, "delta": item.text_delta, "token_ids": list(item.new_token_ids),
                      "meta_info": {"id": req.rid, "prompt_tokens": len(prompt),
                                    "completion_tokens": req.completion_tokens,
                                    "finish_reason": finish_reason_json(reason)}}
                if getattr(item, "prompt_logprobs", None) is not None:  # monolithic runs (PD: prefill reports them)
                    ev["prompt_logprobs"] = [None] + logprob_entries(self.loaded.tokenizer, prompt[1:],
                                                                     item.prompt_logprobs)
                if params.logprobs is not None:  # PD: the first token's entry is None here (prefill reports it)
                    ev["logprobs"] = logprob_entries(self.loaded.tokenizer, list(item.new_token_ids),
                                                     getattr(item, "logprobs", None))
                yield ev
                if item.finished:
                    return

        async def on_close(completed: bool) -> None:
            outcome = "ok" if completed else ("failed" if req.failure else "aborted")
            if not completed and req.failure is None:
                self._fail(req, "client disconnected", cause="client_disconnect", status=499)
            self.metrics.requests.labels(self.role, client_label, outcome).inc()
            self.metrics.e2e.labels(self.role).observe(time.monotonic() - t_arrival)

        if greq.stream:
            async def body() -> AsyncIterator[bytes]:
                first = True
                state = shape.stream_state() if shape is not None else None
                try:
                    async for ev in events():
                        if shape is None:
                            yield sse(ev)
                        else:
                            for c in shape.stream_chunks(ev, first=first, include_usage=include_usage, state=state):
                                yield sse(c)
                        first = False
                except DecodeFailed as exc:
                    err = error_body(exc.status, exc.reason, type="server_error", code="decode_failed")
                    err["error"]["status"] = exc.status  # the HTTP status this would have had (200 was already sent)
                    yield sse(err)
                    return
                yield SSE_DONE
            return GuardedStream(body(), on_close)

        completed = False
        try:
            final = None
            lps: list = []
            async for ev in events():
                final = ev
                lps += ev.get("logprobs") or []
            completed = True
            if shape is None:
                return JSONResponse(final)
            return JSONResponse(shape.final(final["text"], final, logprobs=lps if params.logprobs is not None else None))
        except DecodeFailed as exc:
            return JSONResponse(error_body(exc.status, exc.reason, type="server_error", code="decode_failed"),
                                status_code=exc.status)
        finally:
            await on_close(completed)

    def add_routes(self, app: FastAPI) -> None:
        app.post("/generate")(self.generate)


def _request_failed_status(reason: str) -> int | None:
    """The 4xx of a KV-wire ERROR "request_failed:<status>" (prefill failed the request itself), else None."""
    kind, _, code = reason.partition(":")
    if kind != "request_failed":
        return None
    return int(code) if code.isdigit() and 400 <= int(code) < 500 and int(code) != 499 else 422


class _Trimmed:
    __slots__ = ("new_token_ids", "text_delta", "finished", "finish_reason")

    def __init__(self, ids: list[int], text: str, finished: bool, reason: Any) -> None:
        self.new_token_ids, self.text_delta, self.finished, self.finish_reason = ids, text, finished, reason


def _without_early(out: Any, early: EarlyToken) -> Any:
    """``out`` minus the already-streamed first token (its id and its text prefix)."""
    ids = list(out.new_token_ids)
    if not ids or ids[0] != early.new_token_ids[0]:
        return out  # aborted or otherwise not the expected report: pass through unchanged
    text = out.text_delta
    if text.startswith(early.text_delta):
        text = text[len(early.text_delta):]
    else:
        log.warning("first-token text %r is not a prefix of the engine's %r; streaming both", early.text_delta, text)
    return _Trimmed(ids[1:], text, out.finished, out.finish_reason)
