"""docs/metrics.md lists exactly the pdrt_ metrics the servers define."""

from __future__ import annotations

import os
import re

from pdruntime.server.metrics import Metrics

DOC = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "metrics.md")


def test_every_metric_is_documented_and_every_documented_metric_exists():
    # prometheus_client strips "_total" from counter family names; exposition adds it back
    defined = {m.name + "_total" if m.type == "counter" else m.name for m in Metrics("decode").registry.collect()}
    with open(DOC) as fh:
        documented = set(re.findall(r"^\| `(pdrt_[a-z0-9_]+)`", fh.read(), flags=re.M))
    assert defined == documented, (defined - documented, documented - defined)
    assert all(n.startswith("pdrt_") for n in defined)
