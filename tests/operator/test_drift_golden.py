"""Golden files: ``kubectl pd drift`` (table, json, yaml), the DRIFT section of ``kubectl pd status`` and
``kubectl get pdd``'s printer columns, for one PDDeployment drifted three ways at once (a Service edit, a pod
edit, a moved image tag), against the emulator with the real operator.

They pin the facts a person reads while drift moves from a joined string to a list of objects (issue 18).
Pod-name suffixes, revision hashes and times are normalised (random or not the point). Regenerate after an
intended change with ``PDSTACK_UPDATE_GOLDEN=1`` and review the diff.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import re
from pathlib import Path
from typing import Any

import yaml

from pdop_harness import NS, PODS, eventually, manifest
from pdop_k8s_emulator import R
from pdoperator.cli import kubectl_pd as cli

from test_operator_integration import is_ready

GOLDEN = Path(__file__).resolve().parent / "golden" / "drift"
UPDATE = os.environ.get("PDSTACK_UPDATE_GOLDEN") == "1"
CRD = yaml.safe_load((Path(__file__).resolve().parents[2] / "crds" / "pddeployment.yaml").read_text())
NAME = "gold"
SERVICES = R("", "v1", "services")


async def kpd(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    rc = await asyncio.to_thread(cli.main, list(argv), out)
    return rc, out.getvalue()


def normalise(text: str, revisions: list[str]) -> str:
    text = re.sub(rf"\b({NAME}-\d+-(?:prefill|decode)(?:-\d+)?)-[0-9a-f]{{6}}\b", r"\1-XXXXXX", text)
    for i, rev in enumerate(sorted(set(r for r in revisions if r))):
        text = text.replace(rev, f"<revision-{i}>")
    return re.sub(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?Z", "<time>", text)


def jsonpath(obj: Any, expr: str) -> Any:
    """The few JSONPath forms the CRD's printer columns use: ``.a.b`` and ``.a[?(@.k=='v')].b``."""
    cur = obj
    for part in re.findall(r"\.[A-Za-z]+|\[\?\(@\.\w+=='[^']*'\)\]", expr):
        if part.startswith("["):
            key, value = re.match(r"\[\?\(@\.(\w+)=='([^']*)'\)\]", part).groups()
            cur = next((x for x in cur or [] if isinstance(x, dict) and x.get(key) == value), None)
        else:
            cur = (cur or {}).get(part[1:]) if isinstance(cur, dict) else None
    return cur


def get_pdd(obj: dict[str, Any], revisions: list[str]) -> str:
    """``kubectl get pdd -o wide``'s table without Age (time-dependent): NAME and every printer column."""
    cols = [c for c in CRD["spec"]["versions"][0]["additionalPrinterColumns"] if c["type"] != "date"]
    rows = [["NAME"] + [c["name"].upper() for c in cols],
            [obj["metadata"]["name"]] + [normalise(str(v), revisions) if (v := jsonpath(obj, c["jsonPath"])) is not None
                                         else "<none>" for c in cols]]
    width = [max(len(r[i]) for r in rows) + 3 for i in range(len(rows[0]))]
    return "\n".join("".join(cell.ljust(w) for cell, w in zip(r, width)).rstrip() for r in rows) + "\n"


def check(case: str, text: str) -> None:
    golden = GOLDEN / case
    if UPDATE:
        GOLDEN.mkdir(parents=True, exist_ok=True)
        golden.write_text(text)
    assert golden.exists(), f"missing {golden}; run with PDSTACK_UPDATE_GOLDEN=1 and review it"
    assert text == golden.read_text(), f"{case} changed; if intended, regenerate and review"


async def test_drift_cli_and_get_pdd_match_goldens(operator):
    c = operator
    c.apply(manifest(NAME, pairs=2))
    await eventually(lambda: is_ready(c, NAME), what="Ready")
    await eventually(lambda: c.condition(NAME, "ConfigDrift").get("status") == "False", what="no drift")
    # clean: `kubectl pd drift` says so (exit 0); the Drift column is False
    obj = c.pdd(NAME)
    revs = [obj["status"].get("currentRevision")]
    rc, table = await kpd("drift", NAME)
    assert rc == 0
    check("drift-clean.txt", normalise(table, revs))
    check("get-pdd-clean.txt", get_pdd(obj, revs))
    # 1. children: `kubectl edit service` (a declared port)
    svc = c.api.read(SERVICES, NS, f"{NAME}-router")
    svc["spec"]["ports"][0]["targetPort"] = 9999
    c.api._store(SERVICES, NS, f"{NAME}-router", svc, manager="kubectl-edit")
    # 2. a pod edit (drift.policy Report, the default: reported, nothing restarts)
    pod = c.pair_pods(NAME, 1)["decode"]
    pod["spec"]["containers"][0]["image"] = "ghcr.io/pdstack/runtime:hotfix"
    c.api._store(PODS, NS, pod["metadata"]["name"], pod, manager="kubectl-edit")
    # 3. image: pair 0's decode pulled after the tag moved
    for p in c.pods(NAME):
        labels = p["metadata"]["labels"]
        moved = labels["pdstack.io/pair"] == "0" and labels["pdstack.io/role"] == "decode"
        st = json.loads(json.dumps(p["status"]))
        for cs in st["containerStatuses"]:
            cs["imageID"] = "ghcr.io/pdstack/runtime@sha256:" + ("b" if moved else "a") * 64
        c.api._store(PODS, NS, p["metadata"]["name"], {"status": st}, subresource="status")

    def drifted():
        msg = c.condition(NAME, "ConfigDrift").get("message", "")
        return all(s in msg for s in ("Service/", "Pod/", "image: ")) and msg
    await eventually(drifted, timeout=20, what="drift from all three sources")

    obj = c.pdd(NAME)
    revs = [obj["status"].get("currentRevision"), obj["status"].get("updateRevision")] + [
        p["metadata"]["labels"]["pdstack.io/revision"] for p in c.pods(NAME)]
    rc, table = await kpd("drift", NAME)
    assert rc == 1
    check("drift-table.txt", normalise(table, revs))
    rc, doc = await kpd("drift", NAME, "-o", "json")
    assert rc == 1
    check("drift.json", normalise(doc, revs))
    rc, doc = await kpd("drift", NAME, "-o", "yaml")
    assert rc == 1
    check("drift.yaml", normalise(doc, revs))
    rc, status = await kpd("status", NAME)
    assert rc == 0
    section = status[status.index("DRIFT"):status.index("STALLS")]
    check("status-drift.txt", normalise(section, revs))
    cond = c.condition(NAME, "ConfigDrift")
    check("condition.txt", normalise(f"{cond['status']} {cond['reason']}: {cond['message']}\n", revs))
    check("get-pdd.txt", get_pdd(obj, revs))
