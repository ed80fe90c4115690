"""The one typed place where the runtime reads its environment (prefix ``PDRT_``).

Every knob the runtime honours is a field of :class:`RuntimeEnv`. Nothing else in
``pdruntime`` calls ``os.environ``: servers, the engine and the kernels receive a
``RuntimeEnv`` (or values taken from it), and ``/config`` reports ``RuntimeEnv.as_config()``
so the operator can record and diff what a process actually runs with.

A bad value fails start-up with a message naming the variable, the value, and what is
accepted (``ConfigError``), never a silent fallback.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

PREFIX = "PDRT_"
ATTENTION_BACKENDS = ("auto", "triton", "cpu", "torch")
#: ``--weights``: fp32 (the dtype's own), int4 and int8 (CPU, fp32), auto (int4 on AVX-512 VNNI, else fp32)
WEIGHT_FORMATS = ("auto", "fp32", "int4", "int8")

#: families of variables ``/config`` reports as the process sees them (drift against the declared spec)
REPORTED_PREFIXES = ("PDRT_", "SGLANG_", "NCCL_", "CUDA_", "TORCH_")
REDACTED = "<redacted>"
_SECRET_WORDS = ("TOKEN", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL", "PRIVATE", "APIKEY", "API_KEY",
                 "ACCESS_KEY", "AUTH")
_PATH_SUFFIXES = ("_FILE", "_PATH", "_DIR")
_URL_USERINFO = re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*://)[^/@\s]+@")


def is_secret_name(name: str) -> bool:
    """A variable whose value is a secret: its name says so (``*_TOKEN``, ``*PASSWORD*``, ``*_KEY`` ...).
    A path to a secret (``*_FILE``/``*_PATH``/``*_DIR``) is not itself one."""
    n = name.upper()
    if n.endswith(_PATH_SUFFIXES):
        return False
    return any(w in n for w in _SECRET_WORDS) or n.endswith("_KEY")


def parse_allow_list(raw: str | None) -> tuple[str, ...]:
    """``PDRT_REPORT_ENV``: comma-separated names, a trailing ``*`` for a prefix (``HF_HUB_OFFLINE,OMP_*``)."""
    out = []
    for item in (raw or "").split(","):
        item = item.strip()
        if not item:
            continue
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*\*?", item):
            raise ConfigError(f"{PREFIX}REPORT_ENV item {item!r} is not accepted; accepted: comma-separated "
                              "variable names, each optionally ending in * for a prefix")
        out.append(item)
    return tuple(out)


def env_report(environ: Mapping[str, str], allow: tuple[str, ...] = ()) -> dict[str, str]:
    """The env a process actually sees, for every ``PDRT_*``/``SGLANG_*``/``NCCL_*``/``CUDA_*``/``TORCH_*``
    variable plus the ``allow`` list (exact names or ``PREFIX*``), sorted; secret values redacted (by
    name, and credentials inside URLs)."""
    exact = {a for a in allow if not a.endswith("*")}
    prefixes = REPORTED_PREFIXES + tuple(a[:-1] for a in allow if a.endswith("*"))
    out: dict[str, str] = {}
    for k in sorted(environ):
        if k in exact or k.startswith(prefixes):
            v = environ[k]
            out[k] = REDACTED if is_secret_name(k) else _URL_USERINFO.sub(r"\g<scheme>" + REDACTED + "@", v)
    return out


class ConfigError(ValueError):
    """A PDRT_* variable (or equivalent flag) has a value the runtime cannot accept."""


def _int(env: Mapping[str, str], name: str, default: int, *, lo: int, hi: int) -> int:
    raw = env.get(PREFIX + name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw.strip())
    except ValueError:
        raise ConfigError(f"{PREFIX}{name}={raw!r} is not an integer; accepted: an integer in [{lo}, {hi}]") from None
    if not lo <= value <= hi:
        raise ConfigError(f"{PREFIX}{name}={value} is out of range; accepted: an integer in [{lo}, {hi}]")
    return value


def _float(env: Mapping[str, str], name: str, default: float, *, lo: float, hi: float) -> float:
    raw = env.get(PREFIX + name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = float(raw.strip())
    except ValueError:
        raise ConfigError(f"{PREFIX}{name}={raw!r} is not a number; accepted: seconds in [{lo}, {hi}]") from None
    if not lo <= value <= hi or value != value:
        raise ConfigError(f"{PREFIX}{name}={value} is out of range; accepted: seconds in [{lo}, {hi}]")
    return value


def _choice(env: Mapping[str, str], name: str, default: str, choices: tuple[str, ...]) -> str:
    raw = env.get(PREFIX + name)
    if raw is None or raw.strip() == "":
        return default
    value = raw.strip().lower()
    if value not in choices:
        raise ConfigError(f"{PREFIX}{name}={raw!r} is not accepted; accepted: {', '.join(choices)}")
    return value


def _opt_str(env: Mapping[str, str], name: str) -> str | None:
    raw = env.get(PREFIX + name)
    return raw if raw not in (None, "") else None


# ---- test-only fault knobs ---------------------------------------------------------------------------
# They make a healthy process misbehave on purpose, so that tests (and a canary rollout under test) can
# show that pdstack catches the fault. Never set them in production; a process with one on logs a WARNING
# at start-up, and /config reports them with the rest of the PDRT_* env.
FAULT_KNOBS = {
    # decode: every PD request after the N-th on one incoming HTTP connection stalls after its KV arrives (no
    # token, no watchdog) until it is aborted or its client goes away; one-shot requests on fresh connections
    # pass, multi-round agents on keep-alive connections hang from round N+1
    "FAULT_DECODE_STALL_AFTER": "fault_decode_stall_after",
}


def _fault_knobs(env: Mapping[str, str]) -> dict[str, Any]:
    """Unset = off (0); set, an integer >= 1."""
    return {"fault_decode_stall_after": _int(env, "FAULT_DECODE_STALL_AFTER", 0, lo=1, hi=1 << 30)}


@dataclass(frozen=True)
class RuntimeEnv:
    """Effective PDRT_* configuration of one runtime process."""

    # kernels: paged split-K decode attention
    attention_backend: str = "auto"  # auto | triton | cpu | torch
    decode_target_ctas: int = 0  # CTAs to aim for per decode step; 0 = derive from the device (SMs x waves)
    max_kv_splits: int = 32  # upper bound on KV splits per sequence

    # model
    model: str | None = None  # path to a GGUF file or HF-layout directory; None = default SmolLM2

    # PD watchdogs, seconds
    bootstrap_timeout_s: float = 30.0  # prefill: decode peer never attached
    transfer_timeout_s: float = 60.0  # prefill: KV ready -> receipt confirmed (transfer phase only)
    decode_transfer_timeout_s: float = 60.0  # decode: KV ready (prefill's HEADER) -> KV verified
    prefill_stall_s: float = 60.0  # decode, before the KV is ready: prefill sent no progress for this long
    watchdog_tick_s: float = 0.5  # watchdog period; runs without traffic

    # KV-transfer authentication (per-deployment shared token)
    kv_auth_token: str | None = field(default=None, repr=False)
    kv_auth_token_file: str | None = None

    # engine failure containment (server/worker/engine_runner.py)
    engine_max_step_failures: int = 5  # consecutive failing steps (not tied to a request) before exit
    engine_failure_exit_grace_s: float = 2.0  # unhealthy (/health 503) -> process exit

    # identity reported in /health (set per process by `pdrt up`; default: pid + random)
    instance_id: str | None = None
    parent_pid: int = 0  # set by `pdrt up`: exit when this parent is gone (0 = no parent watch)

    # extra variables /config reports besides the PDRT_/SGLANG_/NCCL_/CUDA_/TORCH_ families (PDRT_REPORT_ENV)
    report_env: tuple[str, ...] = ()

    # test-only: enables POST /debug/test on workers (advance the watchdog clock, stall transfers)
    test_hooks: bool = False

    # test-only fault knob (PDRT_FAULT_DECODE_STALL_AFTER, see FAULT_KNOBS): 0 = off
    fault_decode_stall_after: int = 0

    def __post_init__(self) -> None:
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ConfigError(
                f"attention backend {self.attention_backend!r} is not accepted; accepted: {', '.join(ATTENTION_BACKENDS)}"
            )

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> "RuntimeEnv":
        env = os.environ if environ is None else environ
        # an unset variable takes the field's default: defaults live only in the class body above (the operator's
        # spec.py must agree; tests/operator/test_single_source.py holds them together)
        d = cls()
        return cls(
            attention_backend=_choice(env, "ATTENTION_BACKEND", d.attention_backend, ATTENTION_BACKENDS),
            decode_target_ctas=_int(env, "DECODE_TARGET_CTAS", d.decode_target_ctas, lo=0, hi=1 << 16),
            max_kv_splits=_int(env, "MAX_KV_SPLITS", d.max_kv_splits, lo=1, hi=1024),
            model=_opt_str(env, "MODEL"),
            bootstrap_timeout_s=_float(env, "BOOTSTRAP_TIMEOUT_S", d.bootstrap_timeout_s, lo=0.01, hi=86400.0),
            transfer_timeout_s=_float(env, "TRANSFER_TIMEOUT_S", d.transfer_timeout_s, lo=0.01, hi=86400.0),
            decode_transfer_timeout_s=_float(env, "DECODE_TRANSFER_TIMEOUT_S", d.decode_transfer_timeout_s, lo=0.01,
                                             hi=86400.0),
            prefill_stall_s=_float(env, "PREFILL_STALL_S", d.prefill_stall_s, lo=0.01, hi=86400.0),
            watchdog_tick_s=_float(env, "WATCHDOG_TICK_S", d.watchdog_tick_s, lo=0.001, hi=60.0),
            kv_auth_token=_opt_str(env, "KV_AUTH_TOKEN"),
            kv_auth_token_file=_opt_str(env, "KV_AUTH_TOKEN_FILE"),
            engine_max_step_failures=_int(env, "ENGINE_MAX_STEP_FAILURES", d.engine_max_step_failures, lo=1, hi=100000),
            engine_failure_exit_grace_s=_float(env, "ENGINE_FAILURE_EXIT_GRACE_S", d.engine_failure_exit_grace_s,
                                               lo=0.0, hi=600.0),
            instance_id=_opt_str(env, "INSTANCE_ID"),
            parent_pid=_int(env, "PARENT_PID", d.parent_pid, lo=0, hi=(1 << 31) - 1),
            report_env=parse_allow_list(env.get(PREFIX + "REPORT_ENV")),
            test_hooks=_choice(env, "TEST_HOOKS", "0", ("0", "1")) == "1",
            **_fault_knobs(env),
        )

    def replace(self, **changes: Any) -> "RuntimeEnv":
        return dataclasses.replace(self, **changes)

    def resolve_kv_auth_token(self) -> str | None:
        """The KV-transfer token: the variable wins, else the file's stripped contents."""
        if self.kv_auth_token:
            return self.kv_auth_token
        if self.kv_auth_token_file:
            try:
                with open(self.kv_auth_token_file, encoding="utf-8") as fh:
                    token = fh.read().strip()
            except OSError as exc:
                raise ConfigError(f"{PREFIX}KV_AUTH_TOKEN_FILE={self.kv_auth_token_file!r} cannot be read: {exc}") from None
            if not token:
                raise ConfigError(f"{PREFIX}KV_AUTH_TOKEN_FILE={self.kv_auth_token_file!r} is empty; accepted: a file holding the token")
            return token
        return None

    def as_config(self) -> dict[str, Any]:
        """Effective values for ``/config``; secrets are redacted."""
        out = dataclasses.asdict(self)
        out["kv_auth_token"] = "<redacted>" if self.kv_auth_token else None
        out["report_env"] = list(self.report_env)
        # what the process really sees (webhook- or sidecar-injected variables included), for drift
        out["process_env"] = env_report(os.environ, self.report_env)
        return out
