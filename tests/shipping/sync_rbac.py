"""Rewrite charts/pdstack/files/rbac-rules.yaml from operator/pdoperator/core/rbac.py.

    .venv/bin/python tests/shipping/sync_rbac.py          # rewrite the chart's copy
    .venv/bin/python tests/shipping/sync_rbac.py --check  # exit 1 and print the diff when they differ

rbac.py is the source (its NAMESPACED_RULES and CLUSTER_RULES are kept equal to the requests the
operator makes; cluster_wide_rules() is cluster-wide mode's ClusterRole); the chart grants exactly what
this file lists: ``namespaced`` per watched namespace, ``clusterwide`` in cluster-wide mode, ``cluster``
always.
"""

from __future__ import annotations

import difflib
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
RULES_FILE = ROOT / "charts" / "pdstack" / "files" / "rbac-rules.yaml"
HEADER = """\
# The operator's RBAC rules: a copy of operator/pdoperator/core/rbac.py (NAMESPACED_RULES, cluster_wide_rules(),
# CLUSTER_RULES).
# Values never change these: templates/rbac.yaml grants exactly this list. When rbac.py changes, run
#   .venv/bin/python tests/shipping/sync_rbac.py
# (tests/shipping/test_chart_rbac.py fails, printing the diff, until this file and rbac.py agree.)
"""


def _flow(rule: dict[str, Any]) -> str:
    parts = []
    for key in ("apiGroups", "resources", "resourceNames", "verbs", "nonResourceURLs"):
        if key in rule:
            items = ", ".join('""' if v == "" else str(v) for v in rule[key])
            parts.append(f"{key}: [{items}]")
    return "  - {" + ", ".join(parts) + "}"


def expected_text() -> str:
    sys.path.insert(0, str(ROOT / "operator"))
    from pdoperator.core import rbac

    lines = [HEADER.rstrip("\n"), "namespaced:"] + [_flow(r) for r in rbac.NAMESPACED_RULES]
    lines += ["clusterwide:"] + [_flow(r) for r in rbac.cluster_wide_rules()]
    lines += ["cluster:"] + [_flow(r) for r in rbac.CLUSTER_RULES] if rbac.CLUSTER_RULES else ["cluster: []"]
    text = "\n".join(lines) + "\n"
    parsed = yaml.safe_load(text)  # the flow style must round-trip to exactly rbac.py's rules
    assert parsed["namespaced"] == rbac.NAMESPACED_RULES and (parsed["cluster"] or []) == rbac.CLUSTER_RULES
    assert parsed["clusterwide"] == rbac.cluster_wide_rules()
    return text


def main(argv: list[str]) -> int:
    want = expected_text()
    have = RULES_FILE.read_text() if RULES_FILE.exists() else ""
    if have == want:
        print(f"{RULES_FILE.relative_to(ROOT)} matches pdoperator.core.rbac")
        return 0
    if "--check" in argv:
        sys.stdout.writelines(difflib.unified_diff(have.splitlines(True), want.splitlines(True),
                                                   "chart", "pdoperator.core.rbac"))
        return 1
    RULES_FILE.write_text(want)
    print(f"rewrote {RULES_FILE.relative_to(ROOT)} from pdoperator.core.rbac")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
