"""The router's circuit breaker as a pure state machine (issue 13, defect 1).

Bound pinned here: **the breaker always recovers within its window plus one trial** — with no new
failure, a pair excluded at time t is eligible again by t + cooldown_s + trial_timeout_s.

Checked against the unfixed code (main at 1c0b2fc): the defect tests below fail there — the old breaker
has no outcome for a trial that ends neither in success nor failure, so after ``on_dispatch`` in half-open
with no ``record_*`` call, ``allows()`` stayed False for ever (test_unresolved_trial_... failed with
"pair still excluded at t=3605"), and ``Outcome``/``record``/``reopens_at`` did not exist (ImportError for the
rest of the module).
"""

from __future__ import annotations

import itertools

import pytest

from pdruntime.server.router.policy import CircuitBreaker, Outcome

COOLDOWN = 5.0
TRIAL = 30.0
S, F, N = Outcome.SUCCESS, Outcome.FAILURE, Outcome.NEUTRAL


def _opened(now: float = 0.0) -> CircuitBreaker:
    b = CircuitBreaker(threshold=3, cooldown_s=COOLDOWN, trial_timeout_s=TRIAL)
    for _ in range(3):
        b.record(F, now, trial=b.on_dispatch(now))
    assert b.state(now) == "open"
    return b


# Each row: events after the breaker opened at t=0, then (time, expected state, expected allows).
# Events: ("d", t) dispatch (remembers whether it was the trial), ("r", outcome, t) resolves the last dispatch.
TABLE = [
    ("open during cooldown", [], 4.9, "open", False),
    ("half-open after cooldown", [], 5.0, "half_open", True),
    ("trial in flight blocks others", [("d", 5.0)], 6.0, "half_open", False),
    ("trial success closes", [("d", 5.0), ("r", S, 6.0)], 6.0, "closed", True),
    ("trial failure re-opens", [("d", 5.0), ("r", F, 6.0)], 6.0, "open", False),
    ("re-opened waits a full cooldown", [("d", 5.0), ("r", F, 6.0)], 11.0, "half_open", True),
    ("trial neutral (client gone / 4xx) re-arms", [("d", 5.0), ("r", N, 6.0)], 6.0, "half_open", True),
    ("neutral then success closes", [("d", 5.0), ("r", N, 6.0), ("d", 7.0), ("r", S, 8.0)], 8.0, "closed", True),
    ("unresolved trial expires", [("d", 5.0)], 5.0 + TRIAL, "half_open", True),
    ("unresolved trial not yet expired", [("d", 5.0)], 5.0 + TRIAL - 0.1, "half_open", False),
]


@pytest.mark.parametrize("name,events,t,state,allows", TABLE, ids=[r[0] for r in TABLE])
def test_breaker_table(name, events, t, state, allows):
    b = _opened()
    trial = False
    for ev in events:
        if ev[0] == "d":
            trial = b.on_dispatch(ev[1])
        else:
            b.record(ev[1], ev[2], trial=trial)
    assert (b.state(t), b.allows(t)) == (state, allows)


def test_closed_breaker_opens_only_after_threshold_consecutive_failures():
    b = CircuitBreaker(threshold=3, cooldown_s=COOLDOWN, trial_timeout_s=TRIAL)
    for outcome in (F, F, S, F, F, N, N):  # a success resets the count; neutral results do not count
        b.record(outcome, 0.0, trial=b.on_dispatch(0.0))
    assert b.state(0.0) == "closed"
    b.record(F, 0.0, trial=b.on_dispatch(0.0))
    assert b.state(0.0) == "open" and b.reopens_at(0.0) == COOLDOWN


def test_neutral_results_never_open_a_breaker():
    """Bad input (4xx) and clients that leave are not pair failures (defect 3)."""
    b = CircuitBreaker(threshold=3, cooldown_s=COOLDOWN, trial_timeout_s=TRIAL)
    for i in range(100):
        b.record(N, float(i), trial=b.on_dispatch(float(i)))
    assert b.state(100.0) == "closed" and b.failures == 0


def test_unresolved_trial_never_excludes_a_pair_forever():
    """Defect 1 with the old API only: the trial request is dispatched and never resolved (the client went
    away before the first token). The pair must come back; on the old code it stayed excluded for ever."""
    b = CircuitBreaker(threshold=3, cooldown_s=COOLDOWN)
    for _ in range(3):
        b.record_failure(0.0)
    b.on_dispatch(COOLDOWN)  # the trial; nothing ever records its outcome
    assert b.allows(3605.0), "pair still excluded at t=3605"


def test_reopens_at_names_the_timer_that_brings_an_excluded_pair_back():
    b = _opened()
    assert b.reopens_at(1.0) == COOLDOWN
    trial = b.on_dispatch(COOLDOWN)
    assert trial and b.reopens_at(COOLDOWN + 1) == COOLDOWN + TRIAL
    b.record(N, COOLDOWN + 2, trial=trial)
    assert b.reopens_at(COOLDOWN + 2) is None


# Exhaustive check of the bound over every sequence of up to 6 events from every starting point.
EVENTS = ("dispatch", "success", "failure", "neutral", "tick")


def _run(seq: tuple[str, ...]) -> tuple[CircuitBreaker, float, float]:
    """Apply ``seq`` (times advance 1 s per event; 'tick' advances a cooldown). Returns (breaker, now,
    time of the last failure or 0)."""
    b = CircuitBreaker(threshold=2, cooldown_s=COOLDOWN, trial_timeout_s=TRIAL)
    now, last_failure = 0.0, 0.0
    inflight: list[bool] = []  # trial flags of dispatched, unresolved requests
    for ev in seq:
        now += COOLDOWN if ev == "tick" else 1.0
        if ev == "dispatch":
            if b.allows(now):
                inflight.append(b.on_dispatch(now))
        elif ev in ("success", "failure", "neutral") and inflight:
            outcome = {"success": S, "failure": F, "neutral": N}[ev]
            b.record(outcome, now, trial=inflight.pop(0))
            if outcome is F:
                last_failure = now
    return b, now, last_failure


def test_breaker_always_recovers_within_its_window_plus_one_trial():
    """For every event sequence (unresolved requests left hanging included), once failures stop the pair is
    eligible again by now + cooldown_s + trial_timeout_s, and reopens_at names a time within that bound."""
    checked = 0
    for n in range(7):
        for seq in itertools.product(EVENTS, repeat=n):
            b, now, _ = _run(seq)
            bound = now + COOLDOWN + TRIAL
            at = b.reopens_at(now)
            assert at is None or now < at <= bound, (seq, at)
            assert b.allows(bound), seq
            if at is not None:
                assert b.allows(at) and not b.allows(at - 1e-6), seq
            checked += 1
    assert checked == sum(len(EVENTS) ** n for n in range(7))
