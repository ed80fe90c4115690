"""Fixtures for tests/agent: a PD stack (router + prefill + decode on loopback) and the official openai client."""

from __future__ import annotations

import os
import sys

import pytest

from pdruntime.model.testing import write_tiny_checkpoint

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "pd"))
from pd_harness import start_stack  # noqa: E402


@pytest.fixture(scope="session")
def agent_tiny_model(tmp_path_factory) -> str:
    return str(write_tiny_checkpoint(str(tmp_path_factory.mktemp("agent-tiny"))))


@pytest.fixture(scope="module")
def pd_stack(agent_tiny_model, tmp_path_factory):
    s = start_stack(str(tmp_path_factory.mktemp("agent-stack")), agent_tiny_model)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(pd_stack):
    openai = pytest.importorskip("openai", reason="the official openai client is in the dev extra")
    return openai.OpenAI(base_url=pd_stack.router.url + "/v1", api_key="unused", timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def model_id(client) -> str:
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def reference(agent_tiny_model):
    """The same checkpoint in-process: all-position logits of a token sequence, and the chat template."""
    import torch

    from pdruntime.engine import Engine, EngineConfig
    from pdruntime.model import load_model

    loaded = load_model(agent_tiny_model)
    eng = Engine(loaded, EngineConfig(num_blocks=64, block_size=16))

    def logits(ids: list[int]) -> torch.Tensor:
        blocks = torch.arange(-(-len(ids) // 16), dtype=torch.int64)
        with torch.inference_mode():
            return eng.model.prefill(torch.tensor(ids), 0, eng.kv.k, eng.kv.v, blocks, all_logits=True)

    return loaded.tokenizer, logits
