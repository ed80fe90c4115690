"""The operator renders command lines and env that the runtime it deploys actually accepts."""

from pathlib import Path

import pytest
import yaml

from pdoperator.core.render import Owner, render
from pdoperator.core.revisions import revision_hash
from pdoperator.core.spec import parse_spec
from pdruntime.cli import build_parser
from pdruntime.env import RuntimeEnv

ROOT = Path(__file__).resolve().parents[2]


def _pdrt_containers(example: str):
    doc = yaml.safe_load((ROOT / "examples" / example).read_text())
    spec = parse_spec(doc["spec"], name=doc["metadata"]["name"])
    children = render(spec, Owner(doc["metadata"]["name"], "default", "u"), revision_hash(spec), kv_token="t")
    for obj in children:
        pod_spec = obj["spec"] if obj["kind"] == "Pod" else obj["spec"]["template"]["spec"] if obj["kind"] == "Deployment" else None
        for c in (pod_spec or {}).get("containers", []):
            if c.get("command", [])[:2] == ["pdrt", "serve"]:  # sidecars may have none
                yield obj["metadata"]["name"], c


@pytest.mark.parametrize("example", ["cpu-demo.yaml", "gpu-8x-pairs.yaml", "gpu-production.yaml"])
def test_every_rendered_pdrt_command_parses_with_pdrt_serve(example):
    seen = set()
    for name, c in _pdrt_containers(example):
        args = build_parser().parse_args(c["command"][1:])  # argparse exits (SystemExit) on an unknown flag
        seen.add(args.role)
        env = {e["name"]: e["value"] for e in c.get("env", []) if "value" in e}
        RuntimeEnv.from_environ(env)  # raises ConfigError on a knob value the runtime would reject at start-up
    assert seen == {"prefill", "decode", "router"}


def test_the_router_authenticates_with_its_admin_token_file_and_holds_no_kv_token():
    """The router's rendered line names the router-admin Secret's mount; its env carries no KV-transfer token."""
    routers = [c for _, c in _pdrt_containers("cpu-demo.yaml") if "router" in c["command"]]
    assert routers
    for c in routers:
        args = build_parser().parse_args(c["command"][1:])
        assert args.admin_token_file == "/etc/pdstack/router-admin/token"
        assert {m["mountPath"] for m in c["volumeMounts"]} >= {"/etc/pdstack/router-admin"}
        assert not any(e["name"].startswith("PDRT_KV_AUTH") for e in c.get("env", []))


@pytest.mark.parametrize("example, device, tp, resolved", [
    ("cpu-demo.yaml", "cpu", 1, ("cpu", "fp32")),
    ("gpu-8x-pairs.yaml", "cuda", 4, ("cuda:0", "bf16")),  # 4 GPUs per worker: TP=4 from resources.gpus
])
def test_workers_get_device_dtype_and_tp_the_runtime_resolves(example, device, tp, resolved):
    """--device/--dtype/--tensor-parallel-size as rendered, resolved by the runtime's own EngineConfig on a
    host like the pod's (8 GPUs for the GPU example): the example's TP fits its GPUs and both sides agree."""
    from pdruntime.engine import EngineConfig

    workers = 0
    for name, c in _pdrt_containers(example):
        args = build_parser().parse_args(c["command"][1:])
        if args.role == "router":
            continue
        workers += 1
        assert (args.device, args.dtype, args.tensor_parallel_size) == (device, "auto", tp), name
        cuda = device == "cuda"
        cfg = EngineConfig.resolve(device=args.device, dtype=args.dtype, cuda_graphs=args.cuda_graphs,
                                   tensor_parallel_size=args.tensor_parallel_size, cuda_available=cuda,
                                   cuda_count=8 if cuda else 0)
        assert (cfg.device, cfg.dtype, cfg.tensor_parallel_size, cfg.cuda_graphs) == (*resolved, tp, cuda)
    assert workers >= 2
