"""The tiny-model stack every test directory shares: fixtures exported by the root ``tests/conftest.py``.

One random-weight checkpoint (``write_tiny_checkpoint``'s defaults: 2 layers, hidden 64, 4 query / 2 KV heads,
vocab 320, seed 0) is written once per session. The in-process engine tests load it (``tiny``), the loopback
stack serves it (``stack``: router + one PD pair, ``pd_harness.start_stack``).

Scopes: the checkpoint and the model loaded from it are read-only and session-scoped. The process stack is
module-scoped: a module's tests set its hooks (slow steps, stalled or corrupt transfers, an advanced watchdog
clock) and read its counters, so each module gets a stack only its own tests have touched, and three idle
worker processes are not held through the other suites.

pdstack modules are imported inside the fixtures: this module is imported by the root conftest before any test
directory's, and ``tests/kernels/conftest.py`` must be the first to import Triton.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import pytest

from pd_harness import Stack, start_stack


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Path of the session's tiny checkpoint (HF layout)."""
    from pdruntime.model.testing import write_tiny_checkpoint

    return str(write_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny-model"))))


@pytest.fixture(scope="session")
def tiny(tiny_model: str) -> Any:
    """The tiny checkpoint loaded in-process (a ``LoadedModel``, fp32 on CPU); tests build their own engines."""
    import torch

    from pdruntime.model import load_model

    torch.manual_seed(0)
    return load_model(tiny_model)


@pytest.fixture
def make_engine(tiny: Any) -> Callable[..., Any]:
    """``make_engine(**EngineConfig fields)``: a fresh engine on ``tiny`` (256 blocks of 4 tokens unless given)."""
    from pdruntime.engine import Engine, EngineConfig

    def make(**kw: Any) -> Engine:
        kw.setdefault("num_blocks", 256)
        kw.setdefault("block_size", 4)
        return Engine(tiny, EngineConfig(**kw))
    return make


@pytest.fixture(scope="module")
def stack(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """Router + one PD pair serving ``tiny_model`` on loopback, shared by one module's tests."""
    s = start_stack(str(tmp_path_factory.mktemp("stack")), tiny_model)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def model_id(stack: Stack) -> str:
    """The model id the stack's router lists on /v1/models."""
    import httpx

    return httpx.get(stack.router.url + "/v1/models", timeout=10).json()["data"][0]["id"]


@pytest.fixture(scope="module")
def client(stack: Stack) -> Any:
    """The official openai client on the stack's router (skips without the ``openai`` package)."""
    openai = pytest.importorskip("openai", reason="the official openai client is in the dev extra")
    return openai.OpenAI(base_url=stack.router.url + "/v1", api_key="unused", timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def reference(tiny: Any) -> tuple[Any, Callable[[list[int]], Any]]:
    """The stack's checkpoint in-process: its tokenizer (chat template included) and ``logits(ids)``, the
    all-position logits of one prefill of ``ids`` (``[len(ids), vocab]``)."""
    import torch

    from pdruntime.engine import Engine, EngineConfig

    eng = Engine(tiny, EngineConfig(num_blocks=64, block_size=16))

    def logits(ids: list[int]) -> torch.Tensor:
        blocks = torch.arange(-(-len(ids) // 16), dtype=torch.int64)
        with torch.inference_mode():
            return eng.model.prefill(torch.tensor(ids), 0, eng.kv.k, eng.kv.v, blocks, all_logits=True)

    return tiny.tokenizer, logits
