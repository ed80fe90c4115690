"""``public_error``: a library's error text as a client may see it (no panic text, no backtrace, bounded), and
``grammar_error_code``: the API error code that names a grammar engine's error."""

from __future__ import annotations

import logging

log = logging.getLogger("pdruntime.errors")

_INTERNAL = ("panicked", "backtrace", "RUST_BACKTRACE", ".rs:", "Traceback (most recent call last)")
MAX_PUBLIC_CHARS = 300


def public_error(text: str, what: str = "the grammar engine") -> str:
    """The first line of ``text``, bounded; a library panic or backtrace becomes a plain sentence naming ``what``
    and the full text goes to the log instead."""
    if any(k in text for k in _INTERNAL):
        log.warning("%s error (not shown to the client): %s", what, text[:4000])
        return f"{what} could not compile it (an internal limit of the engine); simplify the schema"
    return text.strip().splitlines()[0][:MAX_PUBLIC_CHARS] if text.strip() else "unknown error"


def grammar_error_code(text: str) -> str:
    """The API code of an llguidance error text: ``unsatisfiable_schema`` (it proved no value fits),
    ``grammar_limit`` (one of its internal limits), else ``invalid_grammar``."""
    if "Unsatisfiable schema" in text:
        return "unsatisfiable_schema"
    if "limit" in text.lower():  # e.g. "Too many items (limit 50000; ff_tokens)"
        return "grammar_limit"
    return "invalid_grammar"
