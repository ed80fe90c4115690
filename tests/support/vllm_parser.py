"""vLLM's own modules for the tests that check pdstack against them (its ``serve`` parser, its request models),
from the folder ``make vllm-parser`` installs vllm 0.33 into (``--no-deps``; .ci/run runs it, ``make test`` alone
skips these checks). One import path for every such test: the folder goes *after* the venv's own packages (it only
adds what they lack), and ``VLLM_TARGET_DEVICE=cpu`` (vLLM's own switch) is set while vLLM resolves its platform,
then the environment is put back as it was, so later tests and the processes they start never see vLLM's changes."""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path
from types import ModuleType

import pytest

PARSER_DIR = Path(sys.prefix) / "vllm-parser"
SKIP_REASON = (f"vLLM's own modules come from the vllm package, installed --no-deps into {PARSER_DIR} by "
               "`make vllm-parser` (.ci/run runs it; `make test` alone skips this check)")


def import_vllm(*modules: str) -> list[ModuleType]:
    """``modules`` of vLLM, imported as above; skips the calling test when vLLM is not installed there."""
    if PARSER_DIR.is_dir() and str(PARSER_DIR) not in sys.path:
        sys.path.append(str(PARSER_DIR))
    env = dict(os.environ)
    try:
        os.environ["VLLM_TARGET_DEVICE"] = "cpu"
        pytest.importorskip("vllm", reason=SKIP_REASON)
        return [importlib.import_module(m) for m in modules]
    finally:
        os.environ.clear()
        os.environ.update(env)
