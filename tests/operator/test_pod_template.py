"""Pod template fields, secure defaults and probes, as rendered (pure): every golden render is valid
Kubernetes (kubernetes-validate, 1.29 and 1.33) and passes Pod Security ``restricted`` as rendered; secret-backed
env stays a reference everywhere (pods, router, ControllerRevision); each secure default can be overridden."""

from __future__ import annotations

import json
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from emu_semantics import psa_restricted_violations
from pdoperator.core.render import CONTAINER_SECURITY, Owner, render, worker_pod
from pdoperator.core.revisions import controller_revision, revision_hash
from pdoperator.core.spec import SpecError, parse_spec

GOLDEN = Path(__file__).resolve().parent / "golden"
SECRET_VALUE = "hf_Zq8vXUniqueSecretValue0123456789"  # what the Secret holds; must appear nowhere we render


def _pod_specs(objs):
    for o in objs:
        if o["kind"] == "Pod":
            yield o["metadata"]["name"], o["spec"]
        elif o["kind"] == "Deployment":
            yield o["metadata"]["name"], o["spec"]["template"]["spec"]


@pytest.mark.parametrize("golden", sorted(p.name for p in GOLDEN.glob("*.yaml")))
def test_every_golden_render_is_valid_kubernetes_and_pod_security_restricted(golden):
    objs = [o for o in yaml.safe_load_all((GOLDEN / golden).read_text()) if o]
    for o in objs:
        for version in ("1.29.0", "1.33.0"):
            try:
                kubernetes_validate.validate(o, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                pytest.fail(f"{golden}: {o['kind']}/{o['metadata']['name']} invalid for {version}: {e}")
    specs = list(_pod_specs(objs))
    assert len(specs) >= 3
    for name, spec in specs:
        assert psa_restricted_violations(spec) == [], f"{golden}: {name}"
        for c in spec["containers"]:
            assert c["securityContext"]["readOnlyRootFilesystem"] is True, (name, c["name"])
        assert {"name": "tmp", "emptyDir": {}} in spec["volumes"]  # writable /tmp under a read-only root
        assert spec["automountServiceAccountToken"] is False


def test_pod_security_check_is_not_vacuous():
    """The same check rejects the pre-secure-defaults pod (no securityContext) and an override to root."""
    spec = parse_spec({"image": "pdrt:1", "decode": {"securityContext": {"runAsNonRoot": False,
                                                                         "allowPrivilegeEscalation": True}}})
    pod = worker_pod(spec, Owner("x", "ns", "u"), "r", 0, "decode", "0")
    assert any("allowPrivilegeEscalation" in v for v in psa_restricted_violations(pod["spec"]))
    bare = {"containers": [{"name": "c", "image": "i"}]}
    assert len(psa_restricted_violations(bare)) == 4


SECRET_ENV = {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token"}}}


def test_secret_backed_env_is_a_reference_in_pods_and_the_controller_revision():
    raw = {"image": "pdrt:1", "pairs": 2,
           "prefill": {"env": [SECRET_ENV], "envFrom": [{"secretRef": {"name": "shared-env"}}]},
           "decode": {"env": [SECRET_ENV, {"name": "PLAIN", "value": "1"}]},
           "router": {"env": [{"name": "UPSTREAM_KEY",
                               "valueFrom": {"secretKeyRef": {"name": "router-keys", "key": "k"}}}]}}
    spec = parse_spec(raw, name="llm")
    owner = Owner("llm", "ns", "u")
    rev = revision_hash(spec)
    objs = render(spec, owner, rev, kv_token="kv", admin_token="adm")
    cr = controller_revision("llm", "ns", owner.reference(), spec, rev, 1, "2026-01-01T00:00:00Z")
    # the user's Secret, as it lives in the cluster: the operator is never handed its value
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "hf-token"},
              "stringData": {"token": SECRET_VALUE}}
    everything = json.dumps(objs + [cr])
    assert SECRET_VALUE not in everything and SECRET_VALUE in json.dumps(secret)
    pods = [o for o in objs if o["kind"] == "Pod"]
    for p in pods:
        env = p["spec"]["containers"][0]["env"]
        assert SECRET_ENV in env
    prefill = next(p for p in pods if p["metadata"]["labels"]["pdstack.io/role"] == "prefill")
    assert prefill["spec"]["containers"][0]["envFrom"] == [{"secretRef": {"name": "shared-env"}}]
    router = next(o for o in objs if o["kind"] == "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert router["env"] == [{"name": "UPSTREAM_KEY", "valueFrom": {"secretKeyRef": {"name": "router-keys", "key": "k"}}}]
    assert cr["data"]["config"]["decode"]["env"]["HF_TOKEN"] == {"valueFrom": SECRET_ENV["valueFrom"]}
    # a changed reference is a new revision; the same spec is the same revision
    other = json.loads(json.dumps(raw))
    other["decode"]["env"][0]["valueFrom"]["secretKeyRef"]["key"] = "token2"
    assert revision_hash(parse_spec(other, name="llm")) != rev
    assert revision_hash(parse_spec(raw, name="llm")) == rev


def test_role_fields_override_shared_template_and_defaults():
    spec = parse_spec({
        "image": "gpu:1",
        "podTemplate": {"imagePullSecrets": [{"name": "reg"}], "serviceAccountName": "shared",
                        "nodeSelector": {"pool": "gpu"}, "podLabels": {"team": "a"},
                        "securityContext": {"readOnlyRootFilesystem": False}},
        "decode": {"image": "gpu:2", "imagePullPolicy": "Always", "serviceAccountName": "decoder",
                   "nodeSelector": {"zone": "z1"}, "sharedMemorySize": "8Gi", "terminationGracePeriodSeconds": 120,
                   "podAnnotations": {"a": "b"}, "automountServiceAccountToken": True,
                   "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "zone",
                                                  "whenUnsatisfiable": "ScheduleAnyway"}],
                   "containers": [{"name": "proxy", "image": "envoy:1",
                                   "securityContext": {"readOnlyRootFilesystem": False}}]},
    })
    owner = Owner("x", "ns", "u")
    d = worker_pod(spec, owner, "r", 0, "decode", "0")
    p = worker_pod(spec, owner, "r", 0, "prefill", "0")
    ds, c = d["spec"], d["spec"]["containers"][0]
    assert (c["image"], c["imagePullPolicy"]) == ("gpu:2", "Always") and p["spec"]["containers"][0]["image"] == "gpu:1"
    assert ds["serviceAccountName"] == "decoder" and p["spec"]["serviceAccountName"] == "shared"
    assert ds["imagePullSecrets"] == [{"name": "reg"}] == p["spec"]["imagePullSecrets"]
    assert ds["nodeSelector"] == {"pool": "gpu", "zone": "z1"}
    assert ds["terminationGracePeriodSeconds"] == 120 and p["spec"]["terminationGracePeriodSeconds"] == 40
    assert ds["automountServiceAccountToken"] is True and p["spec"]["automountServiceAccountToken"] is False
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "8Gi"}} in ds["volumes"]
    assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    assert d["metadata"]["labels"]["team"] == "a" and d["metadata"]["annotations"]["a"] == "b"
    assert c["securityContext"] == {**CONTAINER_SECURITY, "readOnlyRootFilesystem": False}
    sidecar = ds["containers"][1]
    assert sidecar["name"] == "proxy" and sidecar["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert sidecar["securityContext"]["readOnlyRootFilesystem"] is False
    assert ds["topologySpreadConstraints"][0]["topologyKey"] == "zone"


def test_router_image_follows_the_runtime_image_unless_set():
    """No image the user never named: on kind (only loaded images) or air-gapped, a hard-coded registry tag never
    pulls. The router runs the image that has it unless spec.router.image says otherwise: spec.image for pdrt and
    for the engine's own router, spec.runtimeImage for pdstack's router (and the agent) beside SGLang or vLLM."""
    runtime, engine_image = "registry.local/pdstack/runtime:dev", "registry.local/engine:dev"
    for engine, kind, router_image in (("pdrt", "pdstack", runtime), ("sglang", "pdstack", runtime),
                                       ("vllm", "pdstack", runtime), ("sglang", "sglang", engine_image)):
        raw = {"image": runtime if engine == "pdrt" else engine_image, "engine": engine, "model": {"source": "/m"},
               "router": {"kind": kind}, **({"runtimeImage": runtime} if engine != "pdrt" else {})}
        objs = render(parse_spec(raw), Owner("x", "ns", "u"), "r", kv_token="t")
        router = next(o for o in objs if o["kind"] == "Deployment")["spec"]["template"]["spec"]["containers"][0]
        assert router["image"] == router_image, (engine, kind)
        images = {c["image"] for o in objs if o["kind"] in ("Pod", "Deployment")
                  for c in (o["spec"].get("template", o)["spec"]["containers"])}
        assert images == {runtime} | ({engine_image} if engine != "pdrt" else set()), images
    objs = render(parse_spec({"image": "runtime:cuda", "router": {"image": "mine:1"}}), Owner("x", "ns", "u"), "r",
                  kv_token="t")
    assert next(o for o in objs if o["kind"] == "Deployment")["spec"]["template"]["spec"]["containers"][0]["image"] \
        == "mine:1"


@pytest.mark.parametrize("raw,fragment", [
    ({"decode": {"env": [{"name": "A", "valueFrom": {"secretKeyRef": {"name": "s"}}}]}},
     "spec.decode.env[0].valueFrom.secretKeyRef"),
    ({"decode": {"env": [{"name": "A", "value": "x", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]}},
     "sets both value and valueFrom"),
    ({"decode": {"env": [{"name": "A", "valueFrom": {"vaultRef": {}}}]}}, "exactly one of secretKeyRef"),
    ({"prefill": {"imagePullPolicy": "Sometimes"}}, "spec.prefill.imagePullPolicy"),
    ({"prefill": {"sharedMemorySize": "lots"}}, "a quantity such as 16Gi"),
    ({"decode": {"containers": [{"name": "decode", "image": "x"}]}}, "other than"),
    ({"podTemplate": {"image": "x"}}, "spec.podTemplate.image is not a field"),
    ({"probes": {"startupSeconds": 1}}, "spec.probes.startupSeconds"),
])
def test_bad_pod_template_fields_are_rejected_with_what_is_accepted(raw, fragment):
    with pytest.raises(SpecError) as e:
        parse_spec({"image": "pdrt:1", **raw})
    assert fragment in str(e.value) and "accepted" in str(e.value)
