"""Spec validation: defaults, and a clear message for every rejection (field, value, what is accepted)."""

from __future__ import annotations

import pytest

from pdoperator.core.revisions import diff_configs, effective_config, prune_history, revision_hash
from pdoperator.core.spec import CoRestartSpec, SpecError, parse_spec

BASE = {"image": "img"}


def test_defaults():
    s = parse_spec(BASE, name="demo")
    assert s.engine == "pdrt" and s.pairs == 1 and s.prefill.replicas == 1 and s.prefill.gpus == 0
    assert s.co_restart == CoRestartSpec("Pair", 1.0, 300.0)
    assert s.drift_policy == "Report" and s.max_unavailable_pairs == 1 and s.revision_history_limit == 10
    assert s.kernel.max_kv_splits == 32 and s.watchdog.transfer_timeout_s == 60.0


@pytest.mark.parametrize("spec,name,message", [
    ({}, "demo", "spec.image is required; accepted: a non-empty string"),
    ({"image": "  "}, "demo", "spec.image='  ' is invalid; accepted: a non-empty string"),
    (dict(BASE, engine="tgi"), "demo", "spec.engine='tgi' is invalid; accepted: pdrt | sglang | vllm"),
    (dict(BASE, engine="vllm"), "demo", "spec.model.source is required with engine 'vllm'"),
    (dict(BASE, engine="vllm", model={"source": "m"}), "demo", "spec.runtimeImage is required with engine 'vllm'"),
    (dict(BASE, engine="sglang"), "demo", "spec.model.source is required with engine 'sglang'"),
    (dict(BASE, pairs=-1), "demo", "spec.pairs=-1 is invalid; accepted: an integer in [0, 256]"),
    (dict(BASE, pairs=True), "demo", "spec.pairs=True is invalid; accepted: an integer in [0, 256]"),
    (dict(BASE, prefill={"replicas": 17}), "demo", "spec.prefill.replicas=17 is invalid; accepted: an integer in [1, 16]"),
    (dict(BASE, decode={"resources": {"gpus": -1}}), "demo",
     "spec.decode.resources.gpus=-1 is invalid; accepted: an integer in [0, 64]"),
    (dict(BASE, router={"resources": {"gpus": 1}}), "demo",
     "spec.router.resources.gpus=1 is invalid; accepted: an integer in [0, 0]"),
    (dict(BASE, decode={"env": [{"name": "PDRT_MAX_KV_SPLITS", "value": "8"}]}), "demo",
     "spec.decode.env[0].name='PDRT_MAX_KV_SPLITS' is set by the operator; set spec.kernel.maxKVSplits instead"),
    (dict(BASE, decode={"env": [{"name": "PDRT_DECODE_TARGET_CTAS", "value": "512"}]}), "demo",
     "set spec.kernel.decodeTargetCTAs instead"),
    (dict(BASE, prefill={"env": [{"name": "A", "value": "1"}, {"name": "A", "value": "2"}]}), "demo",
     "spec.prefill.env[1].name='A' is declared twice; accepted: each name once"),
    (dict(BASE, prefill={"env": [{"name": "9X"}]}), "demo",
     "spec.prefill.env[0].name='9X' is invalid; accepted: a C identifier such as MY_VAR"),
    (dict(BASE, kernel={"attentionBackend": "cuda"}), "demo",
     "spec.kernel.attentionBackend='cuda' is invalid; accepted: auto | triton | cpu | torch"),
    (dict(BASE, watchdog={"tickSeconds": 5, "transferTimeoutSeconds": 2}), "demo",
     "spec.watchdog.transferTimeoutSeconds=2.0 must exceed spec.watchdog.tickSeconds=5.0"),
    (dict(BASE, coRestart={"policy": "DecodeOnly"}), "demo",
     "spec.coRestart.policy='DecodeOnly' is invalid; accepted: Pair | Never"),
    (dict(BASE, coRestart={"backoff": {"initialSeconds": 10, "maxSeconds": 5}}), "demo",
     "spec.coRestart.backoff.initialSeconds=10.0 exceeds maxSeconds=5.0"),
    (dict(BASE, rollout={"maxUnavailablePairs": 0}), "demo",
     "spec.rollout.maxUnavailablePairs=0 is invalid; accepted: an integer in [1, 256]"),
    (dict(BASE, drift={"policy": "Ignore"}), "demo", "spec.drift.policy='Ignore' is invalid; accepted: Report | Revert"),
    (BASE, "Bad_Name", "metadata.name='Bad_Name' is invalid; accepted: a DNS label of at most 40 characters"),
    ("not a mapping", "demo", "spec='not a mapping' is invalid; accepted: an object"),
])
def test_invalid_spec_message(spec, name, message):
    with pytest.raises(SpecError) as err:
        parse_spec(spec, name=name)
    assert any(message in p for p in err.value.problems), err.value.problems


def test_every_problem_is_reported_at_once():
    with pytest.raises(SpecError) as err:
        parse_spec({"engine": "x", "pairs": -3, "kernel": {"maxKVSplits": 0}}, name="demo")
    assert len(err.value.problems) == 4  # image, engine, pairs, maxKVSplits
    assert str(err.value).count("; ") >= 3


def test_backoff_is_exponential_and_capped():
    co = CoRestartSpec("Pair", 1.0, 10.0)
    assert [co.backoff(n) for n in range(0, 7)] == [0.0, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0]


def test_revision_changes_with_worker_config_only():
    base = parse_spec(dict(BASE, pairs=2), name="d")
    same = parse_spec(dict(BASE, pairs=5, rollout={"maxUnavailablePairs": 2},
                           coRestart={"backoff": {"initialSeconds": 3}}), name="d")
    env = parse_spec(dict(BASE, pairs=2, decode={"env": [{"name": "SGLANG_SM120_MMA_TARGET_CTAS", "value": "512"}]}),
                     name="d")
    knob = parse_spec(dict(BASE, kernel={"decodeTargetCTAs": 512}), name="d")
    assert revision_hash(base) == revision_hash(same)  # scaling / rollout / backoff never restart a pair
    assert len({revision_hash(base), revision_hash(env), revision_hash(knob)}) == 3
    assert diff_configs(effective_config(base), effective_config(env)) == [
        ("decode.env.SGLANG_SM120_MMA_TARGET_CTAS", None, "512")]
    assert diff_configs(effective_config(base), effective_config(knob)) == [("kernel.decodeTargetCTAs", 0, 512)]


def test_prune_history_keeps_the_newest_and_protected():
    revs = [{"metadata": {"name": f"r{i}"}, "revision": i, "data": {"revision": f"h{i}"}} for i in range(1, 6)]
    assert prune_history(revs, keep=3, protected={"h5"}) == ["r1", "r2"]
    assert prune_history(revs, keep=3, protected={"h1"}) == ["r2", "r3"]
    assert prune_history(revs, keep=10, protected=set()) == []
