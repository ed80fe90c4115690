"""pdstack on a real (kind) cluster: install, serve, co-restart a pair, report drift."""

from __future__ import annotations

import json
import urllib.request
from typing import Any


from kube import DEMO, RELEASE, Kubectl, eventually


def _get(url: str) -> Any:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return json.load(r)
    except OSError:
        return None


def _chat(url: str, content: str, client: str = "e2e", max_tokens: int = 16) -> dict[str, Any]:
    model = _get(url + "/v1/models")["data"][0]["id"]
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": content}],
                       "max_tokens": max_tokens, "temperature": 0}).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json", "X-Client-Id": client})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.load(r)


def _pair_pods(kube: Kubectl, pair: int) -> dict[str, dict[str, Any]]:
    pods = kube.json("get", "pods", "-l", f"pdstack.io/deployment={DEMO},pdstack.io/pair={pair}")["items"]
    return {p["metadata"]["labels"]["pdstack.io/role"]: p for p in pods if not p["metadata"].get("deletionTimestamp")}


def _ready(pod: dict[str, Any]) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in pod.get("status", {}).get("conditions", []))


def _condition(kube: Kubectl, ctype: str) -> dict[str, Any]:
    for c in kube.json("get", "pddeployment", DEMO).get("status", {}).get("conditions", []):
        if c["type"] == ctype:
            return c
    return {}


def test_operator_runs_hardened(kube: Kubectl) -> None:
    (pod,) = kube.json("get", "pods", "-l", f"app.kubernetes.io/instance={RELEASE}")["items"]
    assert _ready(pod)
    c = pod["spec"]["containers"][0]
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True


def test_chat_completions_through_the_router_service(kube: Kubectl, router_url: str) -> None:
    for i in range(3):
        out = _chat(router_url, f"Count to {i + 2}.")
        assert out["object"] == "chat.completion" and out["choices"][0]["message"]["content"].strip()
        assert out["usage"]["completion_tokens"] > 0


def test_helm_test_hook_passes(kube: Kubectl) -> None:
    out = kube.helm("test", RELEASE, "--logs", "--timeout", "10m", timeout=900)
    assert "chat completion OK" in out


def _host_has_avx512_vnni() -> bool:
    """The CPU the pods run on (kind's nodes and the test cluster's pods share this host's) has what pdstack's int4
    kernels need to be fast: AVX-512 F, BW, VL and VNNI."""
    with open("/proc/cpuinfo") as f:
        flags = next((ln.split(":", 1)[1].split() for ln in f if ln.startswith("flags")), [])
    return {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= set(flags)


def test_the_demo_workers_run_the_weights_auto_picks(kube: Kubectl) -> None:
    """The example asks for ``model.weights: auto``: int4 once pdstack's CPU kernels build in the pod (the runtime
    image ships gcc; the test cluster's pods run on this host, which has one) for AVX-512 VNNI, else fp32, as each
    worker's engine line says."""
    want = "int4" if _host_has_avx512_vnni() else "float32"
    pods = _pair_pods(kube, 0)
    assert set(pods) == {"prefill", "decode"}, pods
    for role, pod in pods.items():
        log = kube("logs", pod["metadata"]["name"], "-c", role)
        line = next((ln for ln in log.splitlines() if "engine: device=" in ln), None)
        assert line is not None and f" weights={want} " in line, (role, want, line or log[-2000:])


def test_deleting_the_decode_pod_co_restarts_its_pair(kube: Kubectl, router_url: str) -> None:
    before = _pair_pods(kube, 0)
    assert set(before) == {"prefill", "decode"} and all(_ready(p) for p in before.values())
    old = {role: p["metadata"]["uid"] for role, p in before.items()}
    restarts = kube.json("get", "pddeployment", DEMO)["status"]["pairs"][0].get("restarts", 0)

    kube("delete", "pod", before["decode"]["metadata"]["name"], "--wait=false")

    def both_replaced_and_ready() -> bool:
        now = _pair_pods(kube, 0)
        return (set(now) == {"prefill", "decode"} and all(_ready(p) for p in now.values())
                and all(now[r]["metadata"]["uid"] != old[r] for r in old))
    eventually(both_replaced_and_ready, timeout=900, what="both pods of pair 0 replaced and ready")
    now = _pair_pods(kube, 0)
    assert now["prefill"]["metadata"]["labels"]["pdstack.io/revision"] == now["decode"]["metadata"]["labels"]["pdstack.io/revision"]
    status = kube.json("get", "pddeployment", DEMO)["status"]
    assert status["pairs"][0]["restarts"] == restarts + 1
    assert status["pairs"][0]["lastCoRestart"]["reason"] == "PodDeleted"
    events = kube.json("get", "events", "--field-selector", f"involvedObject.name={DEMO},reason=CoRestart")["items"]
    assert events, "no CoRestart Event"
    eventually(lambda: kube.json("get", "pddeployment", DEMO)["status"].get("phase") == "Ready", timeout=600,
               what="Ready again")
    assert _chat(router_url, "Still there?")["choices"][0]["message"]["content"].strip()


def test_a_hand_edit_of_a_declared_field_is_reported_as_drift(kube: Kubectl) -> None:
    """Drift is a field the operator applied now owned by another manager (managedFields): ``kubectl set
    resources`` takes the router's cpu request. (An env var the operator never declared is no drift: the router's
    ``env: []`` claims no entry, so ``kubectl set env`` of a new one owns only what it added.)"""
    assert _condition(kube, "ConfigDrift").get("status") == "False"
    kube("set", "resources", f"deployment/{DEMO}-router", "--requests=cpu=150m")
    try:
        cond = eventually(lambda: (c := _condition(kube, "ConfigDrift")).get("status") == "True" and c,
                          timeout=300, what="ConfigDrift=True after editing the router's cpu request")
        assert cond["reason"] == "Drifted"
        assert f"Deployment/{DEMO}-router" in cond["message"] and "resources.requests.cpu" in cond["message"], cond
    finally:
        kube("set", "resources", f"deployment/{DEMO}-router", "--requests=cpu=100m")


def test_the_chart_rbac_is_enough(kube: Kubectl) -> None:
    """Runs last: after install, serving, a co-restart and drift, the operator was never refused by RBAC.

    kopf's own optional scans (namespaces, CRDs) are refused by design in namespaced mode and log
    "Not enough permissions"; anything the operator's code calls shows up as Forbidden / 403.
    """
    logs = kube("logs", f"deploy/{RELEASE}-pdstack", "--tail=-1")
    refused = [line for line in logs.splitlines() if "Forbidden" in line or " 403" in line]
    assert not refused, "the operator was refused by RBAC:\n" + "\n".join(refused[:20])
