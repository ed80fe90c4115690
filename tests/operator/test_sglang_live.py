"""Drain and the canary with ``engine: sglang`` through pdstack's router, end to end: the operator, the emulator,
the router started from its rendered Deployment (``--worker-protocol sglang``), and every worker pod a real pdrt
process standing in for SGLang, started from the pod's rendered ``sglang.launch_server`` line as SGLang's own
argparse reads it (sglang_standin.py). The same guarantees as the pdrt tests (test_drain_before_delete.py,
test_canary_live.py):

* ``kubectl scale`` 2 -> 1 under steady traffic: every DELETE of a worker pod finds the router's ``/config``
  already showing that group draining, and no client request fails;
* a bad knob (SGLang's own ``--triton-attention-num-kv-splits 512``, the incident's knob, with the stand-in's
  stall fault) is caught by the canary's multi-round probe in round 2, and the other group never gets it.
"""

from __future__ import annotations

import json

import httpx
import pytest

from emu_kubelet import DEPLOYMENTS
from live_stack import live_stack, pods_ready
from pdop_harness import NS, PODS, eventually, more_reconciles
from sglang_standin import SGLANG_WORKER_ARGS, SGLangKubelet, pdrt_argv, sglang_spec
from test_canary_live import FAULT, revisions_ever
from test_drain_before_delete import Traffic

pytestmark = pytest.mark.slow


def _router_command(c, name: str) -> list[str]:
    deploy = c.api.read(DEPLOYMENTS, NS, f"{name}-router")
    return deploy["spec"]["template"]["spec"]["containers"][0]["command"]


async def test_sglang_groups_drain_in_pdstack_router_before_their_pods_go(tmp_path):
    name = "sgd"
    checks: list[tuple[str, int, list[int]]] = []
    async with live_stack(tmp_path, name, kubelet_cls=SGLangKubelet, worker_args=SGLANG_WORKER_ARGS,
                          rollout={"drainSeconds": 5, "maxUnavailablePairs": 1}, **sglang_spec()) as (c, url, kubelet):
        assert "--worker-protocol" in (cmd := _router_command(c, name)) and \
            cmd[cmd.index("--worker-protocol") + 1] == "sglang", cmd
        pod = c.pair_pods(name, 0)["decode"]
        assert pod["spec"]["containers"][0]["command"][:3] == ["python", "-m", "sglang.launch_server"]
        admin = {"Authorization": f"Bearer {next(tmp_path.glob('router-admin-*.token')).read_text()}"}

        def on_pod_delete(ns: str, pod_name: str) -> None:
            pod = c.api.read(PODS, ns, pod_name)
            if not pod or pod["metadata"]["labels"].get("pdstack.io/component") != "worker":
                return
            cfg = httpx.get(url + "/config", headers=admin, timeout=5).json()
            checks.append((pod_name, int(pod["metadata"]["labels"]["pdstack.io/pair"]), cfg["draining"]))
        c.api.on_pod_delete = on_pod_delete

        traffic = Traffic(url)
        traffic.start()
        await eventually(lambda: traffic.ok >= 5, timeout=60, what="traffic flowing")
        scale_url = f"{c.url.rstrip('/')}/apis/pdstack.io/v1alpha1/namespaces/{NS}/pddeployments/{name}/scale"
        async with httpx.AsyncClient() as http:  # the emulator serves on this event loop
            r = await http.patch(scale_url, content=json.dumps({"spec": {"replicas": 1}}), timeout=10,
                                 headers={"Content-Type": "application/merge-patch+json"})
        assert r.status_code == 200 and r.json()["spec"]["replicas"] == 1, r.text
        before = traffic.ok
        await eventually(lambda: (st := c.pdd(name)["status"]).get("replicas") == 1 and st["readyPairs"] == 1
                         and len(c.pods(name)) == 2 and c.condition(name, "Ready").get("status") == "True",
                         timeout=240, interval=0.2, what="scaled to 1")
        await eventually(lambda: traffic.ok >= before + 3, timeout=60, what="traffic at 1 group")
        await traffic.stop()
    assert traffic.failures == [], traffic.failures[:5]
    assert len(checks) == 2 and {pair for _, pair, _ in checks} == {1}, checks
    for pod_name, pair, draining in checks:
        assert pair in draining, f"pod {pod_name} of group {pair} deleted while the router showed draining={draining}"
    print(f"engine sglang: {traffic.ok} requests served, 0 failed; {len(checks)} pod deletions, each after the "
          f"router showed its group draining")


async def test_sglang_canary_catches_a_bad_knob_and_the_other_group_never_gets_it(tmp_path):
    name = "sgc"
    canary = {"agents": 2, "rounds": 3, "roundTimeoutSeconds": 10, "maxTokens": 4}
    async with live_stack(tmp_path, name, kubelet_cls=SGLangKubelet, worker_args=SGLANG_WORKER_ARGS,
                          rollout={"drainSeconds": 5, "canary": canary}, **sglang_spec()) as (c, url, _):
        old = c.pdd(name)["status"]["currentRevision"]
        decode = dict(c.pdd(name)["spec"]["decode"])
        decode["args"] = [*SGLANG_WORKER_ARGS, "--triton-attention-num-kv-splits", "512"]
        decode["env"] = [{"name": FAULT, "value": "1"}]
        c.patch_spec(name, {"decode": decode})
        new = await eventually(lambda: (u := c.pdd(name)["status"].get("updateRevision")) != old and u,
                               what="new revision")
        # the knob reaches the SGLang line, as SGLang's parser reads it
        probing = await eventually(lambda: (c.pdd(name)["status"].get("canary") or {}).get("phase") == "Probing"
                                   and c.pdd(name)["status"]["canary"], timeout=150, interval=0.2,
                                   what="canary group 1 at the new revision, probing")
        assert probing["pair"] == 1 and probing["revision"] == new
        line = c.pair_pods(name, 1)["decode"]["spec"]["containers"][0]["command"]
        assert line[line.index("--triton-attention-num-kv-splits") + 1] == "512"
        assert pdrt_argv(list(line), "127.0.0.1")  # SGLang's parser accepts it
        cond = await eventually(lambda: (x := c.condition(name, "CanaryFailed")).get("status") == "True" and x,
                                timeout=120, interval=0.2, what="CanaryFailed")
        msg = cond["message"]
        assert msg.startswith(f"revision {new} failed its canary on pair 1: round 2: "), msg
        assert f"decode.env.{FAULT}: <unset> -> 1" in msg and "--triton-attention-num-kv-splits" in msg, msg
        events = c.events(name, "CanaryFailed")
        assert len(events) == 1 and events[0]["type"] == "Warning" and "round 2" in events[0]["message"], events
        await eventually(lambda: {p["index"]: p["revision"] for p in c.pdd(name)["status"]["pairs"]} == {0: old, 1: old}
                         and pods_ready(c, name, 4), timeout=120, interval=0.2, what="group 1 back at the old revision")
        await more_reconciles(c, name, 3)
        assert revisions_ever(c, name, 0) == {old}, "group 0 received the canary revision"
        assert revisions_ever(c, name, 1) == {old, new}
        r = httpx.post(url + "/v1/chat/completions", timeout=30,
                       json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert r.status_code == 200, r.text
        print(f"engine sglang CanaryFailed: {msg}")
