"""PDDeployment status: conditions, phase and per-pair records (pure).

The reconcile daemon is the only writer of ``.status``. It builds the whole status with
:func:`build_status` and patches only when the result differs from what is stored.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from .drift import DriftEntry, message_lines
from .pairs import PairMemory, Plan, parse_iso

CONDITION_TYPES = ("Ready", "Progressing", "Degraded", "CoRestarting", "ConfigDrift", "Stalled", "ApiRejected",
                   "CanaryFailed")


def iso(ts: float) -> str:
    return datetime.datetime.fromtimestamp(ts, tz=datetime.timezone.utc).isoformat(timespec="milliseconds").replace(
        "+00:00", "Z")



def memory_from_status(status: Mapping[str, Any] | None) -> dict[int, PairMemory]:
    """Rebuild each pair's :class:`PairMemory` from ``status.pairs``."""
    out: dict[int, PairMemory] = {}
    for p in (status or {}).get("pairs", []) or []:
        try:
            k = int(p["index"])
        except (KeyError, TypeError, ValueError):
            continue
        last = p.get("lastCoRestart") or {}
        out[k] = PairMemory(
            restarts=int(p.get("restarts", 0) or 0),
            streak=int(p.get("backoffStreak", 0) or 0),
            last_co_restart_at=parse_iso(last.get("time")),
            last_co_restart_reason=last.get("reason"),
            ready_since=parse_iso(p.get("readySince")),
            recovering=bool(p.get("recovering", False)),
            drain_started_at=parse_iso((p.get("drain") or {}).get("since")),
            drain_version=(p.get("drain") or {}).get("topologyVersion"),
            drain_confirmed_at=parse_iso((p.get("drain") or {}).get("confirmedAt")),
        )
    return out


@dataclass(frozen=True)
class Facts:
    """Everything besides the plan that status depends on."""

    generation: int
    desired_revision: str | None
    router_ready: bool = False
    unschedulable_message: str | None = None
    spec_error: str | None = None
    drift: Sequence[DriftEntry] = ()  # status.drift; the ConfigDrift condition's message is made from it
    rejections: Sequence[str] = ()  # "<verb> <kind>/<name>: HTTP <code>: <server message>", one per failed write
    topology_version: int | None = None
    selector: str | None = None  # the worker pods' label selector (status.selector, for the scale subresource)
    # rollout safety (canary.py): status.canary, status.lastKnownGoodRevision, status.autoRollback
    canary: Mapping[str, Any] | None = None
    canary_failed: str | None = None  # the CanaryFailed message while the spec asks for the failed revision
    last_known_good: str | None = None
    auto_rollback: Mapping[str, Any] | None = None


def _cond(ctype: str, ok: bool, reason: str, message: str) -> dict[str, Any]:
    return {"type": ctype, "status": "True" if ok else "False", "reason": reason, "message": message}


def _stamp(new: list[dict[str, Any]], old: Sequence[Mapping[str, Any]], now: str) -> list[dict[str, Any]]:
    """Keep lastTransitionTime when a condition's status did not change."""
    prev = {c.get("type"): c for c in old or []}
    out = []
    for c in new:
        p = prev.get(c["type"])
        keep = p is not None and p.get("status") == c["status"] and p.get("lastTransitionTime")
        out.append({**c, "lastTransitionTime": p["lastTransitionTime"] if keep else now})
    return out


def pair_record(state: Any) -> dict[str, Any]:
    m: PairMemory = state.memory
    rec: dict[str, Any] = {"index": state.index, "revision": state.revision, "ready": state.ready,
                           "phase": state.phase, "restarts": m.restarts, "backoffStreak": m.streak,
                           "recovering": m.recovering}
    members = getattr(state, "members", None) or {}
    if set(members) - {"prefill", "decode"}:  # a P:D group beyond 1:1: which pod IP holds each slot
        rec["members"] = {slot: ip for slot, ip in members.items()}
    if m.last_co_restart_at is not None:
        rec["lastCoRestart"] = {"time": iso(m.last_co_restart_at), "reason": m.last_co_restart_reason}
    if m.ready_since is not None:
        rec["readySince"] = iso(m.ready_since)
    if m.drain_started_at is not None:
        drain: dict[str, Any] = {"since": iso(m.drain_started_at)}
        if m.drain_version is not None:
            drain["topologyVersion"] = m.drain_version
        if m.drain_confirmed_at is not None:
            drain["confirmedAt"] = iso(m.drain_confirmed_at)
        rec["drain"] = drain
    return rec


def invalid_status(old: Mapping[str, Any] | None, facts: Facts, now: float) -> dict[str, Any]:
    """Status of a PDDeployment whose spec cannot be reconciled: children are left as they are."""
    old = old or {}
    msg = f"invalid spec: {facts.spec_error}"
    conds = [
        _cond("Ready", False, "InvalidSpec", msg),
        _cond("Progressing", False, "InvalidSpec", msg),
        _cond("Degraded", False, "InvalidSpec", "children left as they were"),
        _cond("CoRestarting", False, "InvalidSpec", ""),
        _cond("ConfigDrift", False, "InvalidSpec", ""),
        _cond("Stalled", True, "InvalidSpec", msg),
        _cond("ApiRejected", False, "InvalidSpec", ""),
    ]
    out = {k: v for k, v in old.items() if k in ("pairs", "currentRevision", "updateRevision", "readyPairs")}
    out.update({"phase": "Invalid", "observedGeneration": facts.generation, "drift": None,
                "conditions": _stamp(conds, old.get("conditions", []), iso(now))})
    return out


def build_status(old: Mapping[str, Any] | None, plan: Plan, facts: Facts, now: float) -> dict[str, Any]:
    old = old or {}
    pairs = plan.pairs
    n = len(pairs)
    ready_pairs = sum(1 for p in pairs if p.ready)
    at_desired = sum(1 for p in pairs if p.ready and p.revision == facts.desired_revision)
    revisions = {p.revision for p in pairs if p.revision is not None}
    current = next(iter(revisions)) if len(revisions) == 1 and all(p.revision for p in pairs) else \
        old.get("currentRevision")
    all_ready = at_desired == n and facts.router_ready
    restarting = [p for p in pairs if p.memory.recovering or p.phase == "CoRestarting"
                  or (p.phase == "Draining" and p.revision == facts.desired_revision)]
    rolling = [p for p in pairs if p.revision not in (None, facts.desired_revision) or p.phase == "RollingOut"]

    ready = _cond("Ready", all_ready, "AllPairsReady" if all_ready else "PairsNotReady",
                  f"{at_desired}/{n} pairs ready at revision {facts.desired_revision}; "
                  f"router {'ready' if facts.router_ready else 'not ready'}")
    if facts.unschedulable_message:
        progressing = _cond("Progressing", False, "Unschedulable", facts.unschedulable_message)
    elif facts.canary_failed:
        progressing = _cond("Progressing", False, "CanaryFailed",
                            f"revision {facts.desired_revision} stopped at its canary; change the spec to try again")
    elif rolling:
        progressing = _cond("Progressing", True, "RollingOut",
                            f"pairs {[p.index for p in rolling]} moving to revision {facts.desired_revision}")
    elif not all_ready:
        progressing = _cond("Progressing", True, "PairsStarting", f"{n - at_desired} pair(s) starting")
    else:
        progressing = _cond("Progressing", True, "RolloutComplete",
                            f"all {n} pairs run revision {facts.desired_revision}")
    down = [p for p in pairs if not p.ready and p.memory.restarts > 0 and p.memory.recovering]
    degraded = _cond("Degraded", bool(down), "PairsDown" if down else "AsExpected",
                     f"pairs {[p.index for p in down]} down after co-restart" if down
                     else "no pair down after a failure")
    co = _cond("CoRestarting", bool(restarting), "PairCoRestart" if restarting else "Idle",
               "; ".join(f"pair {p.index}: {p.memory.last_co_restart_reason} ({p.phase})" for p in restarting))
    drift = _cond("ConfigDrift", bool(facts.drift), "Drifted" if facts.drift else "NoDrift",
                  "; ".join(message_lines(facts.drift)) if facts.drift else "live children match the declared spec")
    stalled = _cond("Stalled", False, "AsExpected", "")
    rejected = _cond("ApiRejected", bool(facts.rejections), "Rejected" if facts.rejections else "AsExpected",
                     "; ".join(facts.rejections) if facts.rejections else "every write was accepted")
    canary_failed = _cond("CanaryFailed", bool(facts.canary_failed), "ProbeFailed" if facts.canary_failed
                          else "AsExpected", facts.canary_failed or "")
    conds = [ready, progressing, degraded, co, drift, stalled, rejected, canary_failed]

    if all_ready:
        phase = "Ready"
    elif facts.unschedulable_message:
        phase = "Pending"
    elif down:
        phase = "Degraded"
    else:
        phase = "Progressing"
    out = {
        "phase": phase,
        "observedGeneration": facts.generation,
        "currentRevision": current,
        "updateRevision": facts.desired_revision,
        "readyPairs": ready_pairs,
        "pairs": [pair_record(p) for p in pairs] + [pair_record(p) for p in plan.retiring],
        "conditions": _stamp(conds, old.get("conditions", []), iso(now)),
    }
    if facts.topology_version is not None:
        out["topologyVersion"] = facts.topology_version
    if facts.selector is not None:  # scale subresource: status.replicas (groups that exist) + selector
        out["replicas"] = n
        out["selector"] = facts.selector
    # a merge patch: None removes a key that no longer applies
    out["drift"] = [e.to_status() for e in facts.drift] or None
    out["canary"] = dict(facts.canary) if facts.canary else None
    out["lastKnownGoodRevision"] = facts.last_known_good or old.get("lastKnownGoodRevision")
    if facts.auto_rollback is not None:
        out["autoRollback"] = dict(facts.auto_rollback)
    return out


def same_status(a: Mapping[str, Any] | None, b: Mapping[str, Any]) -> bool:
    """True when writing ``b`` over ``a`` would change nothing we own."""
    a = a or {}
    return all(a.get(k) == v for k, v in b.items())


def with_stalls(new: dict[str, Any], old: Mapping[str, Any] | None, evidence: Sequence[Any] | None,
                now: float) -> dict[str, Any]:
    """``new`` with condition ``Stalled`` and ``status.stalls`` from :func:`pdoperator.core.stall.evaluate`'s
    evidence per pair. ``None`` (no look this time: no router to ask, or it did not answer) keeps what
    ``old`` says. ``lastTransitionTime`` of a True ``Stalled`` is when the stall was first seen."""
    from .stall import status_entries

    old = old or {}
    if evidence is None:
        prev = next((c for c in old.get("conditions") or [] if c.get("type") == "Stalled"), None)
        if prev is not None and prev.get("reason") != "InvalidSpec":
            new["conditions"] = [prev if c["type"] == "Stalled" else c for c in new["conditions"]]
            new["stalls"] = old.get("stalls")
        return new
    entries = status_entries(evidence, old.get("stalls"), iso(now))
    stalled = [e for e in evidence if e.stalled]
    cond = _cond("Stalled", bool(stalled), "PairStalled" if stalled else "AsExpected",
                 "; ".join(e.reason for e in sorted(stalled, key=lambda e: e.pair)) if stalled else "no stalled pair")
    new["conditions"] = [_stamp([cond], old.get("conditions") or [], iso(now))[0] if c["type"] == "Stalled" else c
                         for c in new["conditions"]]
    new["stalls"] = entries or None  # a merge patch: None removes the list once no pair is stalled
    return new
