"""Pure OpenAI response shaping from SGLang-style token events, shared by the router and the workers' /v1 routes.

An event is what a decode worker streams: ``{"delta": str, "token_ids": [...], "meta_info": {"prompt_tokens",
"completion_tokens", "finish_reason": {"type": ...} | None}}``.
"""

from __future__ import annotations

from dataclasses import dataclass


def usage(ev: dict) -> dict:
    mi = ev.get("meta_info") or {}
    p, c = int(mi.get("prompt_tokens", 0)), int(mi.get("completion_tokens", 0))
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def finish_reason(ev: dict) -> str | None:
    """OpenAI's finish_reason of an event: None while generating, then "length" or "stop"."""
    fr = (ev.get("meta_info") or {}).get("finish_reason")
    if not fr:
        return None
    t = fr.get("type") if isinstance(fr, dict) else str(fr)
    return "length" if t == "length" else "stop"


@dataclass(frozen=True)
class OpenAIShape:
    """Response shape of one request: chat or text completion, its id, model and creation time."""

    chat: bool
    oid: str
    model: str
    created: int

    def chunk(self, ev: dict | None, *, role: bool = False, reason: str | None = None, use: dict | None = None) -> dict:
        """One streamed chunk (``ev`` None: a chunk with no delta, e.g. the usage chunk)."""
        delta = ev.get("delta", "") if ev else ""
        if self.chat:
            d: dict = {"content": delta} if ev else {}
            if role:
                d = {"role": "assistant", **d}
            obj = {"id": self.oid, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                   "choices": [{"index": 0, "delta": d, "finish_reason": reason}]}
        else:
            obj = {"id": self.oid, "object": "text_completion", "created": self.created, "model": self.model,
                   "choices": [{"index": 0, "text": delta, "finish_reason": reason, "logprobs": None}]}
        if use is not None:
            obj["usage"] = use
        return obj

    def usage_chunk(self, ev: dict) -> dict:
        """The final chunk of ``stream_options.include_usage``: no choices, the usage."""
        u = self.chunk(None, use=usage(ev))
        u["choices"] = []
        return u

    def stream_chunks(self, ev: dict, *, first: bool, include_usage: bool) -> list[dict]:
        """The chunks one event becomes (its delta; at the end, the usage chunk when asked for)."""
        reason = finish_reason(ev)
        out = [self.chunk(ev, role=first, reason=reason, use=usage(ev) if reason else None)]
        if reason and include_usage:
            out.append(self.usage_chunk(ev))
        return out

    def final(self, text: str, last: dict) -> dict:
        """The non-streamed response after the last event ``last``."""
        reason = finish_reason(last) or "stop"
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": reason}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "finish_reason": reason, "logprobs": None}
            obj = "text_completion"
        return {"id": self.oid, "object": obj, "created": self.created, "model": self.model, "choices": [choice],
                "usage": usage(last)}
