"""Pure OpenAI response shaping from decode's token events (:class:`~pdruntime.server.openai.events.TokenEvent`),
shared by the router and the workers' /v1 routes.

An event's ``logprobs`` hold one entry per token (see :func:`logprob_entries`) when the request asked for them.
With ``n`` > 1 every event carries its choice (0..n-1) and its ``completion_tokens`` count that choice's tokens.
:class:`Choices` follows the n choices of one response: usage is the prompt once plus every choice's completion
tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from pdruntime.server.openai.events import TokenEvent, choice_index, usage_dict


def _tok(tokenizer: Any, tid: int, lp: float) -> dict:
    text = tokenizer.decode([tid])
    return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}


def logprob_entries(tokenizer: Any, token_ids: list[int], raw: list | None) -> list:
    """Engine logprobs ((logprob, [(id, logprob)])) -> OpenAI chat entries {token, logprob, bytes, top_logprobs}
    (None stays None: a PD decode worker's first token, whose logprobs prefill reports)."""
    out = []
    for tid, r in zip(token_ids, raw or [None] * len(token_ids)):
        if r is None:
            out.append(None)
            continue
        lp, top = r
        out.append({**_tok(tokenizer, tid, lp), "top_logprobs": [_tok(tokenizer, t, v) for t, v in top]})
    return out


def prompt_logprob_entries(tokenizer: Any, prompt_ids: list[int], raw: list | None) -> list:
    """``echo`` + logprobs: one entry per prompt token, ``raw`` holding the engine's for prompt_ids[1:]. The first
    token has its text and a null logprob (nothing predicts it), as OpenAI reports it."""
    first = {**_tok(tokenizer, prompt_ids[0], None), "top_logprobs": None}
    return [first] + logprob_entries(tokenizer, prompt_ids[1:], raw)


def completion_logprobs(entries: list, offset0: int = 0) -> dict:
    """Chat-shaped entries -> the legacy completions shape {tokens, token_logprobs, top_logprobs, text_offset}:
    ``text_offset[i]`` is where ``tokens[i]`` starts in the choice's text (from ``offset0``); an entry with a
    null logprob (the first echoed prompt token) has null top_logprobs."""
    tokens, lps, tops, offs = [], [], [], []
    pos = offset0
    for e in entries:
        e = e or {"token": "", "logprob": None, "top_logprobs": []}
        tokens.append(e["token"])
        lps.append(e["logprob"])
        tops.append(None if e["logprob"] is None else {t["token"]: t["logprob"] for t in e.get("top_logprobs") or []})
        offs.append(pos)
        pos += len(e["token"])
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offs}


@dataclass(slots=True)
class Choices:
    """Progress of the ``n`` choices of one response, fed every event in order (:meth:`see`)."""

    n: int = 1
    prompt_tokens: int = 0
    cached_tokens: int | None = None  # prompt tokens prefill did not recompute (None: not reported)
    tokens: list[int] = field(init=False)  # completion tokens per choice, so far (set by __post_init__)
    started: list[bool] = field(init=False)
    finished: list[bool] = field(init=False)

    def __post_init__(self) -> None:
        self.tokens, self.started, self.finished = [0] * self.n, [False] * self.n, [False] * self.n

    def see(self, ev: TokenEvent) -> tuple[int, bool]:
        """Record an event: (its choice, whether it is that choice's first event). ValueError for a bad index."""
        i = 0 if ev.index is None else choice_index(ev.index, self.n)
        if ev.prompt_tokens is not None:
            self.prompt_tokens = ev.prompt_tokens
        if ev.cached_tokens is not None:
            self.cached_tokens = ev.cached_tokens
        if ev.completion_tokens is not None:
            self.tokens[i] = ev.completion_tokens
        first, self.started[i] = not self.started[i], True
        if ev.finish is not None:  # what finish_reason says, without the property's call
            self.finished[i] = True
        return i, first

    @property
    def done(self) -> bool:
        return all(self.finished)

    def usage(self) -> dict:
        return usage_dict(self.prompt_tokens, sum(self.tokens), self.cached_tokens)


@dataclass(slots=True)
class OpenAIShape:
    """Response shape of one request: chat or text completion, its id, model and creation time; with
    ``tool_parser`` the output is parsed into tool calls; with ``echo`` the prompt precedes the text. Read-only
    once built (not frozen: one is built per request, and a frozen dataclass costs a setattr call per field)."""

    chat: bool
    oid: str
    model: str
    created: int
    tool_parser: str | None = None
    echo: str | None = None

    def stream_state(self) -> Any:
        if self.tool_parser is None:
            return None
        from pdruntime.server.openai.tools import StreamParser, parser_for

        return StreamParser(parser_for(self.tool_parser))

    def _lp(self, ev: TokenEvent | None) -> Any:
        entries = ev.logprobs if ev is not None else None
        if entries is None:
            return None
        return {"content": entries} if self.chat else completion_logprobs(entries)

    def chunk(self, ev: TokenEvent | None, *, role: bool = False, reason: str | None = None, use: dict | None = None,
              delta: dict | None = None, index: int = 0) -> dict:
        """One streamed chunk of choice ``index`` (``ev`` None: a chunk with no delta, e.g. the usage chunk)."""
        text = ev.delta if ev is not None else ""
        if self.chat:
            d: dict = delta if delta is not None else ({"content": text} if ev is not None else {})
            if delta is None and ev is not None and ev.tool_calls:  # parsed by an OpenAI-speaking decode
                d = {**({"content": text} if text else {}), "tool_calls": ev.tool_calls}
            if role:
                d = {"role": "assistant", **d}
            choice = {"index": index, "delta": d, "finish_reason": reason}
            if ev is not None and ev.logprobs is not None:
                choice["logprobs"] = self._lp(ev)
            obj = {"id": self.oid, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                   "choices": [choice]}
        else:
            obj = {"id": self.oid, "object": "text_completion", "created": self.created, "model": self.model,
                   "choices": [{"index": index, "text": text, "finish_reason": reason, "logprobs": self._lp(ev)}]}
        if use is not None:
            obj["usage"] = use
        return obj

    def usage_chunk(self, use: dict) -> dict:
        """The final chunk of ``stream_options.include_usage``: no choices, the usage."""
        u = self.chunk(None, use=use)
        u["choices"] = []
        return u

    def stream_chunks(self, ev: TokenEvent, *, first: bool, include_usage: bool, continuous_usage: bool = False,
                      state: Any = None, choices: Choices | None = None) -> list[dict]:
        """The chunks one event becomes (its delta; at the end, the usage chunk when asked for). ``state``:
        :meth:`stream_state` of this event's choice (tool-call parsing); ``choices``: the response's
        :class:`Choices`, already fed ``ev`` (None: one choice, whose usage ``ev`` carries)."""
        reason = ev.finish_reason
        index = ev.choice
        total = choices.usage() if choices is not None else ev.usage()
        last = choices.done if choices is not None else reason is not None
        use = total if continuous_usage else None  # OpenAI: usage once, in the final chunk (include_usage) only
        if first and self.echo is not None:
            ev = replace(ev, delta=self.echo + ev.delta)
        if state is None:
            out = [self.chunk(ev, role=first, reason=reason, use=use, index=index)]
        else:
            deltas = state.feed(ev.delta, final=reason is not None, cut=reason == "length")
            if reason == "stop" and state.calls_sent:  # cut by max_tokens, a (partial) call ends "length"
                reason = "tool_calls"
            out = [self.chunk(ev, role=first and i == 0, delta=d, use=use if i == len(deltas) - 1 else None,
                              reason=reason if i == len(deltas) - 1 else None, index=index)
                   for i, d in enumerate(deltas)] or [self.chunk(ev, role=first, delta={}, reason=reason, use=use,
                                                                 index=index)]
        if last and include_usage:
            out.append(self.usage_chunk(total))
        return out

    def final(self, text: str, last: TokenEvent, logprobs: list | None = None) -> dict:
        """The non-streamed response after the last event ``last`` (``logprobs``: every token's entry)."""
        return self.response([self.choice(0, text, last, logprobs)], last.usage())

    def response(self, choices: list[dict], use: dict) -> dict:
        """The non-streamed response of :meth:`choice` entries (indices 0..n-1, in order) and the usage."""
        return {"id": self.oid, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices, "usage": use}

    def choice(self, index: int, text: str, last: TokenEvent, logprobs: list | None = None,
               tool_calls: list | None = None) -> dict:
        """One choice of a non-streamed response: its text, its last event ``last``, every token's logprobs;
        ``tool_calls``: the calls an OpenAI-speaking decode parsed itself (:func:`merge_tool_call_deltas`)."""
        reason = last.finish_reason or "stop"
        if self.chat:
            message: dict = {"role": "assistant", "content": text}
            if tool_calls:
                message = {"role": "assistant", "content": text or None, "tool_calls": tool_calls}
            if self.tool_parser is not None:
                from pdruntime.server.openai.tools import openai_tool_calls, parser_for

                p = parser_for(self.tool_parser)
                content, calls = p.parse_cut(text) if reason == "length" else p.parse(text)
                message["content"] = content
                if calls:
                    message = {"role": "assistant", "content": content or None, "tool_calls": openai_tool_calls(calls)}
                    reason = "tool_calls" if reason == "stop" else reason  # cut by max_tokens: "length"
            return {"index": index, "message": message, "finish_reason": reason,
                    "logprobs": {"content": logprobs} if logprobs is not None else None}
        return {"index": index, "text": (self.echo or "") + text, "finish_reason": reason,
                "logprobs": completion_logprobs(logprobs) if logprobs is not None else None}


def merge_tool_call_deltas(calls: list[dict], deltas: list) -> list[dict]:
    """Streamed ``delta.tool_calls`` entries folded into whole calls (OpenAI's streaming rule: an entry with a new
    ``index`` opens a call with its id and name; later entries of that index append to its arguments)."""
    by_index = {c["_index"]: c for c in calls}
    for d in deltas:
        if not isinstance(d, dict):
            continue
        i = d.get("index", len(by_index))
        fn = d.get("function") if isinstance(d.get("function"), dict) else {}
        call = by_index.get(i)
        if call is None:
            call = by_index[i] = {"_index": i, "id": d.get("id") or f"call_{i}", "type": d.get("type") or "function",
                                  "function": {"name": fn.get("name") or "", "arguments": ""}}
            calls.append(call)
        elif fn.get("name"):
            call["function"]["name"] = fn["name"]
        call["function"]["arguments"] += fn.get("arguments") or ""
    return calls


def finished_tool_calls(calls: list[dict]) -> list[dict]:
    """:func:`merge_tool_call_deltas`' calls as a response's message.tool_calls (its bookkeeping key dropped)."""
    return [{k: v for k, v in c.items() if k != "_index"} for c in calls]
