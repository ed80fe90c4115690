"""What each engine does with pdstack's watchdog fields and kernel knobs (pure).

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

``spec.kernel`` is pdrt's (``PDRT_*`` env, which SGLang and vLLM do not read). A knob set away from its default is
rendered to the engine's own flag where the engine has one for the same thing, and otherwise reported as not
enforced (Event ``KernelMapping``); a knob at its default declares nothing and leaves the engine's own default
(so an operator upgrade renders unchanged lines for every spec that never set one):

- ``attentionBackend``: SGLang's ``--attention-backend`` (``triton``; ``torch`` is its ``torch_native``;
  python/sglang/srt/arg_groups/choices.py), vLLM's ``--attention-backend`` (``triton`` is ``TRITON_ATTN``, ``cpu``
  its ``CPU_ATTN``; vllm/v1/attention/backends/registry.py);
- ``maxKVSplits``: SGLang's ``--triton-attention-num-kv-splits`` (its Triton decode kernel's flash-decoding
  splits, default 8); vLLM has no such flag;
- ``decodeTargetCTAs``: neither engine has one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from .spec import KernelKnobs, PDSpec, WatchdogSpec

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


def _json(cls: type, attr: str) -> str:
    """The spec's JSON name of a modelled field of ``cls``."""
    return cls.__dataclass_fields__[attr].metadata["knob"].json


@dataclass(frozen=True)
class EngineMapping:
    """What an engine does with one section of the spec (``spec.watchdog``, ``spec.kernel``): the fields rendered
    to its own settings, and those nothing enforces (its Event says both)."""

    engine: str
    enforced: tuple[tuple[str, str], ...]  # (spec.<section>.<field>, the engine's setting)
    unenforced: tuple[str, ...]  # spec.<section>.<field> nothing enforces
    note: str  # what the engine does instead
    flags: tuple[str, ...] = ()  # rendered on both roles' engine command lines

    @property
    def message(self) -> str:
        done = ", ".join(f"{f} -> {knob}" for f, knob in self.enforced) or "none"
        return (f"engine {self.engine}: enforced by the engine: {done}; not enforced by {self.engine}: "
                f"{', '.join(self.unenforced) or 'none'}; {self.note}")


def watchdog_mapping(spec: PDSpec) -> EngineMapping | None:
    """Which ``spec.watchdog`` fields the engine enforces and which it does not; None for pdrt (all of them)."""
    table = WATCHDOG_KNOBS.get(spec.engine)
    if table is None:
        return None
    enforced = tuple((f"spec.watchdog.{_json(WatchdogSpec, a)}", knob) for a, knob in table.items())
    unenforced = tuple(f"spec.watchdog.{_json(WatchdogSpec, f.name)}" for f in fields(WatchdogSpec)
                       if f.name not in table)
    return EngineMapping(spec.engine, enforced, unenforced, ENGINE_NOTE[spec.engine])


#: engine -> {KernelKnobs attribute: (the engine's own flag, {our value: its value}, or None: the value as given)};
#: a knob an engine has no entry for is reported as not enforced there
KERNEL_FLAGS: dict[str, dict[str, tuple[str, dict[str, str] | None]]] = {
    "sglang": {"attention_backend": ("--attention-backend", {"triton": "triton", "torch": "torch_native"}),
               "max_kv_splits": ("--triton-attention-num-kv-splits", None)},
    "vllm": {"attention_backend": ("--attention-backend", {"triton": "TRITON_ATTN", "cpu": "CPU_ATTN"})},
}


def kernel_mapping(spec: PDSpec) -> EngineMapping | None:
    """The engine's flags for the ``spec.kernel`` knobs set away from their defaults, and those it has none for;
    None for pdrt (it reads every knob itself) and when no knob is set."""
    table = KERNEL_FLAGS.get(spec.engine)
    if table is None:
        return None
    flags: list[str] = []
    enforced: list[tuple[str, str]] = []
    unenforced: list[str] = []
    for f in fields(KernelKnobs):
        value = getattr(spec.kernel, f.name)
        if value == f.default:
            continue
        name = f"spec.kernel.{_json(KernelKnobs, f.name)}={value}"
        flag, values = table.get(f.name, (None, None))
        arg = None if flag is None else str(value) if values is None else values.get(value)
        if arg is None:
            unenforced.append(name)
        else:
            flags += [flag, arg]
            enforced.append((name, f"{flag} {arg}"))
    if not enforced and not unenforced:
        return None
    return EngineMapping(spec.engine, tuple(enforced), tuple(unenforced),
                         f"the others are pdrt's PDRT_* knobs, which {spec.engine} does not read", tuple(flags))


def vllm_kv_lease_s(spec: PDSpec) -> int:
    """vLLM's ``kv_lease_duration`` from ``transferTimeoutSeconds``: whole seconds, rounded up (vLLM takes an int)."""
    return math.ceil(spec.watchdog.transfer_timeout_s)
