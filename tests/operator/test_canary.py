"""Rollout safety decisions (canary.py) as tables: the canary's life, the per-pair targets, the probe's
verdict, known-good after the soak, and auto-rollback on an early stall. No server: fake probe reports."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import yaml

from pdoperator.safety import canary as c
from pdoperator.core.pairs import PairMemory, PairState
from pdoperator.core.render import TopologyPair, topology_doc
from pdoperator.core.spec import CanarySpec
from pdoperator.core.status import iso

NOW = 10_000.0
SPEC = CanarySpec(agents=2, rounds=3, round_timeout_s=10.0, max_tokens=8)
PENDING = c.CanaryState("new", 3, c.PENDING, "old")


@pytest.mark.parametrize("canary,pairs,desired,current,prior,known_good,expect", [
    (None, 4, "new", "old", None, None, None),                        # no canary configured
    (SPEC, 1, "new", "old", None, None, None),                        # one pair: nothing to keep serving
    (SPEC, 4, "new", None, None, None, None),                         # first creation: nothing to fall back to
    (SPEC, 4, "old", "old", None, None, None),                        # the spec asks for what runs
    (SPEC, 4, "good", "new", None, "good", None),                     # a rollback to known-good goes straight
    (SPEC, 4, "new", "old", None, None, PENDING),                     # a new revision: the highest pair first
    (SPEC, 2, "new", "old", None, None, replace(PENDING, pair=1)),
    (SPEC, 4, "new", "old", replace(PENDING, phase=c.PROBING, started_at=1.0), None,
     replace(PENDING, phase=c.PROBING, started_at=1.0)),              # the one in status carries on
    (SPEC, 4, "new", "old", replace(PENDING, phase=c.FAILED), None,
     replace(PENDING, phase=c.FAILED)),                               # failed stays failed for that revision
    (SPEC, 4, "newer", "old", replace(PENDING, phase=c.FAILED), None,
     replace(PENDING, revision="newer")),                             # a new spec change starts over
    (SPEC, 2, "new", "old", PENDING, None, replace(PENDING, pair=1)),  # scaled below the canary pair: re-picked
])
def test_plan_canary(canary, pairs, desired, current, prior, known_good, expect):
    assert c.plan_canary(canary, pairs=pairs, desired=desired, current=current, prior=prior,
                         known_good=known_good) == expect


@pytest.mark.parametrize("state,expect", [
    (None, {0: "new", 1: "new", 2: "new", 3: "new"}),
    (PENDING, {0: "old", 1: "old", 2: "old", 3: "new"}),
    (replace(PENDING, phase=c.PROBING), {0: "old", 1: "old", 2: "old", 3: "new"}),
    (replace(PENDING, phase=c.PASSED), {0: "new", 1: "new", 2: "new", 3: "new"}),
    (replace(PENDING, phase=c.FAILED), {0: "old", 1: "old", 2: "old", 3: "old"}),  # the canary rolls back
])
def test_targets(state, expect):
    assert c.targets(state, pairs=4, desired="new") == expect


@pytest.mark.parametrize("revision,ready,confirmed,expect", [
    ("new", True, True, True),
    ("old", True, True, False),   # still the old pods
    ("new", False, True, False),  # not ready yet
    ("new", True, False, False),  # a router still runs a topology without the canary flag
])
def test_ready_to_probe(revision, ready, confirmed, expect):
    assert c.ready_to_probe(PENDING, pair_revision=revision, pair_ready=ready, routers_confirmed=confirmed) is expect


def rounds(n, failed_round=None):
    return [{"round": r, "completed": 0 if r == failed_round else 2, "failed": 0,
             "hung": 1 if r == failed_round else 0, "latency_p50_s": 0.2, "latency_max_s": 0.4 * r}
            for r in range(1, n + 1)]


HANG = {"ok": False, "rounds": rounds(2, failed_round=2),
        "failure": {"round": 2, "agent": 1, "kind": "hang", "detail": "no byte for 10.0s", "stage": "decode",
                    "age_s": 10.04}}
CLEAN = {"ok": True, "rounds": rounds(3), "failure": None}


@dataclass
class Report:  # what run_agents_probe returns: read through to_dict()
    d: dict

    def to_dict(self):
        return self.d


@pytest.mark.parametrize("report,fires,stall,passed,evidence", [
    (CLEAN, 0, None, True, "3 round(s), 6 request(s) completed, slowest 1.20s"),
    (Report(CLEAN), 0, None, True, "3 round(s), 6 request(s) completed, slowest 1.20s"),
    (HANG, 0, None, False, "round 2: agent 1 hung at stage decode, 10.0s old: no byte for 10.0s"),
    (Report(HANG), 0, None, False, "round 2: agent 1 hung at stage decode, 10.0s old: no byte for 10.0s"),
    ({"ok": False, "rounds": [], "failure": {"kind": "error", "detail": "the probe could not run: X"}}, 0, None,
     False, "round None: agent None failed at stage ?: the probe could not run: X"),
    ({"ok": False, "rounds": []}, 0, None, False, "probe failed without a failure record"),
    (CLEAN, 2, None, False, "watchdog fired 2 time(s) on the canary pair during the probe"),
    (CLEAN, 0, "pair 3: decode request 12s without progress", False,
     "stalled during the probe: pair 3: decode request 12s without progress"),
])
def test_verdict(report, fires, stall, passed, evidence):
    assert c.verdict(report, watchdog_fires=fires, stall=stall) == (passed, evidence)


def test_probe_transitions_and_status_round_trip():
    probing = c.start_probe(PENDING, NOW)
    assert probing.phase == c.PROBING and probing.started_at == NOW and probing.holds_traffic_off
    failed = c.finish_probe(probing, HANG, NOW + 25)
    assert failed.phase == c.FAILED and not failed.holds_traffic_off and failed.evidence.startswith("round 2: ")
    passed = c.finish_probe(probing, Report(CLEAN), NOW + 25)
    assert passed.phase == c.PASSED and len(passed.rounds) == 3
    for s in (PENDING, probing, failed, passed):
        assert c.CanaryState.from_status(yaml.safe_load(yaml.safe_dump(s.to_status(iso)))) == s
    assert c.CanaryState.from_status({"phase": "Bogus"}) is None
    assert c.CanaryState.from_status(None) is None


def test_topology_marks_only_the_canary_pair():
    doc = topology_doc("r", [TopologyPair(0, True, "10.0.0.1", "10.0.0.2"),
                             TopologyPair(1, True, "10.0.1.1", "10.0.1.2", canary=True)])
    assert [p.get("canary", False) for p in doc["pairs"]] == [False, True]
    assert doc["pairs"][1]["ready"] is True  # it takes pinned requests; the router keeps normal traffic off


# --- known-good and auto-rollback ---------------------------------------------------------------------

def pstate(k, rev="r1", ready=True, since=NOW - 100):
    return PairState(k, rev, ready, "Ready" if ready else "Starting", PairMemory(ready_since=since if ready else None))


def cond(status, at, reason="NoProgress", message="pair 0: decode request 70s old, no tokens"):
    return {"type": "Stalled", "status": status, "reason": reason, "message": message, "lastTransitionTime": iso(at)}


@pytest.mark.parametrize("pairs,stall,soak,expect", [
    ([pstate(0), pstate(1)], None, 60, 0.0),                                  # served 100 s > 60 s
    ([pstate(0), pstate(1, since=NOW - 30)], None, 60, 30.0),                 # the last pair ready 30 s ago
    ([pstate(0), pstate(1, rev="r0")], None, 60, None),                       # not every pair on it
    ([pstate(0), pstate(1, ready=False)], None, 60, None),                    # a pair down
    ([pstate(0)], None, 60, None),                                            # a pair missing
    ([pstate(0), pstate(1)], cond("True", NOW - 5), 60, None),                # stalled now
    ([pstate(0), pstate(1)], cond("False", NOW - 20), 60, 40.0),              # a stall ended 20 s ago
    ([pstate(0), pstate(1)], cond("False", NOW - 500), 60, 0.0),              # long ago: ready_since counts
    ([pstate(0), pstate(1)], cond("True", NOW - 5, reason="InvalidSpec"), 60, 0.0),  # not a stall
])
def test_soak_left(pairs, stall, soak, expect):
    assert c.soak_left(revision="r1", pairs=pairs, n_pairs=2, stall=stall, soak_s=soak, now=NOW) == expect


CHANGED = NOW - 100


@pytest.mark.parametrize("kw,expect", [
    ({}, "good"),                                                            # stall 50 s after the change
    ({"enabled": False}, None),
    ({"last_known_good": None}, None),                                       # nothing to go back to
    ({"desired": "good"}, None),                                             # already on it
    ({"reverted": ["bad"]}, None),                                           # once per revision: no flapping
    ({"stall": cond("False", NOW - 50)}, None),                              # not stalled
    ({"stall": cond("True", NOW - 50, reason="InvalidSpec")}, None),
    ({"stall": cond("True", CHANGED - 1)}, None),                            # the stall began before the change
    ({"window_s": 30}, None),                                                # ... or after the window
    ({"changed_at": None}, None),
    ({"canary": c.CanaryState("bad", 1, c.FAILED, "good")}, None),           # the canary judges its revision
    ({"canary": c.CanaryState("bad", 1, c.PASSED, "good")}, "good"),
])
def test_auto_rollback(kw, expect):
    args = dict(enabled=True, window_s=900, desired="bad", last_known_good="good", changed_at=CHANGED,
                stall=cond("True", NOW - 50), reverted=[], canary=None)
    args.update(kw)
    assert c.auto_rollback(**args) == expect


@pytest.mark.parametrize("known_good,desired,expect", [
    ([], "bad", None),
    ([(1.0, "a"), (2.0, "b")], "c", "b"),   # the most recent to become known-good
    ([(1.0, "a"), (2.0, "bad")], "bad", "a"),  # the stalled revision soaked before the load came: the one before
    ([(2.0, "bad")], "bad", None),
])
def test_rollback_target(known_good, desired, expect):
    assert c.rollback_target(known_good, desired) == expect


@pytest.mark.parametrize("state,restart_at,expect_phase", [
    (replace(PENDING, since=NOW), NOW + 5, c.FAILED),                   # the new revision crashed on the canary pair
    (replace(PENDING, since=NOW, phase=c.PROBING), NOW + 5, c.FAILED),
    (replace(PENDING, since=NOW), NOW - 5, c.PENDING),                  # a co-restart from before the canary
    (replace(PENDING, since=NOW), None, c.PENDING),
    (replace(PENDING, since=NOW, phase=c.PASSED), NOW + 5, c.PASSED),   # judged already
])
def test_a_co_restart_of_the_canary_pair_fails_it(state, restart_at, expect_phase):
    got = c.crashed(state, last_co_restart_at=restart_at, reason="OOMKilled", now=NOW + 6)
    assert got.phase == expect_phase
    if expect_phase == c.FAILED:
        assert got.evidence == "pair 3 co-restarted (OOMKilled) while on trial" and got.finished_at == NOW + 6


def test_a_new_canary_records_when_it_began():
    got = c.plan_canary(SPEC, pairs=4, desired="new", current="old", prior=None, now=NOW)
    assert got == replace(PENDING, since=NOW)
    assert c.CanaryState.from_status(got.to_status(iso)) == got


@pytest.mark.parametrize("cond,expect", [
    (None, None),
    (cond("False", NOW), None),
    (cond("True", NOW, message="pair 1 stalled in decode/running: ..."), "pair 1 stalled in decode/running: ..."),
    (cond("True", NOW, message="pair 0 stalled in decode/running; pair 1 stalled in router/x"),
     "pair 0 stalled in decode/running; pair 1 stalled in router/x"),
    (cond("True", NOW, message="pair 10 stalled in decode/running"), None),   # another pair
    (cond("True", NOW, message="pair 0 stalled in decode/running"), None),
    (cond("True", NOW, message="requests stuck"), "requests stuck"),          # names no pair: counts
    (cond("True", NOW, reason="InvalidSpec", message="invalid spec: x"), None),
])
def test_a_stall_counts_against_the_canary_only_on_its_pair(cond, expect):
    assert c.pair_stall(cond, 1) == expect
