"""Paged decode attention: public entry point, backend choice and effective kernel config.

``decode_attention`` is what the engine's decode step calls. It runs the Triton
flash-decoding kernel (``triton_decode_attention.py``) where Triton can run, pdstack's
native CPU kernel (``cpu/attention.py``, pages read in place) on the CPU, and the
vectorised torch path (``reference.py``) otherwise:

* ``PDRT_ATTENTION_BACKEND=auto`` (default): Triton when the engine's device is CUDA; on the CPU
  the native kernel when it builds here, else torch (the device comes from the engine
  configuration, never from ``torch.cuda.is_available()``). The Triton CPU interpreter is a
  test tool (orders of magnitude slower than torch), so ``auto`` never picks it, even when
  ``TRITON_INTERPRET=1`` is set.
* ``PDRT_ATTENTION_BACKEND=cpu``: the native CPU kernel; a host where it cannot be built (no C
  compiler) fails start-up with a ``ConfigError`` saying why. fp32 caches (the CPU default);
  a bf16/fp16 cache takes the torch path.
* ``PDRT_ATTENTION_BACKEND=triton``: Triton, also on CPU when Triton's interpreter is
  active (``TRITON_INTERPRET=1`` set before ``import triton``); a host where Triton
  cannot run fails start-up with a ``ConfigError``.
* ``PDRT_ATTENTION_BACKEND=torch``: torch everywhere.

The choice is made once, at start-up (``configure``), and reported with the split
knobs by ``kernel_config()`` for ``/config``. Triton itself is imported only when the
Triton backend is chosen, so importing this module stays cheap on CPU hosts.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Sequence, TypedDict, Unpack

import torch

from pdruntime.env import ConfigError, RuntimeEnv
from pdruntime.kernels.cpu.attention import cpu_decode_attention, supports
from pdruntime.kernels.reference import torch_decode_attention
from pdruntime.kernels.split_heuristic import BLOCK_N, effective_target_ctas, num_kv_splits

TRITON = "triton"
TORCH = "torch"
CPU = "cpu"


def triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_interpreter_active() -> bool:
    """True when Triton kernels can run on CPU tensors in this process.

    Triton reads ``TRITON_INTERPRET`` when a ``@triton.jit`` decorator runs, and its own
    ``tl.max``/``tl.sum``/... are decorated when ``triton`` is first imported. So the
    interpreter works only if the variable was set before that first import; checking
    the type of ``tl.max`` tells whether it was, whatever the variable says now.
    """
    if not triton_importable():
        return False
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.max, InterpretedFunction)


def _default_device() -> torch.device:
    """The device when the caller names none: cpu. The engine always names its own device; the
    host (``torch.cuda.is_available()``) is never asked which device to use."""
    return torch.device("cpu")


def cpu_kernels_unavailable() -> str | None:
    """None when pdstack's native CPU kernels build and load here, else why not."""
    from pdruntime.kernels.cpu.native import unavailable_reason

    return unavailable_reason()


def select_backend(env: RuntimeEnv, device: torch.device | str | None = None) -> str:
    """Start-up choice of the decode-attention backend: ``"triton"``, ``"cpu"`` or ``"torch"``.

    Raises ``ConfigError`` when ``PDRT_ATTENTION_BACKEND=triton`` or ``cpu`` is forced where
    it cannot run, rather than falling back silently.
    """
    device = torch.device(device) if device is not None else _default_device()
    if env.attention_backend == TORCH:
        return TORCH
    if env.attention_backend == CPU:
        if device.type != "cpu":
            raise ConfigError(f"PDRT_ATTENTION_BACKEND=cpu but the device is {device.type}; accepted here: "
                              "triton, torch or auto")
        why = cpu_kernels_unavailable()
        if why:
            raise ConfigError(f"PDRT_ATTENTION_BACKEND=cpu but pdstack's CPU kernels cannot be used here: {why}; "
                              "accepted here: torch or auto")
        return CPU
    on_cuda = device.type == "cuda" and torch.cuda.is_available()
    if env.attention_backend == TRITON:
        if not triton_importable():
            raise ConfigError("PDRT_ATTENTION_BACKEND=triton but the triton package is not installed; "
                              "accepted here: torch or auto")
        if not on_cuda and not triton_interpreter_active():
            raise ConfigError(f"PDRT_ATTENTION_BACKEND=triton but the device is {device.type} and the Triton "
                              "interpreter is not active (TRITON_INTERPRET=1 must be set before triton is "
                              "imported); accepted here: torch or auto")
        return TRITON
    if on_cuda and triton_importable():
        return TRITON
    if device.type == "cpu" and cpu_kernels_unavailable() is None:
        return CPU
    return TORCH


@dataclass(frozen=True)
class KernelConfig:
    """Effective decode-attention configuration of one process (reported at ``/config``)."""

    backend: str  # triton | cpu | torch
    device: str  # e.g. "cuda:0", "cpu"
    num_sms: int  # SMs of the CUDA device; CPU: torch threads (only used to size splits)
    target_ctas: int  # PDRT_DECODE_TARGET_CTAS as given; 0 = derive from the device
    max_splits: int  # PDRT_MAX_KV_SPLITS
    block_n: int = BLOCK_N  # KV tokens per CTA loop iteration (a "block of work")
    triton_interpreter: bool = False  # Triton runs on CPU through its interpreter (tests)

    def __post_init__(self) -> None:
        if self.backend not in (TRITON, CPU, TORCH):
            raise ConfigError(f"kernel backend {self.backend!r} is not accepted; accepted: triton, cpu, torch")
        if self.num_sms < 1 or self.max_splits < 1 or self.target_ctas < 0:
            raise ConfigError(f"num_sms={self.num_sms}, max_splits={self.max_splits} must be >= 1 and "
                              f"target_ctas={self.target_ctas} >= 0")

    @property
    def effective_target_ctas(self) -> int:
        """CTAs the split heuristic aims for: the knob (or 2 waves) rounded up to whole waves."""
        return effective_target_ctas(self.target_ctas, self.num_sms)

    @classmethod
    def from_env(cls, env: RuntimeEnv, device: torch.device | str | None = None) -> "KernelConfig":
        device = torch.device(device) if device is not None else _default_device()
        backend = select_backend(env, device)
        if device.type == "cuda" and torch.cuda.is_available():
            index = device.index if device.index is not None else torch.cuda.current_device()
            num_sms = torch.cuda.get_device_properties(index).multi_processor_count
            device_name = f"cuda:{index}"
        else:
            num_sms = max(1, torch.get_num_threads())
            device_name = device.type
        return cls(backend=backend, device=device_name, num_sms=num_sms, target_ctas=env.decode_target_ctas,
                   max_splits=env.max_kv_splits,
                   triton_interpreter=backend == TRITON and device_name == "cpu")

    def as_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["effective_target_ctas"] = self.effective_target_ctas
        if self.device == "cpu":  # what the CPU kernels run as here, or why they cannot
            from pdruntime.kernels.cpu.native import tried

            if not tried():  # nothing here uses them (the torch backend, fp32 weights): /config builds nothing (a
                # compile of about a second, blocking the event loop the scrape came in on)
                out["cpu_kernels"] = "not built: nothing in this process has used them"
                return out
            why = cpu_kernels_unavailable()
            if why:
                out["cpu_kernels"] = f"unavailable: {why}"
            else:
                from pdruntime.kernels.cpu.native import simd_level

                out["cpu_kernels"] = simd_level()
        return out


_active: KernelConfig | None = None


def configure(env: RuntimeEnv | None = None, device: torch.device | str | None = None) -> KernelConfig:
    """Choose the backend and knobs once, at start-up; later calls use this config."""
    global _active
    _active = KernelConfig.from_env(env if env is not None else RuntimeEnv.from_environ(), device)
    return _active


def active_config() -> KernelConfig:
    """The config ``configure`` chose (configured from the process environment on first use)."""
    return _active if _active is not None else configure()


def kernel_config() -> dict[str, Any]:
    """Effective kernel configuration as a dict, for ``/config``."""
    return active_config().as_dict()


class SplitOptions(TypedDict, total=False):
    """The optional split and scale arguments of :func:`decode_attention`."""

    num_splits: int | Sequence[int] | None  # KV splits per sequence (one int for all, or one each); None: heuristic
    sm_scale: float | None  # softmax scale; None: 1 / sqrt(D)
    plan: Any  # a SplitPlan built ahead (CUDA graphs); wins over num_splits


_SPLIT_OPTIONS = frozenset(SplitOptions.__annotations__)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                     seq_lens: torch.Tensor, *, config: KernelConfig | None = None, out: torch.Tensor | None = None,
                     **split: Unpack[SplitOptions]) -> torch.Tensor:
    """Attention of one new query token per sequence over its paged KV cache.

    q: [B, Hq, D]; k_cache, v_cache: [num_blocks, BLOCK_SIZE, Hkv, D];
    block_table: [B, max_blocks] int32; seq_lens: [B] int32 (each >= 1, includes the
    new token's own K/V, already stored). Returns out: [B, Hq, D] in q's dtype.

    config: overrides the process-wide ``active_config()`` (tests, benchmarks).
    out: [B, Hq, D] like q, written in place when given.
    split (:class:`SplitOptions`): ``num_splits`` KV splits per sequence for the Triton kernel; ``sm_scale``;
        ``plan``, a ``SplitPlan`` built ahead (CUDA graphs: its split counts hold for any lengths up to the
        plan's, the kernel reads the real ``seq_lens`` on the device). Splits are ignored by torch.
    """
    if split and not split.keys() <= _SPLIT_OPTIONS:
        raise TypeError(f"decode_attention() got unexpected keyword arguments {sorted(split.keys() - _SPLIT_OPTIONS)}")
    num_splits, sm_scale, plan = split.get("num_splits"), split.get("sm_scale"), split.get("plan")
    cfg = config if config is not None else active_config()
    if cfg.backend == CPU:
        if supports(q, k_cache):
            return cpu_decode_attention(q, k_cache, v_cache, block_table, seq_lens, sm_scale, out=out)
    if cfg.backend in (CPU, TORCH):
        return torch_decode_attention(q.contiguous(), k_cache, v_cache, block_table, seq_lens, sm_scale, out=out)
    if not q.is_cuda and not cfg.triton_interpreter:
        raise RuntimeError(f"decode attention is configured for Triton on {cfg.device} but got {q.device} tensors; "
                           "configure(device=...) with the engine's device")
    from pdruntime.kernels.triton_decode_attention import make_split_plan, triton_decode_attention

    if plan is not None:
        pass
    elif num_splits is None:
        plan = _step_plan(seq_lens, cfg, k_cache.shape[2])
    else:
        lens = seq_lens.tolist()
        splits = [num_splits] * len(lens) if isinstance(num_splits, int) else list(num_splits)
        plan = make_split_plan(lens, splits, cfg.block_n, q.device)
    return triton_decode_attention(q, k_cache, v_cache, block_table, seq_lens, plan, sm_scale=sm_scale,
                                   block_n=cfg.block_n, out=out)


class _PlanCache(threading.local):
    """The last step's split plan, per thread (one entry: the engine runs one step at a time)."""

    ref: weakref.ref | None = None
    key: tuple | None = None
    plan: Any = None


_plan_cache = _PlanCache()


def _step_plan(seq_lens: torch.Tensor, cfg: KernelConfig, num_kv_heads: int):
    """Split plan for this step, built on the first layer's call and reused by the others.

    Every layer of a decode step passes the same ``seq_lens`` tensor, so reading it to
    the host, running the heuristic and copying the work list to the device happen
    once per step, not once per layer. The entry is keyed on the tensor object (a weak
    reference: a new tensor never matches a dead one) and its version counter, which
    every in-place torch write bumps, so a changed ``seq_lens`` gets a new plan.
    Inference tensors (the engine's step runs under ``torch.inference_mode()``) have no
    version counter: for them the cached lengths are compared with a host read instead,
    which still saves the heuristic and the copy but not the read (one small sync on CUDA).
    """
    from pdruntime.kernels.triton_decode_attention import make_split_plan

    cache = _plan_cache
    version = None if seq_lens.is_inference() else seq_lens._version
    key = (version, cfg, num_kv_heads)
    lens = None
    if cache.ref is not None and cache.ref() is seq_lens and cache.key == key:
        if version is not None:
            return cache.plan
        lens = seq_lens.tolist()
        if tuple(lens) == cache.plan.lens:
            return cache.plan
    if lens is None:
        lens = seq_lens.tolist()  # the one host read of the step
    splits = num_kv_splits(lens, cfg.num_sms, cfg.target_ctas, cfg.max_splits, num_kv_heads=num_kv_heads,
                           block_n=cfg.block_n)
    plan = make_split_plan(lens, splits, cfg.block_n, seq_lens.device)
    cache.ref, cache.key, cache.plan = weakref.ref(seq_lens), key, plan
    return plan


__all__ = ["CPU", "KernelConfig", "TORCH", "TRITON", "active_config", "configure", "decode_attention", "kernel_config",
           "select_backend", "triton_interpreter_active", "triton_importable"]
