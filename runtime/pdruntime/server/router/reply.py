"""The client's side of one dispatched PD request: decode's token events become OpenAI chunks (streamed) or one
response, per choice, with the router's token metrics; closing it releases the pair and settles both legs."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, AsyncIterator, Awaitable, Callable, Mapping

from pdruntime.server.openai.events import TokenEvent
from pdruntime.server.openai.format import Choices, OpenAIShape, finished_tool_calls, merge_tool_call_deltas
from pdruntime.server.openai.schemas import ApiError, ChatCompletionRequest, CompletionRequest, error_body
from pdruntime.server.router.legs import LegError, Legs
from pdruntime.server.router.policy import PairState
from pdruntime.util.sse import SSE_DONE, sse

if TYPE_CHECKING:
    from pdruntime.server.router.app import Router


@dataclass(eq=False, slots=True)
class LiveRequest:
    rid: str
    client: str
    conversation: str | None
    started: float  # time.monotonic()
    stage: str = "dispatching"
    pair: int | None = None
    tokens: int = 0
    attempts: int = 0
    client_request_id: str | None = None  # the client's X-Request-Id
    pinned: int | None = None  # the group X-PDStack-Pair pinned it to
    progressed_at: float = 0.0  # time.monotonic() of its last progress: arrival, a stage change, a token

    def __post_init__(self) -> None:
        self.progressed_at = self.progressed_at or self.started

    def advance(self, stage: str) -> None:
        self.stage = stage
        self.progressed_at = time.monotonic()


@dataclass(slots=True)
class EdgeCall:
    """One ``/v1/completions`` or ``/v1/chat/completions`` call as the HTTP layer received it (the router's own
    server, or FastAPI for the in-process ASGI app): what :meth:`Router.completion` reads, and nothing more."""

    chat: bool
    headers: Mapping[str, str]  # names in lower case
    body: bytes
    peer: tuple[str, int] | None  # the client's address
    #: returns once the client has gone (the ASGI app watches for it); None: the server cancels the handler instead
    gone: Callable[[], Awaitable[None]] | None = None


@dataclass(slots=True)
class Streamed:
    """A streamed answer: its SSE chunks, and ``finish(completed)``, which must run once however the stream ends."""

    chunks: AsyncIterator[bytes]
    finish: Callable[[bool], Awaitable[None]]


@dataclass(slots=True)
class EdgeRequest:
    """One client request as the router's HTTP edge validated it (once); every layer below reads this."""

    body: ChatCompletionRequest | CompletionRequest
    chat: bool
    client: str  # who sent it (its API key's name, X-Client-Id, or a token hash)
    model: str  # the served model id it resolved to
    deadline: float  # time.monotonic() seconds
    arrived: float  # time.monotonic() seconds
    tool_parser: str  # the model's tool-call parser (its workers report it)
    raw: dict = field(default_factory=dict)  # the client's JSON body, as sent (the OpenAI worker protocols pass it on)
    # what every layer asks of body, read once (a pydantic model's attributes are read through a __getattr__ hook)
    n: int = 1  # body.n
    stream: bool = False  # body.stream
    logprobs: int | None = None  # body.logprobs_n()

    def shape(self, rid: str, parse_tools: bool = True) -> OpenAIShape:
        """The client's response shape; ``parse_tools`` False when decode answers tool calls already parsed."""
        body, chat = self.body, self.chat
        tools = parse_tools and chat and body.tools and body.tool_choice != "none"
        return OpenAIShape(chat, ("chatcmpl-" if chat else "cmpl-") + rid, self.model, int(time.time()),
                           tool_parser=self.tool_parser if tools else None,
                           echo=body.prompt_text() if not chat and body.echo else None)


class Reply:
    """Streams (:meth:`stream`) or collects (:meth:`collect`) one request's events; :meth:`finish` runs once."""

    outcome = "aborted"  # until it completes ("ok") or fails mid-stream ("failed")
    prompt_logprobs: list | None = None  # echo + logprobs: the prompt's entries (prefill's)

    def __init__(self, router: "Router", req: EdgeRequest, live: LiveRequest, legs: Legs, state: PairState,
                 first: TokenEvent, client_label: str) -> None:
        """A request whose pair answered: its ``legs``, the pair's ``state`` and decode's ``first`` event."""
        self.req, self.live, self.legs, self.state, self.first = req, live, legs, state, first
        self.router = router  # its forget() releases the pair slot and the live entry; child() the metric children
        self.metrics = metrics = router.metrics
        self.client_label = client_label
        self.shape = req.shape(live.rid, parse_tools=not legs.protocol.parses_tools)
        self.choices = Choices(req.n)
        self.last_token_at = time.monotonic()
        self._itl = router.itl_seconds
        self._tokens = router.child(metrics.tokens, "router", client_label)
        self._first: TokenEvent | None = first  # decode's first event, not yet read
        self._patch = req.logprobs is not None  # choice 0's first token takes prefill's logprobs

    async def next_event(self) -> TokenEvent | None:
        """Decode's next event (None: every choice finished), counted, with choice 0's first-token logprobs from
        prefill (which sampled it). A plain coroutine, not an async generator: one a reader leaves early would be
        finalised through the loop's thread-safe wake-up, a system call per request."""
        if self.choices.done:
            return None
        if self._first is not None:
            ev, self._first = self._first, None
        else:
            ev = await self.legs.next_event()
        if ev is None:  # e.g. a decode worker that ignores sampling_params.n streams choice 0 alone
            unfinished = [i for i, f in enumerate(self.choices.finished) if not f]
            raise LegError(502, f"decode ended its stream with choices {unfinished} of n={self.req.n} unfinished (a "
                           "decode worker must run choices 1..n-1 as forks of sampling_params.n)", leg="decode",
                           retryable=False)
        if self._patch and ev.choice == 0:
            self._patch = False
            ev = await self.legs.first_with_prefill_logprobs(ev)
            self.prompt_logprobs = ev.prompt_logprobs
        self.choices.see(ev)  # Legs checked the index
        self._count(ev)
        return ev

    def _count(self, ev: TokenEvent) -> None:
        n = ev.num_tokens
        if n:
            now = time.monotonic()
            if self.live.tokens:  # an event of n tokens: n inter-token gaps of a share each
                gap = (now - self.last_token_at) / n
                for _ in range(n):
                    self._itl.observe(gap)
            self.last_token_at = now
            self.live.tokens += n
            self.live.progressed_at = now
            self._tokens.inc(n)

    async def finish(self, completed: bool) -> None:
        """Release the pair and the live entry; a finished stream closes decode and reaps prefill, anything else
        aborts both legs."""
        legs = self.legs
        self.router._forget(self.live, self.state)
        if completed and self.outcome == "aborted":  # finished normally (not failed mid-stream)
            self.outcome = "ok"
            legs.close()
            legs.settle_prefill()
        else:
            if self.outcome == "aborted":
                self.metrics.disconnects.inc()
            await legs.abort()
        self.router.child(self.metrics.requests, "router", self.client_label, self.outcome).inc()
        self.router.e2e_seconds.observe(time.monotonic() - self.req.arrived)

    async def stream(self) -> AsyncIterator[bytes]:
        """SSE chunks per choice, then ``[DONE]``; a failure after the first token ends it with an error event."""
        opts = self.req.body.stream_options
        include_usage = bool(opts and opts.include_usage)
        continuous = bool(opts and opts.continuous_usage_stats)
        started = [False] * self.req.n
        tools = [self.shape.stream_state() for _ in range(self.req.n)]  # per choice
        try:
            while (ev := await self.next_event()) is not None:
                i = ev.choice
                chunk = b"".join(sse(c) for c in self.shape.stream_chunks(
                    ev, first=not started[i], include_usage=include_usage, continuous_usage=continuous,
                    state=tools[i], choices=self.choices))
                started[i] = True
                if self.choices.done:  # the last event: [DONE] in the same write
                    yield chunk + SSE_DONE
                    return
                if chunk:
                    yield chunk
        except LegError as exc:
            self.outcome = "failed"
            yield sse(error_body(exc.status, f"generation failed after the first token: {exc.message}",
                                 type=_error_type(exc.status), code=exc.code))
            return
        yield SSE_DONE

    async def collect(self) -> dict:
        """The whole response body (every choice), after decode's last event."""
        n = self.req.n
        completed = False
        texts, lasts = [""] * n, [self.first] * n  # per choice
        lps: list[list] = [[] for _ in range(n)]
        calls: list[list[dict]] = [[] for _ in range(n)]  # tool calls an OpenAI-speaking decode parsed, per choice
        try:
            while (ev := await self.next_event()) is not None:
                i = ev.index or 0
                texts[i] += ev.delta
                if ev.logprobs:
                    lps[i] += ev.logprobs
                if ev.tool_calls:
                    merge_tool_call_deltas(calls[i], ev.tool_calls)
                lasts[i] = ev
            completed = True
        except LegError as exc:
            self.outcome = "failed"
            status = exc.status if exc.status != 499 else 502
            raise ApiError(status, f"generation failed: {exc.message}", type=_error_type(status), code=exc.code) from None
        finally:
            await self.finish(completed)
        want_lps = self.req.logprobs is not None
        if want_lps and self.prompt_logprobs is not None:  # echo: the prompt's entries first (each text starts with it)
            lps = [self.prompt_logprobs + lp for lp in lps]
        shape = self.shape
        return shape.response(
            [shape.choice(i, texts[i], lasts[i], logprobs=lps[i] if want_lps else None,
                          tool_calls=finished_tool_calls(calls[i]) if calls[i] else None) for i in range(n)],
            self.choices.usage())


def _error_type(status: int) -> str:
    """OpenAI's error type of a failure's HTTP status: the request's fault (a 4xx but 429) or the server's."""
    return "invalid_request_error" if 400 <= status < 500 and status != 429 else "server_error"
