"""engine: sglang as rendered is what SGLang accepts: every worker and router command line parsed by SGLang's
own argparse (``sglang.srt.server_args.ServerArgs.add_cli_args``, ``sglang_router.router_args.RouterArgs``),
the transfer backend explicit, and the NetworkPolicy admits the ports SGLang opens between a group's pods."""

from __future__ import annotations

import argparse
import functools
import os
from pathlib import Path

import pytest
import yaml

from pdoperator.cli.kubectl_pd import render_manifest
from pdoperator.core.engines import kernel_mapping
from pdoperator.core.spec import parse_spec

EXAMPLE = yaml.safe_load((Path(__file__).resolve().parents[2] / "examples" / "sglang-groups.yaml").read_text())


@functools.cache
def _parsers():
    """(sglang.srt.server_args, sglang_router.router_args), imported on first use: in the pytest process that runs
    this file only (importing sglang.srt costs ~4 CPU s; at collection, every xdist worker paid it). Importing sglang
    rewrites os.environ (it points TRITON_CACHE_DIR, CUDA_CACHE_PATH, ... at its own cache dir): restored, or every
    process later tests start inherits those (test_process_drift_live.py reports them as drift)."""
    env = dict(os.environ)
    try:
        return (pytest.importorskip("sglang.srt.server_args", reason="sglang (installed --no-deps by `make setup`) "
                                    "provides SGLang's own argument parser"),
                pytest.importorskip("sglang_router.router_args", reason="sglang-router is in the dev extra"))
    finally:
        os.environ.clear()
        os.environ.update(env)


def _children(doc=EXAMPLE):
    return render_manifest(doc)


def _sglang_parse(cmd):
    assert cmd[:3] == ["python", "-m", "sglang.launch_server"], cmd
    parser = argparse.ArgumentParser(prog="sglang.launch_server")
    _parsers()[0].ServerArgs.add_cli_args(parser)
    return parser.parse_args(cmd[3:])  # argparse exits (SystemExit) on anything SGLang does not accept


def test_every_worker_line_is_parsed_by_sglangs_own_argparse():
    pods = [o for o in _children() if o["kind"] == "Pod"]
    assert len(pods) == 2 * 3  # 2 groups x (1 prefill + 2 decodes)
    for pod in pods:
        a = _sglang_parse(pod["spec"]["containers"][0]["command"])
        role = pod["metadata"]["labels"]["pdstack.io/role"]
        assert a.disaggregation_mode == role and a.tp_size == 2 and a.port == 8000
        assert a.disaggregation_transfer_backend == "nixl"  # explicit, never SGLang's RDMA default
        assert a.model_path == "/models/Llama-3.1-8B-Instruct" and a.served_model_name == "llama"
        if role == "prefill":
            assert a.disaggregation_bootstrap_port == 8998
        else:
            assert a.mem_fraction_static == 0.85


def test_a_disabled_prefix_cache_is_sglangs_own_disable_radix_cache():
    doc = {**EXAMPLE, "spec": {**EXAMPLE["spec"], "prefixCache": {"enabled": False}}}
    pods = [o for o in _children(doc) if o["kind"] == "Pod"]
    assert pods and all(_sglang_parse(p["spec"]["containers"][0]["command"]).disable_radix_cache for p in pods)
    assert not any(_sglang_parse(p["spec"]["containers"][0]["command"]).disable_radix_cache
                   for p in _children() if p["kind"] == "Pod")  # the default leaves SGLang's radix cache on


def test_the_router_line_is_parsed_by_sglang_routers_own_argparse_with_every_member():
    doc = yaml.safe_load(yaml.safe_dump(EXAMPLE))
    doc["spec"]["router"]["kind"] = "sglang"
    objs = _children(doc)
    assert not any(o["kind"] == "Secret" and o["metadata"]["name"].endswith("-router-admin") for o in objs)
    dep = next(o for o in objs if o["kind"] == "Deployment")
    assert dep["spec"]["template"]["spec"]["containers"][0]["image"] == "lmsysorg/sglang:v0.5.3"
    cmd = dep["spec"]["template"]["spec"]["containers"][0]["command"]
    assert cmd[:3] == ["python", "-m", "sglang_router.launch_router"]
    parser = argparse.ArgumentParser()
    _parsers()[1].RouterArgs.add_cli_args(parser)
    a = parser.parse_args(cmd[3:])
    assert a.pd_disaggregation and a.port == 8000
    assert [p[0] for p in a.prefill] == [f"http://sg-{k}-prefill.sg-workers.serving.svc:8000" for k in (0, 1)]
    assert all(p[1] == "8998" for p in a.prefill)
    assert sorted(d[0] for d in a.decode) == sorted(f"http://sg-{k}-{s}.sg-workers.serving.svc:8000"
                                                    for k in (0, 1) for s in ("decode", "decode-1"))


def test_pdstack_router_is_the_default_in_sglangs_protocol_from_the_runtime_image():
    dep = next(o for o in _children() if o["kind"] == "Deployment")
    c = dep["spec"]["template"]["spec"]["containers"][0]
    i = c["command"].index("--worker-protocol")
    assert c["command"][:4] == ["pdrt", "serve", "--role", "router"]
    assert c["command"][i:i + 4] == ["--worker-protocol", "sglang", "--worker-agent-port", "8090"]
    assert c["image"] == "ghcr.io/pdstack/runtime:0.1.0"


def test_every_sglang_worker_has_the_agent_and_exposes_its_metrics():
    for pod in (o for o in _children() if o["kind"] == "Pod"):
        role = pod["metadata"]["labels"]["pdstack.io/role"]
        engine, agent = pod["spec"]["containers"][:2]
        assert _sglang_parse(engine["command"]).enable_metrics  # the agent translates SGLang's /metrics
        assert pod["spec"]["shareProcessNamespace"] is True
        assert agent["name"] == "pdstack-agent" and agent["command"][:6] == ["pdrt", "agent", "--engine", "sglang",
                                                                           "--role", role]
        assert agent["securityContext"]["runAsUser"] == engine["securityContext"]["runAsUser"] == 10001
        assert {"name": "models", "mountPath": "/models", "readOnly": True} in agent["volumeMounts"]


def test_mooncake_over_rdma_passes_the_ib_device_and_rdma_resources():
    doc = yaml.safe_load(yaml.safe_dump(EXAMPLE))
    doc["spec"]["sglang"] = {"transferBackend": "mooncake", "ibDevice": "mlx5_0", "rdmaResources": {"rdma/ib": "1"}}
    for pod in (o for o in _children(doc) if o["kind"] == "Pod"):
        c = pod["spec"]["containers"][0]
        a = _sglang_parse(c["command"])
        assert a.disaggregation_transfer_backend == "mooncake" and a.disaggregation_ib_device == "mlx5_0"
        assert c["resources"]["requests"]["rdma/ib"] == c["resources"]["limits"]["rdma/ib"] == "1"


def _admits(policy, from_labels, port):
    """Does this NetworkPolicy admit TCP to ``port`` from a pod with ``from_labels`` (same namespace)?"""
    for rule in policy["spec"]["ingress"]:
        peers = rule.get("from") or []
        ok_peer = not peers or any(all(from_labels.get(k) == v for k, v in
                                       p["podSelector"].get("matchLabels", {}).items()) for p in peers)
        ok_port = not rule.get("ports") or any(p["port"] <= port <= p.get("endPort", p["port"])
                                               for p in rule["ports"])
        if ok_peer and ok_port:
            return True
    return False


def test_network_policy_admits_sglang_bootstrap_and_zmq_ports_between_group_pods_only():
    objs = _children()
    pol = next(o for o in objs if o["kind"] == "NetworkPolicy")
    worker = next(o for o in objs if o["kind"] == "Pod")["metadata"]["labels"]
    router = next(o for o in objs if o["kind"] == "Deployment")["spec"]["template"]["metadata"]["labels"]
    stranger = {"app": "other"}
    for port in (8000, 8998, 5757, 17001, 40123):  # HTTP, bootstrap, ZMQ / transfer ports SGLang picks at runtime
        assert _admits(pol, worker, port), port
    assert _admits(pol, router, 8000) and not _admits(pol, router, 17001)  # the router needs HTTP ...
    assert _admits(pol, router, 8090)  # ... and the agents' /debug/requests
    assert not any(_admits(pol, stranger, p) for p in (8000, 8998, 17001))
    # pdrt keeps the two fixed ports only
    pdrt = yaml.safe_load(yaml.safe_dump(EXAMPLE))
    pdrt["spec"]["engine"] = "pdrt"
    del pdrt["spec"]["sglang"], pdrt["spec"]["runtimeImage"]
    pol = next(o for o in render_manifest(pdrt) if o["kind"] == "NetworkPolicy")
    assert _admits(pol, worker, 8998) and not _admits(pol, worker, 17001)


def test_sglang_probes_fit_its_generating_health_check():
    pod = next(o for o in _children() if o["kind"] == "Pod")
    c = pod["spec"]["containers"][0]
    assert c["readinessProbe"]["timeoutSeconds"] >= 10 and c["livenessProbe"]["timeoutSeconds"] >= 10
    assert c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"] >= 2400


def test_kernel_knobs_set_are_sglangs_own_flags_and_the_rest_is_named():
    """spec.kernel is pdrt's (PDRT_* env, which SGLang does not read): a knob set away from its default is rendered
    to SGLang's own flag where it has one, parsed by SGLang's argparse, and one it has none for is named in the
    KernelMapping Event; knobs left at their defaults render the line they always did (no rollout on upgrade)."""
    kernel = {"attentionBackend": "torch", "maxKVSplits": 16, "decodeTargetCTAs": 512}
    doc = {**EXAMPLE, "spec": {**EXAMPLE["spec"], "kernel": kernel}}
    pods = [o for o in _children(doc) if o["kind"] == "Pod"]
    for pod in pods:
        a = _sglang_parse(pod["spec"]["containers"][0]["command"])
        assert (a.attention_backend, a.triton_attention_num_kv_splits) == ("torch_native", 16)
    m = kernel_mapping(parse_spec(doc["spec"], name="sg"))
    assert m.enforced == (("spec.kernel.maxKVSplits=16", "--triton-attention-num-kv-splits 16"),
                          ("spec.kernel.attentionBackend=torch", "--attention-backend torch_native"))
    assert m.unenforced == ("spec.kernel.decodeTargetCTAs=512",)
    assert m.message.endswith("; not enforced by sglang: spec.kernel.decodeTargetCTAs=512; the others are pdrt's "
                              "PDRT_* knobs, which sglang does not read")
    cpu = kernel_mapping(parse_spec({**doc["spec"], "kernel": {"attentionBackend": "cpu"}}, name="sg"))
    assert (cpu.flags, cpu.unenforced) == ((), ("spec.kernel.attentionBackend=cpu",))  # pdstack's own C kernel
    assert kernel_mapping(parse_spec(EXAMPLE["spec"], name="sg")) is None
    for pod in (o for o in _children() if o["kind"] == "Pod"):
        a = _sglang_parse(pod["spec"]["containers"][0]["command"])
        assert (a.attention_backend, a.triton_attention_num_kv_splits) == (None, 8)  # SGLang's own defaults
