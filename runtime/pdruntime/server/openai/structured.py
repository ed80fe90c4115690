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
from pdruntime.util.public_error import grammar_error_code, public_error

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A schema the grammar engine cannot use: ``code`` names the cause (``invalid_json_schema``,
    ``unsatisfiable_schema``, ``grammar_limit``), ``param`` the request field that holds it."""

    def __init__(self, message: str, code: str, param: str) -> None:
        super().__init__(message)
        self.code = code
        self.param = param


def _json_grammar(schema: dict, param: str = "response_format") -> str:
    import llguidance

    try:
        return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=JSON_OPTIONS)
    except Exception as exc:  # the library's text may be a Rust panic with a backtrace: logged, not returned
        raise GrammarError(f"{param}: the JSON schema cannot be compiled: {public_error(str(exc))}; accepted: JSON "
                           "Schema the grammar engine supports (docs/api.md)", "invalid_json_schema", param) from None


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


MAX_INSTANCE_ROUNDS = 64  # rounds of the finite-instance fixpoint (each proves one more $ref target); past: not judged


def _resolve(root: Any, ref: str) -> Any:
    """A local ``$ref``'s target in ``root`` (``#``, ``#/$defs/X``, any JSON pointer); None when not local or absent."""
    if not ref.startswith("#"):
        return None
    node = root
    for part in filter(None, ref[1:].split("/")):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _has_instance(node: Any, root: Any, known: set[int], memo: dict[int, bool]) -> bool:
    """Whether some finite JSON value satisfies ``node``, given that the ``$ref`` targets whose ids are in ``known``
    have one. Conservative: false only for what it proves (a false schema, ``not: {}``, ``enum: []``, and required
    properties, minItems, allOf/anyOf/oneOf and ``$ref`` built only on such); anything else counts as satisfiable."""
    if isinstance(node, bool):
        return node
    if not isinstance(node, dict):
        return True
    if id(node) in memo:
        return memo[id(node)]

    def sub(x: Any) -> bool:
        return _has_instance(x, root, known, memo)

    ok = node.get("not") not in (True, {}) and node.get("enum") != []
    ref = node.get("$ref")
    if ok and isinstance(ref, str):
        target = _resolve(root, ref)
        if isinstance(target, bool):
            ok = target
        else:  # not local or absent (None): not judged; a dict: satisfiable once proven so
            ok = not isinstance(target, dict) or id(target) in known
    if ok and isinstance(node.get("allOf"), list):
        ok = all(sub(x) for x in node["allOf"])
    for key in ("anyOf", "oneOf"):
        if ok and isinstance(node.get(key), list) and node[key]:
            ok = any(sub(x) for x in node[key])
    kind = node.get("type")
    if ok and kind in ("object", ["object"]) and isinstance(node.get("required"), list):
        props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        extra = True if node.get("patternProperties") else node.get("additionalProperties", True)
        ok = all(sub(props.get(name, extra)) for name in node["required"] if isinstance(name, str))
    least = node.get("minItems", 0)
    if ok and kind in ("array", ["array"]) and isinstance(least, int) and least > 0:
        prefix = node.get("prefixItems") if isinstance(node.get("prefixItems"), list) else []
        ok = all(sub(x) for x in prefix[:least]) and (least <= len(prefix) or sub(node.get("items", True)))
    memo[id(node)] = ok
    return ok


def has_finite_instance(schema: Any) -> bool | None:
    """Whether some finite JSON value satisfies ``schema`` (see :func:`_has_instance`): the least fixpoint over its
    local ``$ref`` targets, so a cycle of refs with no base case has none. None: not judged (too many rounds)."""
    targets: dict[int, Any] = {}
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            target = _resolve(schema, node["$ref"]) if isinstance(node.get("$ref"), str) else None
            if isinstance(target, dict):
                targets[id(target)] = target
            stack.extend(v for v in node.values() if isinstance(v, (dict, list)))
        elif isinstance(node, list):
            stack.extend(v for v in node if isinstance(v, (dict, list)))
    known: set[int] = set()
    for _ in range(MAX_INSTANCE_ROUNDS):
        memo: dict[int, bool] = {}
        grown = {k for k, t in targets.items() if k not in known and _has_instance(t, schema, known, memo)}
        if not grown:
            return _has_instance(schema, schema, known, {})
        known |= grown
    return None


def _engine_text(messages: list[str]) -> str:
    """llguidance's first error as one line: a regex error's header ("regex parse error:") with its cause."""
    lines = [ln.strip() for ln in (messages[0] if messages else "unknown error").splitlines() if ln.strip()]
    cause = next((ln for ln in lines[1:] if ln.startswith("error:")), None) if lines and lines[0].endswith(":") else None
    return public_error(f"{lines[0]} {cause}" if cause else "\n".join(lines))


def check_schema(schema: Any, param: str) -> None:
    """GrammarError unless the grammar engine can enforce ``schema`` (the field ``param``): it compiles, and
    neither llguidance (contradicting bounds, empty enums, required values no schema admits...) nor
    :func:`has_finite_instance` (``$ref`` cycles without a base case, ``not: {}``) proves it unsatisfiable."""
    import llguidance

    accepted = "accepted: a schema that some finite JSON value satisfies"
    if has_finite_instance(schema) is False:
        raise GrammarError(f"{param}: the JSON schema is unsatisfiable: no finite JSON value satisfies it (a required "
                           "value that only a $ref cycle without a base case, 'not: {}', 'enum: []' or a false "
                           f"schema could fill); {accepted}", "unsatisfiable_schema", param)
    grammar = _json_grammar(schema, param)
    try:
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    except Exception as exc:  # a library panic: logged by public_error, a sentence for the client
        failed, messages = True, [str(exc)]
    if failed:
        text = _engine_text(messages)
        code = grammar_error_code(text)
        if code == "unsatisfiable_schema":
            raise GrammarError(f"{param}: the JSON schema is unsatisfiable ({text}); {accepted}", code, param)
        if code == "grammar_limit":
            raise GrammarError(f"{param}: the JSON schema passes a grammar-engine limit ({text}); accepted: a "
                               "simpler schema", code, param)
        raise GrammarError(f"{param}: the JSON schema cannot be compiled ({text}); accepted: JSON Schema the grammar "
                           "engine supports (docs/api.md)", "invalid_json_schema", param)


def check_satisfiable(req: Any) -> None:
    """Every schema the request's grammar enforces (``response_format``; with a forced ``tool_choice``, the
    parameters of each tool it may call), checked by :func:`check_schema`."""
    rf = req.response_format
    if rf is not None and rf.type == "json_schema" and rf.json_schema.schema_ is not None:
        check_schema(rf.json_schema.schema_, "response_format")
    tc = req.tool_choice
    if req.tools and (tc == "required" or hasattr(tc, "function")):
        named = tc.function.name if hasattr(tc, "function") else None
        for i, t in enumerate(req.tools):
            if t.function.parameters and named in (None, t.function.name):
                check_schema(t.function.parameters, f"tools[{i}].function.parameters")


def _bounded(schema: Any, where: str, param: str) -> int:
    try:
        return check_schema_bounds(schema, where)
    except ValueError as exc:
        raise GrammarError(str(exc), "grammar_limit", param) from None


def check_grammar_bounds(req: Any) -> None:
    """Every schema a request would compile into a grammar, bounded at the edge (GrammarError ``grammar_limit``:
    a 400 naming the limit)."""
    rf = req.response_format
    if rf is not None and rf.type == "json_schema" and rf.json_schema.schema_ is not None:
        _bounded(rf.json_schema.schema_, "response_format.json_schema.schema", "response_format")
    total = 0
    for i, t in enumerate(req.tools or ()):
        if t.function.parameters:
            where = f"tools[{i}].function.parameters"
            total += _bounded(t.function.parameters, where, where)
    if total > MAX_TOOLS_SCHEMA_BYTES:
        raise GrammarError(f"the tools' parameters are {total} bytes as JSON together; accepted: at most "
                           f"{MAX_TOOLS_SCHEMA_BYTES} bytes", "grammar_limit", "tools")


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
    check_satisfiable(req)


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
