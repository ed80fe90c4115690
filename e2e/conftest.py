"""e2e on kind: create a cluster, load both images, ``helm install`` the chart with the example
CPU PDDeployment. Skips the whole suite, saying why, without docker + kind + kubectl + helm.

Environment:
  PDSTACK_E2E_CLUSTER   kind cluster name (default pdstack-e2e); reused when it exists
  PDSTACK_E2E_KEEP=1    keep the cluster afterwards (default: delete the cluster this run created)
  TAG                   image tag to load (default dev; built by images/build.sh --no-smoke when absent)
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import Iterator

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from kube import DEMO, NAMESPACE, RELEASE, ROOT, Kubectl, eventually, missing_reason, sh  # noqa: E402


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).resolve().parent
    mine = [i for i in items if here in Path(str(i.path)).resolve().parents]
    reason = missing_reason() if mine else None
    for item in mine:
        item.add_marker(pytest.mark.kind)
        if reason:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def kubeconfig() -> Iterator[Path]:
    name = os.environ.get("PDSTACK_E2E_CLUSTER", "pdstack-e2e")
    existing = sh("kind", "get", "clusters").stdout.split()
    created = name not in existing
    if created:
        sh("kind", "create", "cluster", "--name", name, "--config", str(ROOT / "e2e/kind-cluster.yaml"),
           "--wait", "180s", timeout=900)
    tag = os.environ.get("TAG", "dev")
    images = [f"pdstack-operator:{tag}", f"pdstack-runtime:{tag}"]
    if any(sh("docker", "image", "inspect", i, check=False).returncode != 0 for i in images):
        sh(str(ROOT / "images/build.sh"), "--no-smoke", timeout=3600)
    for image in images:
        sh("kind", "load", "docker-image", image, "--name", name, timeout=900)
    tmp = Path(tempfile.mkdtemp(prefix="pdstack-e2e-"))
    path = tmp / "kubeconfig"
    path.write_text(sh("kind", "get", "kubeconfig", "--name", name).stdout)
    try:
        yield path
    finally:
        if created and os.environ.get("PDSTACK_E2E_KEEP") != "1":
            sh("kind", "delete", "cluster", "--name", name, check=False, timeout=300)


@pytest.fixture(scope="session")
def kube(kubeconfig: Path) -> Iterator[Kubectl]:
    """The chart installed (kind values: local images, the example PDDeployment), its pair Ready."""
    k = Kubectl(kubeconfig, NAMESPACE)
    tag = os.environ.get("TAG", "dev")
    k.helm("upgrade", "--install", RELEASE, str(ROOT / "charts/pdstack"), "--create-namespace",
           "-f", str(ROOT / "charts/pdstack/ci/kind-values.yaml"),
           "--set", f"operator.image.tag={tag}", "--set", f"runtime.image.tag={tag}",
           "--wait", "--timeout", "10m")
    eventually(lambda: k.json("get", "pddeployment", DEMO).get("status", {}).get("phase") == "Ready",
               timeout=900, what=f"PDDeployment {DEMO} phase Ready")
    yield k
    if os.environ.get("PDSTACK_E2E_KEEP") != "1":
        k.helm("uninstall", RELEASE, "--wait", timeout=300)
