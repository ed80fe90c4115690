"""``kubectl-pd status``, ``drift`` and ``requests``: what a person asks first in an incident.

Pure reports (data in, data out) plus one reader each, through the operator's own client (``kube.Kube``):

* ``status NAME``: the groups with their pods and readiness, the revisions (current, update, last
  known-good), the topology version, conditions, drift lines by source and stalled pairs.
* ``drift NAME``: ``status.drift`` (one object per drifted field) as lines by source; exit 1 when any.
* ``requests NAME``: every live request in the stack, merged across the router replicas and their
  workers, oldest first, with the router's verdict ("nothing is live in the stack ... look outside
  pdstack"). It reads each ready router pod's ``/debug/requests`` through the API server's
  ``pods/proxy`` subresource (no port-forward, no pod IPs reachable needed), sending the router-admin
  token from the Secret ``<name>-router-admin`` as ``X-PDStack-Admin-Token`` (the API server consumes the
  caller's ``Authorization`` header itself). The caller needs ``get`` on ``pods/proxy`` and on that Secret.
"""

from __future__ import annotations

import base64
import json
from typing import Any, Mapping, Sequence, TextIO

import yaml

from pdruntime.util.headers import ADMIN_TOKEN_HEADER  # pods/proxy drops Authorization: the token goes here

from ..core.render import ADMIN_KEY, LABEL_COMPONENT, LABEL_DEPLOYMENT, LABEL_MEMBER, LABEL_PAIR, LABEL_ROLE, \
    admin_secret_name, group_of
from ..core.drift import from_status, lines as drift_lines
from ..core.pairs import pod_ready
from ..core.spec import HTTP_PORT, KIND


class ViewError(Exception):
    """A lookup that failed in a way a person can fix; printed as ``kubectl-pd: ...``, exit 2."""


def _emit(report: Any, fmt: str, table: str, out: TextIO) -> None:
    if fmt == "json":
        out.write(json.dumps(report, indent=2) + "\n")
    elif fmt == "yaml":
        out.write(yaml.safe_dump(report, sort_keys=False))
    else:
        out.write(table)


# ---------------------------------------------------------------- drift
def drift_report(obj: Mapping[str, Any]) -> dict[str, Any]:
    """``status.drift`` of a PDDeployment as lines by source (pure): ``children`` (a live child or pod edited by
    someone else; one line per object), ``image`` (pods of one revision on different digests), ``process`` (a
    worker's /config env differs from its declared env). ``since`` and ``message``: the ConfigDrift condition's."""
    st = obj.get("status") or {}
    cond = next((c for c in (st.get("conditions") or []) if c.get("type") == "ConfigDrift"), {})
    lines = [{"source": source, "drift": text} for source, text in drift_lines(from_status(st.get("drift")))]
    return {"drifted": bool(lines), "since": cond.get("lastTransitionTime"), "message": cond.get("message", ""),
            "lines": lines}


def format_drift(r: Mapping[str, Any], ns: str, name: str) -> str:
    if not r["lines"]:
        return f"{KIND} {ns}/{name}: no drift ({r['message'] or 'not yet observed'})\n"
    return f"{'SOURCE':<10}DRIFT\n" + "".join(f"{line['source']:<10}{line['drift']}\n" for line in r["lines"])


async def show_drift(kube: Any, ns: str, name: str, fmt: str, out: TextIO) -> int:
    from ..shell.kube import path
    from ..core.spec import GROUP, VERSION

    obj = await kube.get(path(f"{GROUP}/{VERSION}", KIND, ns, name))
    if obj is None:
        raise ViewError(f"{KIND} {ns}/{name} not found")
    report = drift_report(obj)
    _emit(report, fmt, format_drift(report, ns, name), out)
    return 1 if report["lines"] else 0


# ---------------------------------------------------------------- status
def status_report(obj: Mapping[str, Any], pods: Sequence[Mapping[str, Any]],
                  drift: Mapping[str, Any]) -> dict[str, Any]:
    """A PDDeployment and its worker pods as one report (pure). ``drift``: :func:`drift_report`."""
    meta, st = obj.get("metadata") or {}, obj.get("status") or {}
    by_group: dict[int, list[dict[str, Any]]] = {}
    for p in pods:
        labels = (p.get("metadata") or {}).get("labels") or {}
        try:
            k = int(labels[LABEL_PAIR])
        except (KeyError, ValueError):
            continue
        cs = (p.get("status") or {}).get("containerStatuses") or []
        by_group.setdefault(k, []).append({
            "name": p["metadata"]["name"], "role": labels.get(LABEL_ROLE), "member": int(labels.get(LABEL_MEMBER, 0)),
            "ready": pod_ready(p), "phase": (p.get("status") or {}).get("phase", "Pending"),
            "terminating": bool(p["metadata"].get("deletionTimestamp")),
            "ip": (p.get("status") or {}).get("podIP"), "node": (p.get("spec") or {}).get("nodeName"),
            "restarts": sum(int(c.get("restartCount", 0) or 0) for c in cs)})
    records = {int(r["index"]): r for r in st.get("pairs") or [] if isinstance(r.get("index"), int)}
    groups = []
    for k in sorted(set(records) | set(by_group)):
        r = records.get(k, {})
        groups.append({"index": k, "phase": r.get("phase", "-"), "ready": bool(r.get("ready")),
                       "revision": r.get("revision"), "restarts": r.get("restarts", 0),
                       "lastCoRestart": r.get("lastCoRestart"),
                       "pods": sorted(by_group.get(k, []), key=lambda p: (p["role"] != "prefill", p["member"],
                                                                          p["name"]))})
    return {
        "name": meta.get("name"), "namespace": meta.get("namespace"), "phase": st.get("phase", "-"),
        "readyPairs": st.get("readyPairs", 0), "pairs": (obj.get("spec") or {}).get("pairs", 1),
        "revisions": {"current": st.get("currentRevision"), "update": st.get("updateRevision"),
                      "lastKnownGood": st.get("lastKnownGoodRevision")},
        "topologyVersion": st.get("topologyVersion"),
        "conditions": [{"type": c.get("type"), "status": c.get("status"), "reason": c.get("reason", ""),
                        "message": c.get("message", ""), "since": c.get("lastTransitionTime")}
                       for c in st.get("conditions") or []],
        "groups": groups,
        "drift": list(drift.get("lines") or []),
        "stalls": list(st.get("stalls") or []),
    }


def format_status(r: Mapping[str, Any]) -> str:
    rev = r["revisions"]
    lines = [f"{KIND} {r['namespace']}/{r['name']}: phase {r['phase']}, ready pairs {r['readyPairs']}/{r['pairs']}, "
             f"topology version {r['topologyVersion'] if r['topologyVersion'] is not None else '-'}",
             f"revisions: current {rev['current'] or '-'}, update {rev['update'] or '-'}, "
             f"last known-good {rev['lastKnownGood'] or '-'}", ""]
    lines.append(f"{'GROUP':<7}{'PHASE':<14}{'READY':<7}{'REVISION':<12}{'RESTARTS':<10}PODS")
    for g in r["groups"]:
        pods = ", ".join(f"{p['name']} ({p['role']}{'-' + str(p['member']) if p['member'] else ''}, "
                         f"{'terminating' if p['terminating'] else 'ready' if p['ready'] else p['phase'].lower()})"
                         for p in g["pods"]) or "-"
        lines.append(f"{g['index']:<7}{g['phase']:<14}{'yes' if g['ready'] else 'no':<7}{g['revision'] or '-':<12}"
                     f"{g['restarts']:<10}{pods}")
    lines += ["", "CONDITIONS"]
    for c in r["conditions"]:
        lines.append(f"  {c['type']}={c['status']} {c['reason']}" + (f": {c['message']}" if c["message"] else ""))
    lines.append("DRIFT" + ("" if r["drift"] else ": none"))
    lines += [f"  {d['source']:<10}{d['drift']}" for d in r["drift"]]
    lines.append("STALLS" + ("" if r["stalls"] else ": none"))
    lines += [f"  pair {s.get('pair')} since {s.get('since')}: {s.get('reason')}" for s in r["stalls"]]
    return "\n".join(lines) + "\n"


async def show_status(kube: Any, ns: str, name: str, fmt: str, out: TextIO) -> int:
    from ..shell.kube import path
    from ..core.spec import GROUP, VERSION

    obj = await kube.get(path(f"{GROUP}/{VERSION}", KIND, ns, name))
    if obj is None:
        raise ViewError(f"{KIND} {ns}/{name} not found")
    pods = await kube.list(path("v1", "Pod", ns), label_selector=f"{LABEL_DEPLOYMENT}={name},{LABEL_COMPONENT}=worker")
    uid = obj["metadata"].get("uid")
    pods = [p for p in pods if any(ref.get("uid") == uid for ref in p["metadata"].get("ownerReferences") or [])]
    report = status_report(obj, pods, drift_report(obj))
    _emit(report, fmt, format_status(report), out)
    return 0


# ---------------------------------------------------------------- requests
def requests_report(docs: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """Router pod name -> its ``/debug/requests`` document => every live entry, oldest first (pure).

    Router rows come from every replica; worker rows once (every replica asks the same workers)."""
    rows: list[dict[str, Any]] = []
    seen: set[tuple[str, str, Any]] = set()
    verdicts, unreachable = [], []
    for pod, doc in sorted(docs.items()):
        for raw in doc.get("requests") or ():
            rows.append(_row("router", raw, raw.get("pair"), pod))
        for w in doc.get("workers") or ():
            if "error" in w:
                where = f"{w.get('role')} {w.get('url')} ({w['error']})"
                if where not in unreachable:
                    unreachable.append(where)
                continue
            for raw in w.get("requests") or ():
                key = (str(w.get("url")), str(raw.get("id")), raw.get("stage"))
                if key not in seen:
                    seen.add(key)
                    rows.append(_row(str(w.get("role")), raw, w.get("pair"), str(w.get("url"))))
        if doc.get("verdict"):
            verdicts.append(f"{pod}: {doc['verdict']}" if len(docs) > 1 else str(doc["verdict"]))
    rows.sort(key=lambda r: (-(r["age_s"] or 0), r["id"] or "", r["role"]))
    return {"routers": sorted(docs), "live": len(rows), "requests": rows, "verdict": "; ".join(verdicts),
            "unreachable": unreachable}


def _row(role: str, raw: Mapping[str, Any], pair: Any, where: str) -> dict[str, Any]:
    tokens = raw.get("tokens", raw.get("completion_tokens"))
    return {"role": role, "pair": group_of(pair) if isinstance(pair, int) else None, "stage": raw.get("stage"),
            "age_s": raw.get("age_s"), "idle_s": raw.get("idle_s", raw.get("in_state_s")), "tokens": tokens,
            "client": raw.get("client"), "id": raw.get("id"), "at": where}


def _secs(v: Any) -> str:
    return f"{v:.1f}s" if isinstance(v, (int, float)) else "-"


def format_requests(r: Mapping[str, Any]) -> str:
    lines = [f"{'ROLE':<9}{'PAIR':<6}{'STAGE':<21}{'AGE':>9}{'IDLE':>9}{'TOKENS':>8}  {'CLIENT':<16}ID"]
    for x in r["requests"]:
        lines.append(f"{x['role']:<9}{'-' if x['pair'] is None else x['pair']:<6}{x['stage'] or '-':<21}"
                     f"{_secs(x['age_s']):>9}{_secs(x['idle_s']):>9}{'-' if x['tokens'] is None else x['tokens']:>8}  "
                     f"{(x['client'] or '-')[:15]:<16}{x['id'] or '-'}")
    if not r["requests"]:
        lines = ["no live request"]
    for u in r["unreachable"]:
        lines.append(f"unreachable: {u}")
    lines.append(f"verdict: {r['verdict'] or '-'}")
    return "\n".join(lines) + "\n"


async def _admin_token(kube: Any, ns: str, name: str) -> str:
    from ..shell.kube import path

    secret = await kube.get(path("v1", "Secret", ns, admin_secret_name(name)))
    raw = ((secret or {}).get("data") or {}).get(ADMIN_KEY)
    if not raw:
        raise ViewError(f"no router-admin token: Secret {ns}/{admin_secret_name(name)} is missing or has no "
                        f"'{ADMIN_KEY}' key (the operator creates it for router kind pdstack)")
    return base64.b64decode(raw).decode()


async def show_requests(kube: Any, ns: str, name: str, fmt: str, out: TextIO) -> int:
    from ..shell.kube import ApiError, path

    pods = await kube.list(path("v1", "Pod", ns), label_selector=f"{LABEL_DEPLOYMENT}={name},{LABEL_COMPONENT}=router")
    ready = sorted(p["metadata"]["name"] for p in pods if pod_ready(p) and not p["metadata"].get("deletionTimestamp")
                   and (p.get("status") or {}).get("podIP"))
    if not ready:
        raise ViewError(f"no ready router pod of {KIND} {ns}/{name} (pods labelled {LABEL_DEPLOYMENT}={name},"
                        f"{LABEL_COMPONENT}=router: {len(pods)}, none running and ready)")
    token = await _admin_token(kube, ns, name)
    docs: dict[str, Mapping[str, Any]] = {}
    for pod in ready:
        url = f"/api/v1/namespaces/{ns}/pods/{pod}:{HTTP_PORT}/proxy/debug/requests"
        try:
            doc = await kube.request("GET", url, headers={ADMIN_TOKEN_HEADER: token})
        except ApiError as e:
            hint = (f" (needs get on pods/proxy and on Secret {admin_secret_name(name)} in {ns})"
                    if e.status == 403 else " (the router's admin token was not accepted)" if e.status == 401 else "")
            raise ViewError(f"router pod {ns}/{pod}: GET /debug/requests through the API server's pods/proxy: "
                            f"HTTP {e.status}: {e.message}{hint}") from None
        if not isinstance(doc, dict):
            raise ViewError(f"router pod {ns}/{pod}: /debug/requests answered no JSON object")
        docs[pod] = doc
    report = requests_report(docs)
    _emit(report, fmt, format_requests(report), out)
    return 0

