"""Llama-architecture model, checkpoint loaders (GGUF, HF safetensors) and tokenizer."""

from .config import LlamaConfig, ModelLoadError
from .llama import LlamaModel
from .loader import INSTALL_HINT, LoadedModel, ModelInfo, default_model_path, load_model
from .tokenizer import Tokenizer

__all__ = ["INSTALL_HINT", "LlamaConfig", "LlamaModel", "LoadedModel", "ModelInfo", "ModelLoadError",
           "Tokenizer", "default_model_path", "load_model"]
