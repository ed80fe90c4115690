"""100 PDDeployments on the test cluster (bench/operator_scale.py): the operator creates every child, and answers a
pod deletion (a co-restart), right after the mass create and once idle.

The issue's targets are 60 s to every child and 5 s per reaction; the bounds here are generous hang catchers for a
shared 2-core machine (docs/benchmarks.md has the measured figures and the load they ran under). A reaction left
to the operator's periodic resync (RESYNC_S, 30 s) instead of the pod watch would be uniform over 0-30 s: two
reactions both under 15 s happen by chance a quarter of the time at most."""

from __future__ import annotations

import importlib.util
import shutil

import pytest

from testcluster import ROOT

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not (ROOT / ".tools" / "bin" / "kubectl").exists() and not shutil.which("kubectl"),
                                 reason="kubectl not installed (make tools)")]


def _bench():
    spec = importlib.util.spec_from_file_location("operator_scale", ROOT / "bench" / "operator_scale.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.timeout(900)
def test_100_pddeployments_get_their_children_and_a_pod_deletion_is_answered_at_once(tmp_path):
    r = _bench().run(100, tmp_path)
    print(r)
    assert r["children_s"] < 120, r
    assert r["reaction_after_create_s"] < 15, r
    assert r["reaction_idle_s"] < 15, r
