"""canary: rollout safety decisions (pure). Which revision each pair may run, the canary's life, when a
revision becomes known-good, and when a stall rolls the spec back.

Canary (``spec.rollout.canary``; at least 2 pairs and a current revision to fall back to)::

    new revision (updateRevision != currentRevision)
        -> Pending   the canary pair (the HIGHEST index: rollouts go lowest first, scale-downs remove the
                     highest first) is replaced at the new revision; every other pair keeps currentRevision,
                     also when it is co-restarted. The topology marks the canary pair ``canary: true``:
                     the router keeps normal traffic off it and takes only pinned probe requests.
        -> Probing   the pair is ready at the new revision and every router runs the topology that marks
                     it: the multi-round agent probe runs against a router, pinned to the pair
        -> Passed    every round completed, no watchdog fire on the pair, no stall: the other pairs roll
                     as ``maxUnavailablePairs`` allows, the canary flag is cleared
        -> Failed    the canary pair rolls back to the old revision; no other pair ever receives the new
                     one while the spec asks for it. A new spec change (a new revision) starts over.

Known-good: a revision that every pair has run, ready, for ``rollout.soakSeconds`` with condition
``Stalled`` not True. Auto-rollback (``rollout.autoRollback``): a stall that starts within
``rollbackWindowSeconds`` of the spec's revision becoming current rolls the spec back to the last
known-good revision other than that one (a revision can soak before the load that breaks it arrives),
once per revision (no flapping).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any, Mapping, Sequence

from ..core.pairs import parse_iso
from ..core.spec import CanarySpec

PENDING, PROBING, PASSED, FAILED = "Pending", "Probing", "Passed", "Failed"
PHASES = (PENDING, PROBING, PASSED, FAILED)
MIN_PAIRS = 2  # with one pair, taking it out of normal traffic would take the whole deployment out


@dataclass(frozen=True)
class CanaryState:
    """``status.canary``: the canary of one revision. Times are epoch seconds."""

    revision: str  # the revision on trial
    pair: int  # the canary pair
    phase: str  # Pending | Probing | Passed | Failed
    from_revision: str  # the revision every other pair keeps until it passes (currentRevision at the start)
    started_at: float | None = None  # the probe started
    finished_at: float | None = None
    evidence: str = ""  # one line: why it failed (round, agent, stage, age) or what passed
    rounds: tuple[Mapping[str, Any], ...] = ()  # the probe's per-round results
    since: float | None = None  # the canary began (a co-restart of its pair after this fails it)

    @property
    def holds_traffic_off(self) -> bool:
        """The canary pair is out of normal traffic (the topology's ``canary: true``)."""
        return self.phase in (PENDING, PROBING)

    def to_status(self, iso: Any) -> dict[str, Any]:
        out: dict[str, Any] = {"revision": self.revision, "pair": self.pair, "phase": self.phase,
                               "fromRevision": self.from_revision}
        if self.started_at is not None:
            out["startedAt"] = iso(self.started_at)
        if self.finished_at is not None:
            out["finishedAt"] = iso(self.finished_at)
        if self.evidence:
            out["evidence"] = self.evidence
        if self.rounds:
            out["rounds"] = [dict(r) for r in self.rounds]
        if self.since is not None:
            out["since"] = iso(self.since)
        return out

    @staticmethod
    def from_status(raw: Any) -> "CanaryState | None":
        if not isinstance(raw, Mapping) or raw.get("phase") not in PHASES:
            return None
        try:
            return CanaryState(str(raw["revision"]), int(raw["pair"]), str(raw["phase"]), str(raw["fromRevision"]),
                               parse_iso(raw.get("startedAt")), parse_iso(raw.get("finishedAt")),
                               str(raw.get("evidence") or ""), tuple(raw.get("rounds") or ()),
                               parse_iso(raw.get("since")))
        except (KeyError, TypeError, ValueError):
            return None


def canary_pair(pairs: int) -> int:
    """The pair that takes a new revision first: the highest index."""
    return pairs - 1


def plan_canary(canary: CanarySpec | None, *, pairs: int, desired: str, current: str | None,
                prior: CanaryState | None, known_good: str | None = None,
                now: float | None = None) -> CanaryState | None:
    """The canary for this reconcile: the one in status if it is still about ``desired``, a new one when a
    new revision appears, None when there is nothing to try (no canary configured, fewer than
    :data:`MIN_PAIRS` pairs, no current revision yet, the spec asks for the current revision, or for the
    last known-good one: a rollback goes straight to every pair)."""
    if canary is None or pairs < MIN_PAIRS or not current or desired in (current, known_good):
        return None
    if prior is not None and prior.revision == desired and prior.pair < pairs:
        return prior
    return CanaryState(desired, canary_pair(pairs), PENDING, current, since=now)


def targets(state: CanaryState | None, *, pairs: int, desired: str) -> dict[int, str]:
    """The revision each pair should run now (the planner rolls pairs toward it)."""
    if state is None or state.phase == PASSED:
        return {k: desired for k in range(pairs)}
    if state.phase == FAILED:
        return {k: state.from_revision for k in range(pairs)}
    return {k: (state.revision if k == state.pair else state.from_revision) for k in range(pairs)}


def ready_to_probe(state: CanaryState, *, pair_revision: str | None, pair_ready: bool,
                   routers_confirmed: bool) -> bool:
    """Pending -> Probing: the canary pair runs the new revision, is ready, and every router runs the
    topology that marks it (so the probe's pinned requests reach it and normal traffic does not)."""
    return state.phase == PENDING and pair_ready and pair_revision == state.revision and routers_confirmed


def start_probe(state: CanaryState, now: float) -> CanaryState:
    return replace(state, phase=PROBING, started_at=now, finished_at=None, evidence="", rounds=())


def crashed(state: CanaryState, *, last_co_restart_at: float | None, reason: str | None, now: float) -> CanaryState:
    """Pending/Probing -> Failed when the canary pair co-restarted since the canary began: the new revision
    crashes (or is evicted, OOM-killed...) before any probe could judge it."""
    if state.phase not in (PENDING, PROBING) or state.since is None or last_co_restart_at is None:
        return state
    if last_co_restart_at < state.since:
        return state
    return replace(state, phase=FAILED, finished_at=now,
                   evidence=f"pair {state.pair} co-restarted ({reason or 'unknown reason'}) while on trial")


def _report(report: Any) -> Mapping[str, Any]:
    return report.to_dict() if hasattr(report, "to_dict") else dict(report or {})


def verdict(report: Any, *, watchdog_fires: int = 0, stall: str | None = None) -> tuple[bool, str]:
    """Did the canary pass? ``report``: the probe's ``ProbeReport`` (or its ``to_dict()``); ``watchdog_fires``:
    fires on the canary pair's workers during the probe; ``stall``: a Stalled condition's message seen
    during it. Returns (passed, one line of evidence)."""
    r = _report(report)
    rounds = list(r.get("rounds") or [])
    f = r.get("failure")
    if f or not r.get("ok"):
        if not f:
            return False, "probe failed without a failure record"
        age = f.get("age_s")
        return False, (f"round {f.get('round')}: agent {f.get('agent')} "
                       f"{'hung' if f.get('kind') == 'hang' else 'failed'} at stage {f.get('stage') or '?'}"
                       + (f", {age:.1f}s old" if isinstance(age, (int, float)) else "")
                       + (f": {f.get('detail')}" if f.get("detail") else ""))
    if watchdog_fires > 0:
        return False, f"watchdog fired {watchdog_fires} time(s) on the canary pair during the probe"
    if stall:
        return False, f"stalled during the probe: {stall}"
    worst = max((x.get("latency_max_s") or 0.0 for x in rounds), default=0.0)
    done = sum(int(x.get("completed") or 0) for x in rounds)
    return True, f"{len(rounds)} round(s), {done} request(s) completed, slowest {worst:.2f}s"


def finish_probe(state: CanaryState, report: Any, now: float, *, watchdog_fires: int = 0,
                 stall: str | None = None) -> CanaryState:
    """Probing -> Passed | Failed, with the evidence."""
    ok, evidence = verdict(report, watchdog_fires=watchdog_fires, stall=stall)
    return replace(state, phase=PASSED if ok else FAILED, finished_at=now, evidence=evidence,
                   rounds=tuple(dict(x) for x in _report(report).get("rounds") or ()))


# --- known-good and auto-rollback ---------------------------------------------------------------------

def stalled(cond: Mapping[str, Any] | None) -> bool:
    """Condition ``Stalled`` is True because something is stuck (an invalid spec also sets it: not a stall)."""
    return bool(cond) and cond.get("status") == "True" and cond.get("reason") != "InvalidSpec"


def pair_stall(cond: Mapping[str, Any] | None, pair: int) -> str | None:
    """The Stalled condition's message when it concerns ``pair`` (it names the pair, or names none); another
    pair's stall is not the canary revision's doing."""
    if not stalled(cond):
        return None
    msg = str((cond or {}).get("message") or "")
    if re.search(rf"\bpair {pair}\b", msg) or not re.search(r"\bpair \d+\b", msg):
        return msg or "Stalled"
    return None


def soak_left(*, revision: str, pairs: Sequence[Any], n_pairs: int, stall: Mapping[str, Any] | None,
              soak_s: float, now: float) -> float | None:
    """Seconds until ``revision`` becomes known-good: 0 when it is now, None while it is not serving
    (a pair not ready, a pair at another revision, a stall). Serving starts when the last pair became
    ready and the last stall ended. ``pairs``: the planner's pair states (revision, ready, memory.ready_since)."""
    if n_pairs < 1 or len(pairs) != n_pairs or stalled(stall):
        return None
    if any(not p.ready or p.revision != revision or p.memory.ready_since is None for p in pairs):
        return None
    start = max(p.memory.ready_since for p in pairs)
    ended = parse_iso((stall or {}).get("lastTransitionTime"))
    if ended is not None and (stall or {}).get("status") == "False" and ended > start:
        start = ended
    return max(0.0, start + soak_s - now)


def rollback_target(known_good: Sequence[tuple[float, str]], desired: str) -> str | None:
    """The revision an auto-rollback goes to: the most recent to become known-good other than ``desired``.
    ``known_good``: (known-good since, revision) of every recorded revision that became known-good."""
    others = [(t, rev) for t, rev in known_good if rev != desired]
    return max(others)[1] if others else None


def auto_rollback(*, enabled: bool, window_s: float, desired: str, last_known_good: str | None,
                  changed_at: float | None, stall: Mapping[str, Any] | None, reverted: Sequence[str],
                  canary: CanaryState | None = None) -> str | None:
    """The revision to roll the spec back to, or None. A stall (condition Stalled turned True) that
    started within ``window_s`` after ``desired`` became current rolls back to ``last_known_good`` (from
    :func:`rollback_target`), once per revision (``reverted``). A revision under a canary is the canary's
    to judge."""
    if not enabled or not last_known_good or desired == last_known_good or desired in reverted:
        return None
    if canary is not None and canary.revision == desired and canary.phase != PASSED:
        return None
    if not stalled(stall) or changed_at is None:
        return None
    began = parse_iso((stall or {}).get("lastTransitionTime"))
    if began is None or not changed_at <= began <= changed_at + window_s:
        return None
    return last_known_good
