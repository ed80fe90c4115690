"""The engines' own metric names, one table per engine, and their translation to pdrt's names.

SGLang: python/sglang/srt/metrics/collector.py (sgl-project/sglang) -- gauges ``sglang:num_running_reqs``,
``sglang:num_queue_reqs``, the PD-disaggregation queue gauges ``sglang:num_prefill_prealloc_queue_reqs``
(the prefill bootstrap queue; newer releases also name it ``sglang:num_prefill_bootstrap_queue_reqs``),
``sglang:num_prefill_inflight_queue_reqs``, ``sglang:num_decode_prealloc_queue_reqs``,
``sglang:num_decode_transfer_queue_reqs``; counters ``sglang:prompt_tokens_total``,
``sglang:generation_tokens_total``.
vLLM: vllm/v1/metrics/loggers.py (vllm-project/vllm) -- gauges ``vllm:num_requests_running``,
``vllm:num_requests_waiting``; counters ``vllm:prompt_tokens`` and ``vllm:generation_tokens`` (exposed with
the ``_total`` suffix prometheus_client adds to a Counter's sample). vLLM has no PD queue gauges.

A metric the engine does not expose is unknown (None), never 0."""

from __future__ import annotations

from typing import Mapping

from prometheus_client.parser import text_string_to_metric_families

#: pdrt quantity -> (sample names the engine may expose, in preference order)
SGLANG: Mapping[str, tuple[str, ...]] = {
    "running": ("sglang:num_running_reqs",),
    "waiting": ("sglang:num_queue_reqs",),
    "bootstrap": ("sglang:num_prefill_bootstrap_queue_reqs", "sglang:num_prefill_prealloc_queue_reqs"),
    "inflight": ("sglang:num_prefill_inflight_queue_reqs",),
    "prealloc": ("sglang:num_decode_prealloc_queue_reqs",),
    "transfer": ("sglang:num_decode_transfer_queue_reqs",),
    "prompt_tokens": ("sglang:prompt_tokens_total",),
    "generation_tokens": ("sglang:generation_tokens_total",),
}
VLLM: Mapping[str, tuple[str, ...]] = {
    "running": ("vllm:num_requests_running",),
    "waiting": ("vllm:num_requests_waiting",),
    "prompt_tokens": ("vllm:prompt_tokens_total",),
    "generation_tokens": ("vllm:generation_tokens_total",),
}
TABLES = {"sglang": SGLANG, "vllm": VLLM}
#: the queue stages ``/debug/requests`` reports, per role (stall.py PRE_DECODE names them)
STAGES = {"prefill": ("running", "waiting", "bootstrap", "inflight"),
          "decode": ("running", "waiting", "prealloc", "transfer")}


def sample_sums(text: str) -> dict[str, float]:
    """Every sample of a Prometheus text, summed over its labels (one value per engine, any number of
    ``engine``/``model_name`` label sets). Raises ValueError on text that is not the exposition format."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def translate(engine: str, text: str | None) -> dict[str, float | None]:
    """The pdrt quantities of ``TABLES[engine]`` from the engine's ``/metrics`` text (None: unreadable)."""
    table = TABLES[engine]
    try:
        sums = sample_sums(text) if text is not None else {}
    except ValueError:
        sums = {}
    out: dict[str, float | None] = {}
    for key, names in table.items():
        out[key] = next((sums[n] for n in names if n in sums), None)
    return out
