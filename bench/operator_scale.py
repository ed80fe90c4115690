"""The operator at scale on the test cluster: N PDDeployments applied at once, then a pod deleted.

    python bench/operator_scale.py [--deployments 100] [--json OUT]

The test cluster (tests/cluster/testcluster.py) with its simulated kubelet (pods Ready once started, no worker
processes) and the operator as a real process (``python -m pdoperator --standalone -n NS``, the kubeconfig of
its service account, bound to the chart's namespaced Role rules from ``pdoperator.core.rbac``). Measured:

* time to all children: from the last ``kubectl apply`` of N PDDeployments (one List) until every one has its
  children (two Secrets, prefill and decode pods, two Services, the router Deployment, the topology ConfigMap,
  the NetworkPolicy and the PodDisruptionBudget);
* pod-deletion reaction, right after the mass create and again once the operator is idle: from deleting one
  decode pod until the operator acted on its pair (the prefill pod deleted, or a new pod created: the co-restart);
* the operator's CPU seconds (user + system, /proc) and peak RSS (VmHWM) over the run.

Prints one table; exits 1 when a phase did not finish within its deadline (hang catchers, not the bounds).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT / "tests" / "cluster", ROOT / "tests" / "operator", ROOT / "operator", ROOT / "runtime"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import yaml  # noqa: E402

from testcluster import call_in_loop, threaded  # noqa: E402

NS = "bench"
IMAGE = "pdstack-runtime:dev"
KUBECTL = str(ROOT / ".tools" / "bin" / "kubectl")
# per PDDeployment (plural, name suffix); pods are counted by label
CHILDREN = (("secrets", "-kv-auth"), ("secrets", "-router-admin"), ("services", "-workers"), ("services", "-router"),
            ("deployments", "-router"), ("configmaps", "-topology"), ("networkpolicies", "-workers"),
            ("poddisruptionbudgets", "-workers"))
GROUPS = {"deployments": "apps", "networkpolicies": "networking.k8s.io", "poddisruptionbudgets": "policy"}
CLK_TCK = os.sysconf("SC_CLK_TCK")


def manifest(i: int) -> dict[str, Any]:
    doc = yaml.safe_load((ROOT / "examples" / "cpu-demo.yaml").read_text())
    doc["metadata"] = {"name": f"s{i:03d}", "namespace": NS}
    doc["spec"]["image"] = IMAGE
    return doc


def kubectl(kubeconfig: Path, *args: str, stdin: str | None = None) -> str:
    out = subprocess.run([KUBECTL, *args], input=stdin, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "KUBECONFIG": str(kubeconfig), "HOME": str(kubeconfig.parent)})
    if out.returncode != 0:
        raise SystemExit(f"kubectl {' '.join(args)}: {out.stderr}")
    return out.stdout


def proc_usage(pid: int) -> tuple[float, int]:
    """(CPU seconds user+system, peak RSS bytes) of a live process."""
    stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    cpu = (int(stat[11]) + int(stat[12])) / CLK_TCK
    hwm = next(int(line.split()[1]) * 1024 for line in Path(f"/proc/{pid}/status").read_text().splitlines()
               if line.startswith("VmHWM:"))
    return cpu, hwm


def wait(check: Callable[[], Any], timeout: float, what: str, interval: float = 0.05) -> float:
    """Seconds until ``check()`` is truthy; SystemExit naming ``what`` after ``timeout``."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if check():
            return time.monotonic() - t0
        time.sleep(interval)
    raise SystemExit(f"timed out after {timeout:.0f} s: {what}")


def run(n: int, log_dir: Path) -> dict[str, float]:
    from pdop_k8s_emulator import PODS, R
    from pdoperator.core import rbac

    with threaded(log_dir) as tc:
        tc.kubelet.load(IMAGE)
        admin = tc.kubeconfig
        kubectl(admin, "apply", "-f", str(ROOT / "crds" / "pddeployment.yaml"))
        kubectl(admin, "create", "namespace", NS)
        role = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
                "metadata": {"name": "pdstack-operator", "namespace": NS}, "rules": rbac.NAMESPACED_RULES}
        binding = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
                   "metadata": {"name": "pdstack-operator", "namespace": NS},
                   "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "pdstack-operator"},
                   "subjects": [{"kind": "ServiceAccount", "name": "pdstack-operator", "namespace": NS}]}
        kubectl(admin, "apply", "-f", "-", stdin=json.dumps({"apiVersion": "v1", "kind": "List",
                                                             "items": [role, binding]}))
        from pdruntime.util.ports import free_port
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PDRT_", "PDSTACK_"))}
        env.update(KUBECONFIG=str(tc.service_account_kubeconfig(NS, "pdstack-operator")),
                   PDSTACK_OPERATOR_METRICS_PORT=str(free_port()), POD_NAMESPACE=NS,
                   PYTHONPATH=f"{ROOT / 'runtime'}:{ROOT / 'operator'}")
        log = open(log_dir / "operator.log", "wb")
        op = subprocess.Popen([sys.executable, "-m", "pdoperator", "--standalone", "-n", NS,
                               f"--liveness=http://127.0.0.1:{free_port()}/healthz"],
                              env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            names = [f"s{i:03d}" for i in range(n)]

            def missing() -> list[str]:
                def scan() -> list[str]:  # one pass per resource: the scan runs on the API server's loop
                    have: dict[str, set[str]] = {}
                    for plural in {pl for pl, _ in CHILDREN}:
                        have[plural] = {o["metadata"]["name"] for o in tc.api.select(R(GROUPS.get(plural, ""), "v1",
                                                                                        plural), NS)}
                    roles = {(p["metadata"]["labels"].get("pdstack.io/deployment"),
                              p["metadata"]["labels"].get("pdstack.io/role")) for p in tc.api.select(PODS, NS)}
                    return [f"{pl}/{n}{sfx}" for n in names for pl, sfx in CHILDREN if n + sfx not in have[pl]] + [
                        f"pods/{n} {r}" for n in names for r in ("prefill", "decode") if (n, r) not in roles]
                return call_in_loop(tc, scan)

            kubectl(admin, "apply", "-f", "-", stdin=json.dumps(
                {"apiVersion": "v1", "kind": "List", "items": [manifest(i) for i in range(n)]}))
            applied = time.monotonic()
            t_children = wait(lambda: not missing(), 600, f"children of {n} PDDeployments", interval=0.25)
            after_create = reaction(tc, names[n // 2])
            t_idle = wait(lambda: idle(tc, names), 600, f"{n} PDDeployments Ready")
            settled = reaction(tc, names[-1])
            cpu, rss = proc_usage(op.pid)
            return {"deployments": n, "children_s": t_children, "apply_to_children_s": time.monotonic() - applied,
                    "reaction_after_create_s": after_create, "ready_after_children_s": t_idle,
                    "reaction_idle_s": settled, "operator_cpu_s": cpu, "operator_peak_rss_mib": rss / 2**20}
        finally:
            op.terminate()
            try:
                op.wait(20)
            except subprocess.TimeoutExpired:
                op.kill()


def idle(tc: Any, names: list[str]) -> bool:
    from pdop_k8s_emulator import R
    pdds = R("pdstack.io", "v1alpha1", "pddeployments")

    def scan() -> bool:
        return all((tc.api.read(pdds, NS, n) or {}).get("status", {}).get("phase") == "Ready" for n in names)
    return call_in_loop(tc, scan)


def reaction(tc: Any, name: str) -> float:
    """Delete ``name``'s decode pod; seconds until the operator acted on the pair (prefill pod deleted or a new pod
    of the pair created)."""
    from pdop_k8s_emulator import PODS

    def pods() -> dict[str, dict[str, Any]]:
        return {p["metadata"]["uid"]: p for p in tc.api.select(PODS, NS, f"pdstack.io/deployment={name}")}
    before = call_in_loop(tc, pods)
    decode = next(p for p in before.values() if p["metadata"]["labels"]["pdstack.io/role"] == "decode")
    prefill = next(p for p in before.values() if p["metadata"]["labels"]["pdstack.io/role"] == "prefill")
    call_in_loop(tc, tc.api._delete, PODS, NS, decode["metadata"]["name"])

    def acted() -> bool:
        now = call_in_loop(tc, pods)
        p = now.get(prefill["metadata"]["uid"])
        return p is None or bool(p["metadata"].get("deletionTimestamp")) or any(u not in before for u in now)
    return wait(acted, 120, f"the operator's reaction to deleting {decode['metadata']['name']}")


def main(argv: list[str] | None = None) -> int:
    import tempfile
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--deployments", type=int, default=100)
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args(argv)
    log_dir = Path(tempfile.mkdtemp(prefix="pdstack-operator-scale-"))
    r = run(args.deployments, log_dir)
    rows = [("PDDeployments", f"{r['deployments']}"),
            ("last apply -> every child", f"{r['children_s']:.1f} s"),
            ("pod-deletion reaction, right after the mass create", f"{r['reaction_after_create_s']:.2f} s"),
            ("children -> all Ready", f"{r['ready_after_children_s']:.1f} s"),
            ("pod-deletion reaction, operator idle", f"{r['reaction_idle_s']:.2f} s"),
            ("operator CPU (user+sys)", f"{r['operator_cpu_s']:.1f} s"),
            ("operator peak RSS", f"{r['operator_peak_rss_mib']:.0f} MiB")]
    width = max(len(k) for k, _ in rows)
    print(f"{'measure':<{width}}  value")
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    print(f"(operator log: {log_dir / 'operator.log'})")
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
