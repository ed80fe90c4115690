"""Pure routing decisions: pair choice (least outstanding, sticky by conversation) and circuit breakers."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from pdruntime.server.topology import Pair

STICKY_CAPACITY = 65536  # conversation keys remembered (LRU)


@dataclass
class CircuitBreaker:
    """closed -> (``threshold`` consecutive failures) -> open for ``cooldown_s`` -> half-open (one trial)
    -> closed on success / open again on failure. Times are caller-supplied seconds."""

    threshold: int = 3
    cooldown_s: float = 5.0
    failures: int = 0
    opened_at: float | None = None
    trial_in_flight: bool = False

    def state(self, now: float) -> str:
        if self.opened_at is None:
            return "closed"
        if now - self.opened_at >= self.cooldown_s:
            return "half_open"
        return "open"

    def allows(self, now: float) -> bool:
        st = self.state(now)
        return st == "closed" or (st == "half_open" and not self.trial_in_flight)

    def on_dispatch(self, now: float) -> None:
        if self.state(now) == "half_open":
            self.trial_in_flight = True

    def record_success(self) -> None:
        self.failures = 0
        self.opened_at = None
        self.trial_in_flight = False

    def record_failure(self, now: float) -> None:
        self.trial_in_flight = False
        self.failures += 1
        if self.opened_at is not None or self.failures >= self.threshold:
            self.opened_at = now


@dataclass
class PairState:
    pair: Pair
    outstanding: int = 0
    breaker: CircuitBreaker = field(default_factory=CircuitBreaker)


class PairPicker:
    """Chooses a pair per request. Sticky by conversation key so a multi-round agent keeps its pair
    (its prefix stays warm and its requests stay ordered); otherwise least outstanding requests."""

    def __init__(self, threshold: int = 3, cooldown_s: float = 5.0) -> None:
        self.states: dict[int, PairState] = {}
        self.sticky: OrderedDict[str, int] = OrderedDict()
        self.threshold = threshold
        self.cooldown_s = cooldown_s

    def set_pairs(self, pairs: tuple[Pair, ...]) -> None:
        """Install a new topology; keeps outstanding counts and breakers of pairs whose endpoints are unchanged."""
        new: dict[int, PairState] = {}
        for p in pairs:
            old = self.states.get(p.index)
            if old is not None and (old.pair.prefill_url, old.pair.decode_url, old.pair.bootstrap_port) == \
                    (p.prefill_url, p.decode_url, p.bootstrap_port):
                old.pair = p
                new[p.index] = old
            else:
                new[p.index] = PairState(p, 0, CircuitBreaker(self.threshold, self.cooldown_s))
                if old is not None:
                    new[p.index].outstanding = old.outstanding
        self.states = new

    def eligible(self, now: float, exclude: set[int] = frozenset()) -> list[PairState]:
        return [s for s in self.states.values() if s.pair.ready and s.pair.index not in exclude and s.breaker.allows(now)]

    def choose(self, now: float, key: str | None, exclude: set[int] = frozenset()) -> PairState | None:
        cands = self.eligible(now, exclude)
        if not cands:
            return None
        if key is not None:
            idx = self.sticky.get(key)
            if idx is not None:
                for s in cands:
                    if s.pair.index == idx:
                        self.sticky.move_to_end(key)
                        return s
        best = min(cands, key=lambda s: (s.outstanding, s.pair.index))
        if key is not None:
            self.sticky[key] = best.pair.index
            self.sticky.move_to_end(key)
            while len(self.sticky) > STICKY_CAPACITY:
                self.sticky.popitem(last=False)
        return best
