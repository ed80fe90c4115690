"""Unit tests of the engine runner's failure containment (fake engines, no model): isolation of a poisoned
request, failures not tied to a request, back-off, giving up, out-of-memory. Plus the pure decisions."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from pdruntime.engine import StepOutput
from pdruntime.server.worker.engine_runner import (OOM_STATUS, REQUEST_ERROR_STATUS, STEP_ERROR_STATUS,
                                                   EngineRunner, FailurePolicy, isolation_verdict, step_backoff)


class FailingEngine:
    """Each live request gets one token per step it runs in, until ``n``. A step running a request in
    ``poison`` raises; ``global_failures`` steps (any requests) raise; ``oom`` makes those OutOfMemoryError."""

    def __init__(self, n: int = 3, poison: tuple[str, ...] = (), global_failures: int = 0, oom: bool = False) -> None:
        self.n = n
        self.poison = set(poison)
        self.global_failures = global_failures
        self.oom = oom
        self.live: dict[str, int] = {}
        self.pending: list[StepOutput] = []
        self.calls: list[tuple[frozenset, bool]] = []  # (requests run, raised)

    def add(self, rid: str) -> None:
        self.live[rid] = 0

    def has_work(self) -> bool:
        return bool(self.live or self.pending)

    def step_request_ids(self) -> list[str]:
        return list(self.live)

    def step(self, only=None):
        ids = [r for r in self.live if only is None or r in only]
        if self.global_failures > 0:
            self.global_failures -= 1
            self.calls.append((frozenset(ids), True))
            raise (torch.cuda.OutOfMemoryError if self.oom else RuntimeError)("device lost")
        if self.poison & set(ids):
            self.calls.append((frozenset(ids), True))
            raise RuntimeError("NaN in this request's logits")
        self.calls.append((frozenset(ids), False))
        outs, self.pending = self.pending, []
        for rid in ids:
            self.live[rid] += 1
            done = self.live[rid] >= self.n
            outs.append(StepOutput(rid, [self.live[rid]], "x", done, "length" if done else None))
            if done:
                del self.live[rid]
        return outs

    def fail_request(self, rid: str, reason: str) -> bool:
        if self.live.pop(rid, None) is None:
            return False
        self.pending.append(StepOutput(rid, [], "", True, "error", error=reason))
        return True

    def take_pending(self):
        out, self.pending = self.pending, []
        return out

    def stats(self) -> dict:
        return {"num_running": len(self.live), "blocks_free": 10, "blocks_total": 10}


class CanaryEngine(FailingEngine):
    """A FailingEngine that can run the runner's one-token canary (as the real Engine does)."""

    def add_canary(self) -> str:
        self.add("__canary")
        return "__canary"

    def drop_canary(self, rid, outputs):
        self.live.pop(rid, None)
        return [o for o in outputs if o.request_id != rid]


def run_runner(engine, rids, *, policy=None, until=None, timeout=10.0):
    """Start a runner, add ``rids`` in one command, collect tokens and errors until every rid is done."""

    async def main():
        errors: dict[str, tuple[str, int]] = {}
        tokens: dict[str, list[int]] = {r: [] for r in rids}
        verdicts: list[str] = []
        fatal: list[str] = []
        done = asyncio.Event()
        finished: set[str] = set()

        def check():
            if finished >= set(rids) or (until is not None and until(fatal)):
                done.set()

        def on_error(rid, msg, status, code=None):
            errors[rid] = (msg, status)
            finished.add(rid)
            check()

        runner = EngineRunner(engine, asyncio.get_running_loop(), policy=policy or FailurePolicy(exit_code=None),
                              on_request_error=on_error, on_step_error=verdicts.append,
                              on_fatal=lambda reason: (fatal.append(reason), check()))
        runner.start()
        for rid in rids:
            def sink(out, rid=rid):
                tokens[rid].extend(out.new_token_ids)
                if out.finished:
                    finished.add(rid)
                    check()
            runner.set_sink(rid, sink)
        await runner.call(lambda e: [e.add(r) for r in rids])
        await asyncio.wait_for(done.wait(), timeout)
        runner.stop()
        return runner, tokens, errors, verdicts, fatal

    return asyncio.run(main())


def test_poisoned_request_fails_alone_and_delays_clean_ones_by_at_most_one_step_retry():
    eng = FailingEngine(n=3, poison=("bad",))
    runner, tokens, errors, verdicts, fatal = run_runner(eng, ["a", "bad", "b", "c"])
    assert tokens["a"] == tokens["b"] == tokens["c"] == [1, 2, 3]
    msg, status = errors["bad"]
    assert status == REQUEST_ERROR_STATUS and "alone" in msg and "NaN" in msg
    assert set(errors) == {"bad"} and verdicts == ["request"] and not fatal
    # the bound: every runner iteration advanced every clean request by one token (the failed step was
    # retried in parts at once), so the clean ones finished in exactly n iterations, as with no poison
    assert runner.steps == 3
    clean_runs = [ids for ids, raised in eng.calls if not raised]
    for rid in "abc":
        assert sum(rid in ids for ids in clean_runs) == 3  # one successful step per token, none repeated
    assert runner.consecutive_failures == 0 and runner.fatal_reason is None


def test_a_lone_poisoned_request_is_told_apart_by_a_canary_step_and_fails_alone_with_422():
    eng = CanaryEngine(n=2, poison=("bad",))
    runner, tokens, errors, verdicts, fatal = run_runner(eng, ["bad"])
    assert errors["bad"][1] == REQUEST_ERROR_STATUS and verdicts == ["request"]
    assert runner.consecutive_failures == 0  # a client repeating it alone can never make the worker give up
    assert "__canary" not in eng.live


def test_a_lone_request_under_an_engine_failure_fails_the_canary_too_and_counts_against_the_engine():
    eng = CanaryEngine(n=2, global_failures=10**6)
    runner, tokens, errors, verdicts, fatal = run_runner(eng, ["a"])
    assert errors["a"][1] == STEP_ERROR_STATUS and verdicts == ["step"] and runner.consecutive_failures == 1


def test_transient_step_failure_is_retried_in_parts_and_fails_nobody():
    eng = FailingEngine(n=2, global_failures=1)
    runner, tokens, errors, verdicts, _ = run_runner(eng, ["a", "b"])
    assert tokens == {"a": [1, 2], "b": [1, 2]} and not errors and verdicts == ["transient"]


def test_failures_not_tied_to_a_request_fail_the_step_back_off_and_give_up_after_n():
    policy = FailurePolicy(max_consecutive=3, backoff_base_s=0.01, backoff_cap_s=0.05, exit_code=None)
    eng = FailingEngine(n=3, global_failures=10**6)

    async def main():
        errors: dict[str, tuple[str, int]] = {}
        fatal: list[str] = []
        got_fatal = asyncio.Event()
        runner = EngineRunner(eng, asyncio.get_running_loop(), policy=policy,
                              on_request_error=lambda rid, msg, st, code=None: errors.__setitem__(rid, (msg, st)),
                              on_fatal=lambda r: (fatal.append(r), got_fatal.set()))
        runner.start()
        for i in range(3):  # one request per round: each round fails its request, the third gives up
            await runner.call(lambda e, i=i: e.add(f"r{i}"))
            while f"r{i}" not in errors:
                await asyncio.sleep(0.01)
        await asyncio.wait_for(got_fatal.wait(), 5)
        with pytest.raises(RuntimeError, match="consecutive engine steps failed"):
            await runner.call(lambda e: e.add("late"))  # commands are refused with the reason once given up
        runner.stop()
        return runner, errors, fatal

    runner, errors, fatal = asyncio.run(main())
    assert sorted(errors) == ["r0", "r1", "r2"]
    assert all(st == STEP_ERROR_STATUS and "not tied to one request" in msg for msg, st in errors.values())
    assert "3 consecutive engine steps failed" in fatal[0] and "device lost" in fatal[0]
    assert runner.health()["healthy"] is False and runner.health()["reason"] == fatal[0]
    assert runner.errors_by_verdict == {"step": 3}


def test_persistent_step_failures_never_spin():
    # 30 requests arrive while every step fails: back-off bounds the rate of failing steps
    policy = FailurePolicy(max_consecutive=10**6, backoff_base_s=0.05, backoff_cap_s=0.2, exit_code=None)
    eng = FailingEngine(n=3, global_failures=10**9)

    async def main():
        errors: dict = {}
        runner = EngineRunner(eng, asyncio.get_running_loop(), policy=policy,
                              on_request_error=lambda rid, msg, st, code=None: errors.__setitem__(rid, st))
        runner.start()
        t0 = time.monotonic()
        for i in range(30):
            await runner.call(lambda e, i=i: e.add(f"r{i}"))
            await asyncio.sleep(0.02)
        while len(errors) < 30 and time.monotonic() - t0 < 30:
            await asyncio.sleep(0.05)
        elapsed = time.monotonic() - t0
        runner.stop()
        return errors, elapsed

    errors, elapsed = asyncio.run(main())
    assert len(errors) == 30 and set(errors.values()) == {STEP_ERROR_STATUS}
    # spinning ran ~1,300 failing steps/s; backing off 0.05 s .. 0.2 s allows at most ~20/s (+ bisection)
    assert len(eng.calls) / elapsed < 100, (len(eng.calls), elapsed)


def test_out_of_memory_rejects_requests_with_503_and_never_gives_up():
    policy = FailurePolicy(max_consecutive=2, exit_code=None)
    eng = FailingEngine(n=2, global_failures=6, oom=True)
    runner, tokens, errors, verdicts, fatal = run_runner(eng, ["a", "b"], policy=policy)
    assert errors["a"][1] == errors["b"][1] == OOM_STATUS
    assert "out of device memory" in errors["a"][0]
    assert not fatal and runner.fatal_reason is None and verdicts == ["oom"]


def test_out_of_memory_of_a_big_batch_is_retried_in_smaller_parts():
    # OOM only for the full batch (the first step): its halves fit, nobody fails
    eng = FailingEngine(n=2, global_failures=1, oom=True)
    _, tokens, errors, verdicts, _ = run_runner(eng, ["a", "b", "c", "d"])
    assert not errors and verdicts == ["transient"] and all(t == [1, 2] for t in tokens.values())


@pytest.mark.parametrize("n,want", [(0, 0.0), (1, 0.05), (2, 0.1), (3, 0.2), (6, 1.6), (7, 2.0), (50, 2.0)])
def test_step_backoff_doubles_from_base_up_to_the_cap(n, want):
    assert step_backoff(n, FailurePolicy()) == pytest.approx(want)


@pytest.mark.parametrize("suspects,culprits,parts_ok,oom,want", [
    (4, 1, 2, False, "request"),   # one failed alone, the others ran: its fault
    (4, 0, 2, False, "transient"),  # every part ran
    (4, 4, 0, False, "step"),      # every request fails even alone: not theirs
    (1, 1, 0, False, "step"),      # a lone request whose canary step failed too: the engine's fault
    (1, 1, 1, False, "request"),   # a lone request whose canary step ran: the request's fault
    (0, 0, 0, False, "step"),      # nothing to blame
    (4, 4, 0, True, "oom"),
    (4, 1, 3, True, "request"),    # one request does not fit even alone; the rest ran
])
def test_isolation_verdict_table(suspects, culprits, parts_ok, oom, want):
    assert isolation_verdict(suspects, culprits, parts_ok, oom) == want


# ---- the real engine: step(only=...) and per-request sampling failures keep its accounting exact ----------

@pytest.fixture(scope="module")
def engine(tiny_model):
    from pdruntime.engine import Engine, EngineConfig
    from pdruntime.model import load_model

    return lambda: Engine(load_model(tiny_model), EngineConfig(num_blocks=64, block_size=16))


def test_a_request_whose_sampling_fails_is_finished_alone_and_its_batch_goes_on(engine, monkeypatch):
    from pdruntime.engine import SamplingParams, engine as engine_mod, sampler

    eng = engine()
    real = sampler.sample_batch

    def sample_batch(logits, rows):
        if any(r.params.seed == 13 for r in rows):
            raise RuntimeError("probability tensor contains either inf, nan or element < 0")
        return real(logits, rows)

    monkeypatch.setattr(engine_mod, "sample_batch", sample_batch)  # batched, then row by row on failure
    for rid, seed in (("a", 1), ("bad", 13), ("b", 2)):
        eng.add_request(rid, [5, 6, 7, 8], SamplingParams(max_tokens=4, temperature=0.8, seed=seed, ignore_eos=True))
    outs: dict[str, list] = {}
    while eng.has_work():
        for o in eng.step():
            outs.setdefault(o.request_id, []).append(o)
    assert [o.finish_reason for o in outs["bad"]] == ["error"] and "inf, nan" in outs["bad"][0].error
    assert sum(len(o.new_token_ids) for o in outs["a"]) == 4 and outs["a"][-1].finish_reason == "length"
    assert sum(len(o.new_token_ids) for o in outs["b"]) == 4
    eng.check_accounting()
    assert eng.pool.num_free == eng.pool.num_total


def test_step_only_runs_the_named_requests_and_a_failed_step_loses_nothing(engine, monkeypatch):
    from pdruntime.engine import SamplingParams

    eng = engine()
    p = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    eng.add_request("a", [5, 6, 7], p)
    eng.add_request("b", [9, 10, 11], p)
    outs = eng.step(only={"a"})  # admits and prefills "a" alone
    assert {o.request_id for o in outs} == {"a"}
    assert eng.step_request_ids() == ["a", "b"]  # "b" still waits
    eng.add_request("c", [1, 2, 3], p)
    eng.abort("c")  # its abort output is pending
    boom = RuntimeError("device lost")
    monkeypatch.setattr(eng.model, "decode", lambda *a, **k: (_ for _ in ()).throw(boom))
    with pytest.raises(RuntimeError):
        eng.step()
    monkeypatch.undo()
    outs = eng.step()
    assert "c" in {o.request_id for o in outs if o.finish_reason == "abort"}  # the pending output survived
    while eng.has_work():
        outs += eng.step()
    got = {r: sum(len(o.new_token_ids) for o in outs if o.request_id == r) for r in ("a", "b")}
    assert got["b"] == 3 and got["a"] == 2  # "a" had its first token from the isolated step
    eng.check_accounting()
    assert eng.pool.num_free == eng.pool.num_total


def test_the_canary_runs_alone_and_leaves_no_trace(engine):
    from pdruntime.engine import SamplingParams

    eng = engine()
    eng.add_request("a", [5, 6, 7], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    rid = eng.add_canary()
    outs = eng.step(only={rid})
    assert {o.request_id for o in outs} == {rid}  # "a" did not run
    assert eng.drop_canary(rid, outs) == []
    assert eng.step_request_ids() == ["a"]
    while eng.has_work():
        eng.step()
    eng.check_accounting()
    assert eng.pool.num_free == eng.pool.num_total
