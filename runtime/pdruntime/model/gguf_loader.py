"""GGUF checkpoints: metadata, dequantisation (F32, F16, BF16, Q8_0, Q4_0, Q4_1) and HF-layout conversion.

GGUF stores a 2-D weight as rows of ``ne0`` elements (``ne0`` = input features), so a row-major
``[ne1, ne0]`` array is already the torch ``[out, in]`` layout. Quantised rows are sequences of
32-element blocks:

* Q8_0: f16 d, int8 q[32]                    x = d * q
* Q4_0: f16 d, u8 qs[16]                     x[j] = d * ((qs[j] & 15) - 8), x[j+16] = d * ((qs[j] >> 4) - 8)
* Q4_1: f16 d, f16 m, u8 qs[16]              x[j] = d * (qs[j] & 15) + m,  x[j+16] = d * (qs[j] >> 4) + m

llama.cpp's converter permutes Q and K rows of llama attention so that its interleaved RoPE works;
:func:`unpermute_qk` restores the HF rotate-half order.
"""

from __future__ import annotations

from collections.abc import Mapping

import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .config import LlamaConfig, ModelLoadError

QK = 32  # elements per quantisation block
_BLOCK_BYTES = {"Q8_0": 2 + QK, "Q4_0": 2 + QK // 2, "Q4_1": 4 + QK // 2}


def _f16(raw: np.ndarray) -> np.ndarray:
    """raw: [..., 2] uint8 -> [..., 1] float32."""
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)


def dequantize(raw: np.ndarray, type_name: str, n_elements: int) -> np.ndarray:
    """Dequantise a GGUF tensor's raw bytes to a flat float32 array of n_elements."""
    if type_name == "F32":
        out = np.asarray(raw).view(np.float32).reshape(-1)
    elif type_name == "F16":
        out = np.asarray(raw).view(np.float16).reshape(-1).astype(np.float32)
    elif type_name == "BF16":
        u16 = np.asarray(raw).view(np.uint16).reshape(-1).astype(np.uint32) << 16
        out = u16.view(np.float32)
    elif type_name in _BLOCK_BYTES:
        nbytes = _BLOCK_BYTES[type_name]
        blocks = np.asarray(raw, dtype=np.uint8).reshape(-1)
        if blocks.size % nbytes:
            raise ModelLoadError(f"{type_name} data of {blocks.size} bytes is not a whole number of {nbytes}-byte blocks")
        blocks = blocks.reshape(-1, nbytes)
        d = _f16(blocks[:, 0:2])  # [nb, 1]
        if type_name == "Q8_0":
            q = blocks[:, 2:].view(np.int8).astype(np.float32)
            out = d * q
        else:
            qs = blocks[:, 4:] if type_name == "Q4_1" else blocks[:, 2:]
            q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32)  # [nb, 32]
            out = d * q + _f16(blocks[:, 2:4]) if type_name == "Q4_1" else d * (q - 8.0)
        out = out.reshape(-1)
    else:
        raise ModelLoadError(f"GGUF tensor type {type_name} is not supported; accepted: F32, F16, BF16, Q8_0, Q4_0, Q4_1")
    if out.size != n_elements:
        raise ModelLoadError(f"{type_name} tensor holds {out.size} values, expected {n_elements} (truncated file?)")
    return out


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation. w: [n_head * D, in] -> HF rotate-half order."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class _Cursor:
    """Little-endian reader over the file bytes; any overrun is a truncated/corrupt file."""

    def __init__(self, buf: memoryview, path: str) -> None:
        self.buf, self.pos, self.path = buf, 0, path

    def scalar(self, fmt: str):
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise ModelLoadError(f"{self.path}: not a readable GGUF file (header ends early at byte {self.pos}); "
                                 "the file may be truncated or corrupt")
        (val,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return val

    def string(self) -> str:
        n = self.scalar("<Q")
        if n > len(self.buf) - self.pos:
            raise ModelLoadError(f"{self.path}: not a readable GGUF file (string of {n} bytes at byte {self.pos}); "
                                 "the file may be truncated or corrupt")
        raw = bytes(self.buf[self.pos: self.pos + n])
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def value(self, vtype: int):
        if vtype in _SCALAR:
            return self.scalar(_SCALAR[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            itype, count = self.scalar("<I"), self.scalar("<Q")
            if itype in _SCALAR and itype != 7:  # numeric arrays in one go
                dt = np.dtype(_SCALAR[itype])
                if count * dt.itemsize > len(self.buf) - self.pos:
                    raise ModelLoadError(f"{self.path}: not a readable GGUF file (array overruns the file); "
                                         "the file may be truncated or corrupt")
                arr = np.frombuffer(self.buf, dtype=dt, count=count, offset=self.pos)
                self.pos += count * dt.itemsize
                return arr.tolist()
            return [self.value(itype) for _ in range(count)]
        raise ModelLoadError(f"{self.path}: not a readable GGUF file (unknown value type {vtype} at byte {self.pos}); "
                             "the file may be truncated or corrupt")


@dataclass(frozen=True)
class _TensorInfo:
    name: str
    shape: tuple[int, ...]  # GGUF order: ne0 (innermost) first
    type_name: str
    offset: int  # absolute byte offset in the file
    nbytes: int


def _parse(path: str) -> tuple[dict[str, Any], list[_TensorInfo], np.ndarray]:
    """Parse a GGUF file (v2/v3): metadata dict, tensor table, memory map of the file.

    A plain parser rather than gguf.GGUFReader: the reader builds a numpy view per string and takes
    ~10 s on a 49k-token vocabulary; the gguf package still supplies the type table."""
    import gguf

    try:
        data = np.memmap(path, dtype=np.uint8, mode="r")
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path}: not a readable GGUF file ({exc}); the file may be truncated or corrupt") from None
    cur = _Cursor(memoryview(data), path)
    if len(data) < 4 or bytes(data[:4]) != b"GGUF":
        raise ModelLoadError(f"{path}: not a readable GGUF file (bad magic {bytes(data[:4])!r}, expected b'GGUF'); "
                             "the file may be truncated or corrupt")
    cur.pos = 4
    version = cur.scalar("<I")
    if version not in (2, 3):
        raise ModelLoadError(f"{path}: not a readable GGUF file (version {version}; accepted: 2, 3); "
                             "the file may be truncated or corrupt")
    n_tensors, n_kv = cur.scalar("<Q"), cur.scalar("<Q")
    if n_tensors > 1 << 20 or n_kv > 1 << 20:
        raise ModelLoadError(f"{path}: not a readable GGUF file (implausible counts {n_tensors} tensors, {n_kv} keys); "
                             "the file may be truncated or corrupt")
    meta: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        meta[key] = cur.value(cur.scalar("<I"))
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        ndim = cur.scalar("<I")
        if ndim > 8:
            raise ModelLoadError(f"{path}: not a readable GGUF file (tensor {name!r} has {ndim} dims); "
                                 "the file may be truncated or corrupt")
        shape = tuple(cur.scalar("<Q") for _ in range(ndim))
        ttype, offset = cur.scalar("<I"), cur.scalar("<Q")
        try:
            qtype = gguf.GGMLQuantizationType(ttype)
        except ValueError:
            raise ModelLoadError(f"{path}: tensor {name!r} has unknown GGML type {ttype}; "
                                 "the file may be truncated or corrupt") from None
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        n = int(np.prod(shape)) if shape else 1
        infos.append(_TensorInfo(name, shape, qtype.name, offset, n // block * type_size))
    align = int(meta.get("general.alignment", 32))
    start = -(-cur.pos // align) * align
    for t in infos:
        end = start + t.offset + t.nbytes
        if end > len(data):
            raise ModelLoadError(f"{path}: tensor {t.name} needs bytes up to {end} but the file has {len(data)}; "
                                 "the file may be truncated or corrupt")
    infos = [_TensorInfo(t.name, t.shape, t.type_name, start + t.offset, t.nbytes) for t in infos]
    return meta, infos, data


def config_from_gguf(meta: dict[str, Any], path: str, has_output: bool) -> LlamaConfig:
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ModelLoadError(f"{path}: GGUF architecture {arch!r} is not supported; accepted: llama")

    def get(key: str, default=None):
        val = meta.get(f"llama.{key}", default)
        if val is None:
            raise ModelLoadError(f"{path}: GGUF metadata lacks llama.{key}")
        return val

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    vocab = meta.get("llama.vocab_size") or len(meta.get("tokenizer.ggml.tokens") or [])
    scaling = None
    if meta.get("llama.rope.scaling.type") == "linear":
        scaling = (("rope_type", "linear"), ("factor", float(meta["llama.rope.scaling.factor"])))
    return LlamaConfig(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")),
        num_heads=heads,
        num_kv_heads=int(get("attention.head_count_kv", heads)),
        head_dim=int(meta.get("llama.attention.key_length") or meta.get("llama.rope.dimension_count") or hidden // heads),
        max_position_embeddings=int(get("context_length", 2048)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        tie_word_embeddings=not has_output,
    )


_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _hf_name(name: str) -> str | None:
    if name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if name == "output_norm.weight":
        return "model.norm.weight"
    if name == "output.weight":
        return "lm_head.weight"
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _NAMES:
        return f"model.layers.{parts[1]}.{_NAMES[parts[2]]}.{parts[3]}"
    return None  # e.g. rope_freqs: not used by this architecture's supported variants


class _LazyGGUF(Mapping):
    """HF name -> fp32 tensor, dequantised from the memory-mapped file when read (one tensor at a time, so a
    large model never sits on the host whole in fp32)."""

    def __init__(self, path: str, cfg: LlamaConfig, infos: list[_TensorInfo], data: np.ndarray) -> None:
        self.path, self.cfg, self.data = path, cfg, data
        self.infos = {hf: t for t in infos if (hf := _hf_name(t.name)) is not None}

    def __getitem__(self, hf: str) -> torch.Tensor:
        t = self.infos[hf]
        shape = [int(x) for x in reversed(t.shape)]  # GGUF lists ne0 first; torch wants [ne1, ne0]
        n = int(np.prod(shape))
        try:
            flat = dequantize(self.data[t.offset: t.offset + t.nbytes], t.type_name, n)
        except ModelLoadError as exc:
            raise ModelLoadError(f"{self.path}: tensor {t.name}: {exc}") from None
        w = torch.from_numpy(np.array(flat, dtype=np.float32, copy=True)).reshape(shape)
        if t.name.endswith("attn_q.weight"):
            w = unpermute_qk(w, self.cfg.num_heads)
        elif t.name.endswith("attn_k.weight"):
            w = unpermute_qk(w, self.cfg.num_kv_heads)
        return w

    def type_of(self, hf: str) -> str:
        """The GGUF type a tensor is stored as (``Q4_1``, ``Q8_0``, ``F32`` ...)."""
        return self.infos[hf].type_name

    def blocks(self, hf: str) -> np.ndarray:
        """A block-quantised tensor's own bytes, not dequantised: [rows, ne0 / 32, block bytes] uint8 (a view of the
        memory map, or a copy with Q and K rows put back in HF order)."""
        t = self.infos[hf]
        if t.type_name not in _BLOCK_BYTES:
            raise ModelLoadError(f"{self.path}: tensor {t.name} is {t.type_name}, not a block format "
                                 f"({', '.join(_BLOCK_BYTES)})")
        rows, nb = int(np.prod(t.shape[1:])), int(t.shape[0]) // QK
        raw = np.asarray(self.data[t.offset: t.offset + t.nbytes]).reshape(rows, nb, _BLOCK_BYTES[t.type_name])
        heads = {"attn_q.weight": self.cfg.num_heads, "attn_k.weight": self.cfg.num_kv_heads}
        for suffix, n_head in heads.items():
            if t.name.endswith(suffix):  # unpermute_qk on rows of blocks (whole rows move, blocks stay intact)
                raw = raw.reshape(n_head, rows // n_head // 2, 2, nb, -1).transpose(0, 2, 1, 3, 4).reshape(raw.shape)
        return raw

    def __contains__(self, name: object) -> bool:  # without reading the tensor (Mapping's default would)
        return name in self.infos

    def __iter__(self):
        return iter(self.infos)

    def __len__(self) -> int:
        return len(self.infos)


def read_gguf(path: str) -> tuple[dict[str, Any], LlamaConfig, Mapping[str, torch.Tensor]]:
    """Parse a llama GGUF file -> (metadata, config, HF-layout fp32 tensors, dequantised when read)."""
    meta, infos, data = _parse(path)
    names = {t.name for t in infos}
    cfg = config_from_gguf(meta, path, has_output="output.weight" in names)
    return meta, cfg, _LazyGGUF(path, cfg, infos, data)
