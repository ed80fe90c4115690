"""Decode-attention kernels: Triton flash-decoding with a torch reference/fallback.

Entry point: ``from pdruntime.kernels.decode_attention import decode_attention``.
(The package does not re-export that function: it would shadow the submodule of the
same name.) Importing this package does not import Triton; it is loaded only when the
Triton backend is used, so CPU processes stay light and tests can choose interpreter mode.
"""

from pdruntime.kernels.decode_attention import KernelConfig, active_config, configure, kernel_config, select_backend
from pdruntime.kernels.split_heuristic import num_kv_splits

__all__ = ["KernelConfig", "active_config", "configure", "kernel_config", "num_kv_splits", "select_backend"]
