"""Stall detection, pure (operator/pdoperator/core/stall.py): table tests of the verdict on one pair from two
observations, the parsing of /debug/requests and /metrics, and the status it gives."""

from __future__ import annotations

import pytest

from pdoperator.core import stall
from pdoperator.core.pairs import PairMemory, PairState, Plan
from pdoperator.core.status import Facts, build_status, with_stalls
from pdoperator.core.stall import Observation, Row, evaluate

S = 60.0  # spec.stall.seconds


def row(role, stage, age, *, id_="r1", tokens=None, idle=None, in_state=None, client="agents"):
    return Row(role=role, id=id_, stage=stage, age_s=age, tokens=tokens, idle_s=idle, in_state_s=in_state,
               client=client)


def obs(at, *rows, fires=0.0, gen=0.0, unreachable=()):
    return Observation(pair=0, at=at, rows=tuple(rows), watchdog_fires=fires, generated_tokens=gen,
                       unreachable=tuple(unreachable))


CASES = [
    # (name, prev, cur, stalled, stage)
    ("idle pair", obs(0), obs(10), False, None),
    ("healthy long generation: old, but tokens flow (idle_s small)",
     obs(0, row("decode", "running", 290, tokens=5000, idle=0.1), gen=1000),
     obs(10, row("decode", "running", 300, tokens=5500, idle=0.05), gen=1500), False, None),
    ("decode made no progress for >= stall.seconds (idle_s)",
     obs(0, row("decode", "running", 100, tokens=40, idle=55), gen=40),
     obs(10, row("decode", "running", 110, tokens=40, idle=65), gen=40), True, "decode/running"),
    ("decode idle just under stall.seconds",
     obs(0, row("decode", "running", 100, tokens=40, idle=49), gen=40),
     obs(10, row("decode", "running", 110, tokens=40, idle=59.9), gen=40), False, None),
    # issue 20: the sweep reads the same progress as the watchdogs; a long prefill that advances is not a stall
    ("a long prefill that keeps advancing (its chunks, then its stage) is never stalled, however old",
     obs(0, row("prefill", "waiting", 55, idle=1)), obs(10, row("prefill", "inflight", 65, idle=2)), False, None),
    ("the same long prompt on decode, its prefill progress reported, router row beside it",
     obs(0, row("decode", "prealloc", 300, tokens=0, idle=2), row("router", "waiting_first_token", 300, idle=300)),
     obs(10, row("decode", "prealloc", 310, tokens=0, idle=1), row("router", "waiting_first_token", 310, idle=310)),
     False, None),
    ("a prefill with no progress for stall.seconds",
     obs(0, row("prefill", "waiting", 55, idle=55)), obs(10, row("prefill", "waiting", 65, idle=65)), True,
     "prefill/waiting"),
    ("request queued in prefill longer than stall.seconds on a runtime that reports no progress",
     obs(0, row("prefill", "waiting", 55)), obs(10, row("prefill", "inflight", 65)), True, "prefill/inflight"),
    ("request stuck in KV transfer on decode",
     obs(0, row("decode", "transfer", 30, tokens=0, idle=30)),
     obs(31, row("decode", "transfer", 61, tokens=0, idle=61)),
     True, "decode/transfer"),
    ("router waiting for a first token too long",
     None, obs(10, row("router", "waiting_first_token", 70, tokens=0, idle=1)), True, "router/waiting_first_token"),
    ("the worker's row names the stage; the router's row mirrors it",
     obs(0, row("router", "waiting_first_token", 65, tokens=0, idle=60),
         row("decode", "running", 61, tokens=0, idle=60)),
     obs(5, row("router", "waiting_first_token", 70, tokens=0, idle=65),
         row("decode", "running", 66, tokens=0, idle=65)),
     True, "decode/running"),
    ("the router's row is older (it started earlier): the decode row holding that request is the one judged",
     obs(0, row("router", "waiting_first_token", 1, tokens=0, idle=1),
         row("decode", "running", 0.5, tokens=0, idle=0.5)),
     obs(60, row("router", "waiting_first_token", 61, tokens=0, idle=61),
         row("decode", "running", 60.5, tokens=0, idle=59.5)),
     False, None),
    ("... and once decode's own row crosses, decode is named",
     obs(0, row("router", "waiting_first_token", 1, tokens=0, idle=1),
         row("decode", "running", 0.5, tokens=0, idle=0.5)),
     obs(61, row("router", "waiting_first_token", 62, tokens=0, idle=62),
         row("decode", "running", 61.5, tokens=0, idle=60.5)),
     True, "decode/running"),
    ("recovery: the stuck request finished", obs(0, row("decode", "running", 100, tokens=40, idle=65)), obs(10), False,
     None),
    ("recovery: tokens flow again", obs(0, row("decode", "running", 100, tokens=40, idle=65), gen=40),
     obs(10, row("decode", "running", 110, tokens=90, idle=0.2), gen=90), False, None),
]


@pytest.mark.parametrize("name,prev,cur,stalled,stage", CASES, ids=[c[0] for c in CASES])
def test_verdict_table(name, prev, cur, stalled, stage):
    e = evaluate(prev, cur, S)
    assert (e.stalled, e.stage) == (stalled, stage), e.reason
    assert e.reason.startswith("pair 0")
    if stalled:
        assert stage in e.reason and "stall.seconds 60" in e.reason


def test_evidence_tokens_per_second_and_watchdog_fires_over_the_interval():
    prev = obs(100, row("decode", "running", 10, tokens=100, idle=0.1), fires=3, gen=1000)
    cur = obs(110, row("decode", "running", 20, tokens=350, idle=0.1), fires=5, gen=1250)
    e = evaluate(prev, cur, S)
    assert not e.stalled and e.tokens_per_s == 25.0 and e.watchdog_fires == 2 and e.interval_s == 10
    assert "25 tokens/s, 2 watchdog fire(s) over 10s" in e.reason
    # fires are reported alongside a stall, never a verdict alone
    stuck = evaluate(obs(100, row("decode", "running", 80, tokens=7, idle=60), fires=1, gen=7),
                     obs(110, row("decode", "running", 90, tokens=7, idle=70), fires=4, gen=7), S)
    assert stuck.stalled and stuck.watchdog_fires == 3 and stuck.tokens_per_s == 0
    assert "made no progress for 70s" in stuck.reason and "0 tokens/s, 3 watchdog fire(s) over 10s" in stuck.reason
    # a counter reset (the worker restarted) counts from zero, never negative
    reset = evaluate(obs(0, fires=9, gen=900), obs(10, fires=1, gen=50), S)
    assert reset.watchdog_fires == 1 and reset.tokens_per_s == 5


def test_missing_idle_s_falls_back_to_tokens_unchanged_across_observations():
    """Runtimes without idle_s: tokens unchanged across observations for >= stall.seconds is no progress,
    counted from the first look that saw that count (polls shorter than stall.seconds accumulate)."""
    e = None
    prev = None
    for t, tokens in ((0, 12), (20, 30), (40, 30), (70, 30), (99, 30), (100, 30)):
        cur = Observation(0, float(t), (row("router", "streaming", 5 + t, tokens=tokens),), None, None)
        e = evaluate(prev, cur, S)
        prev = e.observation
        if t <= 70:
            assert not e.stalled, (t, e.reason)
        if t == 40:  # no metrics readable: tokens/s from the rows' own counts
            assert e.tokens_per_s == 0.0
    assert e.stalled and e.stage == "router/streaming" and e.idle_s == 80  # unchanged since t=20
    assert "request r1 (client agents) made no progress for 80s" in e.reason
    # a row first seen without tokens: in_state_s says how long it has been where it is
    w = evaluate(None, obs(5, row("decode", "running", 70, in_state=65)), S)
    assert w.stalled and w.idle_s == 65
    # the stage changed: that is progress
    moved = evaluate(Observation(0, 0, (Row("decode", "r1", "transfer", 5, tokens=0, progressed_at=-100),)),
                     obs(10, row("decode", "running", 15, tokens=0)), S)
    assert not moved.stalled


def test_unreachable_worker_is_named():
    e = evaluate(obs(0, row("router", "streaming", 30, tokens=4, idle=30), unreachable=["decode http://10.0.0.2:8000"]),
                 obs(40, row("router", "streaming", 70, tokens=4, idle=70),
                     unreachable=["decode http://10.0.0.2:8000"]),
                 S)
    assert e.stalled and "unreachable: decode http://10.0.0.2:8000" in e.reason


def test_rows_by_pair_from_a_router_document():
    doc = {"role": "router", "requests": [
        {"id": "a", "client": "c1", "stage": "streaming", "pair": 1001, "age_s": 3.0, "tokens": 9, "idle_s": 0.1},
        {"id": "b", "client": "c2", "stage": "dispatching", "pair": None, "age_s": 0.1, "tokens": 0}],
        "workers": [
            {"pair": 1001, "role": "decode", "url": "http://d", "requests": [
                {"id": "a", "stage": "running", "age_s": 2.9, "completion_tokens": 9, "in_state_s": 2.0}]},
            {"pair": 0, "role": "prefill", "url": "http://p0", "error": "ConnectTimeout: "},
            {"pair": 0, "role": "decode", "url": "http://d0", "requests": [{"id": "x"}]}]}
    rows, unreachable = stall.rows_by_pair([doc, doc])  # two router replicas listing the same workers
    assert sorted(rows) == [1] and [(r.role, r.id, r.stage, r.tokens) for r in rows[1]] == [
        ("router", "a", "streaming", 9), ("decode", "a", "running", 9)]
    assert unreachable == {0: ["prefill http://p0"]}


def test_metric_sum_over_workers():
    text = ('# TYPE pdrt_watchdog_fired_total counter\n'
            'pdrt_watchdog_fired_total{role="prefill",phase="bootstrap"} 2.0\n'
            'pdrt_watchdog_fired_total{role="prefill",phase="transfer"} 1.0\n'
            '# TYPE pdrt_generated_tokens_total counter\n'
            'pdrt_generated_tokens_total{role="decode",client="a"} 10.0\n'
            'pdrt_generated_tokens_total{role="decode",client="b"} 5.0\n')
    assert stall.metric_sum([text, text], "pdrt_watchdog_fired_total") == 6
    assert stall.metric_sum([text], "pdrt_generated_tokens_total", role="decode") == 15
    assert stall.metric_sum([text, None], "pdrt_watchdog_fired_total") is None  # one unreadable: no evidence
    assert stall.metric_sum([], "pdrt_watchdog_fired_total") == 0


def test_a_series_the_agent_omits_is_unknown_where_pdrts_absent_counter_is_zero():
    """A pdrt worker's labelled counter appears with its first increment (absent = 0 so far); the pdstack agent
    beside SGLang/vLLM omits what its engine does not expose (pdruntime/agent/tables.py): unknown, never 0 tokens/s."""
    pdrt = "# TYPE pdrt_live_requests gauge\npdrt_live_requests{role=\"decode\"} 1.0\n"
    agent = "# TYPE pdrt_agent_engine_up gauge\npdrt_agent_engine_up 1\n"
    assert stall.metric_sum([pdrt], "pdrt_generated_tokens_total", role="decode") == 0
    assert stall.metric_sum([agent], "pdrt_generated_tokens_total", role="decode") is None
    assert stall.metric_sum([pdrt, agent], "pdrt_generated_tokens_total", role="decode") is None
    known = agent + '# TYPE pdrt_generated_tokens counter\npdrt_generated_tokens_total{role="decode"} 7.0\n'
    assert stall.metric_sum([known], "pdrt_generated_tokens_total", role="decode") == 7


def test_status_condition_and_stalls_list():
    plan = Plan((), (PairState(0, "r1", True, "Ready", PairMemory()), PairState(1, "r1", True, "Ready", PairMemory())))
    base = build_status({}, plan, Facts(1, "r1", router_ready=True), 1000.0)
    stuck = evaluate(obs(0, row("decode", "running", 100, tokens=40, idle=65)),
                     obs(10, row("decode", "running", 110, tokens=40, idle=75)), S)
    fine = evaluate(None, Observation(1, 10.0), S)
    st = with_stalls(dict(base), {}, [stuck, fine], 1000.0)
    cond = next(c for c in st["conditions"] if c["type"] == "Stalled")
    assert (cond["status"], cond["reason"]) == ("True", "PairStalled") and cond["message"] == stuck.reason
    assert st["stalls"] == [{"pair": 0, "stage": "decode/running", "oldestAgeSeconds": 110, "idleSeconds": 75,
                             "tokensPerSecond": 0.0, "watchdogFires": 0, "since": cond["lastTransitionTime"],
                             "reason": stuck.reason}]
    # the same episode later: since and lastTransitionTime kept
    later = with_stalls(dict(base), st, [stuck, fine], 1030.0)
    lc = next(c for c in later["conditions"] if c["type"] == "Stalled")
    assert lc["lastTransitionTime"] == cond["lastTransitionTime"]
    assert later["stalls"][0]["since"] == st["stalls"][0]["since"]
    # no look this time (router did not answer): what was known stays
    assert with_stalls(dict(base), st, None, 1040.0)["stalls"] == st["stalls"]
    # recovered
    ok = with_stalls(dict(base), later, [fine], 1050.0)
    oc = next(c for c in ok["conditions"] if c["type"] == "Stalled")
    assert (oc["status"], oc["reason"], oc["message"]) == ("False", "AsExpected", "no stalled pair")
    assert ok["stalls"] is None and oc["lastTransitionTime"] != cond["lastTransitionTime"]


def test_the_next_stall_look_is_due_even_when_no_router_answered():
    """A sweep that found routers but no answer (one restarting) still requeues within stall_check_s: the stalls
    are not left unwatched until the next resync (30 s). Off, or no router to ask: no stall timer."""
    from types import SimpleNamespace

    from pdoperator.core.config import OperatorConfig
    from pdoperator.safety.rollout import Safety
    from pdoperator.shell.reconcile import Acted, _requeue

    cfg = OperatorConfig(stall_check_s=15.0, process_drift_s=0)
    ctx = SimpleNamespace(config=cfg, router=object(), steps=SimpleNamespace(rejections=[]))
    safety = Safety(None, None, None, None, None)

    def requeue(stalls, due):
        return _requeue(ctx, None, Acted(None, [], stalls, True, safety, stall_due=due), ready=True)

    assert requeue(None, True) == 15.0  # routers asked, none answered
    assert requeue([], True) == 15.0
    assert requeue(None, False) is None  # off, or no router: nothing to look at
