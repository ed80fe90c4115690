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
from typing import Any, Mapping

from dataclasses import asdict

from .spec import PDSpec, PodTemplate, Probes, RoleSpec

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
                  **({"dtype": spec.model.dtype} if spec.model.dtype != "auto" else {})},
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
            "tickSeconds": spec.watchdog.tick_s,
        },
        **({"probes": asdict(spec.probes)} if spec.probes != Probes() else {}),
        **({"sglang": _jsonable(asdict(spec.sglang))} if spec.engine == "sglang" else {}),
    }


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


def controller_revision(name: str, namespace: str, owner: Mapping[str, Any], spec: PDSpec,
                        revision: str, number: int, created_at: str) -> dict[str, Any]:
    """An ``apps/v1 ControllerRevision`` recording ``revision`` with its config and time."""
    return {
        "apiVersion": "apps/v1",
        "kind": "ControllerRevision",
        "metadata": {
            "name": f"{name}-{revision}",
            "namespace": namespace,
            "labels": {"pdstack.io/deployment": name, "pdstack.io/revision": revision},
            "annotations": {"pdstack.io/recorded-at": created_at},
            "ownerReferences": [dict(owner)],
        },
        "revision": number,
        "data": {"revision": revision, "recordedAt": created_at, "config": effective_config(spec)},
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
