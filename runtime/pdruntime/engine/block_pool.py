"""Paged KV block pool: exact used/free accounting with reference counts (pages shared copy-on-write by the n
sequences of one prompt, and pages shared through the prefix cache), double-free detection and a leak check."""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable

from .config import OutOfBlocks


class BlockPool:
    """Hands out KV page ids in [0, num_total). Invariant: num_free + num_used == num_total, where a page is used
    while at least one sequence holds it (``share`` / ``reuse`` add a holder, ``free`` drops one).

    Free pages come in two kinds: empty ones (a stack) and *evictable* ones, whose KV the prefix cache still
    indexes (``mark_cached``) but no sequence holds, in least-recently-used order. ``allocate`` takes empty
    pages first and evicts the least recently used cached page only when no empty page is left (memory
    pressure); a page some sequence holds is never in the evictable set, so it is never evicted."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks={num_blocks} is invalid; accepted: a positive integer")
        self.num_total = num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # stack of empty pages; pops low ids first
        self._refs: dict[int, int] = {}  # page id -> number of sequences holding it (>= 1)
        self._cached: set[int] = set()  # pages the prefix cache indexes (held or evictable)
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached pages nobody holds, least recently used first
        self.on_evict: Callable[[int], None] | None = None  # the prefix cache drops its key for an evicted page
        self.num_evictions = 0

    @property
    def num_free(self) -> int:
        """Pages an allocation can get: empty ones plus evictable cached ones."""
        return len(self._free) + len(self._lru)

    @property
    def num_used(self) -> int:
        return len(self._refs)

    @property
    def num_cached(self) -> int:
        """Pages whose KV the prefix cache indexes, held by a sequence or not."""
        return len(self._cached)

    @property
    def num_evictable(self) -> int:
        """Cached pages no sequence holds (counted in num_free)."""
        return len(self._lru)

    def refs(self, page: int) -> int:
        return self._refs.get(page, 0)

    def is_cached(self, page: int) -> bool:
        return page in self._cached

    def can_allocate(self, n: int, reusing=()) -> bool:
        """Whether ``n`` new pages can be allocated after ``reuse(reusing)`` took its evictable pages."""
        taken = sum(1 for p in reusing if p in self._lru)
        return 0 <= n <= len(self._free) + len(self._lru) - taken

    def allocate(self, n: int) -> list[int]:
        """n page ids, all or nothing; OutOfBlocks if fewer than n are free. Empty pages go first; then the least
        recently used evictable cached pages are evicted (their cache keys dropped through ``on_evict``)."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > self.num_free:
            raise OutOfBlocks(f"need {n} KV blocks, {self.num_free} of {self.num_total} free")
        ids = [self._free.pop() for _ in range(min(n, len(self._free)))]
        while len(ids) < n:
            ids.append(self._evict_lru())
        for i in ids:
            self._refs[i] = 1
        return ids

    def share(self, ids) -> list[int]:
        """One more holder for pages already in use (a forked sequence reading its parent's prompt pages)."""
        ids = list(ids)
        bad = [i for i in ids if i not in self._refs]
        if bad:
            raise ValueError(f"sharing KV blocks not in use: {sorted(bad)}")
        for i in ids:
            self._refs[i] += 1
        return ids

    def reuse(self, ids) -> list[int]:
        """One more holder for cached pages, held or evictable (a prefix-cache hit); evictable ones leave the LRU."""
        ids = list(ids)
        bad = [i for i in ids if i not in self._cached]
        if bad:
            raise ValueError(f"reusing KV blocks the prefix cache does not hold: {sorted(bad)}")
        for i in ids:
            if i in self._lru:  # was evictable: now held
                del self._lru[i]
                self._refs[i] = 1
            else:
                self._refs[i] += 1
        return ids

    def mark_cached(self, page: int) -> None:
        """The prefix cache indexes this held page: when its last holder frees it, it stays evictable, not empty."""
        if page not in self._refs:
            raise ValueError(f"caching KV block {page} that no sequence holds")
        self._cached.add(page)

    def evict_one(self) -> bool:
        """Drop the least recently used evictable page from the cache (it becomes empty). False if none."""
        if not self._lru:
            return False
        self._free.append(self._evict_lru())
        return True

    def _evict_lru(self) -> int:
        page, _ = self._lru.popitem(last=False)
        self._cached.discard(page)
        self.num_evictions += 1
        if self.on_evict is not None:
            self.on_evict(page)
        return page

    def free(self, ids) -> None:
        """Drop one holder of each page; a page returns to the pool when its last holder frees it (cached pages as
        evictable, the last page of ``ids`` the least recently used: a sequence's tail goes before its root, so an
        eviction rarely strands the pages after it). A page that is not in use (double free, foreign id) raises
        ValueError."""
        ids = list(ids)
        bad = [i for i in ids if i not in self._refs]
        if bad or len(set(ids)) != len(ids):
            raise ValueError(f"freeing KV blocks not in use (double free or foreign ids): {sorted(bad) or ids}")
        released = []
        for i in ids:
            self._refs[i] -= 1
            if self._refs[i] == 0:
                del self._refs[i]
                released.append(i)
        for i in reversed(released):
            if i in self._cached:
                self._lru[i] = None
            else:
                self._free.append(i)

    def assert_no_leaks(self, held: int = 0, cached: int | None = None) -> None:
        """Raise AssertionError unless exactly `held` pages are in use (0 = no page held: every page empty or an
        evictable cached one) and, when given, exactly `cached` pages are indexed by the prefix cache. Also checks
        that every page is in exactly one of: held, evictable (cached), empty."""
        free, lru, refs = set(self._free), set(self._lru), set(self._refs)
        problems = []
        if len(refs) != held:
            problems.append(f"{len(refs)} in use (expected {held})")
        if cached is not None and len(self._cached) != cached:
            problems.append(f"{len(self._cached)} cached (the prefix cache indexes {cached})")
        if len(free) != len(self._free) or free & lru or free & refs or lru & refs or \
                len(free) + len(lru) + len(refs) != self.num_total or not lru <= self._cached or free & self._cached:
            problems.append("a page is in more than one of held/evictable/empty, or in none")
        if problems:
            raise AssertionError(f"KV block leak: {'; '.join(problems)}; {len(self._free)} empty + {len(self._lru)} "
                                 f"evictable free of {self.num_total}; in use: {sorted(self._refs)[:32]}")
