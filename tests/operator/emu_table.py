"""Server-side ``meta.k8s.io/v1 Table`` (what ``kubectl get`` asks for), a pure function.

Custom resources: the Name column, then the CRD version's ``additionalPrinterColumns`` evaluated as
simple JSONPath (apiextensions-apiserver ``tableconvertor``: a missing value is an empty cell; ``date``
cells carry the timestamp). Built-in kinds: the columns of the real printers
(``pkg/printers/internalversion``) that the tests read; others get Name and Age.
Rows carry ``PartialObjectMetadata`` unless ``includeObject=Object``.
"""

from __future__ import annotations

import datetime
import re
from typing import Any

from emu_catalog import Resource

_COL_DOC = {"name": "Name must be unique within a namespace.", "age": "CreationTimestamp is a timestamp."}


def _age(ts: str | None) -> str:
    if not ts:
        return "<unknown>"
    t = datetime.datetime.fromisoformat(ts.replace("Z", "+00:00"))
    s = int((datetime.datetime.now(tz=datetime.timezone.utc) - t).total_seconds())
    if s < 120:
        return f"{max(s, 0)}s"
    if s < 7200:
        return f"{s // 60}m"
    if s < 172800:
        return f"{s // 3600}h"
    return f"{s // 86400}d"


def jsonpath(obj: Any, path: str) -> list[Any]:
    """The simple JSONPath of printer columns: ``.a.b``, ``.a[0]``, ``.a[*].b``, ``.a[?(@.k=='v')].b``."""
    tokens = re.findall(r"\.([A-Za-z0-9_\-]+)|\[(\d+|\*|\?\(@\.[A-Za-z0-9_]+\s*==\s*['\"][^'\"]*['\"]\))\]",
                        path.strip().lstrip("{").rstrip("}"))
    cur = [obj]
    for name, idx in tokens:
        nxt: list[Any] = []
        for c in cur:
            if name:
                if isinstance(c, dict) and name in c:
                    nxt.append(c[name])
            elif idx == "*":
                nxt += c if isinstance(c, list) else []
            elif idx.isdigit():
                if isinstance(c, list) and int(idx) < len(c):
                    nxt.append(c[int(idx)])
            else:
                m = re.match(r"\?\(@\.([A-Za-z0-9_]+)\s*==\s*['\"]([^'\"]*)['\"]\)", idx)
                key, want = m.group(1), m.group(2)
                nxt += [i for i in (c if isinstance(c, list) else [])
                        if isinstance(i, dict) and str(i.get(key)) == want]
        cur = nxt
    return cur


def _pod_cells(p: dict[str, Any]) -> list[Any]:
    st = p.get("status") or {}
    cs = st.get("containerStatuses") or []
    total = len((p.get("spec") or {}).get("containers") or [])
    ready = sum(1 for c in cs if c.get("ready"))
    phase = st.get("phase") or "Pending"
    if p["metadata"].get("deletionTimestamp"):
        phase = "Terminating"
    restarts = sum(int(c.get("restartCount") or 0) for c in cs)
    return [f"{ready}/{total}", phase, restarts, _age(p["metadata"].get("creationTimestamp")),
            st.get("podIP") or "<none>", (p.get("spec") or {}).get("nodeName") or "<none>", "<none>", "<none>"]


def _builtin(kind: str) -> tuple[list[tuple[str, str, int]], Any] | None:
    if kind == "Pod":
        cols = [("Ready", "string", 0), ("Status", "string", 0), ("Restarts", "string", 0), ("Age", "string", 0),
                ("IP", "string", 1), ("Node", "string", 1), ("Nominated Node", "string", 1),
                ("Readiness Gates", "string", 1)]
        return cols, _pod_cells
    if kind == "Deployment":
        def cells(d: dict[str, Any]) -> list[Any]:
            st, spec = d.get("status") or {}, d.get("spec") or {}
            return [f"{st.get('readyReplicas', 0)}/{spec.get('replicas', 0)}", st.get("updatedReplicas", 0),
                    st.get("availableReplicas", 0), _age(d["metadata"].get("creationTimestamp"))]
        return [("Ready", "string", 0), ("Up-to-date", "string", 0), ("Available", "string", 0),
                ("Age", "string", 0)], cells
    if kind == "Event":
        def ev(e: dict[str, Any]) -> list[Any]:
            io = e.get("involvedObject") or {}
            return [_age(e.get("lastTimestamp") or e.get("eventTime") or e["metadata"].get("creationTimestamp")),
                    e.get("type", ""), e.get("reason", ""), f"{(io.get('kind') or '').lower()}/{io.get('name', '')}",
                    e.get("message", "")]
        return [("Last Seen", "string", 0), ("Type", "string", 0), ("Reason", "string", 0),
                ("Object", "string", 0), ("Message", "string", 0)], ev
    if kind == "Service":
        def svc(s: dict[str, Any]) -> list[Any]:
            spec = s.get("spec") or {}
            ports = ",".join(f"{p.get('port')}/{p.get('protocol', 'TCP')}" for p in spec.get("ports") or [])
            return [spec.get("type", "ClusterIP"), spec.get("clusterIP") or "<none>", "<none>", ports or "<none>",
                    _age(s["metadata"].get("creationTimestamp"))]
        return [("Type", "string", 0), ("Cluster-IP", "string", 0), ("External-IP", "string", 0),
                ("Port(s)", "string", 0), ("Age", "string", 0)], svc
    return None


def table(r: Resource, items: list[dict[str, Any]], list_meta: dict[str, Any], include: str) -> dict[str, Any]:
    cols = [{"name": "Name", "type": "string", "format": "name", "description": _COL_DOC["name"], "priority": 0}]
    rows_cells: list[list[Any]]
    if r.crd is not None:
        pcs = r.printer_columns or [{"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}]
        for c in pcs:
            cols.append({"name": c["name"], "type": c.get("type", "string"), "format": c.get("format", ""),
                         "description": c.get("description", ""), "priority": int(c.get("priority", 0))})
        rows_cells = []
        for o in items:
            cells: list[Any] = [o["metadata"]["name"]]
            for c in pcs:
                found = jsonpath(o, c["jsonPath"])
                if not found:
                    cells.append(None)
                elif c.get("type") == "date" and isinstance(found[0], str):
                    cells.append(_age(found[0]))  # the tableconvertor renders dates as a human duration
                elif c.get("type") == "string":
                    cells.append(",".join(str(v) for v in found) if len(found) > 1 else str(found[0]))
                else:
                    cells.append(found[0])
            rows_cells.append(cells)
    else:
        spec = _builtin(r.kind)
        if spec is None:
            cols.append({"name": "Age", "type": "string", "format": "", "description": _COL_DOC["age"],
                         "priority": 0})
            rows_cells = [[o["metadata"]["name"], _age(o["metadata"].get("creationTimestamp"))] for o in items]
        else:
            names, fn = spec
            cols += [{"name": n, "type": t, "format": "", "description": "", "priority": pr} for n, t, pr in names]
            rows_cells = [[o["metadata"].get("name", "")] + fn(o) for o in items]
            if r.kind == "Event":
                cols.pop(0)
                rows_cells = [cells[1:] for cells in rows_cells]
    rows = []
    for o, cells in zip(items, rows_cells):
        if include == "None":
            obj = None
        elif include == "Object":
            obj = o
        else:
            obj = {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1", "metadata": o["metadata"]}
        row: dict[str, Any] = {"cells": cells}
        if obj is not None:
            row["object"] = obj
        rows.append(row)
    return {"kind": "Table", "apiVersion": "meta.k8s.io/v1", "metadata": list_meta, "columnDefinitions": cols,
            "rows": rows}


def wants_table(accept: str) -> bool:
    return "as=Table" in accept.replace(" ", "")
