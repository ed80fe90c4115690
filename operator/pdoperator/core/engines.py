"""What each engine does with pdstack's watchdog fields (pure).

pdrt enforces every ``spec.watchdog`` field itself (``PDRT_*`` env). SGLang and vLLM have watchdogs of their
own, with their own names and scopes; where one guards the same phase as a pdstack field, the field is rendered
to it, and every other field is reported as not enforced (Event ``WatchdogMapping``): a declared safeguard that
nothing applies must not look like one that holds.

vLLM 0.33 (vllm/distributed/kv_transfer/kv_connector/v1/nixl/base_scheduler.py, base_worker.py,
pull_scheduler.py): prefill keeps a finished request's KV blocks for decode to read for ``kv_lease_duration``
seconds (``kv_connector_extra_config``, an int, default 30), a lease decode renews by heartbeat (every sixth of
it) while it still needs them; an expired lease frees the blocks ("Releasing expired KV blocks ..."). That is the
KV-transfer phase only, as ``transferTimeoutSeconds``. (Older vLLM had a fixed ``VLLM_NIXL_ABORT_REQUEST_TIMEOUT``;
0.33 reads no such variable.) vLLM has no bootstrap, decode-side transfer or prefill-stall timeout.

SGLang (python/sglang/srt/environ.py, srt/disaggregation/common/conn.py):
``SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT`` and ``SGLANG_DISAGGREGATION_WAITING_TIMEOUT`` (300 s each) exist but
also bound time spent queued for memory, so pdstack's shorter defaults would abort requests that only wait;
they are left to the user's env and the fields reported as not enforced.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from .spec import PDSpec, WatchdogSpec

#: engine -> {WatchdogSpec attribute: the engine's own setting the operator renders it to}
WATCHDOG_KNOBS: dict[str, dict[str, str]] = {
    "vllm": {"transfer_timeout_s": "--kv-transfer-config kv_connector_extra_config.kv_lease_duration "
                                   "(prefill's KV lease)"},
    "sglang": {},
}
#: one line per engine: what it does instead, for the Event
ENGINE_NOTE = {
    "vllm": "vLLM has no bootstrap, decode-transfer or prefill-stall timeout",
    "sglang": "SGLang's own SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT and SGLANG_DISAGGREGATION_WAITING_TIMEOUT "
              "(300 s unless set in spec.<role>.env) apply",
}


def _json(attr: str) -> str:
    return WatchdogSpec.__dataclass_fields__[attr].metadata["knob"].json


@dataclass(frozen=True)
class WatchdogMapping:
    engine: str
    enforced: tuple[tuple[str, str], ...]  # (spec.watchdog.<field>, the engine's setting)
    unenforced: tuple[str, ...]  # spec.watchdog.<field> nothing enforces

    @property
    def message(self) -> str:
        done = ", ".join(f"{f} -> {knob}" for f, knob in self.enforced) or "none"
        return (f"engine {self.engine}: enforced by the engine: {done}; not enforced by {self.engine}: "
                f"{', '.join(self.unenforced) or 'none'}; {ENGINE_NOTE[self.engine]}")


def watchdog_mapping(spec: PDSpec) -> WatchdogMapping | None:
    """Which ``spec.watchdog`` fields the engine enforces and which it does not; None for pdrt (all of them)."""
    table = WATCHDOG_KNOBS.get(spec.engine)
    if table is None:
        return None
    enforced = tuple((f"spec.watchdog.{_json(a)}", knob) for a, knob in table.items())
    unenforced = tuple(f"spec.watchdog.{_json(f.name)}" for f in fields(WatchdogSpec) if f.name not in table)
    return WatchdogMapping(spec.engine, enforced, unenforced)


def vllm_kv_lease_s(spec: PDSpec) -> int:
    """vLLM's ``kv_lease_duration`` from ``transferTimeoutSeconds``: whole seconds, rounded up (vLLM takes an int)."""
    return math.ceil(spec.watchdog.transfer_timeout_s)
