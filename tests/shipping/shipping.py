"""Helpers for the shipping checks: find the tools (`make tools` puts them in .tools/bin), render the chart."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "pdstack"
TOOLS_BIN = ROOT / ".tools" / "bin"
# default values plus every file under ci/ (each one a supported way to install)
VALUES_FILES: list[Path | None] = [None] + sorted((CHART / "ci").glob("*.yaml"))


def tool(name: str) -> str:
    """Path of ``name`` (.tools/bin first, then PATH); skips the test, saying how to get it, when missing."""
    local = TOOLS_BIN / name
    if local.exists():
        return str(local)
    found = shutil.which(name)
    if found:
        return found
    pytest.skip(f"{name} not installed: `make tools` installs helm, kubectl and promtool into .tools/bin")


def run(cmd: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, **kw)


def values_id(values: Path | None) -> str:
    return "default" if values is None else values.name


MONITORING_API = "monitoring.coreos.com/v1"  # the Prometheus Operator's CRDs


def render(values: Path | None = None, *sets: str, namespace: str = "pdstack-system", release: str = "pd",
           api_versions: tuple[str, ...] = (MONITORING_API,), lifecycle_hooks: bool = False) -> list[dict[str, Any]]:
    """``helm template`` (CRDs and ``helm test`` hooks included) parsed into objects, in output order; rendered as
    for a cluster that serves ``api_versions`` (default: one with the Prometheus Operator's CRDs; ``()``: without
    them). ``lifecycle_hooks``: also the install/upgrade/delete hooks (templates/hooks.yaml), left out by default:
    they exist only while a hook runs, not as part of the installed release."""
    cmd = [tool("helm"), "template", release, str(CHART), "--namespace", namespace, "--include-crds"]
    for v in api_versions:
        cmd += ["--api-versions", v]
    if values is not None:
        cmd += ["-f", str(values)]
    for s in sets:
        cmd += ["--set", s]
    out = run(cmd)
    assert out.returncode == 0, f"helm template failed:\n{out.stderr}"
    objs = [d for d in yaml.safe_load_all(out.stdout) if d]
    return objs if lifecycle_hooks else [o for o in objs if not is_hook(o) or hook_events(o) == {"test"}]


def hook_events(obj: dict[str, Any]) -> set[str]:
    return set(((obj.get("metadata") or {}).get("annotations") or {}).get("helm.sh/hook", "").split(",")) - {""}


def by_kind(objs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objs if o.get("kind") == kind]


def one(objs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = by_kind(objs, kind)
    assert len(found) == 1, f"expected one {kind}, got {[o['metadata']['name'] for o in found]}"
    return found[0]


def is_hook(obj: dict[str, Any]) -> bool:
    return "helm.sh/hook" in ((obj.get("metadata") or {}).get("annotations") or {})
