"""Generate ``emu_proto_fields.json``: the field numbers of the built-in kinds' protobuf messages.

Read from the Kubernetes ``generated.proto`` files (k8s.io/api and k8s.io/apimachinery), so that
:mod:`emu_protobuf` decodes any built-in kind a typed client sends (``kubectl create deployment``,
helm's release Secrets, ``kubectl auth can-i``). The committed table came from kubernetes/api
10b39a39bcee and kubernetes/apimachinery eed236ceee2c::

    python tests/operator/emu_proto_gen.py DIR_WITH_PROTO_FILES > tests/operator/emu_proto_fields.json

Each message maps a field number to [json name, type, label]; label ``r`` is repeated, ``o`` optional;
a type is a scalar (string, bytes, int32, int64, bool, double), ``map:K:V`` or a full message name.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

SCALARS = {"string", "bytes", "int32", "int64", "bool", "double", "float", "uint32", "uint64", "fixed64"}
_FIELD = re.compile(r"^\s*(optional|repeated)?\s*(map<\s*\w+\s*,\s*[\w.]+\s*>|[\w.]+)\s+(\w+)\s*=\s*(\d+)\s*[;\[]")


def parse(text: str) -> dict[str, dict[str, list[str]]]:
    package = re.search(r"^package\s+([\w.]+);", text, re.M).group(1)  # type: ignore[union-attr]
    out: dict[str, dict[str, list[str]]] = {}
    current: str | None = None
    depth = 0
    for line in text.splitlines():
        code = line.split("//", 1)[0]
        m = re.match(r"^\s*message\s+(\w+)\s*\{", code)
        if m and depth == 0:
            current, depth = f"{package}.{m.group(1)}", 1
            out[current] = {}
            continue
        if current is None:
            continue
        depth += code.count("{") - code.count("}")
        if depth <= 0:
            current, depth = None, 0
            continue
        f = _FIELD.match(code)
        if f and depth == 1:
            label, typ, name, num = f.groups()
            if typ.startswith("map<"):
                k, v = (t.strip() for t in typ[4:-1].split(","))
                typ = f"map:{k}:{v if v in SCALARS else _qualify(v, package)}"
            elif typ not in SCALARS:
                typ = _qualify(typ, package)
            out[current][num] = [name, typ, "r" if label == "repeated" else "o"]
    return out


def _qualify(typ: str, package: str) -> str:
    return typ[1:] if typ.startswith(".") else f"{package}.{typ}"


def main(directory: str) -> int:
    table: dict[str, dict[str, list[str]]] = {}
    for path in sorted(Path(directory).glob("*.proto")):
        table.update(parse(path.read_text()))
    json.dump(table, sys.stdout, separators=(",", ":"), sort_keys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
