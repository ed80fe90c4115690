"""Revisions over time: when each became current, the revision at a time, and field-level diffs.

Golden diff files live in ``golden/diff``; regenerate after an intended change with
``PDSTACK_UPDATE_GOLDEN=1`` and review the diff.
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import pytest
import yaml

from pdoperator.cli import kubectl_pd as cli
from pdoperator.core.revisions import (ANN_CURRENT_SINCE, HistoryEntry, controller_revision, diff_report,
                                  effective_view, format_diff, history, parse_since, parse_time, revision_at,
                                  revision_hash)
from pdoperator.core.spec import parse_spec

GOLDEN = Path(__file__).parent / "golden" / "diff"
UPDATE = os.environ.get("PDSTACK_UPDATE_GOLDEN") == "1"
BASE = {"image": "ghcr.io/pdstack/runtime:1.0", "pairs": 2, "model": {"source": "/models/smollm2"},
        "prefill": {"resources": {"gpus": 1}, "env": [{"name": "A", "value": "1"}, {"name": "B", "value": "2"}]},
        "decode": {"resources": {"gpus": 1}}}

T0 = parse_time("2026-12-01T11:00:00Z")
NOON = parse_time("2026-12-01T12:00:00Z")


def spec(**over):
    d = json.loads(json.dumps(BASE))
    for k, v in over.items():
        d[k] = v
    return parse_spec(d, name="llm")


ENTRIES = [HistoryEntry(1, "aaaaaaaaaa", T0, "llm-aaaaaaaaaa"),
           HistoryEntry(2, "bbbbbbbbbb", NOON, "llm-bbbbbbbbbb"),
           HistoryEntry(3, "cccccccccc", NOON + 3600, "llm-cccccccccc")]


@pytest.mark.parametrize("t,expect", [
    (T0 - 1, None),                  # before the first revision: nothing is known
    (T0, 1),                         # the instant it became current
    (T0 + 1800, 1),                  # between the first two
    (NOON - 0.001, 1),
    (NOON, 2),
    (NOON + 1800, 2),                # between the 2nd and 3rd
    (NOON + 86400, 3),               # after the last
])
def test_revision_at(t, expect):
    got = revision_at(ENTRIES, t)
    assert (got.number if got else None) == expect
    assert (revision_at(list(reversed(ENTRIES)), t) or None) == got  # input order does not matter


def test_history_orders_by_the_time_each_became_current():
    a = controller_revision("llm", "ns", {}, spec(), "aaaaaaaaaa", 1, "2026-12-01T11:00:00.000Z")
    b = controller_revision("llm", "ns", {}, spec(), "bbbbbbbbbb", 2, "2026-12-01T12:00:00.250Z")
    assert a["metadata"]["annotations"][ANN_CURRENT_SINCE] == "2026-12-01T11:00:00.000Z"
    assert [(e.number, e.revision, e.since) for e in history([b, a])] == [
        (1, "aaaaaaaaaa", T0), (2, "bbbbbbbbbb", NOON + 0.25)]
    legacy = {"revision": 1, "metadata": {"name": "x"}, "data": {"revision": "r", "recordedAt": "2026-12-01T11:00:00Z"}}
    assert history([legacy])[0].since == T0  # records from before the annotation: their recordedAt


def test_env_order_and_explicit_defaults_change_neither_hash_nor_diff():
    base = spec()
    reordered = spec(prefill={"resources": {"gpus": 1}, "env": [{"name": "B", "value": "2"}, {"name": "A", "value": "1"}]})
    explicit = spec(kernel={"decodeTargetCTAs": 0, "maxKVSplits": 32, "attentionBackend": "auto"},
                    revisionHistoryLimit=10, model={"source": "/models/smollm2", "dtype": "auto"})
    for other in (reordered, explicit):
        assert revision_hash(other) == revision_hash(base)
        assert diff_report(effective_view(base), effective_view(other), from_side={}, to_side={})["changes"] == []
    knob = spec(kernel={"decodeTargetCTAs": 512})
    assert revision_hash(knob) != revision_hash(base)


@pytest.mark.parametrize("text,expect", [
    ("2h", NOON + 600 - 7200),
    ("90s", NOON + 600 - 90),
    ("12:00", NOON),
    ("12:05:30", NOON + 330),
    ("13:00", NOON - 86400 + 3600),            # later than now today: yesterday's
    ("2026-12-01T11:00:00Z", T0),
    ("2026-12-01T13:00:00+01:00", NOON),
])
def test_parse_since(text, expect):
    assert parse_since(text, NOON + 600) == pytest.approx(expect)


@pytest.mark.parametrize("text", ["noon", "25:00", "2x", "", "12:60"])
def test_parse_since_rejects_with_what_is_accepted(text):
    with pytest.raises(ValueError, match="HH:MM|time of day"):
        parse_since(text, NOON)


CASES = {
    "knob": (BASE, dict(BASE, kernel={"decodeTargetCTAs": 512})),
    "incident-env-and-image": (BASE, dict(BASE, image="ghcr.io/pdstack/runtime:1.1",
                                          decode={"resources": {"gpus": 1}, "env": [
                                              {"name": "SGLANG_SM120_MMA_TARGET_CTAS", "value": "512"},
                                              {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "t"}}}]})),
    "watchdog-and-tp": (BASE, dict(BASE, watchdog={"transferTimeoutSeconds": 45},
                                   decode={"resources": {"gpus": 2}, "tensorParallelSize": 1})),
    "same": (BASE, dict(BASE, pairs=8)),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("fmt", ["table", "json"])
def test_diff_output_golden(case, fmt):
    old, new = (parse_spec(json.loads(json.dumps(d)), name="llm") for d in CASES[case])
    report = diff_report(effective_view(old), effective_view(new),
                         from_side={"revision": revision_hash(old), "number": 1, "since": "2026-12-01T11:00:00Z"},
                         to_side={"revision": revision_hash(new), "number": 2, "since": "2026-12-01T12:00:00Z"})
    text = format_diff(report) if fmt == "table" else json.dumps(report, indent=2) + "\n"
    golden = GOLDEN / f"{case}.{'txt' if fmt == 'table' else 'json'}"
    if UPDATE:
        golden.write_text(text)
    assert golden.exists(), f"missing {golden}; run with PDSTACK_UPDATE_GOLDEN=1 and review it"
    assert text == golden.read_text()


def _files(tmp_path, a, b):
    pa, pb = tmp_path / "a.yaml", tmp_path / "b.yaml"
    for p, s in ((pa, a), (pb, b)):
        p.write_text(yaml.safe_dump({"apiVersion": "pdstack.io/v1alpha1", "kind": "PDDeployment",
                                     "metadata": {"name": "llm"}, "spec": s}))
    return str(pa), str(pb)


def test_offline_diff_from_files_exit_codes_and_formats(tmp_path, capsys):
    a, b = _files(tmp_path, BASE, dict(BASE, kernel={"decodeTargetCTAs": 512}))
    out = io.StringIO()
    assert cli.main(["diff", "--from-file", a, "--to-file", b], out=out) == 1
    assert out.getvalue().splitlines()[2:] == ["decode.env.PDRT_DECODE_TARGET_CTAS: <unset> -> 512"]
    for fmt, load in (("json", json.loads), ("yaml", yaml.safe_load)):
        out = io.StringIO()
        assert cli.main(["diff", "--from-file", a, "--to-file", b, "-o", fmt], out=out) == 1
        assert load(out.getvalue())["changes"] == [
            {"field": "decode.env.PDRT_DECODE_TARGET_CTAS", "from": None, "to": "512"}]
    assert cli.main(["diff", "--from-file", a, "--to-file", a], out=io.StringIO()) == 0
    capsys.readouterr()
    assert cli.main(["diff", "--from-file", a, "--to-file", str(tmp_path / "missing.yaml")], out=io.StringIO()) == 2
    assert "missing.yaml" in capsys.readouterr().err
    bad_a, bad_b = _files(tmp_path, BASE, dict(BASE, pairs=-1))
    assert cli.main(["diff", "--from-file", bad_a, "--to-file", bad_b], out=io.StringIO()) == 2
    assert "spec.pairs" in capsys.readouterr().err
    assert cli.main(["diff", "llm"], out=io.StringIO()) == 2
    assert "exactly one of --since T or --from REV" in capsys.readouterr().err
    assert cli.main(["diff", "--from-file", a], out=io.StringIO()) == 2
