"""Root conftest: the shared tiny-model stack (``tests/support/tiny_stack.py``) for every test directory, and
``tests/pd`` (the process harness ``pd_harness``) and ``tests/support`` on ``sys.path``.

Test modules import their helpers by module name (``from pd_harness import ...``): pytest runs with
``--import-mode=importlib``, which does not put a test's directory on ``sys.path``.
"""

from __future__ import annotations

import sys
from pathlib import Path

_TESTS = Path(__file__).resolve().parent
for _d in (_TESTS / "support", _TESTS / "pd"):
    if str(_d) not in sys.path:
        sys.path.insert(0, str(_d))

from tiny_stack import client, make_engine, model_id, reference, stack, tiny, tiny_model  # noqa: E402,F401
