"""100 PDDeployments on the test cluster (bench/operator_scale.py): the operator creates every child within 60 s
of the last apply and reacts to a pod deletion within 5 s, right after the mass create and once idle."""

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
    assert r["children_s"] < 60, r
    assert r["reaction_after_create_s"] < 5, r
    assert r["reaction_idle_s"] < 5, r
