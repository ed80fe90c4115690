"""What each engine does with pdstack's typed knobs it has no flag for (pure).

pdrt enforces every ``spec.watchdog`` field itself (``PDRT_*`` env). SGLang and vLLM have watchdogs of their
own, with their own names and scopes; where one guards the same phase as a pdstack field, the field is
rendered to it, and every other field is reported as not enforced (Event ``WatchdogMapping``): a declared
safeguard that nothing applies must not look like one that holds.

vLLM (vllm/envs.py, vllm/distributed/kv_transfer/kv_connector/v1/nixl_connector.py):
``VLLM_NIXL_ABORT_REQUEST_TIMEOUT`` (seconds, an int): how long prefill keeps a finished request's KV blocks
for decode to read before it frees them -- the KV-transfer phase only, as ``transferTimeoutSeconds``.
vLLM has no bootstrap, decode-side transfer or prefill-stall timeout of its own.

SGLang (python/sglang/srt/environ.py, srt/disaggregation/common/conn.py):
``SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT`` and ``SGLANG_DISAGGREGATION_WAITING_TIMEOUT`` (300 s each) exist but
also bound time spent queued for memory, so pdstack's shorter defaults would abort requests that only wait;
they are left to the user's env and the fields reported as not enforced.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from .spec import PDSpec, WatchdogSpec

#: engine -> {WatchdogSpec attribute: (the engine's env variable, the role that reads it)}
WATCHDOG_ENV: dict[str, dict[str, tuple[str, str]]] = {
    "vllm": {"transfer_timeout_s": ("VLLM_NIXL_ABORT_REQUEST_TIMEOUT", "prefill")},
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
    enforced: tuple[tuple[str, str, str], ...]  # (spec.watchdog.<field>, the engine's env, role)
    unenforced: tuple[str, ...]  # spec.watchdog.<field> nothing enforces

    @property
    def message(self) -> str:
        done = ", ".join(f"{f} -> {env} ({role})" for f, env, role in self.enforced) or "none"
        return (f"engine {self.engine}: enforced by the engine: {done}; not enforced by {self.engine}: "
                f"{', '.join(self.unenforced) or 'none'}; {ENGINE_NOTE[self.engine]}")


def watchdog_mapping(spec: PDSpec) -> WatchdogMapping | None:
    """Which ``spec.watchdog`` fields the engine enforces and which it does not; None for pdrt (all of them)."""
    table = WATCHDOG_ENV.get(spec.engine)
    if table is None:
        return None
    enforced = tuple((f"spec.watchdog.{_json(a)}", env, role) for a, (env, role) in table.items())
    unenforced = tuple(f"spec.watchdog.{_json(f.name)}" for f in fields(WatchdogSpec) if f.name not in table)
    return WatchdogMapping(spec.engine, enforced, unenforced)


def watchdog_env(spec: PDSpec, role: str) -> list[dict[str, str]]:
    """The engine's own timeout variables for ``role``, from ``spec.watchdog`` (whole seconds, rounded up: the
    engines parse ints)."""
    return [{"name": env, "value": str(math.ceil(getattr(spec.watchdog, attr)))}
            for attr, (env, r) in WATCHDOG_ENV.get(spec.engine, {}).items() if r == role]
