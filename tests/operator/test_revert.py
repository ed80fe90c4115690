"""Pod edit: a ``kubectl edit`` of a worker pod shows as drift naming the field (managedFields); under
``drift.policy: Revert`` the pair is recreated with the declared config as a co-restart (both pods new,
an Event naming the field), since a pod spec cannot be reverted in place. Under Report nothing restarts."""

from __future__ import annotations

from pdop_harness import NS, PODS, eventually, manifest, more_reconciles

from test_operator_integration import is_ready


async def test_a_pod_edit_is_drift_and_revert_recreates_the_pair(operator):
    c = operator
    name = "edit"
    c.apply(manifest(name, pairs=2))
    await eventually(lambda: is_ready(c, name), what="Ready")
    declared = c.pair_pods(name, 1)["decode"]["spec"]["containers"][0]["image"]
    before = {role: p["metadata"]["uid"] for role, p in c.pair_pods(name, 1).items()}
    others = {p["metadata"]["uid"] for p in c.pair_pods(name, 0).values()}

    # kubectl edit pod <decode of pair 1>: a new image (one of the few mutable pod fields)
    pod = c.pair_pods(name, 1)["decode"]
    pod["spec"]["containers"][0]["image"] = "ghcr.io/pdstack/runtime:hotfix"
    c.api._store(PODS, NS, pod["metadata"]["name"], pod, manager="kubectl-edit")
    line = f"Pod/{pod['metadata']['name']}: spec.containers[0].image"
    cond = await eventually(lambda: (x := c.condition(name, "ConfigDrift")).get("status") == "True" and x,
                            what="ConfigDrift=True")
    assert cond["message"] == line, cond

    # Report (the default): the edited pod keeps running; nothing restarts over several reconciles
    await more_reconciles(c, name, 3)
    assert {role: p["metadata"]["uid"] for role, p in c.pair_pods(name, 1).items()} == before
    assert not c.events(name, "CoRestart")
    assert c.condition(name, "ConfigDrift")["message"] == line

    # Revert: the whole pair is recreated with the declared config (a co-restart), pair 0 untouched
    c.patch_spec(name, {"drift": {"policy": "Revert"}})

    def recreated():
        pods = c.pair_pods(name, 1)
        return (set(pods) == {"prefill", "decode"} and not set(before.values()) & {p["metadata"]["uid"] for p in
                                                                                   pods.values()}
                and is_ready(c, name) and pods)
    pods = await eventually(recreated, timeout=20, what="pair 1 recreated")
    assert pods["decode"]["spec"]["containers"][0]["image"] == declared
    assert {p["metadata"]["uid"] for p in c.pair_pods(name, 0).values()} == others
    events = c.events(name, "CoRestart")
    assert len(events) == 1 and events[0]["type"] == "Warning", events
    msg = events[0]["message"]
    assert msg.startswith("pair 1 co-restarted: DriftReverted (decode pod ") and "spec.containers[0].image" in msg, msg
    await eventually(lambda: c.condition(name, "ConfigDrift").get("status") == "False", what="drift gone")
    assert c.pdd(name)["status"]["pairs"][1]["lastCoRestart"]["reason"] == "DriftReverted"
