"""Thin helpers around the real CLIs (kind, kubectl, helm, docker) for the e2e suite."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
TOOLS_BIN = ROOT / ".tools" / "bin"
REQUIRED = ("docker", "kind", "kubectl", "helm")
NAMESPACE = "pdstack-system"  # the release namespace, also the one the example PDDeployment lives in
RELEASE = "pd"
DEMO = "demo"  # charts/pdstack/ci/kind-values.yaml: example.name
BACKENDS = ("kind", "testcluster")
VENV_BIN = Path(sys.executable).parent  # kubectl-pd (the kubectl plugin) is installed here


def which(name: str) -> str | None:
    local = TOOLS_BIN / name
    return str(local) if local.exists() else shutil.which(name)


def missing_reason() -> str | None:
    """Why the e2e suite cannot run here (None when it can)."""
    absent = [n for n in REQUIRED if which(n) is None]
    if absent:
        return (f"e2e needs {', '.join(REQUIRED)} on PATH; missing: {', '.join(absent)} "
                "(kind: https://kind.sigs.k8s.io; helm/kubectl: `make tools`)")
    info = subprocess.run([which("docker"), "info"], capture_output=True, text=True)
    if info.returncode != 0:
        return f"docker is installed but its daemon does not answer: {info.stderr.strip()[:200]}"
    return None


def backend() -> str:
    """PDSTACK_E2E_BACKEND, else kind: a plain `pytest e2e` is the kind path as it always was (it skips, saying
    what is missing, without docker and kind); `make e2e-testcluster` sets testcluster."""
    chosen = os.environ.get("PDSTACK_E2E_BACKEND")
    if chosen:
        if chosen not in BACKENDS:
            raise SystemExit(f"PDSTACK_E2E_BACKEND={chosen!r} is invalid; accepted: {', '.join(BACKENDS)}")
        return chosen
    return "kind"


def sh(*cmd: str, check: bool = True, timeout: float = 600, env: dict[str, str] | None = None,
       input: str | None = None) -> subprocess.CompletedProcess[str]:
    exe = which(cmd[0]) or cmd[0]
    out = subprocess.run([exe, *cmd[1:]], capture_output=True, text=True, timeout=timeout, env=env, input=input)
    if check and out.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {out.returncode}:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    return out


def eventually(check: Callable[[], Any], *, timeout: float, what: str, interval: float = 3.0) -> Any:
    """Poll ``check`` until truthy; fail naming ``what`` and the last value. Deadlines only catch hangs."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
        except AssertionError as e:
            last = e
        if last and not isinstance(last, AssertionError):
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}; last: {last!r}")


class Kubectl:
    def __init__(self, kubeconfig: Path, namespace: str):
        self.env = {"KUBECONFIG": str(kubeconfig), "PATH": f"{TOOLS_BIN}:/usr/local/bin:/usr/bin:/bin:{VENV_BIN}",
                    "HOME": str(kubeconfig.parent)}
        if os.environ.get("PYTHONPATH"):  # kubectl-pd from this checkout
            self.env["PYTHONPATH"] = os.environ["PYTHONPATH"]
        self.namespace = namespace

    def __call__(self, *args: str, check: bool = True, timeout: float = 300, input: str | None = None) -> str:
        return sh("kubectl", "-n", self.namespace, *args, check=check, timeout=timeout, env=self.env,
                  input=input).stdout

    def json(self, *args: str) -> Any:
        return json.loads(self(*args, "-o", "json"))

    def helm(self, *args: str, timeout: float = 900) -> str:
        return sh("helm", "-n", self.namespace, *args, timeout=timeout, env=self.env).stdout

    def helm_status(self) -> dict[str, Any] | None:
        """The release's ``helm status -o json``, or None when it is not installed."""
        out = sh("helm", "-n", self.namespace, "status", RELEASE, "-o", "json", check=False, env=self.env)
        return json.loads(out.stdout) if out.returncode == 0 else None
