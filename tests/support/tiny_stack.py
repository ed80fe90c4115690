"""The tiny-model stack every test directory shares: fixtures exported by the root ``tests/conftest.py``.

One random-weight checkpoint (``write_tiny_checkpoint``'s defaults: 2 layers, hidden 64, 4 query / 2 KV heads,
vocab 320, seed 0) is written once per session. The in-process engine tests load it (``tiny``), the loopback
stack serves it (``stack``: router + one PD pair, ``pd_harness.start_stack``).

Scopes: the checkpoint and the model loaded from it are read-only and session-scoped. The process stack is
module-scoped unless the module says ``SHARED_STACK = True``: a module that sets lasting state (an advanced watchdog
clock, a topology of its own) or kills processes gets a stack only its own tests have touched. A module that sends
traffic (and at most sets hooks it takes back: a slow step reset to 0, a stall or corruption its own request uses
up) shares one stack per pytest process with the other such modules: three process start-ups (~5 CPU s, ~3 s on a
quiet 2-core host, far more on a loaded one) instead of one per module. When a sharing module is done, the shared
stack must be as it found it: no live request in any process, every KV page free, the breaker closed, nothing
outstanding; else the module's teardown fails naming what it left, and the next module gets a fresh stack. Counters
are shared too: a sharing module's test reads a counter as a difference across its own requests, never as an
absolute value another module's traffic could have moved.

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


class _SharedStack:
    """The per-process stack of the ``SHARED_STACK`` modules, started on first use, replaced when a module left it
    in a state the next one must not inherit."""

    def __init__(self, model: str, tmp_path_factory: pytest.TempPathFactory) -> None:
        self.model, self.tmp = model, tmp_path_factory
        self.current: Stack | None = None

    def get(self) -> Stack:
        if self.current is None:
            self.current = start_stack(str(self.tmp.mktemp("shared-stack")), self.model)
        return self.current

    def check_and_reset(self) -> None:
        """After a module: hooks back to their defaults, then fail (and drop the stack) if anything is left."""
        s = self.current
        assert s is not None
        try:
            for proc in (s.prefill, s.decode):
                s.hooks(proc, step_delay_s=0, stall_transfers=0, stall_prefill=0, corrupt_kv_chunk=0)
            left = s.leftovers()
        except BaseException:
            self.discard()
            raise
        if left:
            self.discard()
            raise AssertionError(f"the module left the shared stack dirty (a fresh one replaces it): {left}")

    def discard(self) -> None:
        if self.current is not None:
            self.current.stop()
            self.current = None


@pytest.fixture(scope="session")
def _shared_stack(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[_SharedStack]:
    shared = _SharedStack(tiny_model, tmp_path_factory)
    yield shared
    shared.discard()


@pytest.fixture(scope="module")
def stack(request: pytest.FixtureRequest, tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """Router + one PD pair serving ``tiny_model`` on loopback: the module's own, or with ``SHARED_STACK = True`` in
    the module the process's shared one (checked clean after the module)."""
    if getattr(request.module, "SHARED_STACK", False):
        shared: _SharedStack = request.getfixturevalue("_shared_stack")
        yield shared.get()
        shared.check_and_reset()
        return
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
