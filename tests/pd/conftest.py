"""Fixtures for tests/pd: the tiny random model and the shared stack (router + one PD pair, module-scoped).

Helpers live in ``pd_harness`` (a unique module name: other test dirs have their own conftest.py).
"""

from __future__ import annotations

import os
import sys

import httpx
import pytest

from pdruntime.model.testing import write_tiny_checkpoint

sys.path.insert(0, os.path.dirname(__file__))
from pd_harness import start_stack  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    return str(write_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny-model"))))


@pytest.fixture(scope="module")
def stack(tiny_model, tmp_path_factory):
    """Router + one PD pair, shared by a module's tests (torn down after it, not held through other suites)."""
    s = start_stack(str(tmp_path_factory.mktemp("stack")), tiny_model)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def model_id(stack) -> str:
    return httpx.get(stack.router.url + "/v1/models", timeout=10).json()["data"][0]["id"]
