"""Pure routing decisions: pair choice by policy (least outstanding and sticky by conversation, round-robin, or
prefix-aware within a load bound), pinning to one group (``X-PDStack-Pair``: canary probes), and circuit
breakers. Whatever the policy, it chooses among :meth:`PairPicker.eligible` pairs only: never a draining, not
ready, breaker-open or stale pair, and never a canary pair for normal traffic."""

from __future__ import annotations

import enum
from collections import OrderedDict
from dataclasses import dataclass, field

from pdruntime.server.router.prefix_tree import CHUNK_CHARS, PrefixTree, chunk_names
from pdruntime.server.router.topology import Pair

STICKY_CAPACITY = 65536  # conversation keys remembered (LRU)
ROUTING_POLICIES = ("least-load", "round-robin", "prefix")


@dataclass(frozen=True)
class RoutingConfig:
    """How normal traffic picks a pair (``pdrt serve --role router --routing-policy ...``; CRD spec.router.routing).

    ``prefix``: the pair holding the longest prefix of the prompt (the prefix tree's record of what was sent
    where), if it holds at least ``cache_threshold`` of the prompt; else the least loaded pair (ties: the one
    holding the least, so new prefixes spread). Load bound: when the busiest eligible pair has more than
    ``balance_abs_threshold`` outstanding requests above the idlest and more than ``balance_rel_threshold`` times
    its load, the request goes to the least loaded pair whatever it holds (and that pair learns the prefix), so
    one hot prefix cannot pin every request to one pair."""

    policy: str = "least-load"
    balance_abs_threshold: int = 8  # outstanding requests on a pair's busier worker
    balance_rel_threshold: float = 1.5  # busiest / idlest load ratio
    cache_threshold: float = 0.3  # share of the prompt's characters a pair must hold to win on its prefix
    tree_max_chars: int = 1 << 20  # prompt characters remembered per pair (LRU), about 12 MB of router memory

    def __post_init__(self) -> None:
        problems = []
        if self.policy not in ROUTING_POLICIES:
            problems.append(f"routing policy {self.policy!r} is invalid; accepted: {' | '.join(ROUTING_POLICIES)}")
        if isinstance(self.balance_abs_threshold, bool) or not isinstance(self.balance_abs_threshold, int) \
                or self.balance_abs_threshold < 0:
            problems.append(f"balance_abs_threshold={self.balance_abs_threshold!r} is invalid; accepted: an integer "
                            ">= 0 (outstanding requests)")
        if not isinstance(self.balance_rel_threshold, (int, float)) or not self.balance_rel_threshold >= 1:
            problems.append(f"balance_rel_threshold={self.balance_rel_threshold!r} is invalid; accepted: a number "
                            ">= 1 (busiest / idlest load)")
        if not isinstance(self.cache_threshold, (int, float)) or not 0 <= self.cache_threshold <= 1:
            problems.append(f"cache_threshold={self.cache_threshold!r} is invalid; accepted: a number in [0, 1] "
                            "(share of the prompt held)")
        if isinstance(self.tree_max_chars, bool) or not isinstance(self.tree_max_chars, int) \
                or self.tree_max_chars < CHUNK_CHARS:
            problems.append(f"tree_max_chars={self.tree_max_chars!r} is invalid; accepted: an integer >= "
                            f"{CHUNK_CHARS} (prompt characters remembered per pair)")
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def tree_max_chunks(self) -> int:
        return self.tree_max_chars // CHUNK_CHARS

    def imbalanced(self, loads: list[int]) -> bool:
        """The load bound: True when prefix affinity must yield to least-load."""
        lo, hi = min(loads), max(loads)
        return hi - lo > self.balance_abs_threshold and hi > self.balance_rel_threshold * lo


class Outcome(enum.Enum):
    """How one dispatched request ended, as far as its pair's health is concerned."""

    SUCCESS = "success"  # decode produced a first token: the pair works
    FAILURE = "failure"  # the pair itself failed (connection refused/reset, 5xx, stream broken before a token)
    NEUTRAL = "neutral"  # says nothing about the pair: the client left first, a 4xx (bad input), our own deadline


# the members as module names: an enum class's attribute is read through its metaclass's __getattr__ hook, several
# times slower than a global, and every dispatch reads two or three
SUCCESS, FAILURE, NEUTRAL = Outcome.SUCCESS, Outcome.FAILURE, Outcome.NEUTRAL


@dataclass
class CircuitBreaker:
    """Per-pair breaker. Pure: every method takes the caller's clock (seconds) and returns data.

    ::

        closed --(threshold consecutive FAILUREs)--> open --(cooldown_s)--> half_open
        half_open --dispatch--> one trial in flight (others wait)
        trial SUCCESS -> closed      trial FAILURE -> open (cooldown restarts)
        trial NEUTRAL -> half_open, re-armed (the next request is the trial)
        trial unresolved after trial_timeout_s -> half_open, re-armed (a lost trial cannot hold the pair)

    Invariant (tested exhaustively in tests/pd/test_breaker.py): with no new failure, a pair that is
    excluded now is eligible again by ``now + cooldown_s + trial_timeout_s`` at the latest: the breaker
    always recovers within its window plus one trial. ``reopens_at`` names that timer.
    """

    threshold: int = 3
    cooldown_s: float = 5.0
    trial_timeout_s: float = 30.0  # seconds a half-open trial may stay unresolved before another is let through
    failures: int = 0
    opened_at: float | None = None
    trial_started: float | None = None  # set while a half-open trial is in flight

    def state(self, now: float) -> str:
        if self.opened_at is None:
            return "closed"
        if now - self.opened_at >= self.cooldown_s:
            return "half_open"
        return "open"

    def _trial_pending(self, now: float) -> bool:
        return self.trial_started is not None and now - self.trial_started < self.trial_timeout_s

    def allows(self, now: float) -> bool:
        if self.opened_at is None:  # closed: the usual answer, without state()'s call
            return True
        st = self.state(now)
        return st == "closed" or (st == "half_open" and not self._trial_pending(now))

    def reopens_at(self, now: float) -> float | None:
        """When an excluded pair becomes eligible again without any new event (None: it is eligible now)."""
        if self.allows(now):
            return None
        if self.state(now) == "open":
            return self.opened_at + self.cooldown_s
        return self.trial_started + self.trial_timeout_s

    def on_dispatch(self, now: float) -> bool:
        """A request goes to this pair; True if it is the half-open trial (pass it back to ``record``)."""
        if self.opened_at is not None and self.state(now) == "half_open":
            self.trial_started = now
            return True
        return False

    def record(self, outcome: Outcome, now: float, *, trial: bool) -> bool:
        """Resolve one dispatched request. Every dispatch must end in exactly one ``record``. True when this
        outcome (a failure) opened the breaker or restarted its cooldown."""
        if trial:
            self.trial_started = None  # resolved: success closes, failure re-opens, neutral re-arms
        if outcome is SUCCESS:
            self.failures = 0
            self.opened_at = None
        elif outcome is FAILURE:
            self.failures += 1
            if self.opened_at is not None or self.failures >= self.threshold:
                self.opened_at = now
                self.trial_started = None  # a new cooldown; the next trial starts after it
                return True
        return False

    def trip(self, now: float) -> None:
        """Open now, as ``threshold`` failures would (another router process's breaker for the same pair tripped)."""
        self.failures = max(self.failures, self.threshold)
        self.opened_at = now
        self.trial_started = None

    # the pre-outcome API, kept for callers that only know success and failure
    def record_success(self, now: float = 0.0) -> None:
        self.record(Outcome.SUCCESS, now, trial=self.trial_started is not None)

    def record_failure(self, now: float) -> None:
        self.record(Outcome.FAILURE, now, trial=self.trial_started is not None)


@dataclass
class PairState:
    pair: Pair
    outstanding: int = 0
    breaker: CircuitBreaker = field(default_factory=CircuitBreaker)


class PairPicker:
    """Chooses a pair per request, by ``routing.policy``. ``least-load`` (the default): sticky by conversation key
    so a multi-round agent keeps its pair (its prefix stays warm and its requests stay ordered), otherwise least
    outstanding requests. ``round-robin``: the next eligible pair in turn. ``prefix``: see :class:`RoutingConfig`."""

    def __init__(self, threshold: int = 3, cooldown_s: float = 5.0, trial_timeout_s: float = 30.0,
                 routing: RoutingConfig | None = None) -> None:
        self.states: dict[int, PairState] = {}
        self.sticky: OrderedDict[str, int] = OrderedDict()
        self.threshold = threshold
        self.cooldown_s = cooldown_s
        self.trial_timeout_s = trial_timeout_s
        self.routing = routing or RoutingConfig()
        self.tree = PrefixTree(self.routing.tree_max_chunks) if self.routing.policy == "prefix" else None
        self.turn = 0  # round-robin position
        self.decisions = {"prefix_hit": 0, "least_load": 0, "load_bound": 0}  # prefix policy's choices, by reason

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
                new[p.index] = PairState(p, 0, CircuitBreaker(self.threshold, self.cooldown_s, self.trial_timeout_s))
                if old is not None:
                    new[p.index].outstanding = old.outstanding
        if self.tree is not None:  # a pair that left, or whose workers changed, holds nothing we sent
            for idx in self.tree.pairs():
                if idx not in new or new[idx] is not self.states.get(idx):
                    self.tree.forget(idx)
        self.states = new

    def worker_loads(self) -> dict[str, int]:
        """Outstanding requests per worker URL, over every entry using it: in a P:D group the entries (one per
        prefill x decode) share workers, so the entry with the lowest prefill + decode load is the least-loaded
        prefill with the least-loaded decode of its group."""
        load: dict[str, int] = {}
        for s in self.states.values():
            load[s.pair.prefill_url] = load.get(s.pair.prefill_url, 0) + s.outstanding
            load[s.pair.decode_url] = load.get(s.pair.decode_url, 0) + s.outstanding
        return load

    def eligible(self, now: float, exclude: set[int] = frozenset(), group: int | None = None) -> list[PairState]:
        """Pairs a request may go to now. Normal traffic (``group`` None): ready, not canary. Pinned: the ready
        pairs of that group, canary or not."""
        return [s for s in self.states.values() if s.pair.ready and s.pair.index not in exclude and s.breaker.allows(now)
                and (s.pair.group_id == group if group is not None else not s.pair.canary)]

    def reopens_at(self, now: float) -> float | None:
        """The earliest time a ready pair that is excluded by its breaker becomes eligible (None: none waits)."""
        times = [t for s in self.states.values() if s.pair.ready and not s.pair.canary
                 and (t := s.breaker.reopens_at(now)) is not None]
        return min(times) if times else None

    def groups(self) -> list[int]:
        return sorted({s.pair.group_id for s in self.states.values()})

    def unroutable(self, now: float, group: int, stale: set[int] = frozenset()) -> str:
        """Why a request pinned to ``group`` has no pair now (for its 503)."""
        members = [s for s in self.states.values() if s.pair.group_id == group]
        if not members:
            return f"the topology has no group {group} (groups: {', '.join(map(str, self.groups())) or 'none'})"
        if all(s.pair.draining for s in members):
            return f"group {group} is draining"
        if not any(s.pair.ready for s in members):
            return f"group {group} is not ready"
        if all(s.pair.index in stale for s in members if s.pair.ready):
            return f"group {group}'s workers stopped answering /health (stale)"
        return f"group {group}'s circuit breaker is open after failures"

    def choose(self, now: float, key: str | None, exclude: set[int] = frozenset(),
               group: int | None = None, prompt: str | None = None) -> PairState | None:
        """Normal traffic: by ``routing.policy`` among the eligible pairs, never a canary pair (``key``: the
        conversation, for least-load's stickiness; ``prompt``: the routing text, for the prefix policy).
        ``group``: only that group's pairs (pinned requests), least loaded, whatever the policy; the sticky table
        and the prefix tree are left alone."""
        cands = self.eligible(now, exclude, group)
        if not cands:
            return None
        if group is not None:
            return self._least_loaded(cands, self.worker_loads())
        if self.routing.policy == "round-robin":
            cands.sort(key=lambda s: s.pair.index)
            self.turn += 1
            return cands[(self.turn - 1) % len(cands)]
        if self.tree is not None:
            return self._choose_by_prefix(cands, self.worker_loads(), prompt)
        if key is not None:
            idx = self.sticky.get(key)
            if idx is not None:
                for s in cands:
                    if s.pair.index == idx:
                        self.sticky.move_to_end(key)
                        return s
        best = cands[0] if len(cands) == 1 else self._least_loaded(cands, self.worker_loads())
        if key is not None:
            self.sticky[key] = best.pair.index
            self.sticky.move_to_end(key)
            while len(self.sticky) > STICKY_CAPACITY:
                self.sticky.popitem(last=False)
        return best

    @staticmethod
    def _least_loaded(cands: list[PairState], load: dict[str, int], held: dict[int, int] | None = None) -> PairState:
        """Lowest prefill + decode worker load, then fewest own outstanding, then (``held``) the pair holding the
        least prefix-tree nodes, then the lowest index."""
        return min(cands, key=lambda s: (load[s.pair.prefill_url] + load[s.pair.decode_url], s.outstanding,
                                         held.get(s.pair.index, 0) if held else 0, s.pair.index))

    def _choose_by_prefix(self, cands: list[PairState], load: dict[str, int], prompt: str | None) -> PairState:
        """The prefix policy: the longest held prefix (at least ``cache_threshold`` of the prompt), unless the
        load bound says least-load; the chosen pair then holds the prompt."""
        names = chunk_names(prompt or "")
        sizes = {s.pair.index: self.tree.size(s.pair.index) for s in cands}
        # a pair's load for the bound: requests in flight on its busier worker (in a P:D group, over its entries)
        loads = {s.pair.index: max(load[s.pair.prefill_url], load[s.pair.decode_url]) for s in cands}
        if self.routing.imbalanced(list(loads.values())):
            best, reason = self._least_loaded(cands, load, sizes), "load_bound"
        else:
            matched = self.tree.match(names, set(sizes))
            top = max(matched.values(), default=0)
            if top and top * CHUNK_CHARS >= self.routing.cache_threshold * len(prompt or ""):
                best = min((s for s in cands if matched[s.pair.index] == top),
                           key=lambda s: (loads[s.pair.index], s.outstanding, s.pair.index))
                reason = "prefix_hit"
            else:
                best, reason = self._least_loaded(cands, load, sizes), "least_load"
        self.decisions[reason] += 1
        self.tree.record(best.pair.index, names)
        return best
