"""drift: desired rendering vs live children (pure). Minimal for now; runtime /config drift comes later.

Each child the operator applies carries ``pdstack.io/applied-hash``, the hash of what the operator
last wrote. When the desired hash differs, the operator changed its mind: apply. When the hash is
the same but the live object no longer contains what was written, someone else changed it: that is
drift, reverted or reported per ``spec.drift.policy``. Comparison is "desired is contained in live",
so fields the API server defaults never count as drift.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Mapping

APPLIED_HASH = "pdstack.io/applied-hash"
MANAGED_KEYS = ("spec", "data", "stringData")


def applied_hash(obj: Mapping[str, Any]) -> str:
    managed = {k: obj[k] for k in MANAGED_KEYS if k in obj}
    managed["labels"] = obj.get("metadata", {}).get("labels", {})
    return hashlib.sha256(json.dumps(managed, sort_keys=True).encode()).hexdigest()[:16]


def with_hash(obj: Mapping[str, Any]) -> dict[str, Any]:
    out = json.loads(json.dumps(obj))
    out["metadata"].setdefault("annotations", {})[APPLIED_HASH] = applied_hash(obj)
    return out


def differences(desired: Any, live: Any, path: str = "") -> list[str]:
    """Paths where ``desired`` is not contained in ``live`` (dicts: subset; lists: same length, elementwise)."""
    if isinstance(desired, Mapping):
        if not isinstance(live, Mapping):
            return [path or "."]
        out: list[str] = []
        for k, v in desired.items():
            out += differences(v, live.get(k), f"{path}.{k}" if path else str(k))
        return out
    if isinstance(desired, list):
        if not isinstance(live, list) or len(live) != len(desired):
            return [path]
        out = []
        for i, (d, l) in enumerate(zip(desired, live)):
            out += differences(d, l, f"{path}[{i}]")
        return out
    return [] if desired == live else [path]


@dataclass(frozen=True)
class Decision:
    action: str  # create | apply | revert | report | none
    paths: tuple[str, ...] = ()


def decide(desired: Mapping[str, Any], live: Mapping[str, Any] | None, policy: str, *, enforce: bool = False) -> Decision:
    """What to do with one child. ``enforce``: operator-owned live state (topology) is always reverted."""
    if live is None:
        return Decision("create")
    want = applied_hash(desired)
    have = (live.get("metadata", {}).get("annotations", {}) or {}).get(APPLIED_HASH)
    if have != want:
        return Decision("apply")
    diffs = []
    for key in MANAGED_KEYS:
        if key in desired and key != "stringData":  # Secret stringData is write-only
            diffs += differences(desired[key], live.get(key), key)
    if not diffs:
        return Decision("none")
    if enforce or policy == "Revert":
        return Decision("revert", tuple(diffs))
    return Decision("report", tuple(diffs))
