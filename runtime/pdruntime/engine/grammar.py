"""Structured output: grammar matchers (llguidance) that give the sampler a token bitmask per step.

A request's ``SamplingParams.grammar`` is an llguidance grammar string (JSON schema, Lark; built from OpenAI's
``response_format`` / ``tools`` by ``server/openai/structured.py``). Each sequence owns one matcher; before each
sample the matcher's bitmask (int32 [ceil(V/32)], bit t allows token t) goes into the batched sampler, and the
sampled token advances it. A decode worker re-creates the matcher and advances it by the tokens prefill already
emitted, so constrained decoding continues across the PD split.

Why llguidance: maintained (Microsoft, used by vLLM, SGLang and llama.cpp), a small self-contained wheel with no
torch dependency (xgrammar pins torch/transformers), JSON Schema and Lark grammars with ``%json`` embedded, and
mask computation in ~tens of microseconds per token without a per-schema precompile step.

Errors name their cause (``util.public_error.grammar_error_code``): a grammar that does not compile is
``invalid_grammar``, one that llguidance proves unsatisfiable ``unsatisfiable_schema``, one past its internal
limits ``grammar_limit``. A matcher that reaches a dead end while generating (no token can continue and the output
is not complete: e.g. a schema whose ``$ref`` cycle has no base case) raises :class:`GrammarError` and its request
fails with that code, never finishing "stop" on a cut value.
"""

from __future__ import annotations

from typing import Any

import torch

from pdruntime.util.public_error import grammar_error_code as error_code, public_error

from .config import InvalidRequest


class GrammarError(RuntimeError):
    """A request's grammar failed while generating; ``code`` is the API's name for the cause."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


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
            err = m.get_error()
            raise InvalidRequest(f"the structured-output grammar is invalid: {public_error(err)}", error_code(err))
        return m

    def _dead_end(self, matcher: Any) -> GrammarError:
        err = matcher.get_error()
        if error_code(err) == "grammar_limit":
            return GrammarError(f"the structured-output grammar passed a grammar-engine limit while generating: "
                                f"{public_error(err)}; accepted: a simpler schema", "grammar_limit")
        return GrammarError("the structured-output grammar reached a dead end while generating: no token can continue "
                            "the output and it is not complete (the schema is unsatisfiable along this path, e.g. a "
                            "$ref cycle without a base case); accepted: a schema that some finite JSON value satisfies",
                            "unsatisfiable_schema")

    def mask(self, matcher: Any) -> torch.Tensor:
        """int32 [ceil(V/32)] allowed tokens for the matcher's next token; GrammarError at a dead end."""
        raw = matcher.compute_bitmask()
        if matcher.is_error():
            raise self._dead_end(matcher)
        words = torch.frombuffer(bytearray(raw), dtype=torch.int32)
        need = -(-self.vocab_size // 32)
        return words[:need] if words.numel() >= need else torch.nn.functional.pad(words, (0, need - words.numel()))

    def advance(self, matcher: Any, token: int) -> None:
        if token in self.tokenizer.eos_token_ids and matcher.is_accepting():
            matcher.consume_token(token)
            return
        if not matcher.consume_token(token) or matcher.is_error():
            raise self._dead_end(matcher)

    def finished(self, matcher: Any) -> bool:
        return bool(matcher.is_stopped())
