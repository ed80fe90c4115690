"""The operator's day two on either backend: ``kubectl pd status``, ``requests`` and ``diff --since``;
``kubectl scale``; ``helm upgrade``; then ``helm uninstall`` with nothing left Terminating (runs last)."""

from __future__ import annotations

import datetime
import json
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from kube import DEMO, RELEASE, ROOT, Kubectl, backend, eventually
from test_kind import _chat, _pair_pods, _ready

OPERATOR = f"app.kubernetes.io/instance={RELEASE},app.kubernetes.io/name=pdstack-operator"  # not the helm-test pod
WORKER_READY_S = 420  # model load of two workers on 2 shared cores, with the rest of the stack running


def _pd(kube: Kubectl, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """``kubectl pd ...``: kubectl finds the kubectl-pd plugin on PATH."""
    from kube import sh
    return sh("kubectl", "pd", *args, "-n", kube.namespace, check=check, env=kube.env, timeout=120)


def _status(kube: Kubectl) -> dict[str, Any]:
    return kube.json("get", "pddeployment", DEMO).get("status", {})


def test_the_network_policy_admits_the_operators_reads_which_the_old_one_dropped(
        kube: Kubectl, router_url: str, request: pytest.FixtureRequest) -> None:
    """Every pod connection goes through the test cluster's CNI (the stored NetworkPolicies decide). The operator's
    stall sweep reads each worker's /metrics by pod IP: admitted by the policy the operator renders (its
    namespace and pod are peers), dropped under the policy before the fix (only the deployment's own pods), while
    the router's requests to the workers pass under both."""
    if backend() != "testcluster":
        pytest.skip("reads the test cluster's CNI connection log (tests/cluster/proc_kubelet.py)")
    from testcluster import call_in_loop
    tc = request.getfixturevalue("testcluster")

    kube("rollout", "status", f"deployment/{DEMO}-router", "--timeout=180s", timeout=200)  # one router pod

    def ip(selector: str) -> str:
        (pod,) = [p for p in kube.json("get", "pods", "-l", selector)["items"]
                  if _ready(p) and not p["metadata"].get("deletionTimestamp")]
        return pod["status"]["podIP"]
    op, router = ip(OPERATOR), ip(f"pdstack.io/deployment={DEMO},pdstack.io/component=router")
    workers = {p["status"]["podIP"] for p in _pair_pods(kube, 0).values()}

    def seen(mark: int, src: str, allowed: bool) -> list[tuple[str, str, int, bool, str]]:
        conns = call_in_loop(tc, lambda: list(tc.kubelet.connections))[mark:]
        return [c for c in conns if c[0] == src and c[1] in workers and c[2] == 8000 and c[3] is allowed]

    def mark() -> int:
        return call_in_loop(tc, lambda: len(tc.kubelet.connections))

    eventually(lambda: seen(0, op, True), timeout=120, interval=1, what="the operator's reads of the workers admitted")
    saved = kube.json("get", "networkpolicy", f"{DEMO}-workers")["spec"]["ingress"]
    old = [{"from": [{"podSelector": {"matchLabels": {"pdstack.io/deployment": DEMO}}}],
            "ports": [{"port": 8000}, {"port": 8998}]}]
    kube("patch", "networkpolicy", f"{DEMO}-workers", "--type=json",
         "-p", json.dumps([{"op": "replace", "path": "/spec/ingress", "value": old}]))
    try:
        m = mark()
        (denied, *_) = eventually(lambda: seen(m, op, False), timeout=120, interval=1,
                                  what="the operator's reads dropped under the old policy")
        assert "ingress to" in denied[4] and "denied" in denied[4], denied
        # concurrent chats: the router keeps its worker connections alive (util/h1.py) for 30 s, so only requests
        # beyond its idle connections open new ones, which the CNI then judges under the old policy; 16 at once is
        # more than the module's earlier traffic leaves idle
        with ThreadPoolExecutor(16) as pool:
            replies = list(pool.map(lambda i: _chat(router_url, f"Through the old policy? ({i})"), range(16)))
        assert all(r["choices"][0]["message"]["content"].strip() for r in replies), replies
        assert seen(m, router, True) and not seen(m, router, False), "the router's own requests must pass"
    finally:
        kube("patch", "networkpolicy", f"{DEMO}-workers", "--type=json",
             "-p", json.dumps([{"op": "replace", "path": "/spec/ingress", "value": saved}]))
    m = mark()
    eventually(lambda: seen(m, op, True), timeout=120, interval=1, what="the operator's reads admitted again")


def test_kubectl_pd_status_shows_the_pair_and_its_pods(kube: Kubectl) -> None:
    report = json.loads(_pd(kube, "status", DEMO, "-o", "json").stdout)
    assert report["name"] == DEMO and report["phase"] == "Ready" and report["readyPairs"] == 1
    (group,) = report["groups"]
    assert {p["role"] for p in group["pods"]} == {"prefill", "decode"} and all(p["ready"] for p in group["pods"])
    table = _pd(kube, "status", DEMO).stdout
    assert f"PDDeployment {kube.namespace}/{DEMO}: phase Ready, ready pairs 1/1" in table, table


def test_kubectl_pd_requests_lists_a_live_request(kube: Kubectl, router_url: str) -> None:
    """A long completion is in flight (client id ``e2e-live``): ``requests`` shows it, through pods/proxy."""
    done: dict[str, Any] = {}
    t = threading.Thread(target=lambda: done.update(out=_chat(router_url, "Tell a long story.", "e2e-live",
                                                              max_tokens=400)), daemon=True)
    t.start()
    try:
        def listed() -> Any:
            report = json.loads(_pd(kube, "requests", DEMO, "-o", "json").stdout)
            return report if any(r.get("client") == "e2e-live" for r in report["requests"]) else None
        report = eventually(listed, timeout=120, interval=0.5, what="the in-flight request in kubectl pd requests")
        assert not report["unreachable"], report
    finally:
        t.join(300)
    assert done["out"]["usage"]["completion_tokens"] > 0


def test_kubectl_pd_diff_since_shows_a_spec_change(kube: Kubectl) -> None:
    before = _status(kube)["revisions"]["current"] if "revisions" in _status(kube) else None
    since = (datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(seconds=2)).strftime(
        "%Y-%m-%dT%H:%M:%SZ")
    same = _pd(kube, "diff", DEMO, "--since", since, check=False)
    assert same.returncode == 0 and "(no changes)" in same.stdout, same.stdout + same.stderr
    kube("patch", "pddeployment", DEMO, "--type=merge", "-p", '{"spec":{"watchdog":{"tickSeconds":1}}}')
    eventually(lambda: _status(kube).get("phase") == "Ready" and _status(kube).get("observedGeneration")
               == kube.json("get", "pddeployment", DEMO)["metadata"]["generation"]
               and all(_ready(p) for p in _pair_pods(kube, 0).values()) and len(_pair_pods(kube, 0)) == 2,
               timeout=WORKER_READY_S, what="Ready on the new revision")
    changed = _pd(kube, "diff", DEMO, "--since", since, check=False)
    assert changed.returncode == 1, changed.stdout + changed.stderr
    assert "PDRT_WATCHDOG_TICK_S: 0.5 -> 1" in changed.stdout, changed.stdout
    if before is not None:
        assert _status(kube)["revisions"]["current"] != before


def test_kubectl_scale_adds_and_removes_a_pair(kube: Kubectl) -> None:
    kube("scale", "pddeployment", DEMO, "--replicas=2")
    eventually(lambda: len(_pair_pods(kube, 1)) == 2 and all(_ready(p) for p in _pair_pods(kube, 1).values())
               and _status(kube).get("readyPairs") == 2, timeout=WORKER_READY_S, what="pair 1 ready after scale 2")
    kube("scale", "pddeployment", DEMO, "--replicas=1")
    eventually(lambda: not kube.json("get", "pods", "-l", f"pdstack.io/deployment={DEMO},pdstack.io/pair=1")["items"]
               and _status(kube).get("phase") == "Ready", timeout=180, what="pair 1 gone after scale 1")


def test_helm_upgrade_replaces_the_operator_and_keeps_serving(kube: Kubectl, router_url: str) -> None:
    (old,) = kube.json("get", "pods", "-l", OPERATOR)["items"]
    version = kube.helm_status()["version"]
    kube.helm("upgrade", RELEASE, str(ROOT / "charts/pdstack"), "--reuse-values", "--set", "operator.logLevel=debug",
              "--wait", "--timeout", "5m")
    assert kube.helm_status()["version"] == version + 1

    def replaced() -> Any:
        pods = [p for p in kube.json("get", "pods", "-l", OPERATOR)["items"]
                if not p["metadata"].get("deletionTimestamp")]
        return pods if len(pods) == 1 and pods[0]["metadata"]["uid"] != old["metadata"]["uid"] \
            and _ready(pods[0]) else None
    (new,) = eventually(replaced, timeout=180, what="the upgraded operator pod Ready")
    assert "--verbose" in new["spec"]["containers"][0]["args"]
    eventually(lambda: _status(kube).get("phase") == "Ready", timeout=120, what="still Ready under the new operator")
    assert _chat(router_url, "Still serving?")["choices"][0]["message"]["content"].strip()


def test_helm_uninstall_leaves_nothing_terminating(kube: Kubectl) -> None:
    """The example goes first (its finalizer needs the operator), then the release; ``--wait`` returns and
    nothing of either is left, Terminating or not."""
    kube("delete", "pddeployment", DEMO, "--wait", "--timeout=180s", timeout=200)
    kube.helm("uninstall", RELEASE, "--wait", "--timeout", "3m")
    assert kube.helm_status() is None

    def left() -> list[str]:
        """What is left; a `helm test` hook pod counts only when Terminating (Helm leaves a finished hook pod with
        ``hook-delete-policy: before-hook-creation`` in place, by design)."""
        objs = kube.json("get", "pods,deployments,services,configmaps,networkpolicies,poddisruptionbudgets,"
                                "pddeployments")["items"]
        return [f"{o['kind']}/{o['metadata']['name']}" + (" (Terminating)" if o["metadata"].get("deletionTimestamp")
                                                         else "") for o in objs
                if (o["kind"] != "ConfigMap" or o["metadata"]["name"] != "kube-root-ca.crt")
                and ("helm.sh/hook" not in (o["metadata"].get("annotations") or {})
                     or o["metadata"].get("deletionTimestamp"))]
    # the operator's pod goes by garbage collection after its Deployment, gracefully: allow it its grace period
    deadline = time.monotonic() + 90
    while (rest := left()) and time.monotonic() < deadline:
        time.sleep(1)
    assert not rest, f"left after helm uninstall: {rest}"
