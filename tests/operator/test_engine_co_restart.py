"""Co-restart holds for every engine: deleting the prefill pod of an SGLang or vLLM group (1 prefill + 2 decodes)
recreates the whole group, its healthy decode pods included, and the CoRestart Event names the engine and the
reason. The real operator against the API emulator (pdop_harness ``operator``)."""

from __future__ import annotations

import pytest

from pdop_harness import IMAGE, NS, PODS, eventually, manifest


def group(c, name):
    return {p["metadata"]["labels"].get("pdstack.io/member", "0") + p["metadata"]["labels"]["pdstack.io/role"]:
            p["metadata"]["name"] for p in c.pods(name) if not p["metadata"].get("deletionTimestamp")}


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
async def test_deleting_the_prefill_recreates_the_groups_decode_pods(operator, engine):
    c = operator
    name = f"co-{engine}"
    c.apply(manifest(name, pairs=1, engine=engine, runtimeImage=IMAGE, model={"source": "/models/m"},
                     decode={"replicas": 2, "resources": {"gpus": 1}}))
    await eventually(lambda: c.condition(name, "Ready").get("status") == "True", timeout=20, what=f"{name} Ready")
    before = group(c, name)
    assert sorted(before) == ["0decode", "0prefill", "1decode"]
    pods = {p["metadata"]["name"]: p for p in c.pods(name)}
    assert all([x["name"] for x in p["spec"]["containers"]][:2] == [p["metadata"]["labels"]["pdstack.io/role"],
                                                                    "pdstack-agent"] for p in pods.values())
    c.delete(PODS, before["0prefill"])

    def recreated():
        now = group(c, name)
        return sorted(now) == sorted(before) and not set(now.values()) & set(before.values()) and now
    await eventually(recreated, timeout=20, what="every pod of the group recreated")
    for old in before.values():
        assert c.api.read(PODS, NS, old) is None, f"{old} survived its prefill's deletion"
    events = c.events(name, "CoRestart")
    assert len(events) == 1 and events[0]["type"] == "Warning"
    msg = events[0]["message"]
    assert msg.startswith("pair 0 co-restarted: PodDeleted") and f"engine {engine}" in msg, msg
    assert before["0decode"] in msg and before["1decode"] in msg, msg
    await eventually(lambda: c.condition(name, "Ready").get("status") == "True", timeout=20, what="Ready again")


def test_an_agent_restart_is_not_a_worker_restart():
    """The pdstack-agent holds no KV state: its restarts and OOMs never make its pod count as restarted (the engine
    container's still do), so an agent crash never co-restarts the group."""
    from pdoperator.core.pairs import pod_view

    def pod(agent_restarts, engine_restarts, agent_oom=False):
        agent = {"name": "pdstack-agent", "restartCount": agent_restarts,
                 **({"lastState": {"terminated": {"reason": "OOMKilled"}}} if agent_oom else {})}
        return {"metadata": {"name": "p", "labels": {"pdstack.io/pair": "0", "pdstack.io/role": "decode"}},
                "status": {"phase": "Running", "containerStatuses": [
                    {"name": "decode", "restartCount": engine_restarts}, agent]}}
    assert pod_view(pod(3, 0, agent_oom=True)).restarts == 0 and not pod_view(pod(3, 0, agent_oom=True)).oom_killed
    assert pod_view(pod(3, 1)).restarts == 1
