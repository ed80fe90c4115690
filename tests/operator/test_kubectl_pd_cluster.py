"""``kubectl-pd history`` / ``diff NAME --since|--from/--to`` against the emulator and the real operator."""

from __future__ import annotations

import asyncio
import io
import json
import time

from pdop_harness import eventually, manifest
from pdoperator.cli import kubectl_pd as cli
from pdoperator.core.revisions import format_time

from test_operator_integration import is_ready


async def kpd(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    rc = await asyncio.to_thread(cli.main, list(argv), out)  # asyncio.run of its own, in a thread
    return rc, out.getvalue()


async def test_knob_diff_by_time(operator, capsys):
    c = operator
    name = "knob"
    c.apply(manifest(name, pairs=1))
    await eventually(lambda: is_ready(c, name), what=f"{name} Ready")
    first = c.pdd(name)["status"]["currentRevision"]
    await asyncio.sleep(0.05)
    before = time.time()  # a time before the change
    await asyncio.sleep(0.05)
    c.patch_spec(name, {"kernel": {"decodeTargetCTAs": 512}})

    def rolled():
        st = c.pdd(name)["status"]
        return st.get("currentRevision") != first and st["currentRevision"] == st["updateRevision"] and st
    st = await eventually(rolled, timeout=20, what="rollout of the knob")

    rc, text = await kpd("diff", name, "--since", format_time(before))
    assert rc == 1, capsys.readouterr().err
    lines = text.splitlines()
    assert lines[0].startswith(f"--- {first} #1 current since ")
    assert lines[1].startswith(f"+++ {st['currentRevision']} #2 current since ")
    assert lines[2:] == ["decode.env.PDRT_DECODE_TARGET_CTAS: <unset> -> 512"]

    rc, text = await kpd("diff", name, "--since", "1h", "-o", "json")  # a duration; before the first: error
    assert rc == 2 and "no revision was current at" in capsys.readouterr().err
    rc, text = await kpd("diff", name, "--from", "1", "--to", st["currentRevision"], "-o", "json")
    assert rc == 1 and json.loads(text)["changes"] == [
        {"field": "decode.env.PDRT_DECODE_TARGET_CTAS", "from": None, "to": "512"}]
    rc, _ = await kpd("diff", name, "--from", first, "--to", "1")
    assert rc == 0
    rc, _ = await kpd("diff", name, "--from", "nope")
    assert rc == 2 and "revision 'nope' not found; recorded: #1" in capsys.readouterr().err

    # revert: the first revision becomes current again, re-recorded with a new number and time
    t_revert = time.time()
    c.patch_spec(name, {"kernel": {"decodeTargetCTAs": 0}})
    await eventually(lambda: c.pdd(name)["status"].get("currentRevision") == first
                     and c.pdd(name)["status"].get("updateRevision") == first, timeout=20, what="revert")
    rc, text = await kpd("history", name, "-o", "json")
    rows = json.loads(text)
    assert rc == 0 and [(r["number"], r["revision"], r["current"]) for r in rows] == [
        (2, st["currentRevision"], False), (3, first, True)]
    assert rows[1]["since"] >= format_time(t_revert)[:19]
    rc, text = await kpd("diff", name, "--since", format_time(t_revert - 0.01))
    assert rc == 1 and text.splitlines()[2:] == ["decode.env.PDRT_DECODE_TARGET_CTAS: 512 -> <unset>"]
    rc, text = await kpd("history", name)
    assert rc == 0 and text.splitlines()[0].split() == ["NUMBER", "REVISION", "CURRENT", "SINCE", "CURRENT"]
    rc, _ = await kpd("history", "absent")
    assert rc == 2 and "absent not found" in capsys.readouterr().err
    rc, text = await kpd("drift", name)
    assert rc == 0 and "no drift" in text
    rc, _ = await kpd("drift", "absent")
    assert rc == 2 and "absent not found" in capsys.readouterr().err


def test_drift_report_splits_lines_by_source():
    from pdoperator.cli.view import drift_report
    obj = {"status": {
        "conditions": [{"type": "ConfigDrift", "status": "True", "reason": "Drifted",
                        "message": "Deployment/llm-router: spec.replicas; process: Pod/llm-0-decode-x: "
                                   "SGLANG_X=1 (not declared)"}],
        "drift": [{"source": "children", "object": "Deployment/llm-router", "field": "spec.replicas",
                   "declared": "1", "seen": "3"},
                  {"source": "process", "object": "Pod/llm-0-decode-x", "field": "SGLANG_X", "declared": None,
                   "seen": "1"}]}}
    assert drift_report(obj)["lines"] == [
        {"source": "children", "drift": "Deployment/llm-router: spec.replicas"},
        {"source": "process", "drift": "Pod/llm-0-decode-x: SGLANG_X=1 (not declared)"}]
    clean = {"status": {"conditions": [{"type": "ConfigDrift", "status": "False", "message": "live children match"}]}}
    assert drift_report(clean)["lines"] == [] and not drift_report({})["drifted"]
    # the list, not the message, is read: a field whose text holds "; " stays one line
    odd = {"status": {"drift": [{"source": "children", "object": "ConfigMap/x", "field": "data.a; b"}]}}
    assert drift_report(odd)["lines"] == [{"source": "children", "drift": "ConfigMap/x: data.a; b"}]


async def test_moved_tag_shows_image_drift(operator, capsys):
    from pdop_harness import NS, PODS
    c = operator
    name = "tag"
    c.apply(manifest(name, pairs=2))
    await eventually(lambda: is_ready(c, name), what=f"{name} Ready")
    pods = sorted(c.pods(name), key=lambda p: p["metadata"]["name"])
    for i, p in enumerate(pods):  # the kubelet reports what it pulled: pair 1's decode pulled after the tag moved
        moved = p["metadata"]["labels"]["pdstack.io/pair"] == "1" and p["metadata"]["labels"]["pdstack.io/role"] == "decode"
        digest = "sha256:" + ("b" if moved else "a") * 64
        st = json.loads(json.dumps(p["status"]))
        for cs in st["containerStatuses"]:
            cs["imageID"] = f"ghcr.io/pdstack/runtime@{digest}"
        c.api._store(PODS, NS, p["metadata"]["name"], {"status": st}, subresource="status")
    moved_pod = next(p["metadata"]["name"] for p in pods if p["metadata"]["labels"]["pdstack.io/pair"] == "1"
                     and p["metadata"]["labels"]["pdstack.io/role"] == "decode")

    def drifted():
        cond = c.condition(name, "ConfigDrift")
        return cond.get("status") == "True" and "image: " in cond.get("message", "") and cond
    cond = await eventually(drifted, timeout=15, what="image drift")
    assert f"sha256:{'b' * 64} ({moved_pod})" in cond["message"]
    rc, text = await kpd("drift", name, "-o", "json")
    lines = json.loads(text)["lines"]
    assert rc == 1 and [ln["source"] for ln in lines] == ["image"] and moved_pod in lines[0]["drift"]
    from prometheus_client import REGISTRY
    assert REGISTRY.get_sample_value("pdstack_config_drift", {"namespace": NS, "deployment": name,
                                                              "source": "image"}) == 1
    events = await eventually(lambda: c.events(name, "ConfigDrift"), timeout=10, what="Event")
    assert moved_pod in events[0]["message"]
