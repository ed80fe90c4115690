"""engine: vllm as rendered (examples/pddeployment-vllm.yaml): every worker command line is parsed by vLLM's own
argument parser (the ``vllm serve`` subcommand's, from the vllm package installed by ``make vllm-parser``; skipped
with the reason when it is not installed), the NIXL connector and side channel as llm-d deploys them, the pdstack
agent sidecar as the same UID, the NetworkPolicy's NIXL port between workers only, pdstack's router in vLLM's
protocol, the watchdog mapping, and the spec's and the CRD's rules for spec.vllm and spec.router.kind."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml

import emu_apiext as apiext
from pdoperator.cli.kubectl_pd import render_manifest
from pdoperator.core.engines import kernel_mapping, watchdog_mapping
from pdoperator.core.spec import SpecError, parse_spec
from vllm_parser import import_vllm

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = yaml.safe_load((ROOT / "examples" / "pddeployment-vllm.yaml").read_text())
CRD = yaml.safe_load((ROOT / "crds" / "pddeployment.yaml").read_text())
SCHEMA = CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def _objs(doc=EXAMPLE):
    return render_manifest(doc)


def _pods(doc=EXAMPLE):
    return [o for o in _objs(doc) if o["kind"] == "Pod"]


def _with(**spec):
    doc = copy.deepcopy(EXAMPLE)
    doc["spec"].update(spec)
    return doc


# ---------------------------------------------------------------- vLLM's own parser
def _vllm_serve_parser():
    """The parser ``vllm serve`` parses its command line with, built as vLLM 0.33's ServeSubcommand.subparser_init
    builds it (vllm/entrypoints/cli/serve.py: a ``serve`` subparser of vLLM's FlexibleArgumentParser filled by
    vllm/entrypoints/common/cli_args.py make_arg_parser: the positional model, the OpenAI server's options and every
    AsyncEngineArgs option), without importing serve.py itself, which imports the whole engine at module level.
    Its defaults need a platform: VLLM_TARGET_DEVICE=cpu, vLLM's own switch, while it is imported
    (tests/support/vllm_parser.py)."""
    cli_args, argparse_utils = import_vllm("vllm.entrypoints.common.cli_args", "vllm.utils.argparse_utils")
    parser = argparse_utils.FlexibleArgumentParser(prog="vllm")
    cli_args.make_arg_parser(parser.add_subparsers(dest="subparser").add_parser("serve"))
    validate_parsed_serve_args = cli_args.validate_parsed_serve_args
    return parser, validate_parsed_serve_args


def _parse(parser, cmd):
    parser, validate = parser
    assert cmd[:2] == ["vllm", "serve"], cmd
    args = parser.parse_args(cmd[1:])  # argparse exits (SystemExit) on anything vLLM does not accept
    validate(args)  # what ServeSubcommand.validate checks before serving
    return args


def test_every_worker_line_is_parsed_by_vllms_own_parser():
    parser = _vllm_serve_parser()
    pods = _pods()
    assert len(pods) == 2 * 2
    for pod in pods:
        a = _parse(parser, pod["spec"]["containers"][0]["command"])
        assert a.model_tag == "/models/Llama-3.1-8B-Instruct" and a.served_model_name == ["llama"]
        assert a.host == "0.0.0.0" and a.port == 8000 and a.tensor_parallel_size == 2
        assert a.dtype == "bfloat16" and a.max_model_len == 32768 and a.gpu_memory_utilization == 0.9
        kv = a.kv_transfer_config  # vLLM parses the JSON into its KVTransferConfig
        assert (kv.kv_connector, kv.kv_role) == ("NixlConnector", "kv_both"), kv
        # spec.watchdog.transferTimeoutSeconds 120: prefill's KV lease (engines.py)
        assert kv.get_from_extra_config("kv_lease_duration", None) == 120
    # every optional flag the spec can render, parsed too
    doc = _with(prefixCache={"enabled": False}, vllm={"enforceEager": True, "maxModelLen": 4096})
    doc["spec"]["model"]["dtype"] = "fp16"
    doc["spec"]["decode"]["args"] = ["--max-num-seqs", "64"]
    for pod in _pods(doc):
        a = _parse(parser, pod["spec"]["containers"][0]["command"])
        assert a.enable_prefix_caching is False and a.enforce_eager is True and a.dtype == "float16"
        assert a.max_model_len == 4096


# ---------------------------------------------------------------- the rendered pod
def _kv_config(pod):
    cmd = pod["spec"]["containers"][0]["command"]
    return json.loads(cmd[cmd.index("--kv-transfer-config") + 1])


def test_nixl_side_channel_and_vllms_own_kv_lease_from_the_typed_spec():
    cmds = set()
    for pod in _pods():
        c = pod["spec"]["containers"][0]
        env = {e["name"]: e.get("value", e.get("valueFrom")) for e in c["env"]}
        assert env == {"VLLM_NIXL_SIDE_CHANNEL_HOST": {"fieldRef": {"fieldPath": "status.podIP"}},
                       "VLLM_NIXL_SIDE_CHANNEL_PORT": "5600"}  # pdrt's PDRT_* knobs mean nothing to vLLM
        # spec.watchdog.transferTimeoutSeconds 120 -> prefill's KV lease (decode heartbeats at a sixth of it)
        assert _kv_config(pod) == {"kv_connector": "NixlConnector", "kv_role": "kv_both",
                                   "kv_connector_extra_config": {"kv_lease_duration": 120}}
        assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
        assert c["readinessProbe"]["timeoutSeconds"] == 5
        cmds.add(tuple(c["command"]))
    assert len(cmds) == 1  # kv_both: prefill and decode run the same line


def test_fractional_transfer_timeout_rounds_up_to_vllms_whole_seconds():
    doc = _with(watchdog={"transferTimeoutSeconds": 0.5, "tickSeconds": 0.1})
    assert {_kv_config(p)["kv_connector_extra_config"]["kv_lease_duration"] for p in _pods(doc)} == {1}


def test_the_agent_sidecar_runs_beside_vllm_as_the_same_uid():
    for pod in _pods():
        spec = pod["spec"]
        role = pod["metadata"]["labels"]["pdstack.io/role"]
        engine, agent = spec["containers"][:2]
        assert spec["shareProcessNamespace"] is True
        assert agent["name"] == "pdstack-agent" and agent["image"] == "ghcr.io/pdstack/runtime:0.1.0"
        assert agent["command"] == ["pdrt", "agent", "--engine", "vllm", "--role", role, "--host", "0.0.0.0",
                                    "--port", "8090", "--engine-url", "http://127.0.0.1:8000",
                                    "--model-path", "/models/Llama-3.1-8B-Instruct", "--report-env", "VLLM_*"]
        assert agent["ports"] == [{"name": "agent", "containerPort": 8090}]
        assert agent["readinessProbe"]["httpGet"] == {"path": "/health", "port": "agent"}
        assert agent["resources"]["limits"] == {"cpu": "500m", "memory": "256Mi"}
        sc = agent["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"] == {"drop": ["ALL"]}
        assert sc["runAsNonRoot"] is True and sc["seccompProfile"] == {"type": "RuntimeDefault"}
        # /proc/PID/environ of the engine is readable by the same UID only
        assert sc["runAsUser"] == engine["securityContext"]["runAsUser"] == spec["securityContext"]["runAsUser"]
        assert {"name": "model", "mountPath": "/models", "readOnly": True} in agent["volumeMounts"]


@pytest.mark.parametrize("where", ["podSecurityContext", "securityContext"])
def test_a_uid_override_moves_engine_and_agent_together(where):
    doc = copy.deepcopy(EXAMPLE)
    doc["spec"]["decode"][where] = {"runAsUser": 2000}
    decode = next(p for p in _pods(doc) if p["metadata"]["labels"]["pdstack.io/role"] == "decode")
    engine, agent = decode["spec"]["containers"][:2]
    assert engine["securityContext"]["runAsUser"] == agent["securityContext"]["runAsUser"] == 2000


# the NetworkPolicy (NIXL side channel between workers only, the agent's port for the router and the operator) is
# evaluated connection by connection in test_render_network.py, for both engines


def test_pdstack_router_fronts_vllm_in_vllms_protocol():
    objs = _objs()
    dep = next(o for o in objs if o["kind"] == "Deployment")
    c = dep["spec"]["template"]["spec"]["containers"][0]
    cmd = c["command"]
    assert cmd[:4] == ["pdrt", "serve", "--role", "router"]
    i = cmd.index("--worker-protocol")
    assert cmd[i:i + 4] == ["--worker-protocol", "vllm", "--worker-agent-port", "8090"]
    assert c["image"] == "ghcr.io/pdstack/runtime:0.1.0"  # the runtime image, not vLLM's
    assert any(o["kind"] == "Secret" and o["metadata"]["name"] == "vl-router-admin" for o in objs)


def test_watchdog_fields_vllm_has_no_timeout_for_are_named():
    m = watchdog_mapping(parse_spec(EXAMPLE["spec"], name="vl"))
    assert m.enforced == (("spec.watchdog.transferTimeoutSeconds",
                           "--kv-transfer-config kv_connector_extra_config.kv_lease_duration (prefill's KV lease)"),)
    assert m.unenforced == ("spec.watchdog.bootstrapTimeoutSeconds", "spec.watchdog.decodeTransferTimeoutSeconds",
                            "spec.watchdog.prefillStallSeconds", "spec.watchdog.tickSeconds")
    assert m.message.startswith("engine vllm: enforced by the engine: spec.watchdog.transferTimeoutSeconds -> "
                                "--kv-transfer-config kv_connector_extra_config.kv_lease_duration (prefill's KV "
                                "lease); not enforced by vllm: ")
    assert watchdog_mapping(parse_spec({"image": "pdrt:1"})) is None  # pdrt enforces every field itself


# ---------------------------------------------------------------- the spec's and the CRD's rules
BAD = [
    ({"engine": "sglang", "vllm": {"enforceEager": True}},
     "spec.vllm is set but spec.engine is 'sglang'; accepted: spec.vllm only with engine 'vllm'",
     "spec.vllm is only accepted with spec.engine 'vllm'"),
    ({"router": {"kind": "vllm"}}, "spec.router.kind='vllm' is not rendered: vLLM ships no PD router command",
     "spec.router.kind 'vllm' is not rendered"),
    ({"router": {"kind": "sglang"}}, "spec.router.kind='sglang' with engine 'vllm'; accepted: kind sglang only "
     "with engine sglang", "spec.router.kind 'sglang' is only accepted with engine 'sglang'"),
    ({"runtimeImage": None}, "spec.runtimeImage is required with engine 'vllm'",
     "spec.runtimeImage is required with engine sglang or vllm"),
    ({"model": {"servedName": "x"}}, "spec.model.source is required with engine 'vllm'",
     "spec.model.source is required with engine sglang or vllm"),
]


@pytest.mark.parametrize("change,operator_says,cel_says", BAD, ids=[b[2][:40] for b in BAD])
def test_spec_and_crd_reject_what_vllm_cannot_take(change, operator_says, cel_says):
    raw = copy.deepcopy(EXAMPLE["spec"])
    for k, v in change.items():
        if v is None:
            raw.pop(k)
        elif k == "router":
            raw["router"] = {**raw.get("router", {}), **v}
        else:
            raw[k] = v
    with pytest.raises(SpecError) as e:
        parse_spec(raw, name="vl")
    assert any(operator_says in p for p in e.value.problems), e.value.problems
    obj = {"spec": copy.deepcopy(raw)}
    apiext.apply_defaults(obj, SCHEMA, {})
    messages = [c.message for c in apiext.validate(obj, SCHEMA, {})]
    assert any(cel_says in m for m in messages), messages


def test_the_example_passes_the_crds_cel_rules():
    obj = {"spec": copy.deepcopy(EXAMPLE["spec"])}
    apiext.apply_defaults(obj, SCHEMA, {})
    assert apiext.validate(obj, SCHEMA, {}) == []


def test_kernel_knobs_set_are_vllms_own_attention_backend_and_the_rest_is_named():
    """spec.kernel.attentionBackend triton -> vLLM's own ``--attention-backend TRITON_ATTN`` (parsed by vLLM's
    parser into its backend enum); maxKVSplits and decodeTargetCTAs, which vLLM has no flag for, are named in the
    KernelMapping Event; the example (no knob set) renders no such flag."""
    parser = _vllm_serve_parser()
    (registry,) = import_vllm("vllm.v1.attention.backends.registry")
    doc = _with(kernel={"attentionBackend": "triton", "maxKVSplits": 8})
    for pod in _pods(doc):
        a = _parse(parser, pod["spec"]["containers"][0]["command"])
        assert a.attention_backend == "TRITON_ATTN" and registry.AttentionBackendEnum[a.attention_backend]
    assert registry.AttentionBackendEnum["CPU_ATTN"]  # what attentionBackend cpu renders to
    m = kernel_mapping(parse_spec(doc["spec"], name="vl"))
    assert m.enforced == (("spec.kernel.attentionBackend=triton", "--attention-backend TRITON_ATTN"),)
    assert m.unenforced == ("spec.kernel.maxKVSplits=8",)
    torch = kernel_mapping(parse_spec(_with(kernel={"attentionBackend": "torch"})["spec"], name="vl"))
    assert (torch.flags, torch.unenforced) == ((), ("spec.kernel.attentionBackend=torch",))
    assert kernel_mapping(parse_spec(EXAMPLE["spec"], name="vl")) is None
    assert all(_parse(parser, p["spec"]["containers"][0]["command"]).attention_backend is None for p in _pods())
