"""OpenAI ``response_format`` and forced ``tool_choice`` -> an llguidance grammar for the engine (pure).

* ``json_object``: any JSON object; ``json_schema``: that schema (``strict`` or not: always enforced).
* ``tool_choice: "required"``: one or more (``parallel_tool_calls``) tool calls of any listed tool, in the
  format of the tool-call parser (Hermes ``<tool_call>{json}</tool_call>`` or Llama-3 JSON), with arguments
  that validate against the tool's ``parameters``; a named function: exactly one call of that function.
* ``tool_choice: "auto"`` (the default with tools): no grammar; the output is parsed afterwards.

JSON is compact (``,`` and ``:`` without whitespace runs): a sampled run of whitespace can otherwise keep a small
model inside a valid-but-endless value until max_tokens.
"""

from __future__ import annotations

import json
import re
from typing import Any

from pdruntime.server.openai.tools import parser_for
from pdruntime.util.public_error import public_error

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _json_grammar(schema: dict) -> str:
    import llguidance

    try:
        return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=JSON_OPTIONS)
    except Exception as exc:  # the library's text may be a Rust panic with a backtrace: logged, not returned
        raise ValueError(f"response_format.json_schema cannot be compiled: {public_error(str(exc))}") from None


def _lark_json(schema: dict) -> str:
    return "%json " + json.dumps({**schema, "x-guidance": JSON_OPTIONS})


def _rebase_refs(node: Any, prefix: str) -> Any:
    """A copy of a tool's ``parameters`` whose local ``$ref``s point into the call schema's root ``$defs``:
    ``#/$defs/X`` and ``#/definitions/X`` -> ``#/$defs/{prefix}X``, any other ``#...`` (the parameters'
    own root, e.g. a recursive ``#``) -> ``#/$defs/{prefix}`` + the same pointer. Remote refs stay."""
    if isinstance(node, list):
        return [_rebase_refs(v, prefix) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: _rebase_refs(v, prefix) for k, v in node.items() if k not in ("$defs", "definitions")}
    ref = node.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        ptr = ref[1:]
        for defs in ("/$defs/", "/definitions/"):
            if ptr.startswith(defs):
                out["$ref"] = f"#/$defs/{prefix}{ptr[len(defs):]}"
                break
        else:
            out["$ref"] = f"#/$defs/{prefix}{ptr}"
    return out


def _hoisted_defs(params: dict, prefix: str) -> dict:
    """The parameters' ``$defs``/``definitions`` (rebased), plus the parameters themselves under ``{prefix}``
    (the target of refs to their root)."""
    defs = {**params.get("definitions", {}), **params.get("$defs", {})}
    out = {f"{prefix}{name}": _rebase_refs(d, prefix) for name, d in defs.items()}
    out[prefix] = _rebase_refs(params, prefix)
    return out


def _call_schema(fn: Any, args_key: str, prefix: str, defs: dict) -> dict:
    """One call ``{"name": const, args_key: parameters}``; the parameters' definitions go into ``defs`` (the
    root's: a ``$ref`` resolves against the document root, and the parameters are nested under it)."""
    params = fn.parameters or {"type": "object"}
    defs.update(_hoisted_defs(params, prefix))
    return {"type": "object", "properties": {"name": {"const": fn.name}, args_key: {"$ref": f"#/$defs/{prefix}"}},
            "required": ["name", args_key], "additionalProperties": False}


def tool_grammar(tools: list, named: str | None, parallel: bool, parser: str) -> str:
    """Lark grammar forcing tool calls (of ``named`` only, when given) in ``parser``'s format."""
    fns = [t.function for t in tools if named is None or t.function.name == named]
    p = parser_for(parser)
    defs: dict = {}
    calls = [_call_schema(f, p.args_key, f"tool{i}_", defs) for i, f in enumerate(fns)]
    schema = {**(calls[0] if len(calls) == 1 else {"anyOf": calls}), "$defs": defs}
    many = "+" if parallel and named is None else ""
    return p.lark(_lark_json(schema), many)


MAX_SCHEMA_BYTES = 64 << 10  # bytes of one schema (a json_schema, one tool's parameters), as compact JSON
MAX_TOOLS_SCHEMA_BYTES = 256 << 10  # bytes of every tool's parameters together
MAX_SCHEMA_DEPTH = 64  # nesting of JSON objects and arrays in one schema ("properties" maps count: ~32 object levels)
MAX_PATTERN_CHARS = 1000  # characters of one regex (pattern, patternProperties keys)
MAX_PATTERN_REPEAT = 256  # largest bound of a counted repetition {m,n} in a regex (each one multiplies states)
_REPEAT = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")


def _schema_depth_and_patterns(schema: Any) -> tuple[int, list[str]]:
    """(nesting depth, every regex) of a JSON schema, walked without recursion (a 500-deep body stays cheap)."""
    depth, patterns = 0, []
    stack = [(schema, 1)]
    while stack:
        node, d = stack.pop()
        depth = max(depth, d)
        if depth > MAX_SCHEMA_DEPTH:
            break
        if isinstance(node, dict):
            if isinstance(node.get("pattern"), str):
                patterns.append(node["pattern"])
            if isinstance(node.get("patternProperties"), dict):
                patterns.extend(k for k in node["patternProperties"] if isinstance(k, str))
            stack.extend((v, d + 1) for v in node.values() if isinstance(v, (dict, list)))
        elif isinstance(node, list):
            stack.extend((v, d + 1) for v in node if isinstance(v, (dict, list)))
    return depth, patterns


def check_schema_bounds(schema: Any, where: str) -> int:
    """The schema's compact size in bytes, or ValueError naming the limit it passes (size, depth, regex length,
    counted repetition): grammar compilation is then bounded before it starts. ``where`` names the field."""
    depth, patterns = _schema_depth_and_patterns(schema)
    if depth > MAX_SCHEMA_DEPTH:
        raise ValueError(f"{where} is nested more than {MAX_SCHEMA_DEPTH} levels deep; accepted: at most "
                         f"{MAX_SCHEMA_DEPTH} levels of objects and arrays")
    size = len(json.dumps(schema, separators=(",", ":")))
    if size > MAX_SCHEMA_BYTES:
        raise ValueError(f"{where} is {size} bytes as JSON; accepted: at most {MAX_SCHEMA_BYTES} bytes")
    for pat in patterns:
        if len(pat) > MAX_PATTERN_CHARS:
            raise ValueError(f"a regex in {where} has {len(pat)} characters; accepted: at most {MAX_PATTERN_CHARS}")
        for m in _REPEAT.finditer(pat):
            bound = max(int(m.group(1)), int(m.group(2) or 0))
            if bound > MAX_PATTERN_REPEAT:
                raise ValueError(f"a regex in {where} repeats {m.group(0)!r}; accepted: counted repetitions up to "
                                 f"{{{MAX_PATTERN_REPEAT}}}")
    return size


def check_grammar_bounds(req: Any) -> None:
    """Every schema a request would compile into a grammar, bounded at the edge (a 400 naming the limit)."""
    rf = req.response_format
    if rf is not None and rf.type == "json_schema" and rf.json_schema.schema_ is not None:
        check_schema_bounds(rf.json_schema.schema_, "response_format.json_schema.schema")
    total = 0
    for i, t in enumerate(req.tools or ()):
        if t.function.parameters:
            total += check_schema_bounds(t.function.parameters, f"tools[{i}].function.parameters")
    if total > MAX_TOOLS_SCHEMA_BYTES:
        raise ValueError(f"the tools' parameters are {total} bytes as JSON together; accepted: at most "
                         f"{MAX_TOOLS_SCHEMA_BYTES} bytes")


def check_chat(req: Any) -> None:
    """Unsupported combinations and unbounded grammars: ValueError naming the parameter (the schema layer makes
    it a 400)."""
    check_grammar_bounds(req)
    tc = req.tool_choice
    if tc is not None and tc != "none" and not req.tools:
        raise ValueError("tool_choice needs tools; accepted: tools with tool_choice, or no tool_choice")
    if isinstance(tc, dict) or hasattr(tc, "function"):
        name = tc.function.name
        if not any(t.function.name == name for t in req.tools or ()):
            raise ValueError(f"tool_choice names function {name!r}, which is not in tools; accepted: one of "
                             f"{[t.function.name for t in req.tools or ()]}")
    forced = tc == "required" or hasattr(tc, "function")
    if forced and req.response_format is not None and req.response_format.type != "text":
        raise ValueError("response_format with a forced tool_choice is not supported (both constrain the output); "
                         "accepted: one of them")


def chat_grammar(req: Any, parser: str = "hermes") -> str | None:
    """The grammar a request's ``tool_choice`` / ``response_format`` asks for (None: free text)."""
    tc = req.tool_choice
    if req.tools and (tc == "required" or hasattr(tc, "function")):
        named = tc.function.name if hasattr(tc, "function") else None
        return tool_grammar(req.tools, named, req.parallel_tool_calls, parser)
    rf = req.response_format
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        return _json_grammar({"type": "object"})
    return _json_grammar(rf.json_schema.schema_ or {"type": "object"})
