"""Tokenizer (HF ``tokenizers``) plus the model's chat template rendered with jinja2."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Iterable

from tokenizers import Tokenizer as _HFTokenizer

from .config import ModelLoadError

# GGUF token types (llama.cpp): 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte
_GGUF_CONTROL, _GGUF_USER_DEFINED = 3, 4


@dataclass
class Tokenizer:
    """encode/decode text, render the chat template, know the end-of-sequence ids."""

    backend: _HFTokenizer
    eos_token_ids: frozenset[int]
    bos_token_id: int | None = None
    add_bos: bool = False
    chat_template: str | None = None
    special_tokens: dict[str, str] = field(default_factory=dict)  # bos_token / eos_token strings for templates

    def encode(self, text: str) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if self.add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=False)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """Render ``messages`` ([{"role": ..., "content": ...}]) with the model's template (jinja2, sandboxed)."""
        if not self.chat_template:
            raise ValueError("this model has no chat template; send a plain prompt instead")
        for m in messages:
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError(f"chat message {m!r} is invalid; accepted: {{'role': str, 'content': str}}")
        return _compile(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, **self.special_tokens)


_TEMPLATE_CACHE: dict[str, Any] = {}


def _compile(source: str):
    tpl = _TEMPLATE_CACHE.get(source)
    if tpl is None:
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str):
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
        tpl = _TEMPLATE_CACHE[source] = env.from_string(source)
    return tpl


def tokenizer_from_json(tokenizer_json: str, config: dict, eos_ids: Iterable[int]) -> Tokenizer:
    """HF layout: tokenizer.json + tokenizer_config.json (chat_template, bos/eos strings)."""
    backend = _HFTokenizer.from_file(tokenizer_json)
    specials = {}
    for key in ("bos_token", "eos_token"):
        tok = config.get(key)
        if isinstance(tok, dict):
            tok = tok.get("content")
        if tok:
            specials[key] = tok
    eos = set(int(i) for i in eos_ids)
    if "eos_token" in specials:
        tid = backend.token_to_id(specials["eos_token"])
        if tid is not None:
            eos.add(tid)
    bos_id = backend.token_to_id(specials["bos_token"]) if "bos_token" in specials else None
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: take "default"
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return Tokenizer(backend=backend, eos_token_ids=frozenset(eos), bos_token_id=bos_id,
                     add_bos=bool(config.get("add_bos_token", False)), chat_template=template,
                     special_tokens=specials)


def tokenizer_from_gguf(meta: dict[str, Any]) -> Tokenizer:
    """Build a byte-level BPE tokenizer from GGUF ``tokenizer.ggml.*`` metadata (model ``gpt2``)."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers

    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ModelLoadError(f"GGUF tokenizer model {kind!r} is not supported; accepted: gpt2 (byte-level BPE)")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    merges: list[str] = meta.get("tokenizer.ggml.merges") or []
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    vocab = {t: i for i, t in enumerate(tokens)}
    merge_pairs = [tuple(m.split(" ", 1)) for m in merges]
    bpe = models.BPE(vocab=vocab, merges=merge_pairs, fuse_unk=False, byte_fallback=False)
    backend = _HFTokenizer(bpe)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if meta.get("tokenizer.ggml.pre") == "smollm":  # llama.cpp "smollm": digits split one by one, then GPT-2 regex
        backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        backend.pre_tokenizer = byte_level
    backend.decoder = decoders.ByteLevel()
    specials = [AddedToken(t, special=True, normalized=False)
                for t, ty in zip(tokens, types) if ty in (_GGUF_CONTROL, _GGUF_USER_DEFINED)]
    backend.add_special_tokens(specials)
    bos = meta.get("tokenizer.ggml.bos_token_id")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    eos_ids = {int(eos)} if eos is not None else set()
    eot = meta.get("tokenizer.ggml.eot_token_id")
    if eot is not None:
        eos_ids.add(int(eot))
    template = meta.get("tokenizer.chat_template")
    # a chat-tuned model also ends a turn with its end-of-turn marker (e.g. <|im_end|>)
    if template and "<|im_end|>" in vocab and "<|im_end|>" in template:
        eos_ids.add(vocab["<|im_end|>"])
    special_strings = {}
    if bos is not None and 0 <= int(bos) < len(tokens):
        special_strings["bos_token"] = tokens[int(bos)]
    if eos is not None and 0 <= int(eos) < len(tokens):
        special_strings["eos_token"] = tokens[int(eos)]
    return Tokenizer(backend=backend, eos_token_ids=frozenset(eos_ids),
                     bos_token_id=int(bos) if bos is not None else None,
                     add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
                     chat_template=template, special_tokens=special_strings)
