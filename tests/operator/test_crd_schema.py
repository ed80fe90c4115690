"""The CRD's openAPIV3Schema rejects bad manifests with a useful message; the examples pass.

The OpenAPI subset is converted to JSON Schema: ``nullable`` becomes a null type, and objects
with declared properties reject unknown fields (as kubectl's default strict field validation
does) unless they preserve unknown fields.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CRD = yaml.safe_load((ROOT / "crds" / "pddeployment.yaml").read_text())


def to_json_schema(node: Any) -> Any:
    if isinstance(node, list):
        return [to_json_schema(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: to_json_schema(v) for k, v in node.items() if not k.startswith("x-kubernetes-") and k != "nullable"}
    if node.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    if node.get("type") == "object" and "properties" in node and not node.get("x-kubernetes-preserve-unknown-fields"):
        out.setdefault("additionalProperties", False)
    return out


VERSION = CRD["spec"]["versions"][0]
SCHEMA = to_json_schema(VERSION["schema"]["openAPIV3Schema"])
VALIDATOR = jsonschema.Draft202012Validator(SCHEMA)


def errors(manifest: dict[str, Any]) -> list[str]:
    return sorted(f"{'.'.join(str(p) for p in e.absolute_path)}: {e.message}" for e in VALIDATOR.iter_errors(manifest))


def good() -> dict[str, Any]:
    return {"apiVersion": "pdstack.io/v1alpha1", "kind": "PDDeployment", "metadata": {"name": "x"},
            "spec": {"image": "img", "pairs": 2, "prefill": {"resources": {"gpus": 1, "requests": {"cpu": "4"}}},
                     "decode": {"resources": {"gpus": 1}, "env": [{"name": "A", "value": "1"}]}}}


def test_crd_identity_status_subresource_printer_columns_and_short_name():
    assert CRD["spec"]["group"] == "pdstack.io" and VERSION["name"] == "v1alpha1"
    assert CRD["spec"]["names"]["kind"] == "PDDeployment" and "pdd" in CRD["spec"]["names"]["shortNames"]
    assert VERSION["subresources"] == {"status": {}, "scale": {"specReplicasPath": ".spec.pairs",
                                                                "statusReplicasPath": ".status.replicas",
                                                                "labelSelectorPath": ".status.selector"}}
    cols = [c["name"] for c in VERSION["additionalPrinterColumns"]]
    assert {"Pairs", "Ready", "Revision", "Drift", "Age"} <= set(cols)


@pytest.mark.parametrize("path", sorted((ROOT / "examples").glob("*.yaml")), ids=lambda p: p.name)
def test_examples_pass_the_schema(path):
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d and d.get("kind") == "PDDeployment"]
    assert docs, f"{path} holds no PDDeployment"
    for doc in docs:
        assert errors(doc) == []


def _set(manifest: dict[str, Any], dotted: str, value: Any) -> dict[str, Any]:
    m = copy.deepcopy(manifest)
    node = m
    keys = dotted.split(".")
    for k in keys[:-1]:
        node = node.setdefault(k, {})
    if value is _DELETE:
        node.pop(keys[-1])
    else:
        node[keys[-1]] = value
    return m


_DELETE = object()


@pytest.mark.parametrize("dotted,value,expected", [
    ("spec.image", _DELETE, "spec: 'image' is a required property"),
    ("spec.engine", "tgi", "spec.engine: 'tgi' is not one of ['pdrt', 'sglang', 'vllm']"),
    ("spec.router.kind", "dynamo", "spec.router.kind: 'dynamo' is not one of ['pdstack', 'sglang', 'vllm']"),
    ("spec.vllm.nixlSideChannelPort", 80, "spec.vllm.nixlSideChannelPort: 80 is less than the minimum of 1024"),
    ("spec.pairs", -1, "spec.pairs: -1 is less than the minimum of 0"),
    ("spec.pairs", "2", "spec.pairs: '2' is not of type 'integer'"),
    ("spec.prefill.replicas", 17, "spec.prefill.replicas: 17 is greater than the maximum of 16"),
    ("spec.decode.resources.gpus", 1.5, "spec.decode.resources.gpus: 1.5 is not of type 'integer'"),
    ("spec.decode.env", [{"value": "x"}], "spec.decode.env.0: 'name' is a required property"),
    ("spec.decode.env", [{"name": "1BAD", "value": "x"}], "spec.decode.env.0.name: '1BAD' does not match"),
    ("spec.kernel.maxKVSplits", 0, "spec.kernel.maxKVSplits: 0 is less than the minimum of 1"),
    ("spec.kernel.attentionBackend", "cuda", "spec.kernel.attentionBackend: 'cuda' is not one of"),
    ("spec.coRestart.policy", "Decode", "spec.coRestart.policy: 'Decode' is not one of ['Pair', 'Never']"),
    ("spec.drift.policy", "Ignore", "spec.drift.policy: 'Ignore' is not one of ['Report', 'Revert']"),
    ("spec.rollout.maxUnavailablePairs", 0, "spec.rollout.maxUnavailablePairs: 0 is less than the minimum of 1"),
    ("spec.watchdog.transferTimeoutSeconds", 0, "spec.watchdog.transferTimeoutSeconds: 0 is less than the minimum"),
    ("spec.router.resources.gpus", 1, "spec.router.resources.gpus: 1 is greater than the maximum of 0"),
    ("spec.router.routing.policy", "cache_aware", "spec.router.routing.policy: 'cache_aware' is not one of "
     "['least-load', 'round-robin', 'prefix']"),
    ("spec.router.routing.cacheThreshold", 2, "spec.router.routing.cacheThreshold: 2 is greater than the maximum"),
    ("spec.pair", 2, "spec: Additional properties are not allowed ('pair' was unexpected)"),
])
def test_schema_rejects_bad_manifest_with_a_useful_message(dotted, value, expected):
    errs = errors(_set(good(), dotted, value))
    assert errs, f"schema accepted {dotted}={value!r}"
    assert any(expected in e for e in errs), errs


def test_good_manifest_passes_and_quantities_accept_int_or_string():
    m = _set(good(), "spec.prefill.resources.limits", {"cpu": 8, "memory": "32Gi"})
    assert errors(m) == []
    assert errors(_set(good(), "spec.router.routing", {"policy": "prefix", "balanceAbsThreshold": 4})) == []
