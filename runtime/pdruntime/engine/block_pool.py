"""Paged KV block pool: exact used/free accounting, double-free detection and a leak check."""

from __future__ import annotations

from .config import OutOfBlocks


class BlockPool:
    """Hands out KV page ids in [0, num_total). Invariant: num_free + num_used == num_total."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks={num_blocks} is invalid; accepted: a positive integer")
        self.num_total = num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # stack; pops low ids first
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """n page ids, all or nothing; OutOfBlocks if fewer than n are free."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > len(self._free):
            raise OutOfBlocks(f"need {n} KV blocks, {len(self._free)} of {self.num_total} free")
        ids = [self._free.pop() for _ in range(n)]
        self._used.update(ids)
        return ids

    def free(self, ids) -> None:
        """Return pages; a page that is not in use (double free, foreign id) raises ValueError."""
        ids = list(ids)
        bad = [i for i in ids if i not in self._used]
        if bad or len(set(ids)) != len(ids):
            raise ValueError(f"freeing KV blocks not in use (double free or foreign ids): {sorted(bad) or ids}")
        self._used.difference_update(ids)
        self._free.extend(reversed(ids))

    def assert_no_leaks(self, held: int = 0) -> None:
        """Raise AssertionError unless exactly `held` pages are in use (0 = pool fully free)."""
        if len(self._used) != held or len(self._free) + len(self._used) != self.num_total:
            raise AssertionError(f"KV block leak: {len(self._used)} in use (expected {held}), "
                                 f"{len(self._free)} free of {self.num_total}; in use: {sorted(self._used)[:32]}")
