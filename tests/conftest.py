"""Root conftest: the shared tiny-model stack (``tests/support/tiny_stack.py``) for every test directory, and
``tests/pd`` (the process harness ``pd_harness``) and ``tests/support`` on ``sys.path``.

Test modules import their helpers by module name (``from pd_harness import ...``): pytest runs with
``--import-mode=importlib``, which does not put a test's directory on ``sys.path``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# One intra-op thread for torch (and numpy's BLAS) in the pytest processes and in what they start, unless the
# environment sets its own. make test runs two xdist workers on a 2-core host: torch's default of one thread per
# core gave each worker an OpenMP pool as wide as the host, and the two pools spun against each other and against
# the stacks' processes (those already run with one, pd_harness.base_env). The tests' tensors are tiny (the random
# test model) or memory-bound (SmolLM2's decode): tests/engine/test_low_precision.py took 104 CPU s (155 s wall)
# with two threads, 25 CPU s (37 s) with one, on the same loaded host.
if "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = "1"
    if "torch" in sys.modules:  # imported before this file (by a plugin): its pool is sized already
        sys.modules["torch"].set_num_threads(1)

_TESTS = Path(__file__).resolve().parent
for _d in (_TESTS / "support", _TESTS / "pd"):
    if str(_d) not in sys.path:
        sys.path.insert(0, str(_d))

from tiny_stack import _shared_stack, client, make_engine, model_id, reference, stack, tiny, tiny_model  # noqa: E402,F401

# The slowest files of `make test` (seconds of setup + call per file, --durations of a full run), run first. The
# two xdist workers take whole files (--dist loadfile) in collection order, and collection order put some of the
# slowest last (tests/tp/test_tp_pd.py, ~50 s): one worker finished while the other still had a minute to go.
# Started first, the long files overlap each other and the many short ones fill in at the end. A file missing from
# the list keeps its place; a name here that no longer exists changes nothing.
SLOWEST_FIRST = (  # issue 23's --durations run (after the shared stack), slowest first
    "tests/runtime/test_probe_agents.py",
    "tests/pd/test_worker_protocol_vllm.py",
    "tests/pd/test_pd_stack.py",
    "tests/pd/test_engine_failures.py",
    "tests/pd/test_wire_stack.py",
    "tests/pd/test_pd_failures.py",
    "tests/tp/test_tp_pd.py",
    "tests/operator/test_operator_integration.py",
    "tests/pd/test_fault_matrix.py",
    "tests/kernels/test_triton_decode_attention.py",
    "tests/operator/test_engine_agents_live.py",
    "tests/pd/test_breaker_integration.py",
    "tests/agent/test_n_shared_prefill.py",
    "tests/kernels/test_triton_gpu_compile.py",
    "tests/engine/test_triton_engine.py",
    "tests/shipping/test_chart.py",
    "tests/operator/test_rbac_exact.py",
    "tests/runtime/test_canary_routing.py",
    "tests/operator/test_canary_flow.py",
    "tests/operator/test_probes.py",
    "tests/pd/test_long_prompt.py",
    "tests/engine/test_low_precision.py",
)


def pytest_collection_modifyitems(config, items):
    """Files in SLOWEST_FIRST first, in its order; every file's tests stay together and in their own order."""
    rank = {path: i for i, path in enumerate(SLOWEST_FIRST)}
    root = config.rootpath
    def key(item):
        try:
            rel = item.path.relative_to(root).as_posix()
        except ValueError:
            return len(rank)
        return rank.get(rel, len(rank))
    items.sort(key=key)  # stable: the rest keep collection order
