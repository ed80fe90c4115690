"""A table of live requests keyed by id, each in exactly one named stage (queue)."""

from __future__ import annotations

from typing import Generic, Iterable, TypeVar

T = TypeVar("T")


class StageTable(Generic[T]):
    """Requests by id, partitioned into stages. O(1) move/remove; per-stage counts for gauges."""

    def __init__(self, stages: Iterable[str]) -> None:
        self.stages: dict[str, dict[str, T]] = {s: {} for s in stages}
        self._stage_of: dict[str, str] = {}

    def put(self, rid: str, item: T, stage: str) -> None:
        if rid in self._stage_of:
            raise KeyError(f"request {rid!r} is already live (stage {self._stage_of[rid]})")
        self.stages[stage][rid] = item
        self._stage_of[rid] = stage

    def move(self, rid: str, stage: str) -> None:
        src = self._stage_of[rid]
        if src == stage:
            return
        self.stages[stage][rid] = self.stages[src].pop(rid)
        self._stage_of[rid] = stage

    def remove(self, rid: str) -> T | None:
        stage = self._stage_of.pop(rid, None)
        if stage is None:
            return None
        return self.stages[stage].pop(rid)

    def get(self, rid: str) -> T | None:
        stage = self._stage_of.get(rid)
        return None if stage is None else self.stages[stage][rid]

    def counts(self) -> dict[str, int]:
        return {s: len(d) for s, d in self.stages.items()}

    def items(self) -> list[tuple[str, T]]:
        return [(s, r) for s, d in self.stages.items() for r in d.values()]

    def __len__(self) -> int:
        return len(self._stage_of)

    def __contains__(self, rid: str) -> bool:
        return rid in self._stage_of
