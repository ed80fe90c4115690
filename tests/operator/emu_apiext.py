"""apiextensions as the real server does it, for stored objects and schemas (pure functions).

Follows k8s.io/apiextensions-apiserver: ``pkg/apiserver/schema/pruning`` (unknown fields dropped unless
``x-kubernetes-preserve-unknown-fields``; with ``fieldValidation=Strict`` they are an error instead),
``schema/defaulting`` (a ``default`` fills an absent field whose parent exists, before validation),
``pkg/apiserver/validation`` (go-openapi's messages: "spec.pairs in body should be greater than or equal
to 0", "Unsupported value", "Required value") and ``schema/cel`` (``x-kubernetes-validations`` evaluated
with ``self`` bound to the node, ``oldSelf`` on updates only; ``message``, ``fieldPath`` and ``reason``).
CEL runs on the ``common-expression-language`` library (Rust ``cel-interpreter``, compiled once per rule).

The same walker finds unknown fields of built-in kinds against their OpenAPI definitions (what the real
server's strict JSON decoder reports as ``unknown field "spec.foo"``).
"""

from __future__ import annotations

import copy
import functools
import json
from dataclasses import dataclass
from typing import Any

import cel

from emu_catalog import resolve


@dataclass(frozen=True)
class Cause:
    field: str
    message: str  # without the field, as in a Status cause: 'Invalid value: -5: spec.pairs in body ...'
    reason: str = "FieldValueInvalid"

    def __str__(self) -> str:
        return f"{self.field}: {self.message}" if self.field else self.message


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _node(schema: dict[str, Any] | None, defs: dict[str, Any]) -> dict[str, Any]:
    return resolve(schema, defs) if schema else {}


def _preserves(s: dict[str, Any]) -> bool:
    return bool(s.get("x-kubernetes-preserve-unknown-fields")) or bool(s.get("x-kubernetes-embedded-resource"))


# ---------------------------------------------------------------- pruning / unknown fields
def prune(obj: Any, schema: dict[str, Any] | None, defs: dict[str, Any], path: str = "", *,
          drop: bool = True, root: bool = True, structural: bool | None = None) -> list[str]:
    """Unknown fields of ``obj`` (dotted paths); removed from ``obj`` when ``drop``.

    ``structural`` (a CRD schema, the default without ``defs``): an object node that declares neither
    properties nor additionalProperties keeps no field, as apiextensions prunes. Built-in definitions
    without properties are free-form (``JSONSchemaPropsOrArray``, ``RawExtension``)."""
    if structural is None:
        structural = not defs
    s = _node(schema, defs)
    unknown: list[str] = []
    if isinstance(obj, dict):
        props = s.get("properties")
        extra = s.get("additionalProperties")
        for key in list(obj):
            if key.startswith("$") or (root and key in ("apiVersion", "kind", "metadata")):
                continue  # ObjectMeta is the server's own type; identity fields always known
            sub = (props or {}).get(key)
            if sub is None and isinstance(extra, dict):
                sub = extra
            if sub is None:
                if _preserves(s) or extra is True or (props is None and not structural):
                    continue  # a free-form object (no declared properties) keeps every field
                unknown.append(_join(path, key))
                if drop:
                    del obj[key]
                continue
            unknown += prune(obj[key], sub, defs, _join(path, key), drop=drop, root=False, structural=structural)
    elif isinstance(obj, list) and isinstance(s.get("items"), dict):
        for i, item in enumerate(obj):
            unknown += prune(item, s["items"], defs, f"{path}[{i}]", drop=drop, root=False, structural=structural)
    return unknown


def value_at(obj: Any, path: str) -> Any:
    """The value at a cause's field path (``spec.prefill.env[0].name``); a sentinel when absent."""
    import re
    cur = obj
    for name, idx in re.findall(r"([^.\[\]]+)|\[(\d+)\]", path):
        if name:
            if not isinstance(cur, dict) or name not in cur:
                return _ABSENT
            cur = cur[name]
        else:
            if not isinstance(cur, list) or int(idx) >= len(cur):
                return _ABSENT
            cur = cur[int(idx)]
    return cur


_ABSENT = object()


# ---------------------------------------------------------------- defaulting
def apply_defaults(obj: Any, schema: dict[str, Any] | None, defs: dict[str, Any]) -> None:
    s = _node(schema, defs)
    if isinstance(obj, dict):
        for key, sub in (s.get("properties") or {}).items():
            sub_s = _node(sub, defs)
            if key not in obj and "default" in sub_s:
                obj[key] = copy.deepcopy(sub_s["default"])
            if key in obj:
                apply_defaults(obj[key], sub, defs)
        if isinstance(s.get("additionalProperties"), dict):
            for key in obj:
                if key not in (s.get("properties") or {}):
                    apply_defaults(obj[key], s["additionalProperties"], defs)
    elif isinstance(obj, list) and isinstance(s.get("items"), dict):
        for item in obj:
            apply_defaults(item, s["items"], defs)


# ---------------------------------------------------------------- validation
_TYPES = {"object": dict, "array": list, "string": str, "boolean": bool}


def _type_ok(value: Any, t: str) -> bool:
    if t == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if t == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, _TYPES.get(t, object))


def _show(value: Any) -> str:
    return json.dumps(value) if isinstance(value, str) else ("null" if value is None else
                                                               json.dumps(value) if not isinstance(value, (dict, list))
                                                               else '"object"' if isinstance(value, dict) else
                                                               '"array"')


def _type_name(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    return {str: "string", dict: "object", list: "array"}.get(type(value), "null")


def validate(obj: Any, schema: dict[str, Any] | None, defs: dict[str, Any], path: str = "",
             old: Any = None, has_old: bool = False) -> list[Cause]:
    """Every schema violation of ``obj`` (structural checks, then the node's CEL rules)."""
    s = _node(schema, defs)
    if not s:
        return []
    out: list[Cause] = []
    if obj is None:
        return [] if s.get("nullable") or not s.get("type") else [
            Cause(path, f'Invalid value: "null": {path} in body must be of type {s["type"]}: "null"')]
    int_or_string = s.get("x-kubernetes-int-or-string") or s.get("format") == "int-or-string"
    t = s.get("type")
    if int_or_string:
        if not (isinstance(obj, str) or (isinstance(obj, int) and not isinstance(obj, bool))):
            return [Cause(path, f"Invalid value: {_show(obj)}: {path} in body must be of type integer,string: "
                                f'"{_type_name(obj)}"')]
    elif t and not _type_ok(obj, t):
        return [Cause(path, f"Invalid value: {_show(obj)}: {path} in body must be of type {t}: "
                            f'"{_type_name(obj)}"')]
    if "enum" in s and obj not in s["enum"]:
        allowed = ", ".join(json.dumps(v) for v in s["enum"])
        out.append(Cause(path, f"Unsupported value: {_show(obj)}: supported values: {allowed}",
                         "FieldValueNotSupported"))
    if isinstance(obj, (int, float)) and not isinstance(obj, bool):
        if "minimum" in s and (obj < s["minimum"] or (s.get("exclusiveMinimum") and obj == s["minimum"])):
            word = "greater than" if s.get("exclusiveMinimum") else "greater than or equal to"
            out.append(Cause(path, f"Invalid value: {obj}: {path} in body should be {word} {s['minimum']}"))
        if "maximum" in s and (obj > s["maximum"] or (s.get("exclusiveMaximum") and obj == s["maximum"])):
            word = "less than" if s.get("exclusiveMaximum") else "less than or equal to"
            out.append(Cause(path, f"Invalid value: {obj}: {path} in body should be {word} {s['maximum']}"))
    if isinstance(obj, str) and not int_or_string:
        if "minLength" in s and len(obj) < s["minLength"]:
            out.append(Cause(path, f"Invalid value: {_show(obj)}: {path} in body should be at least "
                                   f"{s['minLength']} chars long"))
        if "maxLength" in s and len(obj) > s["maxLength"]:
            out.append(Cause(path, f"Too long: may not be more than {s['maxLength']} bytes", "FieldValueTooLong"))
        if "pattern" in s:
            import re
            if not re.search(s["pattern"], obj):
                out.append(Cause(path, f"Invalid value: {_show(obj)}: {path} in body should match "
                                       f"'{s['pattern']}'"))
    if isinstance(obj, list):
        if "minItems" in s and len(obj) < s["minItems"]:
            out.append(Cause(path, f"Invalid value: {len(obj)}: {path} in body should have at least "
                                   f"{s['minItems']} items"))
        if "maxItems" in s and len(obj) > s["maxItems"]:
            out.append(Cause(path, f"Too many: {len(obj)}: must have at most {s['maxItems']} items",
                             "FieldValueTooMany"))
        out += _list_type(obj, s, path)
        if isinstance(s.get("items"), dict):
            for i, item in enumerate(obj):
                out += validate(item, s["items"], defs, f"{path}[{i}]")
    if isinstance(obj, dict):
        for req in s.get("required") or []:
            if req not in obj:
                out.append(Cause(_join(path, req), "Required value", "FieldValueRequired"))
        props = s.get("properties") or {}
        for key, value in obj.items():
            sub = props.get(key) or (s["additionalProperties"] if isinstance(s.get("additionalProperties"), dict)
                                     else None)
            if sub is not None and not (path == "" and key == "metadata"):
                old_v = old.get(key) if isinstance(old, dict) else None
                out += validate(value, sub, defs, _join(path, key), old_v,
                                has_old and isinstance(old, dict) and key in old)
    for alt in ("anyOf", "oneOf"):
        if s.get(alt) and not int_or_string:
            ok = [not validate(obj, sub, defs, path) for sub in s[alt]]
            if (alt == "anyOf" and not any(ok)) or (alt == "oneOf" and sum(ok) != 1):
                out.append(Cause(path, f"Invalid value: {_show(obj)}: {path} in body must match {alt}"))
    if not out:
        out += cel_violations(obj, s, path, old, has_old)
    return out


def _list_type(items: list[Any], s: dict[str, Any], path: str) -> list[Cause]:
    lt = s.get("x-kubernetes-list-type")
    if lt == "set":
        seen: list[Any] = []
        for i, v in enumerate(items):
            if v in seen:
                return [Cause(f"{path}[{i}]", f"Duplicate value: {_show(v)}", "FieldValueDuplicate")]
            seen.append(v)
    if lt == "map":
        keys = s.get("x-kubernetes-list-map-keys") or []
        seen_keys: list[Any] = []
        for i, v in enumerate(items):
            k = tuple((v or {}).get(key) for key in keys) if isinstance(v, dict) else v
            if k in seen_keys:
                shown = ", ".join(f'"{key}"={json.dumps((v or {}).get(key))}' for key in keys)
                return [Cause(f"{path}[{i}]", f"Duplicate value: map[string]interface {{}}{{{shown}}}",
                              "FieldValueDuplicate")]
            seen_keys.append(k)
    return []


# ---------------------------------------------------------------- CEL
@functools.lru_cache(maxsize=512)
def _program(rule: str) -> Any:
    return cel.compile(rule)


def compile_errors(schema: Any, path: str = "") -> list[Cause]:
    """Rules that do not compile (the CRD is refused, as the real server refuses it)."""
    out: list[Cause] = []
    if isinstance(schema, dict):
        for i, v in enumerate(schema.get("x-kubernetes-validations") or []):
            try:
                _program(v["rule"])
            except ValueError as e:
                out.append(Cause(f"{path}.x-kubernetes-validations[{i}].rule",
                                 f"Invalid value: {json.dumps(v['rule'])}: compilation failed: {e}"))
        for key in ("properties", "additionalProperties", "items"):
            sub = schema.get(key)
            if key == "properties" and isinstance(sub, dict):
                for k, v in sub.items():
                    out += compile_errors(v, f"{path}.properties[{k}]")
            elif isinstance(sub, dict):
                out += compile_errors(sub, f"{path}.{key}")
    return out


def cel_violations(obj: Any, s: dict[str, Any], path: str, old: Any = None, has_old: bool = False) -> list[Cause]:
    out = []
    for v in s.get("x-kubernetes-validations") or []:
        rule = v["rule"]
        if "oldSelf" in rule and not has_old:
            continue  # a transition rule runs on updates only
        ctx = {"self": obj}
        if has_old:
            ctx["oldSelf"] = old
        try:
            ok = _program(rule).execute(ctx)
        except Exception as e:  # noqa: BLE001 - an evaluation error is a rejection, as in the real server
            out.append(Cause(path, f"Invalid value: {_show(obj)}: {v.get('message') or rule}: evaluation error: {e}",
                             "FieldValueInvalid"))
            continue
        if ok is True:
            continue
        message = v.get("message") or f"failed rule: {rule}"
        if v.get("messageExpression"):
            try:
                message = str(_program(v["messageExpression"]).execute(ctx))
            except Exception:  # noqa: BLE001 - the real server falls back to message
                pass
        field_path = path + (v.get("fieldPath") or "") if v.get("fieldPath") else path
        reason = v.get("reason") or "FieldValueInvalid"
        shown = _show(obj) if not isinstance(obj, (dict, list)) else ('"object"' if isinstance(obj, dict)
                                                                        else '"array"')
        if reason == "FieldValueRequired":
            out.append(Cause(field_path, f"Required value: {message}", reason))
        elif reason == "FieldValueForbidden":
            out.append(Cause(field_path, f"Forbidden: {message}", reason))
        else:
            out.append(Cause(field_path, f"Invalid value: {shown}: {message}", reason))
    return out


def invalid_message(kind: str, group: str, name: str, causes: list[Cause]) -> str:
    """``PDDeployment.pdstack.io "x" is invalid: spec.pairs: Invalid value: ...`` (one cause or a list)."""
    qual = f"{kind}.{group}" if group else kind
    body = str(causes[0]) if len(causes) == 1 else "[" + ", ".join(map(str, causes)) + "]"
    return f'{qual} "{name}" is invalid: {body}'
