"""The two legs of one PD request: a prefill and a decode worker of one pair, in the router's worker protocol
(protocol.py: pdrt's and SGLang's send both legs at once with a bootstrap room; vLLM's sends decode what prefill
answered). Prefill answers once its KV is delivered (pdrt, SGLang) or held for decode (vLLM); decode streams the
tokens. Either leg failing aborts the other, in every protocol. With ``n`` > 1 it is still one pair of legs (one
prefill, one KV transfer): decode streams every choice's events, each with its ``index``."""

from __future__ import annotations

import asyncio
import collections
import time
from dataclasses import dataclass, replace
from typing import Any

import httpx

from pdruntime.server.openai.events import TokenEvent
from pdruntime.server.router.protocol import WorkerProtocol
from pdruntime.server.router.topology import Pair
from pdruntime.util import h1
from pdruntime.util.aio import detach, within
from pdruntime.util.headers import BUSY_WAIT_HEADER, CLIENT_CONNECTION_HEADER, DEADLINE_HEADER, STREAM_INTERVAL_HEADER
from pdruntime.util.sse import DONE_BYTES as DONE, SSEBuffer


ABORT_TIMEOUT_S = 2.0  # seconds for the best-effort /abort_request calls
PREFILL_VERDICT_WAIT_S = 1.0  # seconds a failed decode leg waits for prefill's answer (it may name a 4xx cause)


#: seconds to open a connection to a worker. A worker on a live host completes the handshake in the kernel even
#: when its process is frozen (the health prober catches those in 5 s), so this only has to outlast the router's
#: own event loop being starved on a saturated host, where a 3-s limit failed healthy workers as unreachable
CONNECT_TIMEOUT_S = 10.0
DECODE_TIMEOUT = (CONNECT_TIMEOUT_S, None)  # (connect, read) seconds: no read timeout of its own (h1._timeouts)


class LegError(Exception):
    """A leg failed. ``retryable`` is True for failures of the pair itself (connection, 5xx), False for
    request errors (4xx, which another pair would reject too) and for an expired deadline."""

    def __init__(self, status: int, message: str, *, leg: str, retryable: bool, code: str = "upstream_error",
                 param: str | None = None, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.param = param  # the worker's "param" of a 4xx: passed on to the client
        self.status = status
        self.message = message
        self.leg = leg
        self.retryable = retryable
        self.code = code
        self.retry_after = retry_after  # seconds, a busy worker's suggestion

    @property
    def busy(self) -> bool:
        """The worker is at capacity (429): try another pair; the pair is not failing (breaker untouched)."""
        return self.status == 429


def _error_message(resp_json: Any, fallback: str) -> tuple[str, str, str | None]:
    """(message, code, param) of a worker's OpenAI-style error body."""
    if isinstance(resp_json, dict) and isinstance(resp_json.get("error"), dict):
        err = resp_json["error"]
        param = err.get("param")
        return (str(err.get("message", fallback)), str(err.get("code") or "upstream_error"),
                param if isinstance(param, str) else None)
    return fallback, "upstream_error", None


def _worker_error(status: int, payload: Any, fallback: str, leg: str, retry_after: Any = None) -> LegError:
    """A worker's error answer as a LegError: its 4xx passes on (the request's fault: not retried, another pair
    would reject it too), except 429 (busy: :attr:`LegError.busy`); 5xx and 499 (the worker lost its peer)
    become a retryable 502."""
    msg, code, param = _error_message(payload, fallback)
    if retry_after is None and isinstance(payload, dict) and isinstance(payload.get("error"), dict):
        retry_after = payload["error"].get("retry_after")
    try:
        wait = max(1, int(float(retry_after))) if retry_after is not None else None
    except (TypeError, ValueError):
        wait = None
    return LegError(status if 400 <= status < 500 and status != 499 else 502, msg, leg=leg,
                    retryable=status >= 500 or status == 499, code=code, param=param, retry_after=wait)


def _stream_error(ev: dict) -> LegError:
    """The LegError of an error event in decode's stream (its ``status``: what the HTTP status would have been).
    Before the first token a pair failure may be retried elsewhere (Legs.first_event's caller decides)."""
    st = ev["error"].get("status") if isinstance(ev["error"], dict) else None
    return _worker_error(st if isinstance(st, int) else 502, ev, "decode failed", "decode")


@dataclass(slots=True)
class Outbound:
    """What the router sends for one request, to whichever pair it goes: the workers' body and headers (read-only
    once built; not a frozen dataclass only because those cost a setattr call per field, per request)."""

    rid: str
    body: dict  # pdrt's /generate body without the bootstrap fields
    headers: dict
    deadline: float  # time.monotonic() seconds
    n: int = 1  # choices decode streams
    busy_until: float | None = None  # time.monotonic(): decode waits for KV pages until then at most (None: its own)
    openai: dict | None = None  # the client's OpenAI body (the sglang and vllm worker protocols send it on)
    chat: bool = True  # /v1/chat/completions (else /v1/completions)
    #: seconds decode may gather token events into one (STREAM_INTERVAL_HEADER), for a client that asked for one
    #: response; None: a stream, each event as it comes
    stream_interval: str | None = None
    connection: str = ""  # the client's connection to the router, "host:port" (CLIENT_CONNECTION_HEADER)

    @property
    def route(self) -> str:
        return "/v1/chat/completions" if self.chat else "/v1/completions"


class Legs:
    # set as the legs run; class defaults until then (one store fewer each, per request)
    prefill_task: asyncio.Future | None = None  # the prefill leg's outcome (_start_prefill)
    _prefill_call: "h1.Request | None" = None  # its h1 call
    _decode_call: "h1.Request | None" = None
    _waiting: asyncio.Future | None = None  # what first_event awaits now (_interruptible)
    _stop: LegError | None = None  # why that wait was cut short (_interrupt)
    decode_resp: "h1.Response | None" = None
    _decode_done = False  # decode's stream ended ([DONE] or its body's end)
    _prefill_answer: "h1.Response | None" = None  # prefill's 200 answer, not parsed yet (prefill_result parses it)
    _prefill_result: dict | None = None

    def __init__(self, client: "h1.Client", pair: Pair, out: Outbound,
                 protocol: WorkerProtocol | None = None) -> None:
        self.client = client
        self.pair = pair
        self.out = out
        self.protocol = protocol = protocol or WorkerProtocol()
        self.room = protocol.room(out)
        self.deadline = out.deadline  # time.monotonic() seconds
        self.prefill_req = protocol.prefill(out, pair, self.room)
        self._read = protocol.reader(out)  # decode's SSE payload -> its token events
        self._pending: collections.deque[TokenEvent] = _NO_EVENTS  # a reader's events beyond the one it returned
        self._sse = SSEBuffer()  # decode's body -> its SSE payloads
        self._payloads: collections.deque[bytes] = collections.deque()  # received, not yet read

    def remaining(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    @property
    def prefill_result(self) -> dict | None:
        """Prefill's answer, once it has come (the first token's logprobs in its meta_info; vLLM's kv_transfer_params),
        parsed on the first read: most requests never read it (None for an answer that is not JSON)."""
        resp = self._prefill_answer
        if resp is not None:
            self._prefill_answer = None
            try:
                self._prefill_result = resp.json()
            except ValueError:
                pass
        return self._prefill_result

    # ---- prefill leg ---------------------------------------------------------------------------
    def _start_prefill(self) -> None:
        """Send the prefill leg now. Its outcome is ``prefill_task``, a future: None (:attr:`prefill_result` reads its
        answer) or its LegError. Driven by the answer's arrival (the call's ``on_done``), without a task;
        cancelling it (:meth:`_cancel_prefill`) closes the call's connection (the worker sees the router hang up)."""
        self.prefill_task = outcome = self.client.loop.create_future()
        left = self.remaining()
        headers = {**self.out.headers, DEADLINE_HEADER: f"{left:.3f}"}  # prefill's admission reads it
        try:
            call = self.client.build_request("POST", self.pair.prefill_url + self.prefill_req.path,
                                             json=self.prefill_req.body, headers=headers,
                                             timeout=(CONNECT_TIMEOUT_S, left + 1.0))
            call.on_done = self._prefill_answered
            self._prefill_call = self.client.start(call)
        except httpx.HTTPError as exc:
            outcome.set_exception(self._unreachable("prefill", exc))

    def _unreachable(self, leg: str, exc: BaseException) -> LegError:
        url = self.pair.prefill_url if leg == "prefill" else self.pair.decode_url
        return LegError(502, f"{leg} worker {url} unreachable: {type(exc).__name__} {exc}", leg=leg, retryable=True)

    def _prefill_answered(self, call: asyncio.Future) -> None:
        outcome = self.prefill_task
        if outcome.done():  # cancelled by the router meanwhile
            if not call.cancelled():
                call.exception()  # retrieved
            return
        if call.cancelled():
            outcome.cancel()
            return
        exc = call.exception()
        if exc is not None:
            error = self._unreachable("prefill", exc) if isinstance(exc, httpx.HTTPError) else exc
            outcome.set_exception(error)
            if isinstance(error, LegError):
                self._interrupt(error)
            return
        resp = call.result()
        if resp.status_code == 200:
            self._prefill_answer = resp
            outcome.set_result(None)
            return
        try:
            payload = resp.json()
        except ValueError:
            payload = None
        error = _worker_error(resp.status_code, payload, f"prefill answered HTTP {resp.status_code}", "prefill",
                              resp.headers.get("retry-after"))
        outcome.set_exception(error)
        self._interrupt(error)

    def _interrupt(self, error: LegError) -> None:
        """Before decode's first event: stop waiting for it (prefill failed, or the deadline passed) and raise
        ``error`` in :meth:`_interruptible` instead."""
        if self._stop is None:
            self._stop = error
            if self._waiting is not None:
                self._waiting.cancel()

    def _deadline_passed(self) -> None:
        self._interrupt(LegError(504, f"deadline expired before the first token (pair {self.pair.index})",
                                 leg="router", retryable=False, code="deadline_exceeded"))

    # ---- decode leg ----------------------------------------------------------------------------
    def _interruptible(self, fut: asyncio.Future) -> asyncio.Future:
        """``fut``, to be awaited in :meth:`_open_decode`: if prefill fails first or the deadline passes,
        :meth:`_interrupt` cancels it (for a worker call, that closes its connection) and :meth:`first_event` raises
        that LegError instead of the cancellation. Returned, not awaited here: a coroutine per wait would add a
        frame to every resume of the request's task. One deadline entry and one prefill callback per request, not per wait."""
        if self._stop is not None:
            raise self._stop
        self._waiting = fut
        return fut

    async def _open_decode(self) -> TokenEvent:
        """Send the decode leg; its first token event. Raises LegError (``leg`` "decode" for decode's own failures)."""
        if self.protocol.sequential:  # decode's request carries what prefill answered (vLLM's kv_transfer_params)
            assert self.prefill_task is not None
            await self._interruptible(self.prefill_task)  # its LegError is the request's (first_event reports it)
        self.decode_req = self.protocol.decode(self.out, self.pair, self.room, self.prefill_result)
        out = self.out
        headers = {**out.headers, CLIENT_CONNECTION_HEADER: out.connection}  # decode's own (faults.py reads it)
        if out.busy_until is not None:
            headers[BUSY_WAIT_HEADER] = f"{max(0.0, out.busy_until - time.monotonic()):.3f}"
        if out.stream_interval is not None:
            headers[STREAM_INTERVAL_HEADER] = out.stream_interval
        # no read timeout of its own: first_event waits for its answer within the deadline, next_event each read
        try:
            self._decode_call = self.client.start(self.client.build_request(
                "POST", self.pair.decode_url + self.decode_req.path, json=self.decode_req.body, headers=headers,
                timeout=DECODE_TIMEOUT), stream=True)
            self.decode_resp = await self._interruptible(self._decode_call.fut)
        except httpx.HTTPError as exc:
            raise self._unreachable("decode", exc) from None
        if self.decode_resp.status_code != 200:
            body = []
            try:
                while (piece := self.decode_resp.take()) is not None:
                    if piece is h1.NOTHING:
                        await self._interruptible(self.decode_resp.arrival())
                    else:
                        body.append(piece)
                payload = h1.loads(b"".join(body))  # type: ignore[arg-type]
            except (ValueError, httpx.HTTPError):
                payload = None
            st = self.decode_resp.status_code
            raise _worker_error(st, payload, f"decode answered HTTP {st}", "decode", self.decode_resp.headers.get("retry-after"))
        while (ev := self._buffered_event()) is None and not self._decode_done:
            if (piece := self._take()) is h1.NOTHING:
                await self._interruptible(self.decode_resp.arrival())
            else:
                self._feed(piece)  # type: ignore[arg-type]
        if ev is None:
            raise LegError(502, "decode stream ended before the first token", leg="decode", retryable=True)
        return ev

    def _take(self) -> bytes | None | object:
        try:
            return self.decode_resp.take()  # type: ignore[union-attr]
        except httpx.HTTPError as exc:
            raise LegError(502, f"decode stream broke: {type(exc).__name__} {exc}", leg="decode",
                           retryable=False) from None

    def _feed(self, piece: bytes | None) -> None:
        if piece is None:
            self._payloads.extend(self._sse.end())
            self._payloads.append(DONE)
        else:
            self._payloads.extend(self._sse.feed(piece))

    def _buffered_event(self) -> TokenEvent | None:
        """Decode's next token event among what has already arrived (None: it must be waited for, or the stream
        ended). An error event raises its LegError."""
        while not self._pending:
            if not self._payloads:
                return None
            data = self._payloads.popleft()
            if data == DONE:
                self._decode_done = True
                self._payloads.clear()
                return None
            try:
                ev = h1.loads(data)
            except ValueError as exc:
                raise LegError(502, f"decode sent a malformed event: {exc}", leg="decode", retryable=False) from None
            if isinstance(ev, dict) and "error" in ev:
                raise _stream_error(ev)
            try:
                got = self._read(ev)
            except (ValueError, TypeError, AttributeError) as exc:
                raise LegError(502, f"decode sent a malformed event: {exc}", leg="decode", retryable=False) from None
            if type(got) is TokenEvent:  # one event per payload (pdrt's protocol): nothing to queue
                return got
            if self._pending is _NO_EVENTS:
                self._pending = collections.deque()
            self._pending.extend(got)
        return self._pending.popleft()

    async def _next_event(self) -> TokenEvent | None:
        """Decode's next token event (None: its stream ended). An error event raises its LegError."""
        assert self.decode_resp is not None
        while (ev := self._buffered_event()) is None and not self._decode_done:
            piece = self._take()
            if piece is h1.NOTHING:
                try:
                    piece = await self.decode_resp.read_some()
                except httpx.HTTPError as exc:
                    raise LegError(502, f"decode stream broke: {type(exc).__name__} {exc}", leg="decode",
                                   retryable=False) from None
            self._feed(piece)  # type: ignore[arg-type]
        return ev

    async def first_event(self) -> TokenEvent:
        """Start both legs; return decode's first token event. Raises LegError (legs aborted). Both legs run on
        their answers' arrival (h1.Client.start), awaited here: no task per leg."""
        deadlines = self.client.deadlines  # swept, not a loop timer per request (util/aio.py)
        deadlines.add(self, self.deadline, self._deadline_passed)
        self._start_prefill()
        try:
            try:
                return await self._open_decode()
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if self._stop is None or (task is not None and task.cancelling()):
                    raise  # the client left (or the router stops): not an interrupt of ours
                raise self._stop from None  # _interrupt cancelled the wait: prefill failed (leg "prefill"), or the
                # deadline (leg "router"); neither is a decode failure for _prefer_prefill_verdict
            except LegError as exc:
                if exc.leg == "decode":
                    await self._prefer_prefill_verdict(exc)
                raise
            finally:
                deadlines.discard(self)
                self._stop = _WAIT_OVER
        except BaseException:
            if self._decode_call is not None:
                self._decode_call.cancel()  # unless its answer is all in, its connection closes
            # told to the workers in the background: the client's answer (a 429 under overload, above all) does not
            # wait for two /abort_request round trips to workers that are busy; the prefill call is cancelled now
            self._cancel_prefill()
            detach(self.abort())
            raise

    async def _prefer_prefill_verdict(self, decode_exc: BaseException) -> None:
        """When prefill fails a request for a request error (4xx), decode's KV connection drops first and its
        leg fails as a retryable 502. Prefill's own answer names the cause: wait briefly for it and raise it."""
        if not isinstance(decode_exc, LegError) or not decode_exc.retryable or self.prefill_task is None:
            return
        await asyncio.wait({self.prefill_task}, timeout=min(PREFILL_VERDICT_WAIT_S, self.remaining()))
        if self.prefill_task.done() and not self.prefill_task.cancelled():
            exc = self.prefill_task.exception()
            if isinstance(exc, LegError) and not exc.retryable:
                raise exc

    async def first_with_prefill_logprobs(self, first: TokenEvent) -> TokenEvent:
        """Decode's first event with the first token's logprobs taken from prefill (which sampled it). Waits
        for prefill's answer (sent once decode holds the KV, i.e. about when decode's first event arrives)."""
        lps = first.logprobs
        if not lps or lps[0] is not None or self.prefill_task is None:
            return first
        try:
            await within(asyncio.shield(self.prefill_task), self.remaining() + 1.0)
        except (LegError, asyncio.TimeoutError, asyncio.CancelledError):
            return first
        got, prompt = self.protocol.first_token_logprobs(self.prefill_result)
        return replace(first, logprobs=[got] + list(lps[1:]),
                       prompt_logprobs=prompt if prompt is not None else first.prompt_logprobs)

    async def next_event(self) -> TokenEvent | None:
        """Decode's next event after the first (None: the stream ended), within the deadline. Raises LegError."""
        ev = self._buffered_event()  # most events have already arrived: no deadline to arm for them
        if ev is not None or self._decode_done:
            return ev
        try:
            return await within(self._next_event(), self.remaining())
        except asyncio.TimeoutError:
            raise LegError(504, "deadline expired mid-generation", leg="router", retryable=False,
                           code="deadline_exceeded") from None

    # ---- teardown --------------------------------------------------------------------------------
    async def _post_abort(self, url: str) -> None:
        try:
            rid = self.protocol.worker_rid(self.out, self.room, self.prefill_result)
            await self.client.post(url + "/abort_request", json={"rid": rid}, timeout=ABORT_TIMEOUT_S)
        except httpx.HTTPError:
            pass

    async def abort(self) -> None:
        """Abort both legs: drop the decode stream, cancel the prefill call, and tell both workers."""
        self._cancel_prefill()
        self.close()
        await asyncio.gather(self._post_abort(self.pair.prefill_url), self._post_abort(self.pair.decode_url))

    def _cancel_prefill(self) -> None:
        if self._prefill_call is not None and not self._prefill_call.fut.done():
            self._prefill_call.cancel()  # its connection closes
        if self.prefill_task is not None and not self.prefill_task.done():
            self.prefill_task.cancel()
        elif self.prefill_task is not None and not self.prefill_task.cancelled():
            self.prefill_task.exception()  # retrieved: its error was reported through the other leg (no log noise)

    def close(self) -> None:
        """Done with decode's stream: its connection is reused if the rest arrives within h1.DRAIN_S (a reader that
        stopped at the last token leaves only ``[DONE]``), else closed; the caller does not wait for either."""
        if self.decode_resp is not None:
            self.decode_resp.release()

    def settle_prefill(self) -> None:
        """After a successful decode the prefill leg's outcome no longer matters: reap it now or when it ends (its
        own read timeout bounds it), without a task of its own."""
        task = self.prefill_task
        if task is None:
            return
        if task.done():
            _reap(task)
        else:
            task.add_done_callback(_reap)


_NO_EVENTS: collections.deque = collections.deque(maxlen=0)  # Legs._pending until a reader returns a list (empty)

#: Legs._stop once first_event is over: later interrupts (prefill ending, the deadline timer) change nothing
_WAIT_OVER = LegError(500, "the first event's wait is over", leg="router", retryable=False)


def _reap(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()  # retrieved: an error there was the request's to report, and it has been answered
