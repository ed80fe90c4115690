"""Protobuf request bodies (``application/vnd.kubernetes.protobuf``) of the built-in kinds clients send so.

client-go's typed clientsets send protobuf: ``kubectl auth can-i`` (SelfSubjectAccessReview),
``kubectl auth whoami`` (SelfSubjectReview), helm's release storage (Secrets), deletes (DeleteOptions).
The wire format (k8s.io/apimachinery/pkg/runtime/serializer/protobuf): the magic ``k8s\\0``, then a
``runtime.Unknown`` (1: TypeMeta{1: apiVersion, 2: kind}, 2: raw, 3: contentEncoding, 4: contentType)
whose ``raw`` is the object's message. Field numbers are those of the kinds' ``generated.proto``; a kind
without a table here is refused with 415, so a client that needs one fails loudly, never silently.
"""

from __future__ import annotations

import base64
import datetime
from typing import Any

MAGIC = b"k8s\x00"
# the response type kube-openapi serves (clients Accept ...spec.v2@v1.0+protobuf; Go's mime parser refuses "@")
OPENAPI_V2_PROTOBUF = "application/com.github.proto-openapi.spec.v2.v1.0+protobuf"

# message -> {field number: (json name, type, repeated)}; types: str, bytes, int, bool, map, map_bytes,
# time, or the name of another message
_T = tuple[str, str, bool]
MESSAGES: dict[str, dict[int, _T]] = {
    "ObjectMeta": {1: ("name", "str", False), 2: ("generateName", "str", False), 3: ("namespace", "str", False),
                   5: ("uid", "str", False), 6: ("resourceVersion", "str", False), 7: ("generation", "int", False),
                   8: ("creationTimestamp", "time", False), 11: ("labels", "map", False),
                   12: ("annotations", "map", False), 13: ("ownerReferences", "OwnerReference", True),
                   14: ("finalizers", "str", True)},
    "OwnerReference": {1: ("kind", "str", False), 3: ("name", "str", False), 4: ("uid", "str", False),
                       5: ("apiVersion", "str", False), 6: ("controller", "bool", False),
                       7: ("blockOwnerDeletion", "bool", False)},
    "ResourceAttributes": {1: ("namespace", "str", False), 2: ("verb", "str", False), 3: ("group", "str", False),
                           4: ("version", "str", False), 5: ("resource", "str", False),
                           6: ("subresource", "str", False), 7: ("name", "str", False)},
    "NonResourceAttributes": {1: ("path", "str", False), 2: ("verb", "str", False)},
    "SelfSubjectAccessReviewSpec": {1: ("resourceAttributes", "ResourceAttributes", False),
                                    2: ("nonResourceAttributes", "NonResourceAttributes", False)},
    "SelfSubjectAccessReview": {1: ("metadata", "ObjectMeta", False), 2: ("spec", "SelfSubjectAccessReviewSpec", False)},
    "SelfSubjectRulesReviewSpec": {1: ("namespace", "str", False)},
    "SelfSubjectRulesReview": {1: ("metadata", "ObjectMeta", False), 2: ("spec", "SelfSubjectRulesReviewSpec", False)},
    "SelfSubjectReview": {1: ("metadata", "ObjectMeta", False)},
    "Secret": {1: ("metadata", "ObjectMeta", False), 2: ("data", "map_bytes", False), 3: ("type", "str", False),
               4: ("stringData", "map", False), 5: ("immutable", "bool", False)},
    "ConfigMap": {1: ("metadata", "ObjectMeta", False), 2: ("data", "map", False),
                  3: ("binaryData", "map_bytes", False), 4: ("immutable", "bool", False)},
    "Preconditions": {1: ("uid", "str", False), 2: ("resourceVersion", "str", False)},
    "DeleteOptions": {1: ("gracePeriodSeconds", "int", False), 2: ("preconditions", "Preconditions", False),
                      3: ("orphanDependents", "bool", False), 4: ("propagationPolicy", "str", False),
                      5: ("dryRun", "str", True)},
    "TypeMeta": {1: ("apiVersion", "str", False), 2: ("kind", "str", False)},
    "Unknown": {1: ("typeMeta", "TypeMeta", False), 2: ("raw", "bytes", False),
                3: ("contentEncoding", "str", False), 4: ("contentType", "str", False)},
    "Time": {1: ("seconds", "int", False), 2: ("nanos", "int", False)},
}


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    shift = result = 0
    while True:
        if i >= len(buf):
            raise ValueError("truncated varint")
        b = buf[i]
        i += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, i
        shift += 7


def _fields(buf: bytes) -> list[tuple[int, int, Any]]:
    out, i = [], 0
    while i < len(buf):
        key, i = _varint(buf, i)
        num, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _varint(buf, i)
        elif wire == 2:
            n, i = _varint(buf, i)
            value, i = buf[i:i + n], i + n
        elif wire == 1:
            value, i = int.from_bytes(buf[i:i + 8], "little"), i + 8
        elif wire == 5:
            value, i = int.from_bytes(buf[i:i + 4], "little"), i + 4
        else:
            raise ValueError(f"unsupported wire type {wire}")
        out.append((num, wire, value))
    return out


def _message(buf: bytes, name: str) -> dict[str, Any]:
    table = MESSAGES[name]
    out: dict[str, Any] = {}
    for num, _, value in _fields(buf):
        if num not in table:
            continue
        key, typ, repeated = table[num]
        if typ == "str":
            v: Any = value.decode()
        elif typ == "bytes":
            v = value
        elif typ == "int":
            v = value - (1 << 64) if value >= 1 << 63 else value
        elif typ == "bool":
            v = bool(value)
        elif typ in ("map", "map_bytes"):
            entry = {n: val for n, _, val in _fields(value)}
            k = entry.get(1, b"").decode()
            raw = entry.get(2, b"")
            out.setdefault(key, {})[k] = base64.b64encode(raw).decode() if typ == "map_bytes" else raw.decode()
            continue
        elif typ == "time":
            t = _message(value, "Time")
            v = datetime.datetime.fromtimestamp(t.get("seconds", 0), tz=datetime.timezone.utc).strftime(
                "%Y-%m-%dT%H:%M:%SZ")
        else:
            v = _message(value, typ)
        if repeated:
            out.setdefault(key, []).append(v)
        else:
            out[key] = v
    return out


def decode(body: bytes) -> dict[str, Any]:
    """A protobuf request body as the JSON object it encodes; ValueError for what cannot be read."""
    if not body.startswith(MAGIC):
        raise ValueError("no k8s protobuf magic")
    unknown = _message(body[len(MAGIC):], "Unknown")
    tm = unknown.get("typeMeta") or {}
    kind = tm.get("kind", "")
    if kind not in MESSAGES:
        raise ValueError(f"no protobuf table for kind {kind!r}")
    obj = _message(unknown.get("raw", b""), kind)
    if tm.get("apiVersion"):
        obj["apiVersion"] = tm["apiVersion"]
    obj["kind"] = kind
    return obj


# ---------------------------------------------------------------- OpenAPI v2 as gnostic protobuf
# (github.com/google/gnostic openapiv2/OpenAPIv2.proto: what client-go's OpenAPISchema() unmarshals)
def _key(num: int, wire: int) -> bytes:
    return _uvarint(num << 3 | wire)


def _uvarint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _ld(num: int, payload: bytes) -> bytes:
    return _key(num, 2) + _uvarint(len(payload)) + payload


def _s(num: int, value: str) -> bytes:
    return _ld(num, value.encode())


def _any_yaml(value: Any) -> bytes:
    import yaml
    return _s(2, yaml.safe_dump(value, default_flow_style=True).strip())


def encode_schema(s: dict[str, Any]) -> bytes:
    """One OpenAPI v2 schema object as a gnostic ``Schema`` message."""
    import struct
    out = bytearray()
    if "$ref" in s:
        out += _s(1, s["$ref"])
    if s.get("format"):
        out += _s(2, s["format"])
    if s.get("description"):
        out += _s(4, s["description"])
    if "default" in s:
        out += _ld(5, _any_yaml(s["default"]))
    for key, num in (("maximum", 7), ("minimum", 9)):
        if isinstance(s.get(key), (int, float)) and not isinstance(s.get(key), bool):
            out += _key(num, 1) + struct.pack("<d", float(s[key]))
    for key, num in (("maxLength", 11), ("minLength", 12), ("maxItems", 14), ("minItems", 15)):
        if isinstance(s.get(key), int):
            out += _key(num, 0) + _uvarint(s[key])
    if s.get("pattern"):
        out += _s(13, s["pattern"])
    for r in s.get("required") or []:
        out += _s(19, r)
    for e in s.get("enum") or []:
        out += _ld(20, _any_yaml(e))
    ap = s.get("additionalProperties")
    if isinstance(ap, dict):
        out += _ld(21, _ld(1, encode_schema(ap)))
    elif isinstance(ap, bool):
        out += _ld(21, _key(2, 0) + _uvarint(int(ap)))
    t = s.get("type")
    if t:
        out += _ld(22, b"".join(_s(1, v) for v in ([t] if isinstance(t, str) else t)))
    if isinstance(s.get("items"), dict):
        out += _ld(23, _ld(1, encode_schema(s["items"])))
    for sub in s.get("allOf") or []:
        out += _ld(24, encode_schema(sub))
    if s.get("properties"):
        out += _ld(25, b"".join(_ld(1, _s(1, k) + _ld(2, encode_schema(v))) for k, v in s["properties"].items()))
    for k, v in s.items():
        if k.startswith("x-"):
            out += _ld(31, _s(1, k) + _ld(2, _any_yaml(v)))
    return bytes(out)


def encode_openapi_v2(doc: dict[str, Any]) -> bytes:
    """An OpenAPI v2 document (its info and definitions) as a gnostic ``Document``."""
    info = doc.get("info") or {}
    out = _s(1, doc.get("swagger", "2.0")) + _ld(2, _s(1, info.get("title", "")) + _s(2, info.get("version", "")))
    defs = b"".join(_ld(1, _s(1, name) + _ld(2, encode_schema(schema)))
                    for name, schema in (doc.get("definitions") or {}).items())
    return out + _ld(9, defs)
