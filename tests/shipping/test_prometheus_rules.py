"""The chart's PrometheusRule and Grafana dashboard: promtool checks and unit tests, metric names.

The rules are taken from the rendered chart (``helm template``), so the thresholds in values.yaml and
the templating are what is tested. rules_test.yaml has, for every alert, a case where it fires and a
case where it does not (checked below); rules_annotations_test.yaml checks the rendered alert text.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from shipping import ROOT, one, render, run, tool

HERE = Path(__file__).resolve().parent
ON = "monitoring.prometheusRule.enabled=true"
# Metrics an alert or panel names that the code does not export yet, with who adds them. Each must be
# absent from the code today (else drop it from here); anything else unknown fails the test.
PENDING_METRICS: dict[str, str] = {}


def rendered_groups(*sets: str) -> list[dict[str, Any]]:
    return one(render(None, ON, *sets), "PrometheusRule")["spec"]["groups"]


def write_rules(dirpath: Path, groups: list[dict[str, Any]], *, annotations: bool = True) -> Path:
    groups = json.loads(json.dumps(groups))
    if not annotations:
        for g in groups:
            for r in g["rules"]:
                r.pop("annotations", None)
    path = dirpath / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": groups}, sort_keys=False))
    return path


def promtool_test(tmp_path: Path, test_file: str, *sets: str, annotations: bool) -> Any:
    write_rules(tmp_path, rendered_groups(*sets), annotations=annotations)
    shutil.copy(HERE / test_file, tmp_path / test_file)
    return run([tool("promtool"), "test", "rules", test_file], cwd=tmp_path)


def alert_names(groups: list[dict[str, Any]]) -> list[str]:
    return [r["alert"] for g in groups for r in g["rules"] if "alert" in r]


def test_promtool_check_rules(tmp_path: Path) -> None:
    path = write_rules(tmp_path, rendered_groups())
    out = run([tool("promtool"), "check", "rules", str(path)])
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(alert_names(rendered_groups()))} rules found" in out.stdout


def test_promtool_unit_tests_pass(tmp_path: Path) -> None:
    out = promtool_test(tmp_path, "rules_test.yaml", annotations=False)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


def test_promtool_alert_text(tmp_path: Path) -> None:
    out = promtool_test(tmp_path, "rules_annotations_test.yaml", annotations=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_every_alert_has_a_firing_and_a_quiet_case() -> None:
    cases = yaml.safe_load((HERE / "rules_test.yaml").read_text())["tests"]
    fires, quiet = set(), set()
    for case in cases:
        for t in case["alert_rule_test"]:
            (fires if t.get("exp_alerts") else quiet).add(t["alertname"])
    names = set(alert_names(rendered_groups()))
    assert names == fires, f"alerts without a firing case: {sorted(names - fires)}; unknown: {sorted(fires - names)}"
    assert names == quiet, f"alerts without a not-firing case: {sorted(names - quiet)}"
    assert {"PDStackPairCoRestartLoop", "PDStackWatchdogFiring", "PDStackKVTransferStuck", "PDStackConfigDrift",
            "PDStackRouterOldestRequestAge", "PDStackPairsNotReady"} <= names


@pytest.mark.parametrize("change", ["monitoring.prometheusRule.coRestartLoop.restarts=100",
                                    "monitoring.prometheusRule.kvTransferStuck.for=30m"])
def test_unit_tests_fail_when_a_threshold_changes(tmp_path: Path, change: str) -> None:
    """The unit tests pin the default thresholds: a different one makes them fail."""
    out = promtool_test(tmp_path, "rules_test.yaml", change, annotations=False)
    assert out.returncode != 0 and "FAILED" in out.stdout + out.stderr


# ---------------------------------------------------------------- metric names
def known_metrics() -> dict[str, str]:
    """name -> type, from docs/metrics.md (runtime) and operator/pdoperator/shell/metrics.py (operator)."""
    known: dict[str, str] = {}
    for m in re.finditer(r"^\| `(pdrt_[a-z0-9_]+)` \| (\w+) \|", (ROOT / "docs/metrics.md").read_text(), re.M):
        known[m.group(1)] = m.group(2)
    src = (ROOT / "operator/pdoperator/shell/metrics.py").read_text()
    for m in re.finditer(r"(Counter|Gauge|Histogram)\(\s*\"(pdstack_[a-z0-9_]+)\"", src):
        known[m.group(2)] = m.group(1).lower()
    assert len(known) > 20, known
    return known


def referenced(expr: str) -> set[str]:
    expr = re.sub(r'"[^"]*"', '""', expr)  # label values are not metric names
    return set(re.findall(r"\b((?:pdrt|pdstack)_[a-z0-9_]+)\b", expr))


def exprs_in_chart() -> dict[str, str]:
    objs = render(None, ON, "monitoring.grafanaDashboard.enabled=true")
    out = {f"alert {r['alert']}": r["expr"] for g in one(objs, "PrometheusRule")["spec"]["groups"] for r in g["rules"]}
    dash = json.loads(one(objs, "ConfigMap")["data"]["pdstack.json"])
    for p in dash["panels"]:
        for t in p["targets"]:
            out[f"panel {p['title']!r} {t['refId']}"] = t["expr"]
    for v in dash["templating"]["list"]:
        if v.get("type") == "query":
            out[f"variable {v['name']}"] = v["query"]
    return out


def resolve(name: str, known: dict[str, str]) -> str | None:
    if name in known:
        return name
    for suffix in ("_bucket", "_sum", "_count"):
        base = name.removesuffix(suffix)
        if name.endswith(suffix) and known.get(base) == "histogram":
            return base
    return None


def test_every_metric_an_alert_or_panel_names_exists() -> None:
    known = known_metrics()
    unknown: list[str] = []
    used: set[str] = set()
    for where, expr in exprs_in_chart().items():
        for name in referenced(expr):
            base = resolve(name, known)
            if base:
                used.add(base)
            elif name not in PENDING_METRICS:
                unknown.append(f"{where}: {name}")
    assert not unknown, ("metrics not in docs/metrics.md nor operator/pdoperator/shell/metrics.py:\n"
                         + "\n".join(unknown))
    assert len(used) >= 15, sorted(used)


def test_pending_metrics_are_really_pending() -> None:
    """A pending metric that has landed is used as a known one: it must leave PENDING_METRICS."""
    known = known_metrics()
    landed = [m for m in PENDING_METRICS if m in known]
    assert not landed, f"{landed} now exist in the code: remove them from PENDING_METRICS"


def test_metric_name_resolution_rejects_typos() -> None:
    known = known_metrics()
    assert resolve("pdrt_kv_transfer_seconds_bucket", known) == "pdrt_kv_transfer_seconds"
    assert resolve("pdrt_requests_total", known) == "pdrt_requests_total"
    assert resolve("pdrt_requests_total_bucket", known) is None  # a counter has no buckets
    assert resolve("pdrt_watchdog_fire_total", known) is None


def test_dashboard_queries_are_valid_promql(tmp_path: Path) -> None:
    """Every panel query parses as PromQL (promtool check rules on them as recording rules), with the
    Grafana variables substituted as Grafana would."""
    subst = {"$__rate_interval": "5m", "$namespace": ".*", "$deployment": ".*"}
    rules = []
    for where, expr in exprs_in_chart().items():
        if not where.startswith("panel "):
            continue
        for var, value in subst.items():
            expr = expr.replace(var, value)
        assert "$" not in expr, f"{where}: unsubstituted variable in {expr}"
        rules.append({"record": f"pdstack:dashboard:{len(rules)}", "expr": expr})
    assert len(rules) >= 12
    path = tmp_path / "dashboard-rules.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    out = run([tool("promtool"), "check", "rules", str(path)])
    assert out.returncode == 0, out.stdout + out.stderr
    # and a broken query does fail the same check
    path.write_text(yaml.safe_dump({"groups": [{"name": "d", "rules": [{"record": "x:y", "expr": "sum by (pair (up)"}]}]}))
    assert run([tool("promtool"), "check", "rules", str(path)]).returncode != 0
