"""Bounded grammar work (issue 20, build item 9): schemas are capped at the edge with a 400 naming the limit, and
no message carries a library's panic text or backtrace (the log does)."""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from pdruntime.server.openai.structured import (MAX_PATTERN_REPEAT, MAX_SCHEMA_BYTES, MAX_SCHEMA_DEPTH,
                                                check_schema_bounds)
from pdruntime.util.public_error import public_error

SHARED_STACK = True  # its traffic leaves the stack as it found it: the process's shared stack (tiny_stack.py)


def _deep(n: int) -> dict:
    root = cur = {"type": "object"}
    for _ in range(n):
        cur["properties"] = {"a": {"type": "object"}}
        cur = cur["properties"]["a"]
    return root


def _deep_items(n: int) -> dict:
    """An array of arrays ... ``n`` schema levels deep, one JSON level each (a body a JSON parser takes)."""
    root = cur = {"type": "array"}
    for _ in range(n - 1):
        cur["items"] = {"type": "array"}
        cur = cur["items"]
    return root


def _big(nbytes: int) -> dict:
    return {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 80}
                                             for i in range(nbytes // 100)}}


PATHOLOGICAL = {"type": "object", "properties": {"s": {"type": "string", "pattern": "^((a{1,1000}){1,1000})+$"}},
                "required": ["s"]}


@pytest.mark.parametrize("schema, needle", [
    (_big(1 << 20), f"accepted: at most {MAX_SCHEMA_BYTES} bytes"),
    (_deep(500), f"accepted: at most {MAX_SCHEMA_DEPTH} levels"),
    (PATHOLOGICAL, f"counted repetitions up to {{{MAX_PATTERN_REPEAT}}}"),
    ({"type": "string", "pattern": "a" * 1001}, "accepted: at most 1000"),
])
def test_a_schema_past_a_limit_is_refused_naming_it(schema, needle):
    with pytest.raises(ValueError, match=None) as exc:
        check_schema_bounds(schema, "response_format.json_schema.schema")
    assert needle in str(exc.value) and "response_format.json_schema.schema" in str(exc.value)


def test_schemas_within_the_limits_pass_with_their_size():
    assert check_schema_bounds(_deep(MAX_SCHEMA_DEPTH // 2 - 1), "x") > 0  # two JSON levels per object level
    assert check_schema_bounds({"type": "string", "pattern": "^[a-z]{1,256}$"}, "x") > 0


def test_a_panic_becomes_a_sentence_and_goes_to_the_log(caplog):
    panic = ("thread '<unnamed>' panicked at src/grammar.rs:120:9:\nassertion failed: grammar.symbols.len() < "
             "u16::MAX\nstack backtrace:\n   0: rust_begin_unwind")
    with caplog.at_level(logging.WARNING, logger="pdruntime.errors"):
        msg = public_error(panic)
    assert "panicked" not in msg and "backtrace" not in msg and ".rs" not in msg and "simplify" in msg
    assert "grammar.symbols.len()" in caplog.text
    assert public_error("Pointer '/$defs/City' does not exist\nmore") == "Pointer '/$defs/City' does not exist"


def _schema_request(url: str, model: str, schema: dict) -> tuple[int, float, dict]:
    t0 = time.monotonic()
    r = httpx.post(url + "/v1/chat/completions", timeout=60, json={
        "model": model, "messages": [{"role": "user", "content": "json please"}], "max_tokens": 8,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}})
    return r.status_code, time.monotonic() - t0, r.json()


@pytest.mark.parametrize("schema, needle", [(_big(1 << 20), "bytes"), (_deep_items(500), "levels"),
                                            (PATHOLOGICAL, "counted repetitions")])
def test_through_the_router_each_gets_a_quick_400_and_clean_traffic_is_undisturbed(stack, model_id, schema, needle):
    with ThreadPoolExecutor(2) as pool:
        clean = pool.submit(lambda: httpx.post(stack.router.url + "/v1/chat/completions", timeout=60, json={
            "model": model_id, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}))
        status, secs, body = _schema_request(stack.router.url, model_id, schema)
        assert clean.result().status_code == 200
    msg = body["error"]["message"]
    assert status == 400 and needle in msg and "accepted" in msg, body
    assert "panicked" not in msg and "backtrace" not in msg
    assert secs < 10, secs  # generous: the point is that nothing compiles (today a 1 MB schema took 7.9 s)
