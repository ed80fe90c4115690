"""`pytest e2e` on a machine without docker/kind/helm skips every test and says why (exit status 0)."""

from __future__ import annotations

import os
import subprocess
import sys

from shipping import ROOT


def test_pytest_e2e_skips_cleanly_with_the_reason(tmp_path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("PATH",)}
    env["PATH"] = str(tmp_path)  # nothing there: no docker, no kind
    out = subprocess.run([sys.executable, "-m", "pytest", "e2e", "-q", "-rs", "-p", "no:cacheprovider"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert " passed" not in out.stdout and "error" not in out.stdout.lower(), out.stdout
    assert "skipped" in out.stdout
    assert "e2e needs docker, kind, kubectl, helm on PATH; missing: docker, kind" in out.stdout, out.stdout


def test_hosted_ci_workflow_runs_the_e2e_suite_on_kind() -> None:
    import yaml

    wf = yaml.safe_load((ROOT / ".github/workflows/e2e.yaml").read_text())
    steps = wf["jobs"]["kind"]["steps"]
    runs = "\n".join(s.get("run", "") for s in steps)
    assert any(str(s.get("uses", "")).startswith("helm/kind-action@") for s in steps)
    assert "make setup tools" in runs and "images/build.sh" in runs and "pytest e2e" in runs
    assert runs.index("images/build.sh") < runs.index("pytest e2e")
    assert wf["jobs"]["kind"]["timeout-minutes"] <= 90
