"""Paged KV block pool: exact used/free accounting with reference counts (pages shared copy-on-write by the n
sequences of one prompt), double-free detection and a leak check."""

from __future__ import annotations

from .config import OutOfBlocks


class BlockPool:
    """Hands out KV page ids in [0, num_total). Invariant: num_free + num_used == num_total, where a page is used
    while at least one sequence holds it (``share`` adds a holder, ``free`` drops one)."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks={num_blocks} is invalid; accepted: a positive integer")
        self.num_total = num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # stack; pops low ids first
        self._refs: dict[int, int] = {}  # page id -> number of sequences holding it (>= 1)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._refs)

    def refs(self, page: int) -> int:
        return self._refs.get(page, 0)

    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """n page ids, all or nothing; OutOfBlocks if fewer than n are free."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > len(self._free):
            raise OutOfBlocks(f"need {n} KV blocks, {len(self._free)} of {self.num_total} free")
        ids = [self._free.pop() for _ in range(n)]
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

    def free(self, ids) -> None:
        """Drop one holder of each page; a page returns to the pool when its last holder frees it. A page that is
        not in use (double free, foreign id) raises ValueError."""
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
        self._free.extend(reversed(released))

    def assert_no_leaks(self, held: int = 0) -> None:
        """Raise AssertionError unless exactly `held` pages are in use (0 = pool fully free)."""
        if len(self._refs) != held or len(self._free) + len(self._refs) != self.num_total:
            raise AssertionError(f"KV block leak: {len(self._refs)} in use (expected {held}), "
                                 f"{len(self._free)} free of {self.num_total}; in use: {sorted(self._refs)[:32]}")
