"""Continuous-batching scheduler: which sequences decode, which prefill (in chunks), who is preempted.

Pure bookkeeping over Sequence objects and the BlockPool; the Engine runs the model on the plan.
Policy:
* Every RUNNING sequence decodes each step; its next page is allocated on demand. When the pool is
  empty the newest admitted sequence is preempted (pages freed, KV recomputed later), never the oldest.
* Admission is FIFO: a WAITING sequence is admitted when a sequence slot is free and the pool holds
  pages for its whole prompt (allocated at once, so chunked prefills can never deadlock on pages).
  With the prefix cache, the longest cached page-aligned prefix of its tokens (at most all but the last
  token, whose logits must be computed) is shared instead of allocated, and prefill starts after it.
* Prefill runs in chunks of at most ``max_prefill_tokens`` tokens per step, shared across sequences,
  so new requests join while the running batch keeps decoding. The budget goes to the prompts with the
  fewest tokens left first, above a floor every prompt gets (:func:`prefill_grants`): a long prompt takes
  what the others leave, never the whole step while another prompt waits, so a short request's first token
  waits about one chunk-time, not the long prompt's length; and equal prompts finish one after another,
  not all together at the end.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .block_pool import BlockPool
from .config import EngineConfig
from .prefix_cache import PrefixCache
from .sequence import Sequence, Status


@dataclass
class StepPlan:
    decode: list[Sequence] = field(default_factory=list)
    prefill: list[tuple[Sequence, int, int]] = field(default_factory=list)  # (seq, start, end) token range
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.decode and not self.prefill


def prefill_grants(remaining: list[int], budget: int) -> list[int]:
    """Split one step's ``budget`` prompt tokens over the sequences needing ``remaining`` tokens each.

    Fewest remaining tokens first, every prompt advancing: each open sequence first gets a floor of an
    eighth of an equal share (``budget // (8 * open)``, at most its need), then the rest of the budget goes
    to the sequences with the fewest tokens left, whole, in that order (admission order breaks ties).

    Shortest-remaining-first is what minimises mean time to first token: eight equal prompts finish one or
    two a step, not all eight together at the end as an equal split makes them; a short prompt behind a long
    one is done in the next step; and a long one is behind a shorter one by at most that one's length (the
    bound ``disagg/prefill_rate.py`` estimates a queued request's wait with). The floor keeps every prompt
    advancing every step, so a long prompt is never starved by a stream of short ones, and its progress
    (what the watchdogs measure) never stops. Pure; sum(result) == min(budget, sum(remaining))."""
    open_ = [i for i, r in enumerate(remaining) if r > 0]
    if not open_:
        return [0] * len(remaining)
    floor = budget // (8 * len(open_))
    grant = [min(r, floor) for r in remaining]
    left = budget - sum(grant)
    for i in sorted(open_, key=lambda i: (remaining[i] - grant[i], i)):
        if left <= 0:
            break
        give = min(remaining[i] - grant[i], left)
        grant[i] += give
        left -= give
    return grant


class Scheduler:
    def __init__(self, config: EngineConfig, pool: BlockPool, cache: PrefixCache | None = None) -> None:
        self.config = config
        self.pool = pool
        self.cache = cache
        self.waiting: deque[Sequence] = deque()
        self.active: list[Sequence] = []  # PREFILLING or RUNNING, in admission order

    def free_pages(self, seq: Sequence) -> None:
        if seq.blocks:
            self.pool.free(seq.blocks)
            seq.blocks = []
        seq.num_cached = seq.num_published = 0

    def _admit(self, seq: Sequence) -> bool:
        """Give a WAITING sequence its prompt's pages (cached prefix shared, the rest allocated) and make it
        PREFILLING; False (nothing changed) when the pool cannot hold them."""
        hit = []
        if self.cache is not None and seq.params.prompt_logprobs is None:  # prompt logprobs need every position
            hit = self.cache.match(seq, seq.num_tokens - 1)
        need = seq.blocks_needed(seq.num_tokens, self.config.block_size) - len(hit)
        if not self.pool.can_allocate(need, reusing=hit):
            return False
        seq.blocks = self.pool.reuse(hit) + self.pool.allocate(need)
        seq.num_cached = len(hit) * self.config.block_size
        seq.num_published = len(hit)
        if self.cache is not None:
            self.cache.count(seq.num_cached, seq.num_tokens - seq.num_cached)
        if seq.cached_tokens is None:
            seq.cached_tokens = seq.num_cached
        seq.status = Status.PREFILLING
        self.active.append(seq)
        return True

    def _preempt(self, victim: Sequence, plan: StepPlan) -> None:
        self.active.remove(victim)
        self.free_pages(victim)
        victim.status = Status.WAITING
        self.waiting.appendleft(victim)
        plan.preempted.append(victim)

    def schedule(self, only: set[str] | None = None) -> StepPlan:
        """The next step's plan. ``only`` (failure isolation) restricts it to those request ids."""
        plan = StepPlan()
        bs = self.config.block_size
        # 1. decode: each running sequence needs a page for position num_tokens - 1
        for seq in list(self.active):
            if seq.status is not Status.RUNNING or seq not in self.active:
                continue
            if only is not None and seq.request_id not in only:
                continue
            need = seq.blocks_needed(seq.num_tokens, bs)
            while need and not self.pool.can_allocate(need):
                victim = max(self.active, key=lambda s: s.arrival)
                self._preempt(victim, plan)
                if victim is seq:
                    break
            if seq not in self.active:
                continue
            if need:
                seq.blocks.extend(self.pool.allocate(need))
            plan.decode.append(seq)
        plan.decode = [s for s in plan.decode if s in self.active]
        # 2. admit waiting sequences (FIFO) when slots and prompt pages are available
        for seq in list(self.waiting) if only is not None else ():  # isolation step: admit only those named
            if len(self.active) >= self.config.max_num_seqs or seq.request_id not in only:
                continue
            if not self._admit(seq):
                break
            self.waiting.remove(seq)
        while only is None and self.waiting and len(self.active) < self.config.max_num_seqs:
            if not self._admit(self.waiting[0]):
                break
            self.waiting.popleft()
        # 3. prefill chunks within the token budget: fewest remaining tokens first, every prompt advancing
        filling = [s for s in self.active
                   if s.status is Status.PREFILLING and (only is None or s.request_id in only)]
        grants = prefill_grants([s.num_tokens - s.num_cached for s in filling], self.config.max_prefill_tokens)
        plan.prefill = [(s, s.num_cached, s.num_cached + g) for s, g in zip(filling, grants) if g > 0]
        return plan
