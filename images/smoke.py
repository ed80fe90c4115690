"""Smoke-run the built images as a user would, as non-root with a read-only root filesystem.

    python images/smoke.py runtime IMAGE     # `pdrt up` on the default model answers a chat completion
    python images/smoke.py operator IMAGE    # `--help`, then the operator reconciles a PDDeployment
                                             # in the API emulator of tests/operator

Containers run with ``--read-only --user 10001:10001 --tmpfs /tmp`` and ``--network host``, bound to
127.0.0.1 on free ports. Exit status 0 only when every check passed; on failure the container's log
is printed. Run with the project's venv (the operator check imports the emulator: kmock, dev extra).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable

from pdruntime.util.ports import free_port, free_port_block

ROOT = Path(__file__).resolve().parents[1]
UID = "10001"
# /tmp as a pod's emptyDir is: writable and exec (docker's tmpfs default is noexec), for the CPU kernels the runtime
# compiles there at first use and loads
HARDENED = ["--read-only", "--user", f"{UID}:{UID}", "--tmpfs", "/tmp:rw,exec,size=512m,mode=1777",
            "--network", "host", "--cap-drop", "ALL", "--security-opt", "no-new-privileges"]
READY_TIMEOUT_S = 900.0  # model load + three processes on a contended 2-core machine


def http(method: str, url: str, body: Any = None, timeout: float = 120.0) -> tuple[int, bytes]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def wait_for(check: Callable[[], Any], timeout: float, what: str, container: str) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
            if last:
                return last
        except (OSError, urllib.error.URLError) as e:
            last = e
        state = subprocess.run(["docker", "inspect", "-f", "{{.State.Running}}", container],
                               capture_output=True, text=True).stdout.strip()
        if state != "true":
            fail(f"container exited while waiting for {what}", container)
        time.sleep(1.0)
    fail(f"timed out after {timeout:.0f}s waiting for {what} (last: {last!r})", container)


def docker_logs(container: str) -> str:
    out = subprocess.run(["docker", "logs", container], capture_output=True, text=True)
    return out.stdout + out.stderr


def fail(msg: str, container: str | None = None) -> None:
    if container:
        logs = subprocess.run(["docker", "logs", "--tail", "80", container], capture_output=True, text=True)
        print(logs.stdout + logs.stderr, file=sys.stderr)
    print(f"smoke: FAIL: {msg}", file=sys.stderr)
    raise SystemExit(1)


def check_image(image: str, title: str) -> None:
    """Non-root fixed UID, OCI labels."""
    cfg = json.loads(subprocess.run(["docker", "image", "inspect", image], capture_output=True, text=True,
                                    check=True).stdout)[0]["Config"]
    if cfg.get("User", "").split(":")[0] != UID:
        fail(f"{image}: USER is {cfg.get('User')!r}, expected the fixed non-root UID {UID}")
    labels = cfg.get("Labels") or {}
    for key in ("title", "version", "revision", "created", "source", "licenses"):
        if not labels.get(f"org.opencontainers.image.{key}"):
            fail(f"{image}: OCI label org.opencontainers.image.{key} missing")
    if labels["org.opencontainers.image.title"] != title:
        fail(f"{image}: title label {labels['org.opencontainers.image.title']!r}, expected {title!r}")
    print(f"smoke: {image}: user {cfg['User']}, OCI labels ok")


def docker_run(name: str, image: str, args: list[str], extra: list[str] = ()) -> None:
    subprocess.run(["docker", "rm", "-f", name], capture_output=True)
    subprocess.run(["docker", "run", "-d", "--name", name, *HARDENED, *extra, image, *args], check=True,
                   stdout=subprocess.DEVNULL)
    inspect = json.loads(subprocess.run(["docker", "inspect", name], capture_output=True, text=True).stdout)[0]
    assert inspect["HostConfig"]["ReadonlyRootfs"] is True, "root filesystem is not read-only"


# ---------------------------------------------------------------- runtime
def smoke_runtime(image: str) -> None:
    check_image(image, "pdstack-runtime")
    name = f"pdstack-smoke-runtime-{os.getpid()}"
    port, base = free_port(), free_port_block(3)
    url = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    docker_run(name, image, ["pdrt", "up", "--host", "127.0.0.1", "--port", str(port), "--base-port", str(base),
                             "--ready-timeout-s", str(int(READY_TIMEOUT_S))])
    try:
        wait_for(lambda: "pdrt up: ready at" in docker_logs(name), READY_TIMEOUT_S, "`pdrt up: ready at`", name)
        print(f"smoke: runtime: pdrt up ready in {time.monotonic() - t0:.0f}s")
        status, raw = http("GET", url + "/v1/models", timeout=30)
        if status != 200:
            fail(f"/v1/models answered {status}: {raw[:300]!r}", name)
        model = json.loads(raw)["data"][0]["id"]
        status, raw = http("POST", url + "/v1/chat/completions",
                           {"model": model, "messages": [{"role": "user", "content": "What is the capital of France?"}],
                            "max_tokens": 12, "temperature": 0}, timeout=300)
        if status != 200:
            fail(f"chat completion answered {status}: {raw[:300]!r}", name)
        out = json.loads(raw)
        text = out["choices"][0]["message"]["content"]
        if out.get("object") != "chat.completion" or not text.strip():
            fail(f"not a chat completion with content: {out}", name)
        print(f"smoke: runtime: chat completion from {model}: {text!r} usage={out.get('usage')}")
        status, raw = http("GET", url + "/metrics", timeout=30)
        if status != 200 or b"pdrt_requests_total" not in raw:
            fail("router /metrics has no pdrt_requests_total", name)
        for role, port in (("prefill", base), ("decode", base + 1)):  # pdrt up's first group: base, base + 1
            status, raw = http("GET", f"http://127.0.0.1:{port}/config", timeout=30)
            engine = json.loads(raw).get("engine", {}) if status == 200 else {}
            # the image's C compiler built pdstack's CPU kernels (under /tmp: the root filesystem is read-only), and
            # `pdrt up`'s --weights auto took int4 where they are the AVX-512 VNNI build (fp32 on their portable one)
            kernels = (engine.get("attention_kernel") or {}).get("cpu_kernels")
            if kernels is None:
                fail(f"{role}: pdstack's CPU kernels did not build in the image (attention: "
                     f"{engine.get('attention_kernel')!r}; /config answered {status})", name)
            want = "int4" if kernels == "avx512-vnni" else "float32"
            if engine.get("weights") != want:
                fail(f"{role} runs weights={engine.get('weights')!r} on the {kernels} kernels; --weights auto should "
                     f"give {want}", name)
        print(f"smoke: runtime: CPU kernels built in the container ({kernels}), both workers on {want} weights")
        helm_test_hook(name, url)
        who = subprocess.run(["docker", "exec", name, "id", "-u"], capture_output=True, text=True).stdout.strip()
        if who != UID:
            fail(f"processes run as uid {who}, expected {UID}", name)
        print(f"smoke: runtime OK ({time.monotonic() - t0:.0f}s, uid {who}, read-only root)")
    finally:
        subprocess.run(["docker", "rm", "-f", name], capture_output=True)


def helm_test_hook(container: str, url: str) -> None:
    """Run the chart's `helm test` pod script (rendered by helm) in the runtime image against this router."""
    import shutil

    import yaml

    helm = ROOT / ".tools" / "bin" / "helm"
    helm = str(helm) if helm.exists() else shutil.which("helm")
    if helm is None:
        print("smoke: runtime: helm not installed (`make tools`): the chart's test hook was not run")
        return
    # the test pod renders only with a router to test (example.enabled or test.router); ROUTER_URL is set below
    out = subprocess.run([helm, "template", "pd", str(ROOT / "charts" / "pdstack"), "--set", "test.router=pd-router",
                          "--show-only", "templates/tests/test-chat-completion.yaml"], capture_output=True, text=True,
                         check=True)
    (c,) = yaml.safe_load(out.stdout)["spec"]["containers"]
    env = {e["name"]: e["value"] for e in c["env"]}
    env["ROUTER_URL"] = url
    cmd = ["docker", "exec"] + [a for k, v in env.items() for a in ("-e", f"{k}={v}")] + [container] + c["command"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if run.returncode != 0 or "chat completion OK" not in run.stdout:
        fail(f"the chart's helm test script failed ({run.returncode}): {run.stdout}{run.stderr}", container)
    print(f"smoke: runtime: chart's helm-test hook script passed: {run.stdout.strip()}")


# ---------------------------------------------------------------- operator
class Emulator:
    """tests/operator's API emulator on loopback, in its own thread and event loop."""

    def __init__(self) -> None:
        self.url: str | None = None
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        sys.path.insert(0, str(ROOT / "tests" / "operator"))
        try:
            import kmock
            from pdop_k8s_emulator import PDEmulator

            async def main() -> None:
                self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
                async with PDEmulator() as api, kmock.Server(api, host="127.0.0.1") as server:
                    self.url = str(server.url).rstrip("/")
                    self._ready.set()
                    await self._stop.wait()

            asyncio.run(main())
        except BaseException as e:  # noqa: BLE001 - reported by start()
            self._error = e
            self._ready.set()

    def start(self) -> "Emulator":
        self._thread.start()
        self._ready.wait(60)
        if self._error or not self.url:
            raise RuntimeError(f"emulator did not start: {self._error!r}")
        return self

    def stop(self) -> None:
        if self._loop and self._stop:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)


def smoke_operator(image: str) -> None:
    check_image(image, "pdstack-operator")
    help_out = subprocess.run(["docker", "run", "--rm", *HARDENED, image, "--help"], capture_output=True, text=True)
    if help_out.returncode != 0 or "PDDeployment operator" not in help_out.stdout:
        fail(f"--help exited {help_out.returncode}: {help_out.stdout}{help_out.stderr}")
    print("smoke: operator: --help ok")

    import yaml
    emu = Emulator().start()
    name = f"pdstack-smoke-operator-{os.getpid()}"
    tmp = Path(tempfile.mkdtemp(prefix="pdstack-smoke-"))
    try:
        kubeconfig = tmp / "config"
        kubeconfig.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "emu",
            "clusters": [{"name": "emu", "cluster": {"server": emu.url}}],
            "users": [{"name": "emu", "user": {}}],
            "contexts": [{"name": "emu", "context": {"cluster": "emu", "user": "emu", "namespace": "default"}}]}))
        kubeconfig.chmod(0o644)
        tmp.chmod(0o755)
        metrics, health = free_port(), free_port()
        t0 = time.monotonic()
        # Cluster-wide, as tests/operator runs it: in namespaced mode kopf first lists /api/v1/namespaces,
        # a cluster-scoped path the emulator (kmock 0.8) answers with a 500.
        docker_run(name, image, ["--standalone", f"--liveness=http://127.0.0.1:{health}/healthz"],
                   ["-v", f"{tmp}:/kube:ro", "-e", "KUBECONFIG=/kube/config",
                    "-e", f"PDSTACK_OPERATOR_METRICS_PORT={metrics}"])
        wait_for(lambda: http("GET", f"http://127.0.0.1:{health}/healthz", timeout=5)[0] == 200, 180,
                 "kopf's /healthz", name)
        demo = yaml.safe_load((ROOT / "examples" / "cpu-demo.yaml").read_text())
        status, raw = http("POST", f"{emu.url}/apis/pdstack.io/v1alpha1/namespaces/default/pddeployments", demo)
        if status not in (200, 201):
            fail(f"emulator refused the PDDeployment: {status} {raw[:300]!r}", name)
        sel = urllib.parse.quote("pdstack.io/deployment=demo,pdstack.io/component=worker")

        def worker_pods() -> list[str]:
            _, body = http("GET", f"{emu.url}/api/v1/namespaces/default/pods?labelSelector={sel}", timeout=10)
            items = json.loads(body).get("items", [])
            return sorted(p["metadata"]["labels"]["pdstack.io/role"] for p in items)

        roles = wait_for(lambda: worker_pods() == ["decode", "prefill"] and worker_pods(), 180,
                         "the operator to create the demo pair's prefill and decode pods", name)
        status, raw = http("GET", f"http://127.0.0.1:{metrics}/metrics", timeout=10)
        if status != 200 or b"pdstack_operator_reconcile_duration_seconds" not in raw:
            fail("operator /metrics has no pdstack_operator_reconcile_duration_seconds", name)
        print(f"smoke: operator OK ({time.monotonic() - t0:.0f}s): reconciled cpu-demo in the emulator, "
              f"created pods {roles}, /healthz and /metrics answer, read-only root, uid {UID}")
    finally:
        subprocess.run(["docker", "rm", "-f", name], capture_output=True)
        emu.stop()
        for p in tmp.iterdir():
            p.unlink()
        tmp.rmdir()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("which", choices=("runtime", "operator"))
    ap.add_argument("image")
    args = ap.parse_args(argv)
    (smoke_runtime if args.which == "runtime" else smoke_operator)(args.image)
    return 0


if __name__ == "__main__":
    import urllib.parse  # noqa: F401  (used by smoke_operator)
    sys.exit(main())
