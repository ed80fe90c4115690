"""Tiny random-weight checkpoints for fast tests (no downloads).

``write_tiny_checkpoint`` writes an HF-layout directory (config.json, model.safetensors, tokenizer.json,
tokenizer_config.json with a ChatML chat template). The tokenizer is a byte-level BPE trained in-process
on a fixed corpus, so any text encodes. Same arguments -> byte-identical weights in any process.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import torch

CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention stores the KV cache in fixed-size blocks.",
    "Prefill and decode run on different workers and exchange KV pages.",
    "Continuous batching lets new requests join a running decode batch.",
    "def main():\n    print('hello, world')\n",
    "0123456789 + - * / = ( ) [ ] { } < > ! ? , . ; : ' \" @ # $ % ^ & _ ~",
] * 8


def build_tokenizer(vocab_size: int = 320):
    """A deterministic byte-level BPE tokenizer (tokenizers.Tokenizer) with ChatML special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    return tok


@dataclass(frozen=True)
class TinyShape:
    """The architecture of a tiny checkpoint (the keyword arguments of :func:`write_tiny_checkpoint`)."""

    num_layers: int = 2
    hidden_size: int = 64
    num_heads: int = 4
    num_kv_heads: int = 2
    vocab_size: int = 320
    max_position: int = 2048
    intermediate_size: int | None = None  # None: 3 * hidden_size
    tie_word_embeddings: bool = False
    rope_theta: float = 10000.0
    weight_std: float = 0.08  # projection weights (embeddings: 0.5); 1/sqrt(hidden_size) keeps activations steady


def write_tiny_checkpoint(path: str, *, seed: int = 0, **shape: Any) -> str:
    """Write a random-weight Llama checkpoint in HF layout to `path` (created) and return `path`.

    ``shape``: the fields of :class:`TinyShape` (TypeError for any other)."""
    sh = TinyShape(**shape)
    os.makedirs(path, exist_ok=True)
    tok = _tokenizer_for(sh.vocab_size)
    _save_weights(path, sh, seed)
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": sh.vocab_size,
        "hidden_size": sh.hidden_size, "intermediate_size": sh.intermediate_size or 3 * sh.hidden_size,
        "num_hidden_layers": sh.num_layers, "num_attention_heads": sh.num_heads, "num_key_value_heads": sh.num_kv_heads,
        "head_dim": sh.hidden_size // sh.num_heads, "max_position_embeddings": sh.max_position, "rms_norm_eps": 1e-5,
        "rope_theta": sh.rope_theta, "tie_word_embeddings": sh.tie_word_embeddings, "bos_token_id": 1,
        "eos_token_id": 2, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "torch_dtype": "float32",
        "_name_or_path": f"tiny-llama-seed{seed}",
    }
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as fh:
        json.dump(config, fh, indent=1)
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w", encoding="utf-8") as fh:
        json.dump({"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "add_bos_token": False,
                   "chat_template": CHAT_TEMPLATE, "model_max_length": sh.max_position}, fh, indent=1)
    return path


def _tokenizer_for(vocab_size: int):
    tok = build_tokenizer(min(vocab_size, 320))
    if tok.get_vocab_size() > vocab_size:
        raise ValueError(f"vocab_size={vocab_size} is smaller than the tokenizer's {tok.get_vocab_size()} tokens")
    return tok


def _save_weights(path: str, sh: TinyShape, seed: int) -> None:
    """model.safetensors: the same tensors, drawn in the same order, for the same (shape, seed)."""
    from safetensors.torch import save_file

    hidden_size, num_heads, num_kv_heads = sh.hidden_size, sh.num_heads, sh.num_kv_heads
    head_dim = hidden_size // num_heads
    inter = sh.intermediate_size or 3 * hidden_size
    g = torch.Generator().manual_seed(seed)

    def w(*dims: int, std: float = sh.weight_std) -> torch.Tensor:
        return (torch.randn(*dims, generator=g) * std).contiguous()

    def norm() -> torch.Tensor:
        return (1.0 + 0.1 * torch.randn(hidden_size, generator=g)).contiguous()

    tensors = {"model.embed_tokens.weight": w(sh.vocab_size, hidden_size, std=0.5)}
    for n in range(sh.num_layers):
        p = f"model.layers.{n}."
        tensors.update({
            p + "input_layernorm.weight": norm(),
            p + "self_attn.q_proj.weight": w(num_heads * head_dim, hidden_size),
            p + "self_attn.k_proj.weight": w(num_kv_heads * head_dim, hidden_size),
            p + "self_attn.v_proj.weight": w(num_kv_heads * head_dim, hidden_size),
            p + "self_attn.o_proj.weight": w(hidden_size, num_heads * head_dim),
            p + "post_attention_layernorm.weight": norm(),
            p + "mlp.gate_proj.weight": w(inter, hidden_size),
            p + "mlp.up_proj.weight": w(inter, hidden_size),
            p + "mlp.down_proj.weight": w(hidden_size, inter),
        })
    tensors["model.norm.weight"] = norm()
    if not sh.tie_word_embeddings:
        tensors["lm_head.weight"] = w(sh.vocab_size, hidden_size)
    save_file(tensors, os.path.join(path, "model.safetensors"))
