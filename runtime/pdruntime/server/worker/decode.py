"""Decode worker: admits against its own pool, pulls the KV from prefill, joins the batch, streams.

    POST /generate (bootstrap_*)  -> prealloc queue  (reserve pages; waits for freed pages if the pool is full)
    pages reserved                 -> transfer queue  [watchdog: decode_transfer, until the KV is verified]
    KV verified + ACK sent         -> running queue   (engine: add_prefilled; streams tokens)
    finished / failed / aborted    -> removed, pages freed by the engine

Without bootstrap fields the worker runs the request monolithically (prefill + decode here); the
benchmark uses that to compare PD against the same engine undisaggregated.

n > 1 (``sampling_params.n``): one request, one prefill, one KV transfer. Choice 0 is the request itself and
continues from the first token prefill sampled (seed s); choices 1..n-1 are engine forks (seeds s+1, ...) that
share the transferred prompt pages (reference-counted; the page holding the last prompt position is copied,
copy on write) and each recompute that one position here for the logits of their own first token, which they
sample with their own seed, grammar and logprobs. Their copied pages are reserved with the prompt's, before the
transfer. Events carry ``"index"``; the request ends when every choice has, and failing or aborting it ends all.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from fastapi import FastAPI, Request

from pdruntime.disagg import transfer, wire
from pdruntime.disagg.decode_queues import BUSY_GRACE_S, DecodeQueues, DecodeRequest
from pdruntime.disagg.states import TransferState, TransferStatus
from pdruntime.disagg.wire import WireError
from pdruntime.server.edge import GuardedStream
from pdruntime.server.openai.format import OpenAIShape
from pdruntime.server.openai.schemas import ApiError, GenerateRequest
from pdruntime.server.worker.base import WorkerBase
from pdruntime.server.worker.decode_stream import DecodeFailed, DecodeStream, EarlyToken
from pdruntime.server.worker.engine_commands import (Abort, AddRequest, AdmitPrefilled, RequestGone, Reserve,
                                                     ScatterPages, Unshare)
from pdruntime.server.worker.faults import STALL_THIS_REQUEST, ConnectionStall, connection_of
from pdruntime.server.worker.prompts import client_of, read_generate, request_id
from pdruntime.util.aio import within
from pdruntime.util.headers import BUSY_WAIT_HEADER, STREAM_INTERVAL_HEADER

log = logging.getLogger("pdruntime.decode")

BUSY_RETRY_MAX_S = 30  # the largest Retry-After decode suggests


class DecodeWorker(WorkerBase):
    role = "decode"

    def __init__(self, *a: Any) -> None:
        super().__init__(*a)
        self.queues = DecodeQueues()
        self.pages_freed = asyncio.Event()
        self.layout = None
        self.model_sha = self.loaded.info.sha256 or ""
        self.stall_fault = ConnectionStall(self.env.fault_decode_stall_after) if self.env.fault_decode_stall_after else None
        if self.stall_fault is not None:
            log.warning("TEST-ONLY FAULT KNOB ON: PDRT_FAULT_DECODE_STALL_AFTER=%d: every PD request after the %d-th on "
                        "one connection stalls in decode (never in production)", self.stall_fault.after,
                        self.stall_fault.after)
        self.fork_owner: dict[str, str] = {}  # engine id of a fork (choice >= 1) -> its request's rid
        self.mean_request_s = 2.0  # EWMA of finished requests' seconds from admission (the busy Retry-After)

    async def start_role(self) -> None:
        tp = self.engine.tp_size  # one wire shard per tensor-parallel rank; every rank's cache has rank 0's shape
        self.layouts = [transfer.layout_of(self.engine.kv, r, tp) for r in range(tp)]
        self.layout = self.layouts[0]
        self.pages_freed = asyncio.Event()
        # what keys the KV this decode holds: prefill leaves out the pages decode holds only when its own agrees
        self.cache_namespace = self.engine.kv_namespace if self.engine.prefix_cache is not None else ""

    def role_config(self) -> dict:
        return {"watchdog": {"decode_transfer_timeout_s": self.env.decode_transfer_timeout_s,
                             "prefill_stall_s": self.env.prefill_stall_s,
                             "tick_s": self.env.watchdog_tick_s}}

    def progress(self, req: DecodeRequest) -> tuple[int, float]:
        at = super().progress(req)[1]
        # a long prefill that advances is progress too (its PROGRESS reports): the operator's stall sweep reads this
        return req.completion_tokens, max(at, req.last_token_at or at, req.prefill_progress_at or at)

    def debug_extra(self, req: DecodeRequest) -> dict:
        forks = {"n": req.n, "choices_open": len(req.open_ids), "prompt_page_refs": req.page_refs} if req.forks else {}
        return {"completion_tokens": req.completion_tokens, "prefill_tokens": req.prefill_tokens, **forks,
                "cached_tokens": req.cached_tokens, "kv_held_tokens": req.held_tokens,
                **(req.kv_stats.row() if req.kv_stats is not None else {})}

    def _on_engine_error(self, rid: str, message: str, status: int, code: str | None = None) -> None:
        super()._on_engine_error(self.fork_owner.get(rid, rid), message, status, code)  # a fork fails its whole request

    def busy_retry_after(self) -> int:
        """Seconds a refused request should wait: half the recent mean request time (pages come free as requests
        finish), at least 1, at most BUSY_RETRY_MAX_S."""
        return max(1, min(BUSY_RETRY_MAX_S, round(self.mean_request_s / 2)))

    def owner_of(self, engine_id: str) -> str:
        return self.fork_owner.get(engine_id, engine_id)

    def _forget(self, req: DecodeRequest) -> None:
        self.queues.remove(req.rid)
        for fid, _ in req.forks:
            self.fork_owner.pop(fid, None)

    # ---- failure and cleanup (idempotent) ----------------------------------------------------
    def _fail(self, req: DecodeRequest, reason: str, *, cause: str = "peer_failure", status: int = 502,
              retry_after: int | None = None, code: str | None = None) -> None:
        if req.failure is not None or req.rid not in self.queues:
            return
        req.failure = reason
        if not req.status.state.terminal:
            req.status.fail(self.clock.now(), reason)
            if status != 429:  # a busy refusal is counted in pdrt_requests_refused_total, not as a failed transfer
                self.metrics.transfers.labels(self.role, "failed").inc()
                self.metrics.transfer_failures.labels(self.role, cause).inc()
        self.watchdog.disarm(req.rid)
        if req.writer is not None:
            req.writer.close()
        if req.task is not None and req.task is not asyncio.current_task():
            req.task.cancel()
        def free_pages(ids: list[str] = req.engine_ids()) -> None:  # noqa: B008 - the ids as of now
            if self.runner is not None:
                # always: a reserve() may be queued on the engine thread but not yet answered; the engine runs
                # commands in order, so this abort lands after it and frees those pages (unknown ids: no-op).
                # Every choice's: n > 1 forks end with their request
                self.runner.call(Abort(tuple(ids)))
                for rid in ids:
                    self.runner.drop_sink(rid)
            self._pages_freed()

        self._forget(req)
        if req.writer is not None:  # a KV receive may still be writing into the pages: free them after it stops
            req.writer.after_io(free_pages)
        else:
            free_pages()
        if cause in ("client_disconnect", "abort_request", "watchdog"):
            self.metrics.aborts.labels(self.role, cause).inc()
        req.outputs.put_nowait(DecodeFailed(reason, status, retry_after=retry_after, code=code))
        (log.info if status == 429 else log.warning)("decode request %s: rid=%s room=%s reason=%s",
                                                     "refused" if status == 429 else "failed", req.rid, req.room, reason)

    def _pages_freed(self) -> None:
        self.pages_freed.set()
        self.pages_freed = asyncio.Event()

    # ---- transfer ------------------------------------------------------------------------------
    async def _reserve(self, req: DecodeRequest) -> tuple[list[int], int]:
        from pdruntime.engine import OutOfBlocks

        deadline = time.monotonic() + req.busy_grace_s
        while True:
            event = self.pages_freed
            try:
                return await self.runner.call(Reserve(req))  # RequestGone once failed: no page without an owner
            except OutOfBlocks as exc:
                left = deadline - time.monotonic()
                if left <= 0:  # busy, not broken: the router neither fails the pair nor opens its breaker
                    wait = self.busy_retry_after()
                    self.metrics.refused.labels(self.role, "kv_pages").inc()
                    raise DecodeFailed(f"decode is at capacity: its KV pool has no room for this request ({exc}); "
                                       f"retry after {wait}s", 429, retry_after=wait) from None
                try:
                    await within(event.wait(), min(left, 0.5))  # within: a cancel (router failed it) propagates
                except TimeoutError:
                    pass

    async def _pull(self, req: DecodeRequest) -> None:
        try:
            blocks, req.held_tokens = await self._reserve(req)
            req.reserved = True
            self.queues.move(req.rid, "transfer")
            t0 = self.clock.now()
            self._arm_prefill_stall(req)  # until the KV is ready: fires only if prefill stops advancing
            expected = self.layouts  # one shard per TP rank this connection carries
            att = wire.Attach(req.room, req.rid, len(req.prompt_ids), wire.prompt_crc(req.prompt_ids),
                              tp_size=self.layout.tp_size, tp_ranks=tuple(lay.tp_rank for lay in expected),
                              held_tokens=req.held_tokens, cache_namespace=self.cache_namespace)
            conn = req.writer = await transfer.open_attach(req.bootstrap_host, req.bootstrap_port, self.kv_token, att)
            req.kv_stats = conn.stats
            req.status.advance(TransferState.WAITING_FOR_INPUT, self.clock.now())
            header = await transfer.recv_header(conn, on_progress=lambda msg, r=req: self._on_prefill_progress(r, msg))
            # KV ready: from here the transfer phase alone is timed (prefill's compute never counts against it)
            self.watchdog.disarm(req.rid, "prefill_stall")
            self.watchdog.arm(req.rid, "decode_transfer", self.env.decode_transfer_timeout_s,
                              lambda d, r=req: self._fail(r, f"decode transfer timeout: no verified KV within "
                                                          f"{self.env.decode_transfer_timeout_s}s of KV ready",
                                                          cause="watchdog", status=504),
                              ids=f"rid={req.rid} room={req.room}")
            if self.hooks.take("stall_transfers"):
                # test hook: read the HEADER, then stop reading (a stuck transfer; the peer never gets its ACK)
                req.status.advance(TransferState.TRANSFERRING, self.clock.now())
                await asyncio.Event().wait()
            try:
                transfer.check_header(header, att, expected, self.model_sha)  # mismatch: both sides fail + free
                blocks = await self._take_delta(req, header, blocks)
                req.status.advance(TransferState.TRANSFERRING, self.clock.now())
                dest = blocks[header.skip_pages:header.num_pages]  # the pages sent; the ones before are held
                if self.engine.tp_size > 1:  # host staging per rank, then rank 0 scatters to its peers
                    if header.num_pages > len(blocks):
                        raise WireError("mismatch", f"prefill sends {header.num_pages} pages, decode reserved {len(blocks)}")
                    staged = self.engine.empty_pages(header.sent_pages)
                    sinks = [transfer.ShardSink(kv, range(header.sent_pages), lay) for kv, lay in zip(staged, expected)]
                else:
                    sinks = [transfer.ShardSink(self.engine.kv, dest, self.layout)]
                stats = await transfer.recv_kv(conn, header, sinks)
                if self.engine.tp_size > 1:
                    await self.runner.call(ScatterPages(tuple(dest), staged))
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
            self.metrics.transfer_saved_bytes.labels(self.role).inc(header.saved_bytes)
            self.metrics.transfer_wire_seconds.labels(self.role).observe(stats.seconds)
            if STALL_THIS_REQUEST.get():  # test-only fault knob: KV held, no token ever, no watchdog armed
                self.queues.move(req.rid, "running")
                await asyncio.Event().wait()  # until _fail (abort, client gone) cancels this task
            self._set_sinks(req)
            early = self._early_first_token(req, header.first_token_id)
            if early is not None:  # queued before the engine can report anything for this request
                req.outputs.put_nowait(early)
            # running from here: a request whose only token prefill sampled may end in the engine, and leave the
            # table, before the admission below returns
            self.queues.move(req.rid, "running")
            self.metrics.queue_time.labels(self.role).observe(self.clock.now() - req.created_at)
            req.page_refs = await self.runner.call(AdmitPrefilled(req, header.first_token_id))
            req.in_engine = True
            # the engine reports the first token (sampled by prefill) with its first decode step
        except asyncio.CancelledError:
            raise
        except RequestGone:
            return  # failed meanwhile; its failure freed whatever it held
        except DecodeFailed as exc:
            self._fail(req, exc.reason, status=exc.status, retry_after=exc.retry_after)
        except WireError as exc:
            status, code = _request_failed(exc.reason)
            if status is not None:  # prefill failed the request itself: its error (and code), not the pair's
                self._fail(req, exc.message, cause="engine_error", status=status, code=code)
            else:
                self._fail(req, f"KV transfer failed: {exc}", status=502)
        except (asyncio.IncompleteReadError, ConnectionError, OSError, asyncio.TimeoutError) as exc:
            self._fail(req, f"prefill peer unreachable or lost during {req.status.state.label}: {type(exc).__name__} {exc}",
                       status=502)
        except Exception as exc:
            self._fail_unexpected(req, exc, "decode transfer")

    async def _take_delta(self, req: DecodeRequest, header: wire.KVHeader, blocks: list[int]) -> list[int]:
        """The pages to receive into, after prefill's HEADER said what it sends: the delta (``skip_pages`` = the
        held pages; check_header allows nothing else but 0), or the whole prompt (prefill fell back, or does not
        know the delta): then the reservation gives its shared pages up first, since a shared page is never
        written. -> the reservation's pages."""
        req.cached_tokens = header.cached_tokens
        if header.skip_pages or not req.held_tokens:
            return blocks
        from pdruntime.engine import OutOfBlocks

        self.metrics.kv_delta_fallbacks.labels(self.role, "prefill_sent_all").inc()
        try:
            blocks = await self.runner.call(Unshare(req))
        except OutOfBlocks as exc:
            raise DecodeFailed(f"decode is at capacity: no room to receive the whole prompt ({exc})", 503) from None
        req.held_tokens = 0
        return blocks

    def _arm_prefill_stall(self, req: DecodeRequest) -> None:
        s = self.env.prefill_stall_s
        self.watchdog.arm(req.rid, "prefill_stall", s,
                          lambda d, r=req: self._fail(
                              r, f"prefill stalled: no progress for {s:g}s while computing the prompt (stage prefill, "
                                 f"{r.prefill_tokens} of {len(r.prompt_ids)} prompt tokens computed)",
                              cause="watchdog", status=504),
                          ids=f"rid={req.rid} room={req.room}")

    def _on_prefill_progress(self, req: DecodeRequest, msg: dict) -> None:
        """A PROGRESS report from prefill: re-arm the stall watchdog when tokens or engine steps advanced."""
        tokens, steps = msg.get("tokens"), msg.get("steps")
        if not isinstance(tokens, int) or not isinstance(steps, int):
            return
        if (tokens, steps) != (req.prefill_tokens, req.prefill_steps):
            req.prefill_tokens, req.prefill_steps = tokens, steps
            req.prefill_progress_at = self.clock.now()
            self._arm_prefill_stall(req)

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

    def _set_sinks(self, req: DecodeRequest) -> None:
        req.open_ids = set(req.engine_ids())
        for rid in req.engine_ids():
            self.runner.set_sink(rid, lambda out, r=req: self._on_output(r, out))

    async def _monolithic(self, req: DecodeRequest) -> None:
        try:
            self._set_sinks(req)
            req.in_engine = True
            self.queues.move(req.rid, "running")
            await self.runner.call(AddRequest(req))
        except asyncio.CancelledError:
            raise
        except RequestGone:
            return  # failed before the engine took it
        except Exception as exc:
            self._fail_unexpected(req, exc, "monolithic admission")

    def _on_output(self, req: DecodeRequest, out: Any) -> None:
        if req.cached_tokens is None and getattr(out, "cached_tokens", None) is not None:
            req.cached_tokens = out.cached_tokens  # monolithic: this engine's own hits (PD: prefill's, from HEADER)
        req.outputs.put_nowait(out)
        if out.finished:
            self.runner.drop_sink(out.request_id)
            req.open_ids.discard(out.request_id)
            if not req.open_ids:  # the last choice
                self._forget(req)
                self.mean_request_s += 0.2 * (self.clock.now() - req.created_at - self.mean_request_s)
            self._pages_freed()

    # ---- HTTP ----------------------------------------------------------------------------------
    async def generate(self, request: Request):
        greq = await read_generate(request)
        self.inject_faults(request, greq)
        return await self.run_generate(greq, client_of(request), **self.leg_hints(request))

    def inject_faults(self, request: Request, greq: GenerateRequest) -> None:
        if self.stall_fault is not None and greq.bootstrap_room is not None:
            STALL_THIS_REQUEST.set(self.stall_fault.admit(connection_of(request.headers, request.scope)))

    def leg_hints(self, request: Request) -> dict:
        return {"interval_s": stream_interval(request.headers), "busy_grace_s": busy_grace(request.headers)}

    async def run_generate(self, greq: GenerateRequest, client: str, shape: OpenAIShape | None = None,
                           usage: tuple[bool, bool] = (False, False), interval_s: float = 0.0,
                           busy_grace_s: float = BUSY_GRACE_S):
        """One request, SGLang-shaped events (``shape`` None: /generate) or OpenAI-shaped (the /v1 routes; ``usage``:
        their stream's include_usage and continuous_usage_stats); ``interval_s``: seconds to gather token events
        into one (the router's STREAM_INTERVAL_HEADER); ``busy_grace_s``: seconds to wait for KV pages before a 429
        (the router's BUSY_WAIT_HEADER)."""
        req = self._admit(greq, client, busy_grace_s)
        stream = DecodeStream(self, req, self.metrics.clients.label(req.client), interval_s)
        if greq.stream:
            return GuardedStream(stream.sse_body(shape, *usage), stream.on_close)
        return await stream.respond(shape)

    def _admit(self, greq: GenerateRequest, client: str, busy_grace_s: float = BUSY_GRACE_S) -> DecodeRequest:
        """Validate against this worker (prompt, context, PD fields, n), queue in prealloc, start its KV pull."""
        prompt = self.prompts.prompt_ids(greq)
        params = self.prompts.sampling(greq, len(prompt))
        pd = greq.bootstrap_room is not None
        if pd and (not greq.bootstrap_host or not greq.bootstrap_port):
            raise ApiError(400, "bootstrap_room needs bootstrap_host and bootstrap_port", param="bootstrap_host")
        n = greq.sampling_params.n
        if n > 1 and self.engine.tp_size > 1:
            raise ApiError(400, f"n={n}: parallel sampling forks sequences in one engine, and this decode engine runs "
                           f"tensor_parallel_size={self.engine.tp_size}; accepted: n = 1 here", param="n",
                           code="unsupported_parameter")
        now = self.clock.now()
        rid = request_id(greq)
        req = DecodeRequest(rid=rid, room=int(greq.bootstrap_room or 0), client=client,
                            prompt_ids=prompt, params=params, bootstrap_host=greq.bootstrap_host or "",
                            bootstrap_port=int(greq.bootstrap_port or 0), created_at=now, status=TransferStatus(now),
                            forks=[(f"{rid}#{i}", params.for_choice(i)) for i in range(1, n)], busy_grace_s=busy_grace_s)
        try:
            self.queues.put(req.rid, req, "prealloc")
        except KeyError as exc:
            raise ApiError(409, str(exc), param="rid", code="duplicate_request") from None
        self.fork_owner.update((fid, rid) for fid, _ in req.forks)
        req.task = asyncio.get_running_loop().create_task(self._pull(req) if pd else self._monolithic(req))
        return req

    def add_routes(self, app: FastAPI) -> None:
        app.post("/generate")(self.generate)


def _request_failed(reason: str) -> tuple[int | None, str | None]:
    """(the 4xx, the API code or None) of a KV-wire ERROR "request_failed:<status>[:<code>]" (prefill failed the
    request itself), else (None, None)."""
    kind, _, rest = reason.partition(":")
    if kind != "request_failed":
        return None, None
    st, _, code = rest.partition(":")
    status = int(st) if st.isdigit() and 400 <= int(st) < 500 and int(st) != 499 else 422
    return status, (code if code.replace("_", "").isalnum() else None)



def _hint_seconds(headers: Any, name: str, absent: float, most: float) -> float:
    """Seconds of the router's hint header ``name``, clamped to [0, ``most``]; ``absent`` when it is missing or
    not a number (an optimisation hint: a bad value is ignored, not an error)."""
    try:
        v = float(headers.get(name) or absent)
    except ValueError:
        return absent
    return min(max(v, 0.0), most) if v == v else absent


def busy_grace(headers: Any) -> float:
    """BUSY_WAIT_HEADER: the router's hint can only shorten decode's own wait for pages (BUSY_GRACE_S)."""
    return _hint_seconds(headers, BUSY_WAIT_HEADER, BUSY_GRACE_S, BUSY_GRACE_S)


MAX_STREAM_INTERVAL_S = 1.0  # the most STREAM_INTERVAL_HEADER may ask for (progress is reported at least this often)


def stream_interval(headers: Any) -> float:
    """STREAM_INTERVAL_HEADER: seconds to gather token events, at most MAX_STREAM_INTERVAL_S; 0 (none) without it."""
    return _hint_seconds(headers, STREAM_INTERVAL_HEADER, 0.0, MAX_STREAM_INTERVAL_S)
