"""Rollback: a ControllerRevision keeps what restores its spec, and ``kubectl-pd rollback`` puts it back.

* unit: restoring a recorded revision's fields over any current spec hashes to that revision again, and
  keeps the current spec's other fields (pairs, rollout, ...); the merge patch the CLI sends does the same;
* cluster (emulator + the real operator): ``rollback NAME --to REV`` and ``--last-known-good`` patch the
  spec, print the field-level diff, and the pairs roll back; ``--dry-run`` changes nothing; errors exit 2.
"""

from __future__ import annotations

import json

import pytest
from kmock._internal import dicts

from pdop_harness import NS, eventually, manifest, more_reconciles
from pdop_k8s_emulator import R
from pdoperator.cli.kubectl_pd import rollback_plan
from pdoperator.core.revisions import (ANN_KNOWN_GOOD, REVISION_KEYS, controller_revision, merge_patch, recorded_spec,
                                  restore_spec, revision_hash)
from pdoperator.core.spec import parse_spec

from test_kubectl_pd_cluster import kpd
from test_operator_integration import is_ready

OWNER = {"apiVersion": "pdstack.io/v1alpha1", "kind": "PDDeployment", "name": "llm", "uid": "u"}
BASE = {"image": "ghcr.io/pdstack/runtime:1.0", "pairs": 2, "model": {"source": "/models/m", "servedName": "m"},
        "prefill": {"resources": {"gpus": 1}, "env": [{"name": "A", "value": "1"}]},
        "decode": {"resources": {"gpus": 1}, "args": ["--max-num-seqs", "8"]},
        "rollout": {"maxUnavailablePairs": 1, "soakSeconds": 30}, "coRestart": {"policy": "Pair"}}
VARIANTS = [
    {},
    {"kernel": {"decodeTargetCTAs": 512}, "decode": {"resources": {"gpus": 1}, "env": [
        {"name": "PDRT_FAULT_DECODE_STALL_AFTER", "value": "1"}]}},
    {"image": "ghcr.io/pdstack/runtime:2.0", "watchdog": {"transferTimeoutSeconds": 90}},
    {"podTemplate": {"annotations": {"team": "x"}}, "placement": {"nodeSelector": {"gpu": "h100"}},
     "probes": {"startupSeconds": 600}},
]


def variant(v, **over):
    d = json.loads(json.dumps(BASE))
    d.update(json.loads(json.dumps(v)))
    d.update(over)
    return d


@pytest.mark.parametrize("old", range(len(VARIANTS)))
@pytest.mark.parametrize("now", range(len(VARIANTS)))
def test_restored_spec_hashes_to_the_recorded_revision(old, now):
    recorded = variant(VARIANTS[old])
    rev = revision_hash(parse_spec(recorded, name="llm"))
    cr = controller_revision("llm", "ns", OWNER, parse_spec(recorded, name="llm"), rev, 1, "2026-12-01T12:00:00Z",
                             recorded)
    assert set(recorded_spec(cr)) <= set(REVISION_KEYS)
    # the spec today: another variant, scaled and with other rollout settings
    current = variant(VARIANTS[now], pairs=5, rollout={"maxUnavailablePairs": 2, "autoRollback": True})
    restored = restore_spec(current, recorded_spec(cr))
    assert revision_hash(parse_spec(restored, name="llm")) == rev
    assert restored["pairs"] == 5 and restored["rollout"] == current["rollout"]  # not part of a revision
    assert dict(dicts.merge_patch_dict(current, merge_patch(current, restored))) == restored  # what the CLI sends
    body = {"metadata": {"name": "llm"}, "spec": current}
    spec, patch, got = rollback_plan(body, cr)
    assert spec == restored and got == rev and (patch == {}) == (old == now)


def test_a_record_without_its_spec_is_refused():
    spec = parse_spec(variant({}), name="llm")
    cr = controller_revision("llm", "ns", OWNER, spec, revision_hash(spec), 1, "2026-12-01T12:00:00Z")
    assert recorded_spec(cr) is None
    with pytest.raises(Exception, match="recorded without its spec"):
        rollback_plan({"metadata": {"name": "llm"}, "spec": variant({})}, cr)


def test_merge_patch_nulls_what_goes_and_replaces_lists():
    assert merge_patch({"a": {"b": 1, "c": 2}, "l": [1, 2], "k": 1}, {"a": {"b": 1}, "l": [3], "k": 1}) == \
        {"a": {"c": None}, "l": [3]}


# --- against the emulator ------------------------------------------------------------------------

async def test_rollback_by_cli_to_a_revision_and_to_the_last_known_good(operator, capsys):
    c = operator
    name = "rb"
    c.apply(manifest(name, pairs=2, rollout={"soakSeconds": 1, "maxUnavailablePairs": 1}))
    await eventually(lambda: is_ready(c, name), what="Ready")
    first = c.pdd(name)["status"]["currentRevision"]
    await eventually(lambda: c.pdd(name)["status"].get("lastKnownGoodRevision") == first, timeout=15,
                     what="first revision known-good")
    crs = c.api.select(R("apps", "v1", "controllerrevisions"), NS, f"pdstack.io/deployment={name}")
    assert crs[0]["metadata"]["annotations"][ANN_KNOWN_GOOD]  # durable: on the record, not only in status

    # the knob; from now on nothing soaks long enough to become known-good (soakSeconds is not in a revision)
    c.patch_spec(name, {"kernel": {"decodeTargetCTAs": 512}, "rollout": {"soakSeconds": 3600}})

    def at(rev):
        st = c.pdd(name)["status"]
        return st.get("currentRevision") == rev and st.get("updateRevision") == rev and is_ready(c, name) and st
    second = (await eventually(lambda: (st := c.pdd(name)["status"]).get("currentRevision") != first
                               and st.get("currentRevision") == st.get("updateRevision") and is_ready(c, name)
                               and st, timeout=30, what="rollout of the knob"))["currentRevision"]
    c.patch_spec(name, {"pairs": 3})  # scaling is not part of a revision: a rollback keeps it

    before = c.pdd(name)["spec"]
    assert before["kernel"]["decodeTargetCTAs"] == 512  # (the server filled the CRD's other kernel defaults)
    rc, text = await kpd("rollback", name, "--to", "1", "--dry-run")
    assert rc == 0, capsys.readouterr().err
    assert "decode.env.PDRT_DECODE_TARGET_CTAS: 512 -> <unset>" in text and "dry run" in text, text
    assert c.pdd(name)["spec"] == before  # unchanged

    rc, text = await kpd("rollback", name, "--to", first)
    assert rc == 0, capsys.readouterr().err
    assert text.splitlines()[2:] == ["decode.env.PDRT_DECODE_TARGET_CTAS: 512 -> <unset>",
                                     f"rolled back PDDeployment default/{name} to revision {first} (#1)"], text
    assert "kernel" not in c.pdd(name)["spec"] and c.pdd(name)["spec"]["pairs"] == 3
    await eventually(lambda: at(first) and len(c.pods(name)) == 6, timeout=40, what="pairs back at the first revision")

    rc, text = await kpd("rollback", name, "--to", first)
    assert rc == 0 and "already at revision" in text, text

    # forward again, then --last-known-good: back to the first revision, the only one that soaked
    c.patch_spec(name, {"kernel": {"decodeTargetCTAs": 512}})
    await eventually(lambda: at(second), timeout=40, what="second revision again")
    assert c.pdd(name)["status"]["lastKnownGoodRevision"] == first
    rc, text = await kpd("rollback", name, "--last-known-good", "-o", "json")
    assert rc == 0, capsys.readouterr().err
    report = json.loads(text[:text.rindex("}") + 1])
    assert report["to"]["revision"] == first and report["changes"] == [
        {"field": "decode.env.PDRT_DECODE_TARGET_CTAS", "from": "512", "to": None}]
    await eventually(lambda: at(first), timeout=40, what="pairs back at the known-good revision")

    rc, _ = await kpd("rollback", name, "--to", "nope")
    assert rc == 2 and "revision 'nope' not found" in capsys.readouterr().err
    rc, _ = await kpd("rollback", "missing", "--to", "1")
    assert rc == 2 and "not found" in capsys.readouterr().err
    rc, _ = await kpd("rollback", name)
    assert rc == 2  # one of --to / --last-known-good is required


async def test_rollback_to_last_known_good_without_one_is_an_error(operator, capsys):
    c = operator
    c.apply(manifest("young", pairs=1, rollout={"soakSeconds": 3600}))
    await eventually(lambda: is_ready(c, "young"), what="Ready")
    rc, _ = await kpd("rollback", "young", "--last-known-good")
    assert rc == 2 and "no known-good revision yet" in capsys.readouterr().err


async def test_auto_rollback_on_a_stall_soon_after_a_revision_change(operator):
    """The operator's path from a Stalled condition to the spec patch. The stall detector (stall11) writes
    Stalled into status in a real run; here the test writes it, as that detector would, with its
    lastTransitionTime (the slow test_rollback_live.py has the real detector and real processes)."""
    from pdop_harness import PDDS
    from pdoperator.core.status import iso
    import time

    c = operator
    name = "ar"
    c.apply(manifest(name, pairs=2, rollout={"soakSeconds": 1, "autoRollback": True, "rollbackWindowSeconds": 600}))
    await eventually(lambda: is_ready(c, name), what="Ready")
    good = c.pdd(name)["status"]["currentRevision"]
    await eventually(lambda: c.pdd(name)["status"].get("lastKnownGoodRevision") == good, timeout=15,
                     what="known-good")
    c.patch_spec(name, {"decode": {"resources": {"gpus": 1}, "env": [{"name": "PDRT_FAULT_DECODE_STALL_AFTER",
                                                                    "value": "1"}]}})
    bad = await eventually(lambda: (st := c.pdd(name)["status"]).get("currentRevision") not in (None, good)
                           and st["currentRevision"] == st["updateRevision"] and is_ready(c, name)
                           and st["currentRevision"], timeout=30, what="the knob rolled out")
    stalled_at = iso(time.time())

    def stall() -> list:
        obj = c.pdd(name)
        conds = [x for x in obj["status"]["conditions"] if x["type"] != "Stalled"]
        conds.append({"type": "Stalled", "status": "True", "reason": "NoProgress", "lastTransitionTime": stalled_at,
                      "message": "pair 0: decode request 12s old without a token"})
        if not c.events(name, "AutoRollback"):
            c.api._store(PDDS, "default", name, {**obj, "status": {**obj["status"], "conditions": conds}},
                         subresource="status")
            c.patch_spec(name, {})  # wakes the daemon (a PDDeployment event)
        return c.events(name, "AutoRollback")
    events = await eventually(stall, timeout=20, interval=0.3, what="AutoRollback")
    assert len(events) == 1 and events[0]["type"] == "Warning"
    msg = events[0]["message"]
    assert f"revision {bad}" in msg and f"last known-good revision {good}" in msg, msg
    assert msg.endswith("reverting: decode.env.PDRT_FAULT_DECODE_STALL_AFTER: <unset> -> 1"), msg
    assert "env" not in c.pdd(name)["spec"]["decode"]
    record = c.pdd(name)["status"]["autoRollback"]
    assert record["from"] == bad and record["to"] == good and record["reverted"] == [bad]
    await eventually(lambda: c.pdd(name)["status"]["currentRevision"] == good and is_ready(c, name),
                     timeout=30, what="back at the known-good revision")
    # the stall still shows (nothing cleared it in this test): no second rollback, no flapping
    await more_reconciles(c, name, 3)
    assert len(c.events(name, "AutoRollback")) == 1
