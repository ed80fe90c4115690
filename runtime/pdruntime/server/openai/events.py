"""The token events a decode worker streams to the router (SGLang ``/generate`` shape on the wire), typed.

On the wire one event is ``{"text", "delta", "token_ids", "meta_info": {"id", "prompt_tokens",
"completion_tokens", "finish_reason": {"type": ...} | None}}``, plus ``"index"`` (its choice, 0..n-1) when
``n`` > 1, ``"prompt_logprobs"`` and ``"logprobs"`` when asked for, and ``meta_info.cached_tokens`` (SGLang's
name: prompt tokens prefill did not recompute) when known. :meth:`TokenEvent.to_json` writes that
shape (the decode worker), :meth:`TokenEvent.from_json` is the one place it is parsed (the router's decode leg).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any


def choice_index(raw: Any, n: int) -> int:
    """An event's choice (0 when absent); ValueError unless an integer in [0, n)."""
    i = 0 if raw is None else raw
    if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n:
        raise ValueError(f"event choice index {i!r} is outside 0..{n - 1}")
    return i


def _finish_type(raw: Any) -> str | None:
    """SGLang's finish_reason ({"type": t} or t) -> t; None while generating ("" for a reason without a type)."""
    if not raw:
        return None
    return str((raw.get("type") if isinstance(raw, dict) else raw) or "")


def _count(raw: Any) -> int | None:
    """A count from the wire: None when absent, an int as it came, anything else through int() (ValueError, TypeError)."""
    return raw if raw is None or type(raw) is int else int(raw)


def usage_dict(prompt: int, completion: int, cached: int | None) -> dict:
    """OpenAI's usage object; ``prompt_tokens_details.cached_tokens`` when the cached count is known."""
    out: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    if cached is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached}
    return out


@dataclass(slots=True)
class TokenEvent:
    """One decode event of one choice. Counts are that choice's; ``text`` is its whole text so far. Read-only once
    built (:meth:`then` builds a new one); not a frozen dataclass only because those cost a setattr call per field,
    and decode and the router build one per event."""

    delta: str = ""
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    rid: str | None = None  # meta_info.id
    prompt_tokens: int | None = None  # None: not reported
    completion_tokens: int | None = None
    finish: str | None = None  # SGLang's finish_reason type ("length", "stop", "abort", ...); None: generating
    index: int | None = None  # the choice, when n > 1 (None: not on the wire, choice 0)
    logprobs: list | None = None  # one entry per token of token_ids (None entries: reported by prefill)
    prompt_logprobs: list | None = None
    cached_tokens: int | None = None  # prompt tokens whose KV prefill did not recompute (its prefix cache); None: not reported
    # an OpenAI-speaking decode (the router's sglang/vllm worker protocols) parses tool calls itself: its chunks'
    # delta.tool_calls, passed through as they came ([{index, id?, type?, function: {name?, arguments}}])
    tool_calls: list | None = None
    n_tokens: int | None = None  # tokens this event adds when token_ids are not on the wire (OpenAI chunks)

    @property
    def choice(self) -> int:
        return self.index or 0

    @property
    def num_tokens(self) -> int:
        """Completion tokens this event adds (its token ids, or what an OpenAI chunk's usage said)."""
        return len(self.token_ids) if self.n_tokens is None else self.n_tokens

    @property
    def finish_reason(self) -> str | None:
        """OpenAI's finish_reason: None while generating, then "length", "tool_calls" (an OpenAI-speaking decode's
        own) or "stop"."""
        if self.finish is None:
            return None
        return self.finish if self.finish in ("length", "tool_calls") else "stop"

    def then(self, later: "TokenEvent") -> "TokenEvent":
        """This event and ``later`` (the same choice, next) as one: deltas, token ids and logprobs joined, the
        counts, text and finish ``later``'s. Decode sends one event per batch of tokens that are ready together."""
        lps = None if self.logprobs is None and later.logprobs is None else (self.logprobs or []) + (later.logprobs or [])
        calls = None if self.tool_calls is None and later.tool_calls is None else \
            (self.tool_calls or []) + (later.tool_calls or [])
        count = None if self.n_tokens is None and later.n_tokens is None else self.num_tokens + later.num_tokens
        return replace(later, delta=self.delta + later.delta, token_ids=self.token_ids + later.token_ids, logprobs=lps,
                       prompt_logprobs=self.prompt_logprobs if self.prompt_logprobs is not None else later.prompt_logprobs,
                       tool_calls=calls, n_tokens=count)

    def usage(self) -> dict:
        p, c = self.prompt_tokens or 0, self.completion_tokens or 0
        return usage_dict(p, c, self.cached_tokens)

    def to_json(self) -> dict:
        out: dict[str, Any] = {"text": self.text, "delta": self.delta, "token_ids": list(self.token_ids),
                               "meta_info": {"id": self.rid, "prompt_tokens": self.prompt_tokens,
                                             "completion_tokens": self.completion_tokens,
                                             "finish_reason": None if self.finish is None else {"type": self.finish}}}
        if self.cached_tokens is not None:
            out["meta_info"]["cached_tokens"] = self.cached_tokens
        if self.index is not None:
            out["index"] = self.index
        if self.prompt_logprobs is not None:
            out["prompt_logprobs"] = self.prompt_logprobs
        if self.logprobs is not None:
            out["logprobs"] = self.logprobs
        return out

    @classmethod
    def from_json(cls, ev: dict, n: int | None = None) -> "TokenEvent":
        """A wire event (decode's, or prefill's answer) -> TokenEvent. With ``n``: ValueError for a choice outside
        [0, n)."""
        mi = ev.get("meta_info") or {}
        index = ev.get("index")
        if index is not None and n is not None:  # absent: choice 0, which every n has
            choice_index(index, n)
        ids = ev.get("token_ids")
        # positional, in the fields' order, and no copy of what JSON already made a list or int: the router builds
        # one per decode event (3x cheaper than keywords, copies and int() of ints)
        return cls(ev.get("delta", ""), ids if type(ids) is list else list(ids or ()), ev.get("text", ""), mi.get("id"),
                   _count(mi.get("prompt_tokens")), _count(mi.get("completion_tokens")),
                   _finish_type(mi.get("finish_reason")), index, ev.get("logprobs"), ev.get("prompt_logprobs"),
                   _count(mi.get("cached_tokens")))


def _logprob_entries_of(lp: Any, chat: bool) -> list | None:
    """A chunk choice's ``logprobs`` as chat entries ({token, logprob, top_logprobs}); completions' legacy shape
    ({tokens, token_logprobs, top_logprobs}) is turned back into them."""
    if not isinstance(lp, dict):
        return None
    if chat:
        content = lp.get("content")
        return list(content) if isinstance(content, list) else None
    tokens, lps, tops = lp.get("tokens") or [], lp.get("token_logprobs") or [], lp.get("top_logprobs") or []
    out = []
    for i, tok in enumerate(tokens):
        top = tops[i] if i < len(tops) and isinstance(tops[i], dict) else {}
        out.append({"token": tok, "logprob": lps[i] if i < len(lps) else None, "bytes": list(str(tok).encode("utf-8")),
                    "top_logprobs": [{"token": t, "logprob": v, "bytes": list(t.encode("utf-8"))} for t, v in top.items()]})
    return out


class OpenAIStreamReader:
    """Decode's OpenAI-shaped SSE chunks (SGLang's and vLLM's /v1 routes, pdrt's too) -> TokenEvents, one per choice
    per chunk. Token counts come from the chunks' usage (the router asks for ``continuous_usage_stats``: the running
    total on every chunk, whose growth is the tokens a chunk added); a chunk without usage counts one token."""

    def __init__(self, n: int, chat: bool) -> None:
        self.n, self.chat = n, chat
        self.tokens = [0] * n  # completion tokens per choice so far
        self.texts = [""] * n
        self.total = 0  # the last usage.completion_tokens seen (every choice's)
        self.prompt: int | None = None
        self.cached: int | None = None

    def events(self, chunk: dict) -> list[TokenEvent]:
        """The events of one chunk (none for a usage-only chunk). ValueError for a chunk that is not one."""
        if not isinstance(chunk, dict) or not isinstance(chunk.get("choices"), list):
            raise ValueError("an OpenAI chunk has a 'choices' list")
        use = chunk.get("usage") if isinstance(chunk.get("usage"), dict) else None
        added = None
        if use is not None:
            self.prompt = use.get("prompt_tokens", self.prompt)
            details = use.get("prompt_tokens_details")
            if isinstance(details, dict) and details.get("cached_tokens") is not None:
                self.cached = int(details["cached_tokens"])
            total = use.get("completion_tokens")
            if isinstance(total, int) and not isinstance(total, bool):
                added, self.total = max(0, total - self.total), max(self.total, total)
        out = []
        for c in chunk["choices"]:
            if not isinstance(c, dict):
                raise ValueError("an OpenAI chunk's choices are objects")
            i = choice_index(c.get("index"), self.n)
            if self.chat:
                d = c.get("delta") if isinstance(c.get("delta"), dict) else {}
                text = d.get("content") or ""
                calls = d.get("tool_calls") or None
            else:
                text, calls = c.get("text") or "", None
            finish = c.get("finish_reason") or None
            count = added if added is not None else int(bool(text or calls))
            added = 0  # a chunk's usage growth belongs to its (one) choice
            if not (text or calls or finish or count):
                continue  # e.g. the role-only first chunk
            self.tokens[i] += count
            self.texts[i] += text
            out.append(TokenEvent(delta=text, text=self.texts[i], prompt_tokens=self.prompt,
                                  completion_tokens=self.tokens[i], finish=finish, index=i if self.n > 1 else None,
                                  logprobs=_logprob_entries_of(c.get("logprobs"), self.chat), cached_tokens=self.cached,
                                  tool_calls=calls, n_tokens=count, rid=chunk.get("id")))
        return out
