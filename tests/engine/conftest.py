"""Fixtures for engine/model tests: tiny random-weight checkpoints written in-process (no downloads)."""

from __future__ import annotations

import pytest
import torch

from pdruntime.engine import Engine, EngineConfig
from pdruntime.model import load_model
from pdruntime.model.testing import write_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> str:
    return write_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny")), seed=0, num_layers=2, hidden_size=64,
                                 num_heads=4, num_kv_heads=2, vocab_size=320)


@pytest.fixture(scope="session")
def tiny(tiny_dir):
    torch.manual_seed(0)
    return load_model(tiny_dir)


@pytest.fixture
def make_engine(tiny):
    def make(**kw) -> Engine:
        kw.setdefault("num_blocks", 256)
        kw.setdefault("block_size", 4)
        return Engine(tiny, EngineConfig(**kw))
    return make
