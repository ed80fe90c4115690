"""Structured output: grammar matchers (llguidance) that give the sampler a token bitmask per step.

A request's ``SamplingParams.grammar`` is an llguidance grammar string (JSON schema, Lark; built from OpenAI's
``response_format`` / ``tools`` by ``server/openai/structured.py``). Each sequence owns one matcher; before each
sample the matcher's bitmask (int32 [ceil(V/32)], bit t allows token t) goes into the batched sampler, and the
sampled token advances it. A decode worker re-creates the matcher and advances it by the tokens prefill already
emitted, so constrained decoding continues across the PD split.

Why llguidance: maintained (Microsoft, used by vLLM, SGLang and llama.cpp), a small self-contained wheel with no
torch dependency (xgrammar pins torch/transformers), JSON Schema and Lark grammars with ``%json`` embedded, and
mask computation in ~tens of microseconds per token without a per-schema precompile step.
"""

from __future__ import annotations

from typing import Any

import torch

from pdruntime.util.public_error import public_error

from .config import InvalidRequest


class Grammars:
    """The engine's grammar backend: one llguidance tokenizer (built on first use) and matcher helpers."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._ll_tok = None

    def _lltok(self):
        if self._ll_tok is None:
            import llguidance

            eos = sorted(self.tokenizer.eos_token_ids)
            self._ll_tok = llguidance.LLTokenizer(self.tokenizer.backend.to_str(), n_vocab=self.vocab_size,
                                                  eos_token=eos[0] if eos else None)
        return self._ll_tok

    def matcher(self, grammar: str) -> Any:
        import llguidance

        m = llguidance.LLMatcher(self._lltok(), grammar, log_level=0)
        if m.is_error():
            raise InvalidRequest(f"the structured-output grammar is invalid: {public_error(m.get_error())}")
        return m

    def mask(self, matcher: Any) -> torch.Tensor:
        """int32 [ceil(V/32)] allowed tokens for the matcher's next token."""
        raw = matcher.compute_bitmask()
        words = torch.frombuffer(bytearray(raw), dtype=torch.int32)
        need = -(-self.vocab_size // 32)
        return words[:need] if words.numel() >= need else torch.nn.functional.pad(words, (0, need - words.numel()))

    def advance(self, matcher: Any, token: int) -> None:
        if token in self.tokenizer.eos_token_ids and matcher.is_accepting():
            matcher.consume_token(token)
            return
        if not matcher.consume_token(token):
            raise RuntimeError(f"token {token} is outside the grammar: {matcher.get_error()[:200]}")

    def finished(self, matcher: Any) -> bool:
        return bool(matcher.is_stopped())
