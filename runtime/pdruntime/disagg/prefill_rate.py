"""Admission from a measured prefill rate (issue 20, build item 2): a request that cannot be served in time is
refused when it arrives, with the figures, instead of failing after its deadline.

:class:`PrefillRate` measures prompt tokens per second this worker computes, sampled only over intervals that
began with a backlog (an idle stretch would make the rate look slow and refuse work that fits), as an EWMA.
:func:`verdict` compares what a request needs (its prompt, and the backlog queued before it) with the seconds
its router says are left. Pure: the shell (worker/prefill.py) feeds it clocks and counters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

ALPHA = 0.3  # EWMA weight of a new sample
MIN_INTERVAL_S = 0.5  # shorter intervals are too noisy to sample
MAX_RETRY_AFTER_S = 30


class PrefillRate:
    def __init__(self) -> None:
        self.tokens_per_s: float | None = None
        self._start: tuple[float, int] | None = None  # (time, computed tokens) where the current interval began

    def observe(self, now: float, computed_total: int, backlog_tokens: int) -> None:
        """``computed_total``: the engine's cumulative prompt tokens computed; ``backlog_tokens``: still to compute.
        An interval is sampled only when it began and ended with a backlog (busy throughout, as far as can be seen)."""
        start = self._start
        if start is not None and now - start[0] < MIN_INTERVAL_S:
            return  # keep the interval open
        if start is not None and backlog_tokens > 0 and computed_total >= start[1]:
            sample = (computed_total - start[1]) / (now - start[0])
            self.tokens_per_s = sample if self.tokens_per_s is None else \
                (1 - ALPHA) * self.tokens_per_s + ALPHA * sample
        self._start = (now, computed_total) if backlog_tokens > 0 else None


@dataclass(frozen=True)
class Verdict:
    status: int  # 400: the prompt alone cannot make it; 429: not behind this backlog (Retry-After)
    code: str
    message: str
    retry_after: int | None = None


def verdict(rate: float | None, prompt_tokens: int, backlog: list[int], seconds_left: float | None) -> Verdict | None:
    """None: admit. A refusal only with a measured rate and a deadline to meet. ``backlog``: the prompt tokens each
    queued request still has to compute. Prefill gives each step to the fewest remaining tokens first,
    above a floor for every prompt (engine/scheduler.py prefill_grants), so a queued request delays this one by at
    most this one's own length: it waits at most ``sum(min(r, prompt))``."""
    if rate is None or rate <= 0 or seconds_left is None:
        return None
    ahead = sum(min(r, prompt_tokens) for r in backlog)
    alone = prompt_tokens / rate
    behind = (prompt_tokens + ahead) / rate
    if behind <= seconds_left:
        return None
    figures = (f"{prompt_tokens} prompt tokens at the measured {rate:.0f} tokens/s take ~{alone:.1f}s; {ahead} "
               f"tokens of {len(backlog)} queued requests share prefill with it (~{behind:.1f}s in all); "
               f"{seconds_left:.1f}s are left of its deadline")
    if alone > seconds_left:
        return Verdict(400, "deadline_unreachable", f"this request cannot be prefilled within its deadline: {figures}; "
                       "accepted: a shorter prompt, or a longer X-Request-Timeout (up to the router's "
                       "--request-timeout-s)")
    wait = max(1, min(MAX_RETRY_AFTER_S, math.ceil(behind - seconds_left)))
    return Verdict(429, "prefill_backlog", f"prefill is too busy to serve this request within its deadline: {figures}; "
                   f"retry after {wait}s", retry_after=wait)
