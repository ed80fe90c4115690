"""Golden tests of render(): the exact children for the examples and an SGLang deployment.

Regenerate after an intended change with ``PDSTACK_UPDATE_GOLDEN=1`` and review the diff.
"""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest
import yaml

from pdoperator.cli import kubectl_pd as cli
from pdoperator.core.render import Owner, TopologyPair, topology_yaml, worker_pod
from pdoperator.core.revisions import revision_hash
from pdoperator.core.spec import SpecError, parse_spec

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).resolve().parent / "golden"
UPDATE = os.environ.get("PDSTACK_UPDATE_GOLDEN") == "1"

SGLANG = {"apiVersion": "pdstack.io/v1alpha1", "kind": "PDDeployment",
          "metadata": {"name": "sg", "namespace": "serving"},
          "spec": {"engine": "sglang", "image": "lmsysorg/sglang:v0.4", "pairs": 2, "router": {"kind": "sglang"},
                   "runtimeImage": "ghcr.io/pdstack/runtime:0.1.0",
                   "model": {"source": "meta-llama/Llama-3.1-8B-Instruct", "servedName": "llama"},
                   "prefill": {"resources": {"gpus": 2}}, "decode": {"resources": {"gpus": 2},
                                                                    "args": ["--mem-fraction-static", "0.85"]}}}


def _cases():
    for path in sorted((ROOT / "examples").glob("*.yaml")):
        yield path.stem, yaml.safe_load(path.read_text())
    yield "sglang", SGLANG


@pytest.mark.parametrize("case,doc", list(_cases()), ids=[c for c, _ in _cases()])
def test_render_matches_golden(case, doc):
    out = io.StringIO()
    rendered = yaml.safe_dump_all(cli.render_manifest(doc), sort_keys=False, explicit_start=True)
    golden = GOLDEN / f"{case}.yaml"
    if UPDATE:
        GOLDEN.mkdir(exist_ok=True)
        golden.write_text(rendered)
    assert golden.exists(), f"missing {golden}; run with PDSTACK_UPDATE_GOLDEN=1 and review it"
    assert rendered == golden.read_text(), f"render() changed for {case}; if intended, regenerate and review"
    if case != "sglang":  # `kubectl-pd render FILE` prints exactly that
        assert cli.main(["render", str(ROOT / "examples" / f"{case}.yaml")], out=out) == 0
        assert out.getvalue() == rendered


def test_cli_rejects_an_invalid_manifest_with_the_reasons(tmp_path, capsys):
    bad = dict(SGLANG, spec=dict(SGLANG["spec"], model={}, pairs=-1))
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(bad))
    assert cli.main(["render", str(path)], out=io.StringIO()) == 1
    err = capsys.readouterr().err
    assert "PDDeployment/sg: spec.pairs=-1 is invalid; accepted: an integer in [0, 256]" in err
    assert "spec.model.source is required with engine 'sglang'" in err


def test_sglang_command_lines_are_sglangs_own():
    spec = parse_spec(SGLANG["spec"], name="sg")
    owner = Owner("sg", "serving", "u")
    prefill = worker_pod(spec, owner, "r", 0, "prefill", "x")["spec"]["containers"][0]["command"]
    decode = worker_pod(spec, owner, "r", 1, "decode", "x")["spec"]["containers"][0]["command"]
    assert prefill[:3] == ["python", "-m", "sglang.launch_server"]
    assert prefill[prefill.index("--disaggregation-mode") + 1] == "prefill"
    assert prefill[prefill.index("--disaggregation-bootstrap-port") + 1] == "8998"
    assert prefill[prefill.index("--tp-size") + 1] == "2"
    assert decode[decode.index("--disaggregation-mode") + 1] == "decode"
    assert decode[-2:] == ["--mem-fraction-static", "0.85"]
    docs = cli.render_manifest(SGLANG)
    router = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"]["containers"][0]["command"]
    assert router[:4] == ["python", "-m", "sglang_router.launch_router", "--pd-disaggregation"]
    i = router.index("--prefill")
    assert router[i + 1:i + 3] == ["http://sg-0-prefill.sg-workers.serving.svc:8000", "8998"]
    assert "http://sg-1-decode.sg-workers.serving.svc:8000" in router


def test_pdrt_command_lines_follow_the_runtime_convention():
    doc = yaml.safe_load((ROOT / "examples" / "gpu-8x-pairs.yaml").read_text())
    spec = parse_spec(doc["spec"], name="llm")
    owner = Owner("llm", "inference", "u")
    pod = worker_pod(spec, owner, revision_hash(spec), 1, "prefill", "abc")
    c = pod["spec"]["containers"][0]
    assert c["command"] == ["pdrt", "serve", "--role", "prefill", "--host", "0.0.0.0", "--port", "8000",
                            "--bootstrap-port", "8998", "--model", "/models/llama-3.1-8b-instruct",
                            "--served-model-name", "llama-3.1-8b-instruct",
                            "--device", "cuda", "--dtype", "auto", "--tensor-parallel-size", "4"]
    assert c["resources"]["requests"]["nvidia.com/gpu"] == "4" and c["resources"]["limits"]["nvidia.com/gpu"] == "4"
    env = {e["name"]: e["value"] for e in c["env"]}
    assert env["PDRT_KV_AUTH_TOKEN_FILE"] == "/etc/pdstack/kv-auth/token"
    assert env["PDRT_MAX_KV_SPLITS"] == "32" and env["PDRT_ATTENTION_BACKEND"] == "triton"
    labels = pod["metadata"]["labels"]
    assert labels["pdstack.io/pair"] == "1" and labels["pdstack.io/role"] == "prefill"
    assert labels["pdstack.io/deployment"] == "llm" and labels["pdstack.io/revision"] == revision_hash(spec)
    assert pod["spec"]["nodeSelector"] == {"nvidia.com/gpu.count": "8"}
    assert pod["spec"]["priorityClassName"] == "inference-critical"
    assert pod["spec"]["tolerations"][0]["key"] == "nvidia.com/gpu"


def test_tensor_parallel_size_defaults_to_gpus_and_must_match_across_the_pair():
    doc = yaml.safe_load((ROOT / "examples" / "gpu-8x-pairs.yaml").read_text())
    raw = doc["spec"]
    owner = Owner("llm", "inference", "u")

    def cmd(spec, role):
        return worker_pod(spec, owner, revision_hash(spec), 0, role, "abc")["spec"]["containers"][0]["command"]

    base = parse_spec(raw, name="llm")
    assert (base.prefill.tp_size, base.decode.tp_size) == (4, 4)
    explicit = parse_spec({**raw, "model": {**raw["model"], "dtype": "fp16"},
                           "prefill": {**raw["prefill"], "tensorParallelSize": 2},
                           "decode": {**raw["decode"], "tensorParallelSize": 2}}, name="llm")
    assert cmd(explicit, "decode")[-6:] == ["--device", "cuda", "--dtype", "fp16", "--tensor-parallel-size", "2"]
    assert revision_hash(explicit) != revision_hash(base)  # an explicit TP size or dtype is a new revision
    with pytest.raises(SpecError, match="spec.prefill tensor-parallel size 2 differs from spec.decode's 4"):
        parse_spec({**raw, "prefill": {**raw["prefill"], "tensorParallelSize": 2}}, name="llm")
    with pytest.raises(SpecError, match=r"spec.decode.tensorParallelSize=8 exceeds spec.decode.resources.gpus=4"):
        parse_spec({**raw, "decode": {**raw["decode"], "tensorParallelSize": 8}}, name="llm")
    with pytest.raises(SpecError, match="spec.model.dtype"):
        parse_spec({**raw, "model": {**raw["model"], "dtype": "int4"}}, name="llm")



def test_model_weights_renders_pdrts_weights_flag_on_cpu_pods_and_is_refused_where_it_cannot_run():
    """spec.model.weights is pdrt's --weights: unset (fp32) renders the command it always did; int4 is a new revision
    with the flag on both sides of the pair; GPU pods, a non-fp32 dtype and the other engines are refused with what
    is accepted."""
    cpu = yaml.safe_load((ROOT / "examples" / "cpu-demo.yaml").read_text())["spec"]
    cpu["model"] = {k: v for k, v in cpu.get("model", {}).items() if k != "weights"}  # the example asks for auto
    gpu = yaml.safe_load((ROOT / "examples" / "gpu-8x-pairs.yaml").read_text())["spec"]
    owner = Owner("llm", "inference", "u")

    def cmd(spec, role):
        return worker_pod(spec, owner, revision_hash(spec), 0, role, "abc")["spec"]["containers"][0]["command"]

    def with_weights(raw, weights, **model):
        return {**raw, "model": {**(raw.get("model") or {}), "weights": weights, **model}}

    base = parse_spec(cpu, name="llm")
    assert base.model.weights == "fp32"
    assert all("--weights" not in cmd(base, role) for role in ("prefill", "decode"))
    assert revision_hash(parse_spec(with_weights(cpu, "fp32"), name="llm")) == revision_hash(base)
    int4 = parse_spec(with_weights(cpu, "int4"), name="llm")
    for role in ("prefill", "decode"):
        line = cmd(int4, role)
        assert line[line.index("--weights") + 1] == "int4"
    assert revision_hash(int4) != revision_hash(base)  # a new weight format is a rollout
    auto = parse_spec(with_weights(gpu, "auto"), name="llm")  # auto runs anywhere: fp32 (bf16) on GPU pods
    assert cmd(auto, "decode")[cmd(auto, "decode").index("--weights") + 1] == "auto"

    with pytest.raises(SpecError, match=r"spec.model.weights='int4' runs on CPU pods only .* "
                                        r"spec.prefill.resources.gpus=4 and spec.decode.resources.gpus=4; "
                                        r"accepted: fp32 or auto on GPU pods"):
        parse_spec(with_weights(gpu, "int4"), name="llm")
    with pytest.raises(SpecError, match=r"spec.model.weights='int8' computes in fp32, but spec.model.dtype='bf16'; "
                                        r"accepted: dtype auto or fp32"):
        parse_spec(with_weights(cpu, "int8", dtype="bf16"), name="llm")
    sglang = yaml.safe_load((ROOT / "examples" / "sglang-groups.yaml").read_text())["spec"]
    with pytest.raises(SpecError, match=r"spec.model.weights='int4' is pdstack's runtime's --weights and engine "
                                        r"'sglang' has no such flag; accepted: fp32 \(the default\)"):
        parse_spec(with_weights(sglang, "int4"), name="llm")
    with pytest.raises(SpecError, match=r"spec.model.weights='q4' is invalid; accepted: auto \| fp32 \| int4 \| int8"):
        parse_spec(with_weights(cpu, "q4"), name="llm")


@pytest.mark.parametrize("spec", [
    {"model": {"weights": "int4"}},
    {"model": {"weights": "auto"}, "prefill": {"resources": {"gpus": 1}}, "decode": {"resources": {"gpus": 1}}},
    {"model": {"weights": "int4"}, "decode": {"resources": {"gpus": 1}}},
    {"model": {"weights": "int8", "dtype": "fp32"}},
    {"model": {"weights": "int8", "dtype": "fp16"}},
    {"engine": "sglang", "runtimeImage": "r", "model": {"source": "m", "weights": "int4"}},
    {"engine": "sglang", "runtimeImage": "r", "model": {"source": "m", "weights": "fp32"}},
])
def test_the_crds_cel_rules_on_model_weights_agree_with_the_operator(spec):
    """What the API server refuses at admission (the CRD's CEL rules, run by the test cluster's evaluator) is what
    parse_spec refuses, and the other way round."""
    import copy

    import emu_apiext as apiext

    schema = yaml.safe_load((ROOT / "crds" / "pddeployment.yaml").read_text())["spec"]["versions"][0]["schema"][
        "openAPIV3Schema"]
    obj = {"spec": {"image": "i", **copy.deepcopy(spec)}}
    apiext.apply_defaults(obj, schema, {})
    cel = [c.message for c in apiext.validate(obj, schema, {}) if "weights" in c.message]
    try:
        parse_spec({"image": "i", **copy.deepcopy(spec)}, name="llm")
        refused = None
    except SpecError as exc:
        refused = [p for p in exc.problems if "weights" in p]
    assert bool(cel) == bool(refused), (cel, refused)

def test_topology_file_format():
    text = topology_yaml("abc123", [TopologyPair(0, True, "10.0.0.11", "10.0.0.12"),
                                    TopologyPair(1, True, "10.0.0.13", None),
                                    TopologyPair(2, True, "10.0.0.14", "10.0.0.15", draining=True)], generation=7)
    doc = yaml.safe_load(text)
    assert doc == {
        "version": 1, "generation": 7, "revision": "abc123",
        "pairs": [{"index": 0, "ready": True, "draining": False,
                   "prefill": {"url": "http://10.0.0.11:8000", "bootstrap_host": "10.0.0.11", "bootstrap_port": 8998},
                   "decode": {"url": "http://10.0.0.12:8000"}},
                  {"index": 1, "ready": False, "draining": False,  # a pair without a decode address is never ready
                   "prefill": {"url": "http://10.0.0.13:8000", "bootstrap_host": "10.0.0.13", "bootstrap_port": 8998},
                   "decode": {"url": None}},
                  {"index": 2, "ready": False, "draining": True,  # draining: no new requests
                   "prefill": {"url": "http://10.0.0.14:8000", "bootstrap_host": "10.0.0.14", "bootstrap_port": 8998},
                   "decode": {"url": "http://10.0.0.15:8000"}}]}
    # the router's own parser reads it: the half-created pair is skipped, the draining one is kept, not ready
    from pdruntime.server.router.topology import load_topology_text
    topo = load_topology_text(text)
    assert topo.generation == 7 and [p.index for p in topo.pairs] == [0, 2]
    assert topo.ready_pairs()[0].index == 0 and topo.draining() == [2]


def test_topology_generation_moves_only_when_the_content_changes():
    from pdoperator.core.render import topology_doc, topology_generation
    a = topology_doc("r", [TopologyPair(0, True, "10.0.0.1", "10.0.0.2")], 4)
    assert topology_generation(None, a) == 1
    assert topology_generation(a, dict(a, generation=0)) == 4
    b = topology_doc("r", [TopologyPair(0, False, "10.0.0.1", "10.0.0.2", draining=True)], 0)
    assert topology_generation(a, b) == 5


def test_cli_diff_names_the_changed_knob(tmp_path):
    doc = yaml.safe_load((ROOT / "examples" / "gpu-8x-pairs.yaml").read_text())
    changed = yaml.safe_load((ROOT / "examples" / "gpu-8x-pairs.yaml").read_text())
    changed["spec"]["kernel"]["decodeTargetCTAs"] = 512
    changed["spec"]["decode"]["env"] = [{"name": "SGLANG_SM120_MMA_TARGET_CTAS", "value": "512"}]
    changed["spec"]["pairs"] = 4  # scaling is not a config change
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text(yaml.safe_dump(doc))
    b.write_text(yaml.safe_dump(changed))
    out = io.StringIO()
    assert cli.main(["diff", str(a), str(b)], out=out) == 1
    lines = out.getvalue().splitlines()
    assert lines[2:] == ["decode.env.PDRT_DECODE_TARGET_CTAS: <unset> -> 512",
                         "decode.env.SGLANG_SM120_MMA_TARGET_CTAS: <unset> -> 512"]
    assert cli.main(["diff", str(a), str(a)], out=io.StringIO()) == 0
    valid = io.StringIO()
    assert cli.main(["validate", str(a)], out=valid) == 0 and "PDDeployment/llm: valid, revision" in valid.getvalue()
