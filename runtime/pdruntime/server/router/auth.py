"""Who a router request is from and what it may do: API keys, the admin token, client identity (pure)."""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
from typing import Any


from pdruntime.util.headers import ADMIN_TOKEN_HEADER, REQUEST_ID_HEADER


def bearer(headers: Any) -> str | None:
    auth = headers.get("authorization", "")
    if auth.lower().startswith("bearer ") and auth[7:].strip():
        return auth[7:].strip()
    return None


MAX_CLIENT_REQUEST_ID = 128  # characters of a client's X-Request-Id kept in /debug/requests


def admin_token(headers: Any) -> str | None:
    """The admin token a request carries: X-PDStack-Admin-Token, else 'Authorization: Bearer'."""
    return (headers.get(ADMIN_TOKEN_HEADER) or "").strip() or bearer(headers)


def same_secret(given: str, expected: str) -> bool:
    """Constant-time comparison (digests of equal length)."""
    return hmac.compare_digest(hashlib.sha256(given.encode()).digest(), hashlib.sha256(expected.encode()).digest())


def client_request_id(headers: Any) -> str | None:
    """The client's own X-Request-Id, shown in /debug/requests so that a client (the agent probe) can find its
    request there; printable ASCII, truncated. Not the router's id (that stays unique per PD request)."""
    raw = headers.get(REQUEST_ID_HEADER)
    if not raw:
        return None
    return "".join(c for c in raw[:MAX_CLIENT_REQUEST_ID] if 32 < ord(c) < 127) or None


def key_name(key: str) -> str:
    """The attribution name of an API key without a name: a hash prefix, never the key."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:12]


def client_of(headers: Any) -> str:
    """Who sent a request with these headers (no API keys configured): the X-Client-Id header, else a name derived
    from the bearer token (a hash prefix, never the token), else "anonymous". Metric labels built from it have
    bounded cardinality."""
    explicit = headers.get("x-client-id")
    if explicit:
        return explicit[:64]
    token = bearer(headers)
    return key_name(token) if token else "anonymous"


MIN_API_KEY_CHARS = 16


def parse_api_keys(text: str, source: str = "api key file") -> dict[str, str]:
    """``--api-key-file`` contents -> {key: client name}. One key per line, optionally followed by a name
    (``KEY NAME``); blank lines and ``#`` comments are skipped. Errors name the line, never the key."""
    keys: dict[str, str] = {}
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split(None, 1)
        key, name = parts[0], (parts[1].strip() if len(parts) > 1 else "")
        if len(key) < MIN_API_KEY_CHARS:
            raise ValueError(f"{source} line {n}: the key is {len(key)} characters; accepted: keys of at least "
                             f"{MIN_API_KEY_CHARS} characters")
        if key in keys:
            raise ValueError(f"{source} line {n}: the key repeats an earlier line; accepted: each key once")
        if name and not all(c.isalnum() or c in "-_.@:" for c in name) or len(name) > 64:
            raise ValueError(f"{source} line {n}: name {name[:64]!r} is not accepted; accepted: up to 64 of "
                             "letters, digits and -_.@:")
        keys[key] = name or key_name(key)
    if not keys:
        raise ValueError(f"{source} holds no key; accepted: one key per line, optionally followed by a name")
    return keys


def match_api_key(keys: dict[str, str], token: str | None) -> str | None:
    """The name of ``token``'s key, or None. Compares against every key in constant time per key (digests of
    equal length), so neither the match position nor a common prefix shows in the timing."""
    if token is None:
        return None
    probe = hashlib.sha256(token.encode()).digest()
    found: str | None = None
    for key, name in keys.items():
        if hmac.compare_digest(hashlib.sha256(key.encode()).digest(), probe):
            found = name
    return found


def is_loopback(host: str | None) -> bool:
    try:
        return host is not None and ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
