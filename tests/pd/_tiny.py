"""Fallback tiny random HF-layout checkpoint for tests/pd, used only while
``pdruntime.model.testing.write_tiny_checkpoint`` (the engine helper's) is unavailable."""

from __future__ import annotations

import json
import os


def write_tiny_checkpoint_fallback(path, *, seed=0, num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2,
                                   vocab_size=512, max_position=2048):
    import torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    os.makedirs(path, exist_ok=True)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    corpus = ["the quick brown fox jumps over the lazy dog", "hello world, how are you today?",
              "user assistant system round agent context"] * 20
    tok.train_from_iterator(corpus, trainer)
    tok.save(os.path.join(path, "tokenizer.json"))
    vocab = tok.get_vocab_size()
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    with open(os.path.join(path, "tokenizer_config.json"), "w") as fh:
        json.dump({"chat_template": template, "eos_token": "<|im_end|>", "bos_token": None}, fh)
    head_dim = hidden_size // num_heads
    inter = hidden_size * 2
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden_size,
           "intermediate_size": inter, "num_hidden_layers": num_layers, "num_attention_heads": num_heads,
           "num_key_value_heads": num_kv_heads, "vocab_size": vocab, "max_position_embeddings": max_position,
           "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
           "eos_token_id": tok.token_to_id("<|im_end|>"), "_name_or_path": "tiny-random-llama"}
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump(cfg, fh)
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: (torch.randn(*s, generator=g) * 0.1).contiguous()
    t = {"model.embed_tokens.weight": r(vocab, hidden_size), "model.norm.weight": torch.ones(hidden_size),
         "lm_head.weight": r(vocab, hidden_size)}
    for n in range(num_layers):
        p = f"model.layers.{n}."
        t[p + "input_layernorm.weight"] = torch.ones(hidden_size)
        t[p + "post_attention_layernorm.weight"] = torch.ones(hidden_size)
        t[p + "self_attn.q_proj.weight"] = r(num_heads * head_dim, hidden_size)
        t[p + "self_attn.k_proj.weight"] = r(num_kv_heads * head_dim, hidden_size)
        t[p + "self_attn.v_proj.weight"] = r(num_kv_heads * head_dim, hidden_size)
        t[p + "self_attn.o_proj.weight"] = r(hidden_size, num_heads * head_dim)
        t[p + "mlp.gate_proj.weight"] = r(inter, hidden_size)
        t[p + "mlp.up_proj.weight"] = r(inter, hidden_size)
        t[p + "mlp.down_proj.weight"] = r(hidden_size, inter)
    save_file(t, os.path.join(path, "model.safetensors"))
    return path


def write_tiny(path):
    try:
        from pdruntime.model.testing import write_tiny_checkpoint
    except ImportError:
        return write_tiny_checkpoint_fallback(path)
    return write_tiny_checkpoint(path)
