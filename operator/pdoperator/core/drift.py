"""drift: which fields the operator declares are now owned by someone else (pure).

Children are written by server-side apply as ``pdstack-operator``. Each carries
``pdstack.io/applied-hash``, the hash of what the operator last applied: when the desired hash
differs, the operator changed its mind and applies again. Otherwise drift is read from the
server's own bookkeeping, ``metadata.managedFields``: when someone edits a field the operator
applied (``kubectl edit``, ``kubectl patch``, another controller), the API server moves that
field's ownership to them. A declared field owned by another manager is drift; it is reverted
(re-applied with force) or reported per ``spec.drift.policy``.

No values are compared, so what the server does to values (defaults filled in, empty lists
dropped, ``0.5`` stored as ``500m``, ``1024Mi`` as ``1Gi``) never reads as drift.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

APPLIED_HASH = "pdstack.io/applied-hash"
MANAGED_KEYS = ("spec", "data", "stringData")
FIELD_MANAGER = "pdstack-operator"

Path = tuple[str, ...]

SOURCES = ("children", "image", "process")  # status.drift[].source; the pdstack_config_drift gauge's label
FROM_REFERENCE = "from a reference"  # ``declared`` of an env var declared by valueFrom (compared by presence)


@dataclass(frozen=True)
class DriftEntry:
    """One drifted field, as ``status.drift[]`` holds it: where it came from (``source``), the object and field,
    what was declared and what is seen (None: absent, or not compared). Text is made from it at the edges."""

    source: str  # children | image | process
    object: str  # Kind/name (image: "revision <hash>")
    field: str  # children: a path like spec.ports[0].port; process: the env var; image: "container <name>"
    declared: str | None = None
    seen: str | None = None

    def to_status(self) -> dict[str, Any]:
        return {"source": self.source, "object": self.object, "field": self.field, "declared": self.declared,
                "seen": self.seen}

    @classmethod
    def from_status(cls, raw: Any) -> "DriftEntry | None":
        if not isinstance(raw, Mapping) or raw.get("source") not in SOURCES:
            return None
        return cls(str(raw["source"]), str(raw.get("object") or ""), str(raw.get("field") or ""),
                   _opt(raw.get("declared")), _opt(raw.get("seen")))

    @property
    def text(self) -> str:
        """The field as one line says it (children: grouped per object by :func:`lines`)."""
        if self.source == "image":
            return f"{self.object} {self.field} runs {self.seen}"
        if self.source == "process":
            if self.declared is None:
                return f"{self.field}={self.seen} (not declared)"
            if self.seen is None:
                return f"{self.field}: declared {self.declared}, not in the process"
            return f"{self.field}: declared {self.declared}, process sees {self.seen}"
        return f"{self.object}: {self.field}"


def _opt(v: Any) -> str | None:
    return None if v is None else str(v)


def lines(entries: Sequence[DriftEntry]) -> list[tuple[str, str]]:
    """(source, text) per line, in order: children fields grouped per object (``Service/x: a, b``); one line
    per process field (``Pod/x: NAME ...``) and per image entry."""
    out: list[tuple[str, str]] = []
    last: str | None = None
    for e in entries:
        if e.source == "children":
            if last == e.object and out:
                out[-1] = (out[-1][0], f"{out[-1][1]}, {e.field}")
            else:
                out.append(("children", e.text))
            last = e.object
            continue
        last = None
        out.append((e.source, f"{e.object}: {e.text}" if e.source == "process" else e.text))
    return out


def message_lines(entries: Sequence[DriftEntry]) -> list[str]:
    """The ConfigDrift condition's lines (joined with "; "): other sources than children prefixed with theirs."""
    return [text if source == "children" else f"{source}: {text}" for source, text in lines(entries)]


def from_status(raw: Any) -> list[DriftEntry]:
    """``status.drift`` as entries (unknown or malformed items skipped)."""
    return [e for e in (DriftEntry.from_status(x) for x in (raw if isinstance(raw, list) else [])) if e is not None]


def children_entries(kind_name: str, desired: Mapping[str, Any], live: Mapping[str, Any],
                     paths: Sequence[str]) -> list[DriftEntry]:
    """Entries of a child (or pod) whose declared ``paths`` another manager owns: the declared and live values."""
    return [DriftEntry("children", kind_name, p, _show(value_at(desired, p)), _show(value_at(live, p)))
            for p in paths]


def value_at(obj: Any, readable: str) -> Any:
    """The value at a readable path (``spec.ports[0].targetPort``); None when absent."""
    cur = obj
    for name, index in re.findall(r"([^.\[\]]+)|\[(\d+)\]", readable):
        if index:
            cur = cur[int(index)] if isinstance(cur, list) and int(index) < len(cur) else None
        else:
            cur = cur.get(name) if isinstance(cur, Mapping) else None
        if cur is None:
            return None
    return cur


def _show(v: Any) -> str | None:
    if v is None or isinstance(v, str):
        return v
    return json.dumps(v, sort_keys=True)


def applied_hash(obj: Mapping[str, Any]) -> str:
    managed = {k: obj[k] for k in MANAGED_KEYS if k in obj}
    managed["labels"] = obj.get("metadata", {}).get("labels", {})
    return hashlib.sha256(json.dumps(managed, sort_keys=True).encode()).hexdigest()[:16]


def with_hash(obj: Mapping[str, Any]) -> dict[str, Any]:
    out = json.loads(json.dumps(obj))
    out["metadata"].setdefault("annotations", {})[APPLIED_HASH] = applied_hash(obj)
    return out


def leaf_paths(fields_v1: Mapping[str, Any], prefix: Path = ()) -> list[Path]:
    """``{"f:spec": {"f:replicas": {}}}`` -> ``[("f:spec", "f:replicas")]`` (``.`` item markers dropped)."""
    out: list[Path] = []
    for k, v in fields_v1.items():
        if k == ".":
            continue
        if v:
            out += leaf_paths(v, prefix + (k,))
        else:
            out.append(prefix + (k,))
    return out


def resolve(obj: Any, path: Path) -> tuple[bool, str]:
    """Does ``obj`` declare the field at ``path``? Returns (found, readable path like ``spec.ports[0].port``).

    List items are matched by the key fields the object states (a key field the server defaulted,
    such as a port's ``protocol: TCP``, is matched against its default).
    """
    cur, text = obj, ""
    for el in path:
        if el.startswith("f:"):
            if not isinstance(cur, Mapping) or el[2:] not in cur:
                return False, text
            cur = cur[el[2:]]
            text += ("." if text else "") + el[2:]
        elif el.startswith("k:"):
            want = json.loads(el[2:])
            if not isinstance(cur, list):
                return False, text
            hit = None
            for i, item in enumerate(cur):
                if isinstance(item, Mapping) and all(item.get(k, "TCP" if k == "protocol" else None) == v
                                                     for k, v in want.items()):
                    hit = i
                    break
            if hit is None:
                return False, text
            cur = cur[hit]
            text += f"[{hit}]"
        elif el.startswith("v:") or el.startswith("i:"):
            return False, text
    return True, text


def owned_elsewhere(desired: Mapping[str, Any], live: Mapping[str, Any], manager: str = FIELD_MANAGER) -> list[str]:
    """Declared fields (under spec/data) whose ownership another manager took by editing them."""
    out: list[str] = []
    for entry in (live.get("metadata", {}) or {}).get("managedFields", []) or []:
        if entry.get("manager") == manager or entry.get("subresource"):
            continue
        for path in leaf_paths(entry.get("fieldsV1") or {}):
            if not path or path[0] not in ("f:spec", "f:data"):
                continue
            found, text = resolve(desired, path)
            if found and text not in out:
                out.append(text)
    return sorted(out)


@dataclass(frozen=True)
class Decision:
    action: str  # create | apply | revert | report | none
    paths: tuple[str, ...] = ()


def decide(desired: Mapping[str, Any], live: Mapping[str, Any] | None, policy: str, *,
           enforce: bool = False) -> Decision:
    """What to do with one child. ``enforce``: operator-owned live state (topology) is always reverted."""
    if live is None:
        return Decision("create")
    have = (live.get("metadata", {}).get("annotations", {}) or {}).get(APPLIED_HASH)
    if have != applied_hash(desired):
        return Decision("apply")
    diffs = owned_elsewhere(desired, live)
    if not diffs:
        return Decision("none")
    if enforce or policy == "Revert":
        return Decision("revert", tuple(diffs))
    return Decision("report", tuple(diffs))


# --- source (c): the env a runtime process really sees, against the declared env -----------------------

#: the families a runtime's ``/config`` reports (``pdruntime.env.REPORTED_PREFIXES``); keep in step
REPORTED_PREFIXES = ("PDRT_", "SGLANG_", "NCCL_", "CUDA_", "TORCH_")
REDACTED = "<redacted>"


def _reported(name: str, allow: tuple[str, ...]) -> bool:
    return (name.startswith(REPORTED_PREFIXES) or name in allow
            or any(a.endswith("*") and name.startswith(a[:-1]) for a in allow))


def process_env_drift(declared: Mapping[str, Any], reported: Mapping[str, str],
                      allow: tuple[str, ...] = (), presence_only: tuple[str, ...] = (),
                      pod: str = "") -> list[DriftEntry]:
    """Field-level differences between the env a pod declares and what its process (``Pod/<pod>``) reports at
    ``/config`` (``env.process_env``), sorted by name. Only names the process reports are compared
    (its families plus its allow-list ``allow``). A ``valueFrom`` reference or a redacted value compares
    by presence only, as do ``presence_only`` names (paths into the operator's own mounts). Their text:
    ``NAME=value (not declared)``, ``NAME: declared X, process sees Y``, ``NAME: declared X, not in the process``."""
    out = []
    for name in sorted(set(declared) | set(reported)):
        if not _reported(name, allow):
            continue
        want, got = declared.get(name), reported.get(name)
        if want is None:
            out.append(DriftEntry("process", f"Pod/{pod}", name, None, got))
        elif got is None:
            out.append(DriftEntry("process", f"Pod/{pod}", name, want if isinstance(want, str) else FROM_REFERENCE))
        elif isinstance(want, str) and got != REDACTED and got != want and name not in presence_only:
            out.append(DriftEntry("process", f"Pod/{pod}", name, want, got))
    return out


#: operator plumbing: where the operator mounts the KV-transfer Secret; its value is a path, not a knob
PRESENCE_ONLY = ("PDRT_KV_AUTH_TOKEN_FILE",)


# --- source (b): image digests that differ between pods of one revision (a moved tag) ---------------

def _digest(image_id: str) -> str:
    return image_id.rsplit("@", 1)[-1] if "@" in image_id else image_id.removeprefix("docker-pullable://")


def image_drift(pods: list[Mapping[str, Any]], revision_label: str = "pdstack.io/revision") -> list[DriftEntry]:
    """Pods of one revision whose containers run different image digests (``status.containerStatuses
    [].imageID``): the tag moved between pulls. One entry per (revision, container), naming each digest and
    its pods. Pods that report no imageID yet are not evidence."""
    seen: dict[tuple[str, str], dict[str, list[str]]] = {}
    for p in pods:
        rev = ((p.get("metadata") or {}).get("labels") or {}).get(revision_label)
        if not rev:
            continue
        for cs in ((p.get("status") or {}).get("containerStatuses") or []):
            if cs.get("imageID"):
                seen.setdefault((rev, cs.get("name", "")), {}).setdefault(_digest(cs["imageID"]), []).append(
                    p["metadata"]["name"])
    out = []
    for (rev, ctr), digests in sorted(seen.items()):
        if len(digests) > 1:
            parts = ", ".join(f"{d} ({', '.join(sorted(names))})" for d, names in sorted(digests.items()))
            out.append(DriftEntry("image", f"revision {rev}", f"container {ctr}", None,
                                  f"{len(digests)} digests: {parts}"))
    return out
