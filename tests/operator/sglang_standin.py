"""pdrt workers standing in for SGLang pods: the pods' rendered ``python -m sglang.launch_server`` line is parsed by
SGLang's own argparse (``sglang.srt.server_args.ServerArgs.add_cli_args``, installed --no-deps by ``make setup``),
and every field it sets becomes the ``pdrt serve`` flag of the same meaning. A field that pdrt has no meaning for
must be listed in :data:`IGNORED` with the reason, so a newly rendered SGLang flag fails here until somebody decides
what the stand-in does with it. The workers then speak SGLang's protocol to the router (OpenAI routes with
``bootstrap_host`` / ``bootstrap_port`` / ``bootstrap_room``), which pdrt workers serve for sglang-router too."""

from __future__ import annotations

import argparse
import os
from typing import Any

from pdop_harness import IMAGE
from test_drain_before_delete import ProcessKubelet

#: SGLang fields the stand-in accepts without a pdrt equivalent
IGNORED = {
    "disaggregation_transfer_backend": "pdrt's own KV wire moves the KV",
    "disaggregation_ib_device": "pdrt's own KV wire moves the KV",
    "enable_metrics": "pdrt always serves /metrics",
    "triton_attention_num_kv_splits": "the CPU stand-in runs no Triton decode kernel",
    "mem_fraction_static": "the stand-in's pool is sized by --max-total-tokens",
}
DTYPES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32"}


def _sglang_parser() -> argparse.ArgumentParser:
    env = dict(os.environ)  # importing sglang rewrites os.environ (its cache dirs): later processes must not see it
    try:
        from sglang.srt.server_args import ServerArgs
    finally:
        os.environ.clear()
        os.environ.update(env)
    parser = argparse.ArgumentParser(prog="sglang.launch_server", exit_on_error=False)
    ServerArgs.add_cli_args(parser)
    return parser


def pdrt_argv(cmd: list[str], ip: str) -> list[str]:
    """The ``pdrt serve`` line of a rendered SGLang worker command, bound to ``ip``, on this host's CPU."""
    assert cmd[:3] == ["python", "-m", "sglang.launch_server"], cmd
    parser = _sglang_parser()
    got = vars(parser.parse_args(cmd[3:]))
    default = vars(parser.parse_args(["--model-path", got["model_path"]]))
    changed = {k: v for k, v in got.items() if v != default[k]}
    out = ["pdrt", "serve", "--role", changed.pop("disaggregation_mode"), "--host", ip,
           "--port", str(changed.pop("port", default["port"])), "--model", changed.pop("model_path", got["model_path"]),
           "--device", "cpu"]
    changed.pop("host", None)
    if "served_model_name" in changed:
        out += ["--served-model-name", changed.pop("served_model_name")]
    if out[3] == "prefill":
        out += ["--bootstrap-port", str(changed.pop("disaggregation_bootstrap_port", default[
            "disaggregation_bootstrap_port"]))]
    changed.pop("disaggregation_bootstrap_port", None)
    if "tp_size" in changed:
        out += ["--tensor-parallel-size", str(changed.pop("tp_size"))]
    if "dtype" in changed:
        out += ["--dtype", DTYPES[changed.pop("dtype")]]
    if changed.pop("disable_radix_cache", False):
        out += ["--no-prefix-cache"]
    page = changed.pop("page_size", None) or 16
    out += ["--block-size", str(page)]
    if "max_total_tokens" in changed:
        out += ["--num-blocks", str(changed.pop("max_total_tokens") // page)]
    if "max_running_requests" in changed:
        out += ["--max-num-seqs", str(changed.pop("max_running_requests"))]
    for k in IGNORED:
        changed.pop(k, None)
    assert not changed, f"rendered SGLang fields the pdrt stand-in has no meaning for: {changed}"
    return out


class SGLangKubelet(ProcessKubelet):
    """:class:`ProcessKubelet` for ``engine: sglang`` pods: each worker a pdrt process in SGLang's place."""

    def worker_argv(self, cmd: list[str], ip: str) -> list[str]:
        return pdrt_argv(cmd, ip)


#: SGLang's own flags for the stand-in's small pool (what WORKER_ARGS sets for pdrt): 256 pages of 16 tokens
SGLANG_WORKER_ARGS = ["--page-size", "16", "--max-total-tokens", "4096", "--max-running-requests", "16"]


def sglang_spec(**extra: Any) -> dict[str, Any]:
    """The PDDeployment fields of an SGLang deployment served through pdstack's router (``router.kind`` pdstack,
    the default, spelled out); the agent sidecar's image is the emulated nodes' one image."""
    return {"engine": "sglang", "sglang": {"transferBackend": "nixl"}, "runtimeImage": IMAGE,
            "router": {"kind": "pdstack"}, **extra}
