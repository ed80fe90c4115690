"""Fixtures for the bad-input fuzz tests: the same real stack as tests/pd (router + one PD pair, tiny model)."""

from __future__ import annotations

import os
import sys

import httpx
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "pd"))
from pd_harness import start_stack  # noqa: E402

from pdruntime.model.testing import write_tiny_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def fuzz_model(tmp_path_factory) -> str:
    return str(write_tiny_checkpoint(str(tmp_path_factory.mktemp("fuzz-model"))))


@pytest.fixture(scope="module")
def fuzz_stack(fuzz_model, tmp_path_factory):
    s = start_stack(str(tmp_path_factory.mktemp("fuzz-stack")), fuzz_model)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def fuzz_model_id(fuzz_stack) -> str:
    return httpx.get(fuzz_stack.router.url + "/v1/models", timeout=10).json()["data"][0]["id"]
