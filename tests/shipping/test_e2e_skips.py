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
