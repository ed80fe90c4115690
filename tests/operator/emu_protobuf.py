"""Protobuf request bodies (``application/vnd.kubernetes.protobuf``) of the built-in kinds, and OpenAPI v2
as protobuf.

client-go's typed clientsets send protobuf: ``kubectl create deployment``, ``kubectl auth can-i``
(SelfSubjectAccessReview), ``kubectl auth whoami`` (SelfSubjectReview), helm's release storage (Secrets),
deletes (DeleteOptions). The wire format (k8s.io/apimachinery/pkg/runtime/serializer/protobuf): the magic
``k8s\\0``, then a ``runtime.Unknown`` (1: TypeMeta{1: apiVersion, 2: kind}, 2: raw, 3: contentEncoding,
4: contentType) whose ``raw`` is the object's message. Field numbers come from the kinds'
``generated.proto`` (``emu_proto_fields.json``, made by :mod:`emu_proto_gen`); ``Time``, ``Quantity``,
``IntOrString``, ``RawExtension`` and ``FieldsV1`` decode to their JSON forms. A kind without a table is
refused with 415, so a client that needs one fails loudly, never silently.
"""

from __future__ import annotations

import base64
import datetime
import functools
import json
from pathlib import Path
from typing import Any

MAGIC = b"k8s\x00"
# the response type kube-openapi serves (clients Accept ...spec.v2@v1.0+protobuf; Go's mime parser refuses "@")
OPENAPI_V2_PROTOBUF = "application/com.github.proto-openapi.spec.v2.v1.0+protobuf"
_META = "k8s.io.apimachinery.pkg.apis.meta.v1."
# API group -> protobuf package of its v1 types
PACKAGES = {"": "k8s.io.api.core.v1", "apps": "k8s.io.api.apps.v1", "networking.k8s.io": "k8s.io.api.networking.v1",
            "policy": "k8s.io.api.policy.v1", "coordination.k8s.io": "k8s.io.api.coordination.v1",
            "rbac.authorization.k8s.io": "k8s.io.api.rbac.v1", "authorization.k8s.io": "k8s.io.api.authorization.v1",
            "authentication.k8s.io": "k8s.io.api.authentication.v1", "autoscaling": "k8s.io.api.autoscaling.v1",
            "meta.k8s.io": "k8s.io.apimachinery.pkg.apis.meta.v1"}


@functools.lru_cache(maxsize=1)
def fields() -> dict[str, dict[str, list[str]]]:
    return json.loads((Path(__file__).with_name("emu_proto_fields.json")).read_text())


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


def _signed(value: int, bits: int = 64) -> int:
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value


def _scalar(typ: str, wire: int, value: Any) -> Any:
    if typ == "string":
        return value.decode()
    if typ == "bytes":
        return base64.b64encode(value).decode()
    if typ == "bool":
        return bool(value)
    if typ == "double":
        import struct
        return struct.unpack("<d", value.to_bytes(8, "little"))[0]
    return _signed(value)


def _special(typ: str, buf: bytes) -> tuple[bool, Any]:
    """The messages whose JSON form is not an object of their fields."""
    name = typ.rsplit(".", 1)[-1]
    if typ in (_META + "Time", _META + "MicroTime"):
        f = {n: v for n, _, v in _fields(buf)}
        t = datetime.datetime.fromtimestamp(_signed(f.get(1, 0)), tz=datetime.timezone.utc)
        if typ.endswith("MicroTime"):
            return True, t.strftime("%Y-%m-%dT%H:%M:%S") + f".{f.get(2, 0) // 1000:06d}Z"
        return True, t.strftime("%Y-%m-%dT%H:%M:%SZ")
    if typ == _META + "Duration":
        ns = _signed({n: v for n, _, v in _fields(buf)}.get(1, 0))
        return True, f"{ns / 1e9:g}s"
    if name == "Quantity":
        return True, {n: v for n, _, v in _fields(buf)}.get(1, b"").decode()
    if name == "IntOrString":
        f = {n: v for n, _, v in _fields(buf)}
        return True, _signed(f.get(2, 0)) if f.get(1, 0) == 0 else f.get(3, b"").decode()
    if name in ("RawExtension", "FieldsV1"):
        raw = {n: v for n, _, v in _fields(buf)}.get(1, b"")
        return True, json.loads(raw) if raw else {}
    return False, None


def _message(buf: bytes, typ: str) -> Any:
    special, value = _special(typ, buf)
    if special:
        return value
    table = fields().get(typ)
    if table is None:
        raise ValueError(f"no protobuf table for message {typ}")
    out: dict[str, Any] = {}
    for num, wire, value in _fields(buf):
        spec = table.get(str(num))
        if spec is None:
            continue
        key, ftyp, label = spec
        if ftyp.startswith("map:"):
            _, ktyp, vtyp = ftyp.split(":", 2)
            entry = {n: (w, v) for n, w, v in _fields(value)}
            k = _scalar(ktyp, *entry[1]) if 1 in entry else ""
            if 2 not in entry:
                v: Any = "" if vtyp in ("string", "bytes") else {}
            elif vtyp in ("string", "bytes", "int32", "int64", "bool", "double"):
                v = _scalar(vtyp, *entry[2])
            else:
                v = _message(entry[2][1], vtyp)
            out.setdefault(key, {})[k] = v
            continue
        if ftyp in ("string", "bytes", "int32", "int64", "bool", "double", "float", "uint32", "uint64"):
            if label == "r" and wire == 2 and ftyp not in ("string", "bytes"):  # packed scalars
                i, items = 0, []
                while i < len(value):
                    n, i = _varint(value, i)
                    items.append(_signed(n))
                out.setdefault(key, []).extend(items)
                continue
            v = _scalar(ftyp, wire, value)
        else:
            v = _message(value, ftyp)
        if label == "r":
            out.setdefault(key, []).append(v)
        else:
            out[key] = v
    return _omit_empty(out)


def _omit_empty(obj: dict[str, Any]) -> dict[str, Any]:
    """gogo encodes every non-pointer string, empty or not; JSON (omitempty) leaves the empty ones out. An
    empty message stays: on the wire it means a set pointer (``emptyDir: {}``)."""
    return {k: v for k, v in obj.items() if v != ""}


def decode(body: bytes) -> dict[str, Any]:
    """A protobuf request body as the JSON object it encodes; ValueError for what cannot be read."""
    if not body.startswith(MAGIC):
        raise ValueError("no k8s protobuf magic")
    envelope = {n: v for n, _, v in _fields(body[len(MAGIC):])}
    tm = {n: v.decode() for n, _, v in _fields(envelope.get(1, b""))}
    api_version, kind = tm.get(1, ""), tm.get(2, "")
    group = api_version.rsplit("/", 1)[0] if "/" in api_version else ""
    package = PACKAGES.get(group)
    if kind in ("DeleteOptions", "Status", "List"):
        package = _META.rstrip(".")
    if package is None or f"{package}.{kind}" not in fields():
        raise ValueError(f"no protobuf table for {api_version} {kind}")
    obj = _message(envelope.get(2, b""), f"{package}.{kind}")
    if api_version:
        obj["apiVersion"] = api_version
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
