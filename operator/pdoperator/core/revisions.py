"""Revisions: the canonical effective configuration of the worker pods, and its hash.

A revision covers everything that changes what a prefill/decode process runs: engine,
image, model, per-role resources/env/args/volumes, placement, kernel knobs and watchdog
timeouts. Scaling (``pairs``), rollout and co-restart settings are not part of it: changing
them must not restart a pair. History is kept as ``apps/v1 ControllerRevision`` objects owned
by the PDDeployment, so "what ran at noon" is a list call and a ``diff_configs``.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Iterable, Mapping, Sequence

from dataclasses import asdict

from .spec import ModelSpec, PDSpec, PodTemplate, Probes, RoleSpec, default_of

#: annotation on a ControllerRevision: when it last became the current revision (RFC 3339, UTC)
ANN_CURRENT_SINCE = "pdstack.io/current-since"
#: annotation on a ControllerRevision: when it became known-good (served ``rollout.soakSeconds`` with no stall)
ANN_KNOWN_GOOD = "pdstack.io/known-good-since"
#: the top-level spec fields a revision covers (everything :func:`effective_config` reads); the others
#: (pairs, rollout, coRestart, drift, stall, router, revisionHistoryLimit) are not part of a revision and
#: a rollback keeps them as they are
REVISION_KEYS = ("engine", "image", "model", "podTemplate", "prefill", "decode", "placement", "kernel",
                 "watchdog", "probes", "sglang", "vllm", "runtimeImage")
UNSET = "<unset>"

REVISION_LEN = 10


def _role_config(role: RoleSpec) -> dict[str, Any]:
    return {
        "replicas": role.replicas,
        "gpus": role.gpus,
        "requests": dict(sorted(role.requests.items())),
        "limits": dict(sorted(role.limits.items())),
        "env": {name: value for name, value in role.env},
        "args": list(role.args),
        "volumes": [dict(v) for v in role.volumes],
        "volumeMounts": [dict(v) for v in role.volume_mounts],
        # only when set: a spec that leaves it out keeps its revision hash (the default derives from gpus)
        **({"tensorParallelSize": role.tensor_parallel} if role.tensor_parallel is not None else {}),
        # pod template fields, only those set (a spec without them keeps its revision hash)
        **({"pod": _jsonable({k: v for k, v in asdict(role.pod).items() if v not in (None, (), {})})}
           if role.pod != PodTemplate() else {}),
    }


def _jsonable(x: Any) -> Any:
    if isinstance(x, Mapping):
        return {str(k): _jsonable(v) for k, v in sorted(x.items())}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


def effective_config(spec: PDSpec) -> dict[str, Any]:
    """The worker-affecting configuration as plain JSON data (the thing a revision hashes)."""
    return {
        "engine": spec.engine,
        "image": spec.image,
        "model": {"source": spec.model.source, "servedName": spec.model.served_name,
                  **({"sha256": spec.model.sha256} if spec.model.sha256 else {}),
                  **({"storage": _jsonable(asdict(spec.model.storage))} if spec.model.storage else {}),
                  **({"dtype": spec.model.dtype} if spec.model.dtype != "auto" else {}),
                  **({"weights": spec.model.weights}
                     if spec.model.weights != default_of(ModelSpec, "weights") else {})},
        "prefill": _role_config(spec.prefill),
        "decode": _role_config(spec.decode),
        "placement": {
            "nodeSelector": dict(sorted(spec.placement.node_selector.items())),
            "tolerations": [dict(t) for t in spec.placement.tolerations],
            "affinity": dict(spec.placement.affinity),
            "priorityClassName": spec.placement.priority_class_name,
            **({"groupPlacement": spec.placement.group_placement}
               if spec.placement.group_placement != "Preferred" else {}),
        },
        "kernel": {
            "decodeTargetCTAs": spec.kernel.decode_target_ctas,
            "maxKVSplits": spec.kernel.max_kv_splits,
            "attentionBackend": spec.kernel.attention_backend,
        },
        "watchdog": {
            "bootstrapTimeoutSeconds": spec.watchdog.bootstrap_timeout_s,
            "transferTimeoutSeconds": spec.watchdog.transfer_timeout_s,
            "decodeTransferTimeoutSeconds": spec.watchdog.decode_transfer_timeout_s,
            "prefillStallSeconds": spec.watchdog.prefill_stall_s,
            "tickSeconds": spec.watchdog.tick_s,
        },
        **({"probes": asdict(spec.probes)} if spec.probes != Probes() else {}),
        **_engine_config(spec),
    }


def _engine_config(spec: PDSpec) -> dict[str, Any]:
    """The engine's own section, and the agent sidecar's image (both in every worker pod of those engines)."""
    return {**({"sglang": _jsonable(asdict(spec.sglang))} if spec.engine == "sglang" else {}),
            **({"vllm": _jsonable(asdict(spec.vllm))} if spec.engine == "vllm" else {}),
            **({"runtimeImage": spec.runtime_image} if spec.has_agent else {})}


def canonical_json(data: Any) -> str:
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def revision_hash(spec: PDSpec) -> str:
    """Stable short hash of :func:`effective_config` (same spec -> same revision, across processes)."""
    return hashlib.sha256(canonical_json(effective_config(spec)).encode()).hexdigest()[:REVISION_LEN]


def diff_configs(old: Mapping[str, Any], new: Mapping[str, Any], prefix: str = "") -> list[tuple[str, Any, Any]]:
    """Field-level diff: ``[(dotted.path, old_value, new_value)]`` sorted by path; absent = None."""
    out: list[tuple[str, Any, Any]] = []
    for key in sorted(set(old) | set(new)):
        path = f"{prefix}.{key}" if prefix else str(key)
        a, b = old.get(key), new.get(key)
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            out.extend(diff_configs(a, b, path))
        elif a != b:
            out.append((path, a, b))
    return out


def revision_spec(raw: Mapping[str, Any] | None) -> dict[str, Any]:
    """The revision's part of a raw ``spec`` (:data:`REVISION_KEYS`), as written: what a rollback restores."""
    return {k: json.loads(json.dumps(v)) for k, v in sorted((raw or {}).items()) if k in REVISION_KEYS}


def restore_spec(current: Mapping[str, Any] | None, recorded: Mapping[str, Any]) -> dict[str, Any]:
    """``current`` spec with its revision fields replaced by ``recorded`` (a ControllerRevision's
    ``data.spec``): like ``kubectl rollout undo``, scaling, rollout and the other settings stay."""
    out = {k: json.loads(json.dumps(v)) for k, v in (current or {}).items() if k not in REVISION_KEYS}
    out.update(revision_spec(recorded))
    return out


def recorded_spec(cr: Mapping[str, Any]) -> dict[str, Any] | None:
    """The raw revision fields a ControllerRevision recorded; None for records made before they were kept."""
    data = cr.get("data") or {}
    return dict(data["spec"]) if isinstance(data.get("spec"), Mapping) else None


def merge_patch(old: Any, new: Any) -> Any:
    """The RFC 7386 merge patch that turns ``old`` into ``new`` (removed keys become null; lists whole)."""
    if not isinstance(old, Mapping) or not isinstance(new, Mapping):
        return json.loads(json.dumps(new))
    out: dict[str, Any] = {}
    for key in sorted(set(old) | set(new)):
        if key not in new:
            out[key] = None
        elif key not in old:
            out[key] = json.loads(json.dumps(new[key]))
        elif old[key] != new[key]:
            out[key] = merge_patch(old[key], new[key])
    return out


def controller_revision(name: str, namespace: str, owner: Mapping[str, Any], spec: PDSpec,
                        revision: str, number: int, created_at: str,
                        raw_spec: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """An ``apps/v1 ControllerRevision`` recording ``revision`` with its config and time, and the raw
    revision fields of the spec (``data.spec``) that a rollback restores."""
    return {
        "apiVersion": "apps/v1",
        "kind": "ControllerRevision",
        "metadata": {
            "name": f"{name}-{revision}",
            "namespace": namespace,
            "labels": {"pdstack.io/deployment": name, "pdstack.io/revision": revision},
            "annotations": {"pdstack.io/recorded-at": created_at, ANN_CURRENT_SINCE: created_at},
            "ownerReferences": [dict(owner)],
        },
        "revision": number,
        "data": {"revision": revision, "recordedAt": created_at, "config": effective_config(spec),
                 "effective": effective_view(spec),
                 **({"spec": revision_spec(raw_spec)} if raw_spec is not None else {})},
    }


def prune_history(revisions: list[Mapping[str, Any]], keep: int, protected: set[str]) -> list[str]:
    """Names of ControllerRevisions to delete: the oldest beyond ``keep``, never a ``protected`` revision."""
    ordered = sorted(revisions, key=lambda r: r.get("revision", 0))
    excess = len(ordered) - keep
    out: list[str] = []
    for rev in ordered:
        if excess <= 0:
            break
        if rev.get("data", {}).get("revision") in protected:
            continue
        out.append(rev["metadata"]["name"])
        excess -= 1
    return out


# --- the per-role view a diff reads -------------------------------------------------------------------

def _role_view(spec: PDSpec, role: str) -> dict[str, Any]:
    """What one role's process runs, defaults included: image, model, TP size, resources, args, and env
    as the container gets it (operator knobs and watchdog timeouts as their ``PDRT_*`` names, then the
    user's env; a ``valueFrom`` stays a reference)."""
    from .render import worker_env  # render does not import this module; keep the import local anyway

    r = spec.prefill if role == "prefill" else spec.decode
    env: dict[str, Any] = {}
    for e in worker_env(spec, role):
        env[e["name"]] = e["value"] if "value" in e else _jsonable({k: v for k, v in e.items() if k != "name"})
    return {
        "engine": spec.engine,
        "image": spec.image,
        "model": {"source": spec.model.source, "servedName": spec.model.served_name,
                  "sha256": spec.model.sha256 or UNSET, "dtype": spec.model.dtype, "weights": spec.model.weights},
        "tensorParallelSize": r.tp_size,
        "replicas": r.replicas,
        "gpus": r.gpus,
        "requests": dict(sorted(r.requests.items())),
        "limits": dict(sorted(r.limits.items())),
        "args": list(r.args),
        "env": dict(sorted(env.items())),
        "volumes": [_jsonable(v) for v in r.volumes],
        "volumeMounts": [_jsonable(v) for v in r.volume_mounts],
        **({"pod": _jsonable({k: v for k, v in asdict(r.pod).items() if v not in (None, (), {})})}
           if r.pod != PodTemplate() else {}),
    }


def effective_view(spec: PDSpec) -> dict[str, Any]:
    """The canonical effective config per role, defaults included (what ``kubectl-pd diff`` compares).

    Derived from the same parsed spec as :func:`revision_hash`, so env order and explicitly written
    defaults change neither."""
    return {
        "prefill": _role_view(spec, "prefill"),
        "decode": _role_view(spec, "decode"),
        "placement": _jsonable(effective_config(spec)["placement"]),
        **({"probes": asdict(spec.probes)} if spec.probes != Probes() else {}),
        **_engine_config(spec),
    }


def revision_view(cr: Mapping[str, Any]) -> dict[str, Any]:
    """The diffable config of a recorded ControllerRevision (older records carry only ``config``)."""
    data = cr.get("data") or {}
    return dict(data.get("effective") or data.get("config") or {})


@dataclass(frozen=True)
class HistoryEntry:
    number: int
    revision: str
    since: float  # epoch seconds: when it became current
    name: str = ""


def parse_time(text: str) -> float:
    """RFC 3339 (``2026-12-01T12:00:00Z``, offsets allowed) -> epoch seconds; ValueError when malformed."""
    t = text.strip()
    if t.endswith("Z") or t.endswith("z"):
        t = t[:-1] + "+00:00"
    dt = datetime.fromisoformat(t)
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    return dt.timestamp()


def known_good(revisions: Iterable[Mapping[str, Any]]) -> list[tuple[float, str]]:
    """(known-good since, revision) of every ControllerRevision annotated known-good, newest first: the one
    known-good rule (the last known-good, an auto-rollback's target, the records pruning keeps)."""
    out = []
    for cr in revisions:
        rev = (cr.get("data") or {}).get("revision")
        since = ((cr.get("metadata") or {}).get("annotations") or {}).get(ANN_KNOWN_GOOD)
        try:
            t = parse_time(since) if isinstance(since, str) and since else None
        except ValueError:
            t = None
        if t is not None and rev:
            out.append((t, str(rev)))
    return sorted(out, reverse=True)


def last_known_good(recorded: str | None, revisions: Iterable[Mapping[str, Any]]) -> str | None:
    """The last known-good revision: ``status.lastKnownGoodRevision`` (``recorded``), else the newest
    ControllerRevision annotated known-good (a lost status is rebuilt from the records)."""
    if recorded:
        return str(recorded)
    good = known_good(revisions)
    return good[0][1] if good else None


def history(revisions: Iterable[Mapping[str, Any]]) -> list[HistoryEntry]:
    """ControllerRevisions -> entries ordered by the time each became current (then by number)."""
    out = []
    for r in revisions:
        meta = r.get("metadata") or {}
        ann = meta.get("annotations") or {}
        data = r.get("data") or {}
        since = ann.get(ANN_CURRENT_SINCE) or data.get("recordedAt") or ann.get("pdstack.io/recorded-at")
        if not since:
            continue
        out.append(HistoryEntry(int(r.get("revision", 0)), str(data.get("revision", "")), parse_time(since),
                                meta.get("name", "")))
    return sorted(out, key=lambda e: (e.since, e.number))


def revision_at(entries: Sequence[HistoryEntry], t: float) -> HistoryEntry | None:
    """The revision current at time ``t``: the last to become current at or before ``t``; None when
    ``t`` is before the first recorded revision (nothing is known about that time)."""
    best = None
    for e in sorted(entries, key=lambda e: (e.since, e.number)):
        if e.since <= t:
            best = e
        else:
            break
    return best


def parse_since(text: str, now: float) -> float:
    """``--since``: ``12:00`` / ``12:00:30`` (today, UTC; yesterday when that is in the future), a
    duration ``90s``/``15m``/``2h``/``1d``, or an RFC 3339 time. ValueError names what is accepted."""
    t = text.strip()
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([smhd])", t)
    if m:
        return now - float(m.group(1)) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]
    m = re.fullmatch(r"(\d{1,2}):(\d{2})(?::(\d{2}))?", t)
    if m:
        h, mi, s = int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)
        if h > 23 or mi > 59 or s > 59:
            raise ValueError(f"--since {text!r}: not a time of day (HH:MM[:SS], UTC)")
        day = datetime.fromtimestamp(now, timezone.utc).replace(hour=h, minute=mi, second=s, microsecond=0)
        ts = day.timestamp()
        return ts - 86400 if ts > now else ts
    try:
        return parse_time(t)
    except ValueError:
        raise ValueError(f"--since {text!r}: expected HH:MM (UTC, today), a duration like 90s/15m/2h/1d, "
                         "or an RFC 3339 time like 2026-12-01T12:00:00Z") from None


def show(v: Any) -> str:
    """One side of a diff line: ``<unset>`` for absent, scalars bare, structures as compact JSON."""
    if v is None:
        return UNSET
    if isinstance(v, str):
        return v if v and v.strip() == v and " -> " not in v else json.dumps(v)
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    return canonical_json(v)


def format_time(ts: float | None) -> str:
    if ts is None:
        return UNSET
    dt = datetime.fromtimestamp(ts, timezone.utc)
    return dt.isoformat(timespec="seconds" if dt.microsecond == 0 else "milliseconds").replace("+00:00", "Z")


def diff_report(old: Mapping[str, Any], new: Mapping[str, Any], *, from_side: Mapping[str, Any],
                to_side: Mapping[str, Any]) -> dict[str, Any]:
    """A diff as data (``-o json|yaml``): each side's revision/time/source, and the changed fields."""
    return {"from": dict(from_side), "to": dict(to_side),
            "changes": [{"field": p, "from": a, "to": b} for p, a, b in diff_configs(old, new)]}


def format_diff(report: Mapping[str, Any]) -> str:
    """The table form: a header naming each side, then ``field: old -> new`` lines."""
    def side(s: Mapping[str, Any]) -> str:
        parts = [str(s.get("revision") or UNSET)]
        if s.get("number") is not None:
            parts.append(f"#{s['number']}")
        if s.get("since"):
            parts.append(f"current since {s['since']}")
        if s.get("source"):
            parts.append(str(s["source"]))
        return " ".join(parts)
    lines = [f"--- {side(report['from'])}", f"+++ {side(report['to'])}"]
    changes = report["changes"]
    if not changes:
        lines.append("(no changes)")
    for c in changes:
        lines.append(f"{c['field']}: {show(c['from'])} -> {show(c['to'])}")
    return "\n".join(lines) + "\n"
