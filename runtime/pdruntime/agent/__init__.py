"""``pdrt agent``: the pdstack sidecar in SGLang and vLLM worker pods (issue 22).

It finds the engine's process under /proc (the pod shares its process namespace), and serves what a pdrt
worker serves to the operator: ``/health``, ``/config`` (the engine process's real env, redacted by
pdruntime.env's rules; the weights' sha256), ``/metrics`` and ``/debug/requests`` translated from the
engine's own Prometheus exposition."""

AGENT_PORT = 8090  # the operator's copy: operator/pdoperator/core/spec.py AGENT_PORT
ENGINES = ("sglang", "vllm")
ROLES = ("prefill", "decode")
#: a substring of the engine's command line that finds its PID (any one matches)
DEFAULT_MATCH = {"sglang": ("sglang.launch_server",), "vllm": ("vllm serve", "vllm.entrypoints")}
