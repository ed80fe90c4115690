"""P:D groups (``prefill.replicas`` : ``decode.replicas`` per group, ``spec.pairs`` groups) and the scale
subresource. Pure: topology entries per (prefill, decode) combination, the planner's whole-group co-restart,
the router's least-loaded choice inside a group. Emulator: a 1P:2D group whose decode dies is recreated whole
while the other group is untouched; ``kubectl scale`` (a scale-subresource patch) 1 -> 3 -> 1."""

from __future__ import annotations

import json

import aiohttp
import yaml

from pdop_harness import NS, R, eventually, manifest
from pdoperator.core.pairs import CoRestart, CreatePods, PodView, PlanInput, plan_pairs
from pdoperator.core.render import Owner, TopologyPair, group_slots, render, topology_doc
from pdoperator.core.spec import CoRestartSpec, parse_spec
from pdruntime.server.router.policy import PairPicker
from pdruntime.server.router.topology import parse_topology

CONFIGMAPS = R("", "v1", "configmaps")
SLOTS = group_slots(1, 2)


def test_group_slots_and_render_of_a_1p3d_group():
    assert group_slots(1, 3) == ("prefill", "decode", "decode-1", "decode-2")
    spec = parse_spec({"image": "x", "pairs": 2, "decode": {"replicas": 3}}, name="llm")
    objs = render(spec, Owner("llm", "ns", "u"), "r", kv_token="t")
    pods = [o for o in objs if o["kind"] == "Pod"]
    assert sorted(p["spec"]["hostname"] for p in pods) == sorted(
        f"llm-{k}-{s}" for k in (0, 1) for s in group_slots(1, 3))
    d2 = next(p for p in pods if p["spec"]["hostname"] == "llm-1-decode-2")
    assert d2["metadata"]["labels"]["pdstack.io/member"] == "2" and d2["metadata"]["labels"]["pdstack.io/pair"] == "1"
    pdb = next(o for o in objs if o["kind"] == "PodDisruptionBudget")
    assert pdb["spec"]["minAvailable"] == 2 * 4 - 1


def test_topology_has_one_entry_per_combination_tagged_with_its_group():
    doc = topology_doc("r", [TopologyPair(0, True, "p0", "d0", prefill_hosts=("p0",), decode_hosts=("d0", "d1")),
                             TopologyPair(1, True, "q0", "e0")], 3)
    assert [(e["index"], e.get("group"), e["prefill"]["url"], e["decode"]["url"]) for e in doc["pairs"]] == [
        (0, 0, "http://p0:8000", "http://d0:8000"), (1000, 0, "http://p0:8000", "http://d1:8000"),
        (1, None, "http://q0:8000", "http://e0:8000")]
    topo = parse_topology(doc)
    assert [p.group_id for p in topo.pairs] == [0, 0, 1]


def test_router_picks_the_least_loaded_decode_of_a_group():
    doc = topology_doc("r", [TopologyPair(0, True, "p0", "d0", prefill_hosts=("p0",), decode_hosts=("d0", "d1"))], 1)
    picker = PairPicker()
    picker.set_pairs(parse_topology(doc).pairs)
    used = []
    for _ in range(4):
        s = picker.choose(0.0, None)
        s.outstanding += 1
        used.append(s.pair.decode_url)
    assert sorted(used) == ["http://d0:8000"] * 2 + ["http://d1:8000"] * 2  # alternates: both decodes used


def _view(name, pair, role, member=0, **kw):
    return PodView(name=name, pair=pair, role=role, member=member, revision="r1", phase="Running", ready=True,
                   ip=f"10.0.{pair}.{len(name)}", **kw)


def test_planner_co_restarts_the_whole_group_when_one_decode_goes():
    group = lambda k: [_view(f"g{k}-p", k, "prefill"), _view(f"g{k}-d0", k, "decode"),  # noqa: E731
                       _view(f"g{k}-d1", k, "decode", 1)]
    pods = group(0) + group(1)[:2]  # group 1 lost decode-1
    plan = plan_pairs(PlanInput(desired_revision="r1", pairs=2, policy=CoRestartSpec(), max_unavailable=1, pods=pods,
                      memory={}, now=100.0, slots=SLOTS))
    co = [a for a in plan.actions if isinstance(a, CoRestart)]
    assert len(co) == 1 and co[0].pair == 1 and set(co[0].pods) == {"g1-p", "g1-d0"} and "decode-1" in co[0].detail
    assert plan.pairs[0].ready and plan.pairs[0].members == {"prefill": "10.0.0.4", "decode": "10.0.0.5",
                                                               "decode-1": "10.0.0.5"}
    # once gone, the group is created whole
    plan = plan_pairs(PlanInput(desired_revision="r1", pairs=2, policy=CoRestartSpec(backoff_initial_s=0),
                                max_unavailable=1,
                      pods=group(0), memory={}, now=200.0, slots=SLOTS))
    assert [a for a in plan.actions if isinstance(a, CreatePods)] == [CreatePods(1, "r1", SLOTS)]


def _group_pods(c, name, k):
    return {p["spec"]["hostname"].split(f"{name}-{k}-", 1)[1]: p for p in c.pods(name)
            if p["metadata"]["labels"]["pdstack.io/pair"] == str(k)}


def _ready(c, name, groups):
    st = (c.pdd(name) or {}).get("status") or {}
    return st.get("readyPairs") == groups and len(st.get("pairs", [])) == groups and \
        st.get("observedGeneration") == c.pdd(name)["metadata"].get("generation")


async def test_a_dead_decode_recreates_its_whole_group_and_leaves_the_other_alone(operator):
    c = operator
    body = manifest("grp", pairs=2, gpus=0)
    body["spec"]["decode"]["replicas"] = 2
    c.apply(body)
    await eventually(lambda: _ready(c, "grp", 2), timeout=30, what="two 1P:2D groups ready")
    before0 = {s: p["metadata"]["uid"] for s, p in _group_pods(c, "grp", 0).items()}
    before1 = {s: p["metadata"]["name"] for s, p in _group_pods(c, "grp", 1).items()}
    assert set(before0) == set(before1) == set(SLOTS)
    st = c.pdd("grp")["status"]["pairs"][1]
    assert set(st["members"]) == set(SLOTS)  # status shows the group's members
    topo = yaml.safe_load(c.api.read(CONFIGMAPS, NS, "grp-topology")["data"]["topology.yaml"])
    assert sorted((e["index"], e.get("group")) for e in topo["pairs"]) == [(0, 0), (1, 1), (1000, 0), (1001, 1)]

    c.delete(R("", "v1", "pods"), before1["decode-1"])

    def recreated():
        now = _group_pods(c, "grp", 1)
        return set(now) == set(SLOTS) and all(now[s]["metadata"]["name"] != before1[s] for s in SLOTS) and now
    new1 = await eventually(recreated, timeout=30, what="all three pods of group 1 recreated")
    assert len({p["metadata"]["name"].rsplit("-", 1)[1] for p in new1.values()}) == 1  # one incarnation
    assert {s: p["metadata"]["uid"] for s, p in _group_pods(c, "grp", 0).items()} == before0  # group 0 untouched
    await eventually(lambda: _ready(c, "grp", 2), timeout=30, what="Ready again")
    st = c.pdd("grp")["status"]
    assert st["pairs"][1]["restarts"] == 1 and st["pairs"][0]["restarts"] == 0
    assert "decode-1 pod gone" in c.events("grp", "CoRestart")[0]["message"]


async def test_kubectl_scale_patches_the_scale_subresource_1_to_3_to_1(operator):
    c = operator
    c.apply(manifest("sc", pairs=1, gpus=0))
    await eventually(lambda: _ready(c, "sc", 1), timeout=30, what="1 group")
    url = f"/apis/pdstack.io/v1alpha1/namespaces/{NS}/pddeployments/sc/scale"
    async with aiohttp.ClientSession(c.url) as http:
        async def scale(n):
            async with http.patch(url, data=json.dumps({"spec": {"replicas": n}}),
                                  headers={"Content-Type": "application/merge-patch+json"}) as r:
                assert r.status == 200, await r.text()
                return await r.json()
        assert (await scale(3))["spec"]["replicas"] == 3
        assert c.pdd("sc")["spec"]["pairs"] == 3
        await eventually(lambda: _ready(c, "sc", 3), timeout=30, what="3 groups")
        async with http.get(url) as r:
            got = await r.json()
        assert got["kind"] == "Scale" and got["status"]["replicas"] == 3
        assert got["status"]["selector"] == "pdstack.io/deployment=sc,pdstack.io/component=worker"
        assert len(c.pods("sc")) == 6
        await scale(1)
        await eventually(lambda: _ready(c, "sc", 1) and len(c.pods("sc")) == 2, timeout=30, what="back to 1 group")
    assert c.events("sc", "RollingOut") == [] and c.events("sc", "CoRestart") == []


def test_default_placement_keeps_a_group_on_one_node_and_spreads_groups():
    from pdoperator.core.render import worker_pod

    owner = Owner("llm", "ns", "u")
    spec = parse_spec({"image": "x", "pairs": 2, "decode": {"replicas": 2}})
    aff = worker_pod(spec, owner, "r", 1, "decode-1", "0")["spec"]["affinity"]
    together = aff["podAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]["podAffinityTerm"]
    assert together["topologyKey"] == "kubernetes.io/hostname"
    assert together["labelSelector"]["matchLabels"] == {"pdstack.io/deployment": "llm",
                                                        "pdstack.io/component": "worker", "pdstack.io/pair": "1"}
    apart = aff["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]["podAffinityTerm"]
    assert apart["labelSelector"]["matchExpressions"] == [{"key": "pdstack.io/pair", "operator": "NotIn",
                                                           "values": ["1"]}]
    # a pod of group 1 matches its own group's term and not the spread term (labels as rendered)
    labels = worker_pod(spec, owner, "r", 1, "prefill", "0")["metadata"]["labels"]
    assert all(labels.get(k) == v for k, v in together["labelSelector"]["matchLabels"].items())
    assert labels["pdstack.io/pair"] in apart["labelSelector"]["matchExpressions"][0]["values"]

    req = parse_spec({"image": "x", "placement": {"groupPlacement": "Required"}})
    aff = worker_pod(req, owner, "r", 0, "prefill", "0")["spec"]["affinity"]
    assert aff["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0]["topologyKey"] == \
        "kubernetes.io/hostname"
    assert "affinity" not in worker_pod(parse_spec({"image": "x", "placement": {"groupPlacement": "None"}}),
                                        owner, "r", 0, "prefill", "0")["spec"]
    # the user's nodeAffinity adds to the default; their podAntiAffinity replaces the default of that kind
    mine = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["h100"]}]}]}},
        "podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": []}}
    aff = worker_pod(parse_spec({"image": "x", "decode": {"affinity": mine}}), owner, "r", 0, "decode", "0")["spec"][
        "affinity"]
    assert aff["nodeAffinity"] == mine["nodeAffinity"] and aff["podAntiAffinity"] == mine["podAntiAffinity"]
    assert "podAffinity" in aff


def test_rollout_replaces_one_whole_group_at_a_time():
    from pdoperator.core.pairs import RolloutPair

    pods = [_view(f"g{k}-{s}", k, s.split("-")[0], int(s.split("-")[1]) if "-" in s else 0)
            for k in (0, 1) for s in SLOTS]
    plan = plan_pairs(PlanInput(desired_revision="r2", pairs=2, policy=CoRestartSpec(), max_unavailable=1, pods=pods,
                      memory={}, now=100.0, slots=SLOTS))
    rolls = [a for a in plan.actions if isinstance(a, RolloutPair)]
    assert len(rolls) == 1 and set(rolls[0].pods) == {f"g{rolls[0].pair}-{s}" for s in SLOTS}
