"""The output side of one admitted decode request: engine outputs of its n choices -> typed token events ->
SSE (``/generate`` or OpenAI-shaped chunks) or one response, with decode's token metrics."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, AsyncIterator, Protocol

from fastapi.responses import JSONResponse

from pdruntime.disagg.decode_queues import DecodeRequest
from pdruntime.server.openai.events import TokenEvent
from pdruntime.server.openai.format import Choices, OpenAIShape, logprob_entries, prompt_logprob_entries
from pdruntime.server.openai.schemas import error_body
from pdruntime.util.sse import SSE_DONE, sse

log = logging.getLogger("pdruntime.decode")


class DecodeFailed(Exception):
    """A decode request ends with an error: ``status`` (the HTTP status), and for a busy worker (429) the
    ``retry_after`` seconds it suggests and the code ``decode_busy``."""

    def __init__(self, reason: str, status: int = 502, *, retry_after: int | None = None,
                 code: str | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.status = status
        self.retry_after = retry_after
        self._code = code  # the cause's name (e.g. unsatisfiable_schema), else decode_busy / decode_failed

    @property
    def code(self) -> str:
        return self._code or ("decode_busy" if self.status == 429 else "decode_failed")

    def body(self) -> dict:
        kind = "invalid_request_error" if 400 <= self.status < 500 and self.status != 429 else "server_error"
        err = error_body(self.status, self.reason, type=kind, code=self.code)
        if self.retry_after is not None:
            err["error"]["retry_after"] = self.retry_after
        return err

    def headers(self) -> dict | None:
        return {"Retry-After": str(self.retry_after)} if self.retry_after is not None else None


class EarlyToken:
    """The first token, streamed as soon as decode holds the KV (see DecodeWorker._early_first_token)."""

    early = True
    finished = False
    finish_reason = None

    def __init__(self, token_id: int, text: str) -> None:
        self.new_token_ids = [token_id]
        self.text_delta = text


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


def _ends(item: Any) -> bool:
    """An output that ends a batch: a failure, or one that finishes its choice."""
    return isinstance(item, DecodeFailed) or bool(item.finished)


class _Worker(Protocol):
    """What a stream needs of its decode worker."""

    role: str
    metrics: Any  # pdruntime.server.metrics.Metrics
    clock: Any  # the watchdog clock: progress times
    loaded: Any  # the model: its tokenizer renders logprobs

    def _fail(self, req: DecodeRequest, reason: str, *, cause: str = ..., status: int = ...,
              retry_after: int | None = ..., code: str | None = ...) -> None: ...


class DecodeStream:
    """Events of one request, per choice (``req.n``), from its output queue; :meth:`on_close` runs once."""

    def __init__(self, worker: _Worker, req: DecodeRequest, client_label: str, interval_s: float = 0.0) -> None:
        self.worker, self.req = worker, req
        self.metrics, self.role = worker.metrics, worker.role
        self.tokenizer = worker.loaded.tokenizer
        self.client_label = client_label
        self.interval_s = interval_s  # seconds to gather outputs into one event after a batch's first (0: none)
        self.arrived = time.monotonic()
        self.choice_of = {eid: i for i, eid in enumerate(req.engine_ids())}
        self._itl = self.metrics.itl.labels(self.role)  # label lookups once per request, not per token
        self._tokens = self.metrics.tokens.labels(self.role, client_label)

    async def _batch(self, gather: bool) -> list:
        """The next engine output and every output already waiting behind it; with ``gather`` (and an interval)
        also those arriving within ``interval_s`` of the first. A batch ends at an output that finishes a choice
        or fails. Outputs left in the queue (a timeout's race) stay there for the next batch."""
        q = self.req.outputs
        batch = [await q.get()]
        if gather and self.interval_s > 0:
            end = time.monotonic() + self.interval_s
            while not _ends(batch[-1]) and (left := end - time.monotonic()) > 0:
                try:
                    async with asyncio.timeout(left):
                        batch.append(await q.get())
                except TimeoutError:
                    break
        while not _ends(batch[-1]) and not q.empty():
            batch.append(q.get_nowait())
        return batch

    async def events(self) -> AsyncIterator[TokenEvent]:
        """The engine's outputs as token events, one per choice per batch (:meth:`_batch`: the outputs that are
        ready together, so a busy reader gets fewer, larger events), until every choice finished. The first batch
        is never held back (it carries the first token). Raises DecodeFailed after the events before it."""
        req = self.req
        texts, tokens = [""] * req.n, [0] * req.n  # per choice
        open_ = req.n
        last = None
        early: EarlyToken | None = None
        first = True
        while open_:
            merged: dict[int, TokenEvent] = {}  # per choice, in the order they came
            for item in await self._batch(gather=not first):
                if isinstance(item, DecodeFailed):
                    for ev in merged.values():
                        yield ev
                    raise item
                i = self.choice_of[getattr(item, "request_id", req.rid)]  # the early token is choice 0's
                if i == 0 and early is not None:  # the engine's first report repeats the early token: drop it once
                    item = _without_early(item, early)
                    early = None
                elif isinstance(item, EarlyToken):
                    early = item
                if item.new_token_ids:
                    last = self._count(item, last)
                    tokens[i] += len(item.new_token_ids)
                texts[i] += item.text_delta
                ev = self._event(item, i, texts[i], tokens[i])
                merged[i] = merged[i].then(ev) if i in merged else ev
                if item.finished:
                    open_ -= 1
            first = False
            for ev in merged.values():
                yield ev

    def _count(self, item: Any, last: float | None) -> float:
        """Token metrics of one output with tokens; -> its time (the next one's ITL reference)."""
        ts = time.monotonic()
        if last is None:
            self.metrics.ttft.labels(self.role).observe(ts - self.arrived)
        else:
            self._itl.observe(ts - last)
        self.req.completion_tokens += len(item.new_token_ids)
        self.req.last_token_at = self.worker.clock.now()
        self._tokens.inc(len(item.new_token_ids))
        return ts

    def _event(self, item: Any, i: int, text: str, tokens: int) -> TokenEvent:
        req, ids = self.req, list(item.new_token_ids)
        prompt_lps = None
        if getattr(item, "prompt_logprobs", None) is not None:  # monolithic runs (PD: prefill reports them)
            prompt_lps = prompt_logprob_entries(self.tokenizer, req.prompt_ids, item.prompt_logprobs)
        lps = None
        if req.params.logprobs is not None:  # PD: the first token's entry is None here (prefill reports it)
            lps = logprob_entries(self.tokenizer, ids, getattr(item, "logprobs", None))
        return TokenEvent(delta=item.text_delta, token_ids=ids, text=text, rid=req.rid,
                          prompt_tokens=len(req.prompt_ids), completion_tokens=tokens,
                          finish=item.finish_reason if item.finished else None, index=i if req.forks else None,
                          logprobs=lps, prompt_logprobs=prompt_lps, cached_tokens=req.cached_tokens)

    async def on_close(self, completed: bool) -> None:
        req = self.req
        outcome = "ok" if completed else ("failed" if req.failure else "aborted")
        if not completed and req.failure is None:
            self.worker._fail(req, "client disconnected", cause="client_disconnect", status=499)
        self.metrics.requests.labels(self.role, self.client_label, outcome).inc()
        self.metrics.e2e.labels(self.role).observe(time.monotonic() - self.arrived)

    async def sse_body(self, shape: OpenAIShape | None, include_usage: bool,
                       continuous_usage: bool = False) -> AsyncIterator[bytes]:
        """SGLang events (``shape`` None) or OpenAI chunks (usage on every chunk with ``continuous_usage``), then
        ``[DONE]``; a failure ends with an error event."""
        choices = Choices(self.req.n)
        states = [shape.stream_state() if shape is not None else None for _ in range(self.req.n)]
        done_sent = False
        try:
            async for ev in self.events():
                i, first = choices.see(ev)
                if shape is None:
                    chunk = sse(ev.to_json())
                else:
                    chunk = b"".join(sse(c) for c in shape.stream_chunks(
                        ev, first=first, include_usage=include_usage, continuous_usage=continuous_usage,
                        state=states[i], choices=choices))
                # the last event: [DONE] goes out in the same write (one wake-up for the reader). Not a return here:
                # events() ends by itself right after, and one left suspended is finalised through the loop's
                # thread-safe wake-up (a system call)
                if choices.done:
                    chunk, done_sent = chunk + SSE_DONE, True
                if chunk:
                    yield chunk
        except DecodeFailed as exc:
            err = exc.body()
            err["error"]["status"] = exc.status  # the HTTP status this would have had (200 was already sent)
            yield sse(err)
            return
        if not done_sent:
            yield SSE_DONE

    async def respond(self, shape: OpenAIShape | None) -> JSONResponse:
        """The whole answer: SGLang's last event (a list of them for n > 1), or an OpenAI response."""
        completed = False
        n = self.req.n
        try:
            choices = Choices(n)
            finals: list = [None] * n  # per choice: its last event
            lps: list = [[] for _ in range(n)]
            async for ev in self.events():
                i, _ = choices.see(ev)
                finals[i] = ev
                lps[i] += ev.logprobs or []
            completed = True
            if shape is None:  # SGLang: n > 1 answers a list
                return JSONResponse(finals[0].to_json() if n == 1 else [f.to_json() for f in finals])
            want_lps = self.req.params.logprobs is not None
            return JSONResponse(shape.response(
                [shape.choice(i, f.text, f, logprobs=lps[i] if want_lps else None) for i, f in enumerate(finals)],
                choices.usage()))
        except DecodeFailed as exc:
            return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers())
        finally:
            await self.on_close(completed)
