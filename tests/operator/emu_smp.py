"""Strategic merge patch for built-in kinds (k8s.io/apimachinery/pkg/util/strategicpatch), a pure function.

Patch metadata comes from the OpenAPI definitions (``x-kubernetes-patch-strategy``,
``x-kubernetes-patch-merge-key``), as the server reads it from the Go struct tags:

* maps merge; ``null`` deletes a key; ``$patch: replace`` replaces the map, ``$patch: delete`` removes it;
* ``$retainKeys: [..]`` (strategy ``retainKeys``) drops the keys of the original not listed;
* lists with strategy ``merge`` merge by their merge key (primitive lists: union); an item
  ``{$patch: delete, key: v}`` removes the item; ``{$patch: replace}`` in the list replaces it;
  ``$deleteFromPrimitiveList/<field>`` removes values; ``$setElementOrder/<field>`` orders the result;
* every other list is replaced.
"""

from __future__ import annotations

import copy
from typing import Any

from emu_catalog import resolve

PATCH = "$patch"
RETAIN = "$retainKeys"
ORDER = "$setElementOrder/"
DELETE_PRIMITIVE = "$deleteFromPrimitiveList/"


def _strategy(s: dict[str, Any]) -> set[str]:
    return set(filter(None, (s.get("x-kubernetes-patch-strategy") or "").split(",")))


def apply_patch(original: Any, patch: Any, schema: dict[str, Any] | None, defs: dict[str, Any]) -> Any:
    """``original`` with the strategic merge ``patch`` applied (neither argument is modified)."""
    return _merge_map(copy.deepcopy(original) if isinstance(original, dict) else {}, patch, schema or {}, defs)


def _child(schema: dict[str, Any], key: str, defs: dict[str, Any]) -> dict[str, Any]:
    s = resolve(schema, defs)
    sub = (s.get("properties") or {}).get(key)
    if sub is None and isinstance(s.get("additionalProperties"), dict):
        sub = s["additionalProperties"]
    if sub is None:
        return {}
    # keep the patch extensions that sit on the referring property
    ext = {k: v for k, v in sub.items() if k.startswith("x-kubernetes-patch")}
    return {**resolve(sub, defs), **ext}


def _merge_map(original: dict[str, Any], patch: dict[str, Any], schema: dict[str, Any],
               defs: dict[str, Any]) -> dict[str, Any] | None:
    patch = dict(patch)
    directive = patch.pop(PATCH, None)
    if directive == "replace":
        return {k: v for k, v in patch.items() if not k.startswith("$")}
    if directive == "delete":
        return None
    retain = patch.pop(RETAIN, None)
    orders = {k[len(ORDER):]: patch.pop(k) for k in [k for k in patch if k.startswith(ORDER)]}
    for k in [k for k in patch if k.startswith(DELETE_PRIMITIVE)]:
        field, values = k[len(DELETE_PRIMITIVE):], patch.pop(k)
        if isinstance(original.get(field), list):
            original[field] = [v for v in original[field] if v not in values]
    out = dict(original)
    for key, value in patch.items():
        sub = _child(schema, key, defs)
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            merged = _merge_map(out[key], value, sub, defs)
            if merged is None:
                out.pop(key, None)
            else:
                out[key] = merged
        elif isinstance(value, dict):
            merged = _merge_map({}, value, sub, defs)
            if merged is not None:
                out[key] = merged
        elif isinstance(value, list):
            out[key] = _merge_list(out.get(key), value, sub, defs)
        else:
            out[key] = copy.deepcopy(value)
    if retain is not None:
        out = {k: v for k, v in out.items() if k in retain}
    for field, order in orders.items():
        out[field] = _order(out.get(field), order, _child(schema, field, defs))
    return out


def _merge_list(original: Any, patch: list[Any], schema: dict[str, Any], defs: dict[str, Any]) -> list[Any]:
    if any(isinstance(i, dict) and i.get(PATCH) == "replace" for i in patch):
        return [{k: v for k, v in i.items() if k != PATCH} for i in patch
                if not (isinstance(i, dict) and i.get(PATCH) == "replace")]
    if "merge" not in _strategy(schema) or not isinstance(original, list):
        return [_clean(i) for i in patch if not (isinstance(i, dict) and i.get(PATCH) == "delete")]
    key = schema.get("x-kubernetes-patch-merge-key")
    items_schema = resolve(schema.get("items") or {}, defs)
    out = copy.deepcopy(original)
    if not key:  # primitive list: union
        for v in patch:
            if v not in out:
                out.append(copy.deepcopy(v))
        return out
    for item in patch:
        if not isinstance(item, dict):
            continue
        idx = next((n for n, o in enumerate(out) if isinstance(o, dict) and o.get(key) == item.get(key)), None)
        if item.get(PATCH) == "delete":
            if idx is not None:
                out.pop(idx)
            continue
        if idx is None:
            out.append(_clean(item))
        else:
            merged = _merge_map(out[idx], item, items_schema, defs)
            if merged is None:
                out.pop(idx)
            else:
                out[idx] = merged
    return out


def _order(items: Any, order: list[Any], schema: dict[str, Any]) -> Any:
    if not isinstance(items, list):
        return items
    key = schema.get("x-kubernetes-patch-merge-key")

    def ident(i: Any) -> Any:
        return i.get(key) if key and isinstance(i, dict) else i

    wanted = [ident(o) for o in order]
    ranked = sorted(items, key=lambda i: wanted.index(ident(i)) if ident(i) in wanted else len(wanted))
    return ranked


def _clean(value: Any) -> Any:
    """A value added by the patch, its directives removed."""
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items() if not k.startswith("$")}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return copy.deepcopy(value)
