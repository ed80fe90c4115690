"""The client's side of one dispatched PD request: decode's token events become OpenAI chunks (streamed) or one
response, per choice, with the router's token metrics; closing it releases the pair and settles both legs."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

from fastapi.responses import JSONResponse

from pdruntime.server.metrics import Metrics
from pdruntime.server.openai.events import TokenEvent
from pdruntime.server.openai.format import Choices, OpenAIShape, finished_tool_calls, merge_tool_call_deltas
from pdruntime.server.openai.schemas import ApiError, ChatCompletionRequest, CompletionRequest, error_body
from pdruntime.server.router.legs import LegError, Legs
from pdruntime.server.router.policy import PairState
from pdruntime.util.aio import detach
from pdruntime.util.sse import SSE_DONE, sse


@dataclass(eq=False)
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


@dataclass(frozen=True)
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

    @property
    def n(self) -> int:
        return self.body.n

    def shape(self, rid: str, parse_tools: bool = True) -> OpenAIShape:
        """The client's response shape; ``parse_tools`` False when decode answers tool calls already parsed."""
        body, chat = self.body, self.chat
        tools = parse_tools and chat and body.tools and body.tool_choice != "none"
        return OpenAIShape(chat, ("chatcmpl-" if chat else "cmpl-") + rid, self.model, int(time.time()),
                           tool_parser=self.tool_parser if tools else None,
                           echo=body.prompt_text() if not chat and body.echo else None)


@dataclass(frozen=True)
class Dispatched:
    """A request whose pair answered: its legs, the pair's state and decode's first event."""

    legs: Legs
    state: PairState
    first: TokenEvent


class Reply:
    """Streams (:meth:`stream`) or collects (:meth:`collect`) one request's events; :meth:`finish` runs once."""

    def __init__(self, metrics: Metrics, req: EdgeRequest, live: LiveRequest, sent: Dispatched, client_label: str,
                 forget: Callable[[LiveRequest, PairState], None]) -> None:
        self.req, self.live, self.sent = req, live, sent
        self.metrics = metrics
        self.forget = forget  # releases the pair slot and the live entry
        self.client_label = client_label
        self.shape = req.shape(live.rid, parse_tools=not sent.legs.protocol.parses_tools)
        self.choices = Choices(req.n)
        self.outcome = "aborted"  # until it completes ("ok") or fails mid-stream ("failed")
        self.last_token_at = time.monotonic()
        self.prompt_logprobs: list | None = None  # echo + logprobs: the prompt's entries (prefill's)
        self._itl = metrics.itl.labels("router")  # label lookups once per request, not per event
        self._tokens = metrics.tokens.labels("router", client_label)

    async def token_events(self) -> AsyncIterator[TokenEvent]:
        """Decode's events, counted, with choice 0's first-token logprobs from prefill (which sampled it)."""
        patch = self.req.body.logprobs_n() is not None
        async for ev in self.sent.legs.events(self.sent.first):
            if patch and ev.choice == 0:
                patch = False
                ev = await self.sent.legs.first_with_prefill_logprobs(ev)
                self.prompt_logprobs = ev.prompt_logprobs
            self.choices.see(ev)  # Legs checked the index
            self._count(ev)
            yield ev
        if not self.choices.done:  # e.g. a decode worker that ignores sampling_params.n streams choice 0 alone
            unfinished = [i for i, f in enumerate(self.choices.finished) if not f]
            raise LegError(502, f"decode ended its stream with choices {unfinished} of n={self.req.n} unfinished (a "
                           "decode worker must run choices 1..n-1 as forks of sampling_params.n)", leg="decode",
                           retryable=False)

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
        legs = self.sent.legs
        self.forget(self.live, self.sent.state)
        if completed and self.outcome == "aborted":  # finished normally (not failed mid-stream)
            self.outcome = "ok"
            await legs.close()
            detach(legs.join_prefill())
        else:
            if self.outcome == "aborted":
                self.metrics.disconnects.inc()
            await legs.abort()
        self.metrics.requests.labels("router", self.client_label, self.outcome).inc()
        self.metrics.e2e.labels("router").observe(time.monotonic() - self.req.arrived)

    async def stream(self) -> AsyncIterator[bytes]:
        """SSE chunks per choice, then ``[DONE]``; a failure after the first token ends it with an error event."""
        opts = self.req.body.stream_options
        include_usage = bool(opts and opts.include_usage)
        continuous = bool(opts and opts.continuous_usage_stats)
        started = [False] * self.req.n
        tools = [self.shape.stream_state() for _ in range(self.req.n)]  # per choice
        try:
            async for ev in self.token_events():
                i = ev.choice
                for c in self.shape.stream_chunks(ev, first=not started[i], include_usage=include_usage,
                                                  continuous_usage=continuous, state=tools[i], choices=self.choices):
                    yield sse(c)
                started[i] = True
                if self.choices.done:
                    break
        except LegError as exc:
            self.outcome = "failed"
            yield sse(error_body(exc.status, f"generation failed after the first token: {exc.message}",
                                 type=_error_type(exc.status), code=exc.code))
            return
        yield SSE_DONE

    async def collect(self) -> JSONResponse:
        """The whole response (every choice), after decode's last event."""
        n = self.req.n
        completed = False
        texts, lps, lasts = [""] * n, [[] for _ in range(n)], [self.sent.first] * n  # per choice
        calls: list[list[dict]] = [[] for _ in range(n)]  # tool calls an OpenAI-speaking decode parsed, per choice
        try:
            async for ev in self.token_events():
                i = ev.choice
                texts[i] += ev.delta
                lps[i] += ev.logprobs or []
                if ev.tool_calls:
                    merge_tool_call_deltas(calls[i], ev.tool_calls)
                lasts[i] = ev
                if self.choices.done:
                    break
            completed = True
        except LegError as exc:
            self.outcome = "failed"
            status = exc.status if exc.status != 499 else 502
            raise ApiError(status, f"generation failed: {exc.message}", type=_error_type(status), code=exc.code) from None
        finally:
            await self.finish(completed)
        want_lps = self.req.body.logprobs_n() is not None
        if want_lps and self.prompt_logprobs is not None:  # echo: the prompt's entries first (each text starts with it)
            lps = [self.prompt_logprobs + lp for lp in lps]
        return JSONResponse(self.shape.response(
            [self.shape.choice(i, texts[i], lasts[i], logprobs=lps[i] if want_lps else None,
                               tool_calls=finished_tool_calls(calls[i]) or None) for i in range(n)],
            self.choices.usage()))


def _error_type(status: int) -> str:
    """OpenAI's error type of a failure's HTTP status: the request's fault (a 4xx but 429) or the server's."""
    return "invalid_request_error" if 400 <= status < 500 and status != 429 else "server_error"
