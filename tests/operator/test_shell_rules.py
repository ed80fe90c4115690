"""The pure rules the operator shell and ``kubectl pd`` share (one each): pod readiness, known-good, drift as
entries; the one merge patch with its 409 retry; and the reconcile's plan phase on its own (no cluster)."""

from __future__ import annotations

import logging

import pytest

from pdoperator.core import drift
from pdoperator.core.config import OperatorConfig
from pdoperator.core.pairs import CreatePods, PodView, pod_ready
from pdoperator.core.revisions import ANN_KNOWN_GOOD, known_good, last_known_good, revision_hash
from pdoperator.core.spec import parse_spec
from pdoperator.shell.context import Context, EventSink, Observed
from pdoperator.shell.kube import ApiError, Kube
from pdoperator.shell.reconcile import plan
from pdoperator.shell.routerlink import router_pods_ready
from pdoperator.shell.state import DeploymentState


def pod(ready=None, phase="Running", ip="10.0.0.1"):
    conds = [] if ready is None else [{"type": "Ready", "status": ready}]
    return {"metadata": {"name": "p"}, "status": {"phase": phase, "podIP": ip, "conditions": conds}}


@pytest.mark.parametrize("p,ready", [(pod("True"), True), (pod("False"), False), (pod(None), False), ({}, False),
                                     ({"status": {"conditions": None}}, False)])
def test_one_pod_readiness_rule(p, ready):
    assert pod_ready(p) is ready
    assert router_pods_ready([p]) == (["10.0.0.1"] if ready else [])


def cr(rev, since=None):
    ann = {ANN_KNOWN_GOOD: since} if since else {}
    return {"metadata": {"name": f"x-{rev}", "annotations": ann}, "data": {"revision": rev}}


def test_one_known_good_rule():
    crs = [cr("a", "2026-12-01T10:00:00.000Z"), cr("b", "2026-12-01T12:00:00.000Z"), cr("c"), cr("d", "garbage")]
    assert [rev for _, rev in known_good(crs)] == ["b", "a"]  # newest first; unannotated or unreadable: not
    assert last_known_good(None, crs) == "b"  # no status: rebuilt from the records
    assert last_known_good("a", crs) == "a"  # the status says
    assert last_known_good(None, [cr("c")]) is None


def test_drift_entries_round_trip_and_make_the_same_lines():
    entries = [drift.DriftEntry("children", "Service/x-router", "spec.ports[0].port", "8000", "9000"),
               drift.DriftEntry("children", "Service/x-router", "spec.type", "ClusterIP", "NodePort"),
               drift.DriftEntry("process", "Pod/x-0-decode-a", "PDRT_X", "1", "2"),
               drift.DriftEntry("process", "Pod/x-0-decode-a", "HF_TOKEN", drift.FROM_REFERENCE, None),
               drift.DriftEntry("image", "revision r1", "container worker", None, "2 digests: a (p), b (q)")]
    assert drift.from_status([e.to_status() for e in entries] + [{"source": "?"}, "x"]) == entries
    assert drift.message_lines(entries) == [
        "Service/x-router: spec.ports[0].port, spec.type",
        "process: Pod/x-0-decode-a: PDRT_X: declared 1, process sees 2",
        "process: Pod/x-0-decode-a: HF_TOKEN: declared from a reference, not in the process",
        "image: revision r1 container worker runs 2 digests: a (p), b (q)"]


def test_children_entries_carry_the_declared_and_live_values():
    desired = {"spec": {"ports": [{"port": 8000, "targetPort": 8000}], "selector": {"a": "b"}}}
    live = {"spec": {"ports": [{"port": 8000, "targetPort": 9999}], "selector": {"a": "c"}}}
    got = drift.children_entries("Service/x", desired, live, ["spec.ports[0].targetPort", "spec.selector", "spec.no"])
    assert [(e.field, e.declared, e.seen) for e in got] == [
        ("spec.ports[0].targetPort", "8000", "9999"), ("spec.selector", '{"a": "b"}', '{"a": "c"}'),
        ("spec.no", None, None)]


def test_the_plan_phase_alone_decides_from_what_was_observed():
    raw = {"image": "i", "pairs": 2}
    spec = parse_spec(raw, name="llm")
    body = {"metadata": {"name": "llm", "namespace": "default", "uid": "u"}, "spec": raw, "status": {}}
    ctx = Context(None, body, spec, revision_hash(spec), OperatorConfig(), 100.0,  # type: ignore[arg-type]
                  EventSink(None, body), DeploymentState("default", "llm"),  # type: ignore[arg-type]
                  logging.getLogger("test"))
    up = [PodView(f"llm-0-{r}-a", 0, r, ctx.revision, "Running", True, ip=f"10.0.0.{i}")
          for i, r in enumerate(("prefill", "decode"))]
    obs = Observed(crs={}, token=None, owned=[], views=up, prior=None, canary=None, specs={ctx.revision: spec},
                   pod_drift=[], reverts={}, lost_nodes=frozenset())
    planned = plan(ctx, obs)
    assert [a for a in planned.plan.actions] == [CreatePods(1, ctx.revision, ("prefill", "decode"))]
    assert [p["ready"] for p in planned.topology["pairs"]] == [True, False]
    assert planned.topology_cm in planned.children


class FakeKube(Kube):
    """Kube.merge_patch against a scripted server: PATCH answers from ``answers``, GET returns ``reads``."""

    def __init__(self, answers, reads):
        self.answers, self.reads, self.sent = list(answers), list(reads), []

    async def request(self, method, url_path, *, body=None, query=None, content_type="", headers=None):
        self.sent.append((method, body, dict(query or {}), content_type))
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    async def get(self, url_path):
        return self.reads.pop(0)


def obj(rv, replicas):
    return {"metadata": {"resourceVersion": rv}, "spec": {"pairs": replicas}}


async def test_one_merge_patch_recomputes_from_a_fresh_read_on_409():
    conflict = ApiError(409, "the object has been modified", verb="patch", target="pddeployments/x")
    kube = FakeKube([conflict, {}], [obj("2", 3)])
    done = await kube.merge_patch("/x", obj("1", 2), lambda o: {"spec": {"pairs": o["spec"]["pairs"] + 1}},
                                  field_manager="kubectl-pd")
    assert done == obj("2", 3)
    assert [(b["metadata"]["resourceVersion"], b["spec"]["pairs"]) for _, b, _, _ in kube.sent] == [("1", 3), ("2", 4)]
    assert {q["fieldManager"] for _, _, q, _ in kube.sent} == {"kubectl-pd"}
    assert {c for _, _, _, c in kube.sent} == {"application/merge-patch+json"}


async def test_merge_patch_gives_up_after_its_attempts_and_knows_gone_and_nothing_to_do():
    conflict = ApiError(409, "modified", verb="patch", target="x")
    kube = FakeKube([conflict] * 2, [obj("2", 1)])
    with pytest.raises(ApiError) as e:
        await kube.merge_patch("/x", obj("1", 1), lambda o: {"spec": {"pairs": 5}}, field_manager="m", attempts=2)
    assert e.value.status == 409 and len(kube.sent) == 2
    gone = FakeKube([conflict], [None])
    assert await gone.merge_patch("/x", obj("1", 1), lambda o: {"spec": {"pairs": 5}}, field_manager="m") is None
    idle = FakeKube([], [])
    assert await idle.merge_patch("/x", obj("1", 1), lambda o: None, field_manager="m") == obj("1", 1)
    assert idle.sent == []
