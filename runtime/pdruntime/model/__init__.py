"""Llama-architecture model, checkpoint loaders (GGUF, HF safetensors) and tokenizer.

Only :mod:`.config` (torch-free) is imported eagerly; the rest on first use (PEP 562), so ``pdrt up`` can find the
default model (:func:`default_model_path`) without importing torch on its critical path (~2 s on 2 cores)."""

from importlib import import_module
from typing import Any

from .config import DEFAULT_FILE, DEFAULT_PACKAGE, INSTALL_HINT, LlamaConfig, ModelLoadError, default_model_path

_LAZY = {"LlamaModel": ".llama", "LoadedModel": ".loader", "ModelInfo": ".loader", "load_model": ".loader",
         "Tokenizer": ".tokenizer"}

__all__ = ["DEFAULT_FILE", "DEFAULT_PACKAGE", "INSTALL_HINT", "LlamaConfig", "LlamaModel", "LoadedModel", "ModelInfo",
           "ModelLoadError", "Tokenizer", "default_model_path", "load_model"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
