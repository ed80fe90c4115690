"""Capped exponential backoff: the one formula behind every retry delay in the runtime."""

from __future__ import annotations

MAX_DOUBLINGS = 30  # 2**30 * any base is past every cap; bounds the float


def capped_backoff(attempt: int, base_s: float, cap_s: float) -> float:
    """Seconds to wait before retry ``attempt`` (1-based): ``base_s * 2**(attempt-1)``, at most ``cap_s``;
    0 for ``attempt`` <= 0 (nothing failed yet)."""
    if attempt <= 0:
        return 0.0
    return min(cap_s, base_s * 2 ** min(attempt - 1, MAX_DOUBLINGS))
