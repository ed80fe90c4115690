"""The model's default sampling parameters (applied when a request omits a field; reported at /v1/models, /config).

``--generation-config`` (vLLM's meaning): ``auto`` = the checkpoint's ``generation_config.json`` when it has one,
else the documented per-model default below; ``none`` = the OpenAI API defaults (temperature 1, top_p 1);
a PATH = that directory's (or file's) ``generation_config.json``.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass

API = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}

# Per-model defaults for checkpoints without generation_config.json (GGUF files carry none).
# SmolLM2-*-Instruct: its model card's example samples with temperature 0.2, top_p 0.9. Those alone answer
# "What is the capital of France?" with Paris in 14 of 20 seeds (measured: at T=0.2 the first token is "The"
# 0.55 / "L" 0.36, and "L" leads into "L'Etoile, la Marseillaise, ..."), so pdrt adds repetition_penalty 1.1
# (llama.cpp's long-standing repeat_penalty default), which answers 20 of 20 (tests/agent/test_default_answer.py).
KNOWN = {"smollm2": {"temperature": 0.2, "top_p": 0.9, "repetition_penalty": 1.1}}


@dataclass(frozen=True)
class GenerationDefaults:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    source: str = "api"  # where the values came from

    def as_dict(self) -> dict:
        return asdict(self)


def _from_file(path: str) -> dict:
    f = os.path.join(path, "generation_config.json") if os.path.isdir(path) else path
    with open(f, encoding="utf-8") as fh:
        cfg = json.load(fh)
    if cfg.get("do_sample") is False:
        return {"temperature": 0.0}
    return {k: cfg[k] for k in API if isinstance(cfg.get(k), (int, float)) and not isinstance(cfg.get(k), bool)}


def resolve(mode: str, model_path: str | None, model_name: str | None) -> GenerationDefaults:
    """``mode`` auto | none | PATH -> the defaults (raises ValueError for an unreadable PATH)."""
    if mode == "none":
        return GenerationDefaults(source="none (OpenAI API defaults)")
    if mode != "auto":
        try:
            return GenerationDefaults(**{**API, **_from_file(mode)}, source=f"file {mode}")
        except (OSError, ValueError) as exc:
            raise ValueError(f"--generation-config {mode!r}: {exc}; accepted: auto, none, or a directory/file "
                             "holding generation_config.json") from None
    if model_path and os.path.isdir(model_path) and os.path.exists(os.path.join(model_path, "generation_config.json")):
        vals = _from_file(model_path)
        if vals:
            return GenerationDefaults(**{**API, **vals}, source=f"{model_path}/generation_config.json")
    name = f"{model_name or ''} {os.path.basename(str(model_path or ''))}".lower()
    for key, vals in KNOWN.items():
        if key in name:
            return GenerationDefaults(**{**API, **vals}, source=f"documented default for {key} (docs/api.md)")
    return GenerationDefaults(source="api (no generation_config.json, no documented default)")
