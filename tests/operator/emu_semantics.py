"""What a real API server does to an object between the request and etcd (pure functions).

Each behaviour is small and follows the Kubernetes source it names; ``test_emulator_strict.py``
checks each against responses recorded from real servers.

* defaulting: ``pkg/apis/core/v1/defaults.go``, ``pkg/apis/apps/v1/defaults.go`` (+ the admission
  plugins every cluster runs: ServiceAccount, DefaultTolerationSeconds, Priority);
* empty fields dropped: Go's ``omitempty`` on lists and maps (``env: []`` is not returned);
* canonical quantities: ``k8s.io/apimachinery/pkg/api/resource`` (``0.5`` -> ``500m``, ``1024Mi`` -> ``1Gi``);
* server-side apply field sets in the ``fieldsV1`` notation (``f:``/``k:``/``.``), ownership and conflicts;
* Pod Security Admission, level ``restricted`` (``k8s.io/pod-security-admission/policy``).
"""

from __future__ import annotations

import copy
import json
import re
from decimal import Decimal, InvalidOperation
from typing import Any, Iterable

Path = tuple[str, ...]

# ---------------------------------------------------------------- quantities
_BIN = {"Ki": 1, "Mi": 2, "Gi": 3, "Ti": 4, "Pi": 5, "Ei": 6}
_DEC = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
_QTY = re.compile(r"^([+-]?[0-9.]+)([eE][+-]?[0-9]+|Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E)?$")


def canonical_quantity(q: Any) -> str:
    """The canonical string of a resource quantity, as the API server returns it."""
    s = str(q).strip()
    m = _QTY.match(s)
    if not m:
        raise ValueError(f"quantities must match the regular expression "
                         f"'^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$': {s!r}")
    num, suffix = m.group(1), m.group(2) or ""
    try:
        value = Decimal(num)
    except InvalidOperation:
        raise ValueError(f"quantities must match the regular expression "
                         f"'^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$': {s!r}") from None
    if suffix in _BIN:
        value *= Decimal(1024) ** _BIN[suffix]
        if value == value.to_integral_value() and value >= 1024:
            k = 0
            while k < 6 and value % (Decimal(1024) ** (k + 1)) == 0:
                k += 1
            if k:
                return f"{int(value / Decimal(1024) ** k)}{[n for n, e in _BIN.items() if e == k][0]}"
        suffix_kind = "dec"
    elif suffix and suffix[0] in "eE":
        value *= Decimal(10) ** int(suffix[1:])
        suffix_kind = "exp"
    else:
        value *= Decimal(10) ** _DEC[suffix]
        suffix_kind = "dec"
    # decimal SI: the largest power of 1000 that leaves an integer mantissa; below 1n rounds up to 1n
    if value == 0:
        return "0"
    for exp in (18, 15, 12, 9, 6, 3, 0, -3, -6, -9):
        mant = value / Decimal(10) ** exp
        if mant == mant.to_integral_value():
            if suffix_kind == "exp":
                return f"{int(mant)}e{exp}" if exp else f"{int(mant)}"
            return f"{int(mant)}{[n for n, e in _DEC.items() if e == exp][0]}"
    return f"{int((value / Decimal(10) ** -9).to_integral_value(rounding='ROUND_CEILING'))}n"


def canonicalize_resources(obj: Any) -> Any:
    """Every ``resources.requests``/``limits`` (and node ``capacity``/``allocatable``) value made canonical."""
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            if k in ("requests", "limits", "capacity", "allocatable") and isinstance(v, dict):
                out[k] = {rk: canonical_quantity(rv) for rk, rv in v.items()}
            else:
                out[k] = canonicalize_resources(v)
        return out
    if isinstance(obj, list):
        return [canonicalize_resources(v) for v in obj]
    return obj


# ---------------------------------------------------------------- empty fields
_OMITEMPTY_MAPS = {"labels", "annotations", "data", "stringData", "binaryData", "nodeSelector", "matchLabels",
                   "requests", "limits"}


def drop_empty(obj: Any) -> Any:
    """Go ``omitempty``: empty lists, nulls and empty maps of the listed fields are not stored."""
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            v = drop_empty(v)
            if v is None or (isinstance(v, list) and not v) or (k in _OMITEMPTY_MAPS and v == {}):
                continue
            out[k] = v
        return out
    if isinstance(obj, list):
        return [drop_empty(v) for v in obj]
    return obj


# ---------------------------------------------------------------- defaulting
def _default_probe(p: dict[str, Any]) -> None:
    for k, v in (("timeoutSeconds", 1), ("periodSeconds", 10), ("successThreshold", 1), ("failureThreshold", 3)):
        p.setdefault(k, v)
    if "httpGet" in p:
        p["httpGet"].setdefault("scheme", "HTTP")


def _default_container(c: dict[str, Any]) -> None:
    c.setdefault("terminationMessagePath", "/dev/termination-log")
    c.setdefault("terminationMessagePolicy", "File")
    image = c.get("image", "")
    tagged = ":" in image.rsplit("/", 1)[-1] or "@" in image
    c.setdefault("imagePullPolicy", "IfNotPresent" if tagged and not image.endswith(":latest") else "Always")
    for port in c.get("ports", []) or []:
        port.setdefault("protocol", "TCP")
    for key in ("readinessProbe", "livenessProbe", "startupProbe"):
        if key in c:
            _default_probe(c[key])
    res = c.get("resources")
    if res is not None and res.get("limits"):
        req = res.setdefault("requests", {})
        for k, v in res["limits"].items():
            req.setdefault(k, v)
    c.setdefault("resources", res if res is not None else {})


def default_pod_spec(spec: dict[str, Any], *, admission: bool) -> None:
    spec.setdefault("restartPolicy", "Always")
    spec.setdefault("terminationGracePeriodSeconds", 30)
    spec.setdefault("dnsPolicy", "ClusterFirst")
    spec.setdefault("securityContext", {})
    spec.setdefault("schedulerName", "default-scheduler")
    for c in spec.get("containers", []) or []:
        _default_container(c)
    for v in spec.get("volumes", []) or []:
        for src in ("secret", "configMap"):
            if src in v:
                v[src].setdefault("defaultMode", 420)
    if admission:  # admission plugins, pods only (not pod templates)
        spec.setdefault("serviceAccountName", "default")
        spec.setdefault("serviceAccount", spec["serviceAccountName"])
        spec.setdefault("enableServiceLinks", True)
        spec.setdefault("priority", 0)
        spec.setdefault("preemptionPolicy", "PreemptLowerPriority")
        tol = spec.setdefault("tolerations", [])
        for key in ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable"):
            if not any(t.get("key") == key for t in tol):
                tol.append({"key": key, "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 300})


def default_object(kind: str, obj: dict[str, Any]) -> dict[str, Any]:
    """Apply the server's defaults for ``kind`` (in place; returns ``obj``)."""
    spec = obj.get("spec")
    if kind == "Pod" and isinstance(spec, dict):
        default_pod_spec(spec, admission=True)
    elif kind == "Deployment" and isinstance(spec, dict):
        spec.setdefault("replicas", 1)
        spec.setdefault("revisionHistoryLimit", 10)
        spec.setdefault("progressDeadlineSeconds", 600)
        strategy = spec.setdefault("strategy", {})  # SetDefaults_Deployment: an empty strategy is defaulted too
        strategy.setdefault("type", "RollingUpdate")
        if strategy["type"] == "RollingUpdate":
            ru = strategy.setdefault("rollingUpdate", {})
            ru.setdefault("maxUnavailable", "25%")
            ru.setdefault("maxSurge", "25%")
        tmpl = spec.get("template", {}).get("spec")
        if isinstance(tmpl, dict):
            default_pod_spec(tmpl, admission=False)
    elif kind == "Service" and isinstance(spec, dict):
        spec.setdefault("type", "ClusterIP")
        spec.setdefault("sessionAffinity", "None")
        spec.setdefault("internalTrafficPolicy", "Cluster")
        spec.setdefault("ipFamilies", ["IPv4"])
        spec.setdefault("ipFamilyPolicy", "SingleStack")
        for p in spec.get("ports", []) or []:
            p.setdefault("protocol", "TCP")
            p.setdefault("targetPort", p.get("port"))
    elif kind == "Secret":  # stringData is write-only: merged into data (base64), never stored or returned
        string_data = obj.pop("stringData", None) or {}
        if string_data:
            import base64
            data = obj.setdefault("data", {})
            for k, v in string_data.items():
                data[k] = base64.b64encode(str(v).encode()).decode()
        obj.setdefault("type", "Opaque")
    elif kind == "NetworkPolicy" and isinstance(spec, dict):
        for rule in spec.get("ingress", []) or []:
            for p in rule.get("ports", []) or []:
                p.setdefault("protocol", "TCP")
    return obj


def normalize(kind: str, obj: dict[str, Any]) -> dict[str, Any]:
    """What is stored and returned: defaults filled, quantities canonical, empty fields dropped."""
    return drop_empty(canonicalize_resources(default_object(kind, copy.deepcopy(obj))))


# ---------------------------------------------------------------- server-side apply field sets
_LIST_KEYS = {"containers": ("name",), "initContainers": ("name",), "env": ("name",), "volumes": ("name",),
              "volumeMounts": ("mountPath",), "imagePullSecrets": ("name",), "conditions": ("type",),
              "ownerReferences": ("uid",)}


def _list_key(field: str, items: list[Any]) -> tuple[str, ...] | None:
    if field == "ports" and items and isinstance(items[0], dict):
        return ("containerPort", "protocol") if "containerPort" in items[0] else ("port", "protocol")
    if field in _LIST_KEYS and all(isinstance(i, dict) for i in items):
        return _LIST_KEYS[field]
    return None  # atomic list (command, args, tolerations, ...)


def _item_key(keys: tuple[str, ...], item: dict[str, Any]) -> str:
    fields = {k: item.get(k, "TCP" if k == "protocol" else None) for k in keys}
    return "k:" + json.dumps(fields, separators=(",", ":"), sort_keys=True)


def field_paths(obj: Any, prefix: Path = (), field: str = "") -> set[Path]:
    """Leaf paths of ``obj`` in fieldsV1 notation (``('f:spec', 'f:containers', 'k:{"name":"x"}', 'f:image')``)."""
    out: set[Path] = set()
    if isinstance(obj, dict):
        if not obj and prefix:
            out.add(prefix)
        for k, v in obj.items():
            out |= field_paths(v, prefix + (f"f:{k}",), k)
        return out
    if isinstance(obj, list):
        keys = _list_key(field, obj)
        if keys is None:
            out.add(prefix)
            return out
        for item in obj:
            ip = prefix + (_item_key(keys, item),)
            out.add(ip + (".",))
            out |= field_paths(item, ip, "")
        return out
    out.add(prefix)
    return out


def object_paths(obj: dict[str, Any]) -> set[Path]:
    """Fields a manager can own: everything but the identity and server-owned metadata."""
    body = {k: v for k, v in obj.items() if k not in ("apiVersion", "kind", "status")}
    meta = {k: v for k, v in (obj.get("metadata") or {}).items()
            if k in ("labels", "annotations", "ownerReferences", "finalizers")}
    if meta:
        body["metadata"] = meta
    else:
        body.pop("metadata", None)
    return field_paths(body)


def to_fields_v1(paths: Iterable[Path]) -> dict[str, Any]:
    root: dict[str, Any] = {}
    for p in sorted(paths):
        node = root
        for el in p:
            node = node.setdefault(el, {})
    return root


def from_fields_v1(tree: dict[str, Any], prefix: Path = ()) -> set[Path]:
    out: set[Path] = set()
    for k, v in tree.items():
        if v:
            out |= from_fields_v1(v, prefix + (k,))
        else:
            out.add(prefix + (k,))
    return out


def value_at(obj: Any, path: Path) -> tuple[bool, Any]:
    """(found, value) of a fieldsV1 path in ``obj``."""
    cur = obj
    for el in path:
        if el == ".":
            return True, cur
        if el.startswith("f:"):
            if not isinstance(cur, dict) or el[2:] not in cur:
                return False, None
            cur = cur[el[2:]]
        elif el.startswith("k:"):
            want = json.loads(el[2:])
            if not isinstance(cur, list):
                return False, None
            match = [i for i in cur if isinstance(i, dict)
                     and all(i.get(k, "TCP" if k == "protocol" else None) == v for k, v in want.items())]
            if not match:
                return False, None
            cur = match[0]
    return True, cur


def remove_at(obj: Any, path: Path) -> None:
    """Delete the field (or list item, for a ``.`` path) at ``path``."""
    if not path:
        return
    if path[-1] == ".":
        parent_path = path[:-2]
        found, lst = value_at(obj, parent_path)
        ok, item = value_at(obj, path[:-1])
        if found and ok and isinstance(lst, list):
            lst.remove(item)
        return
    found, parent = value_at(obj, path[:-1])
    if found and isinstance(parent, dict) and path[-1].startswith("f:"):
        parent.pop(path[-1][2:], None)


def merge_applied(live: Any, applied: Any, field: str = "") -> Any:
    """Set every value of ``applied`` into ``live`` (maps merge; keyed lists merge by key; others replace)."""
    if isinstance(applied, dict) and isinstance(live, dict):
        out = dict(live)
        for k, v in applied.items():
            out[k] = merge_applied(live.get(k), v, k)
        return out
    if isinstance(applied, list) and isinstance(live, list):
        keys = _list_key(field, applied)
        if keys is None:
            return copy.deepcopy(applied)
        out_list = [copy.deepcopy(i) for i in live]
        for item in applied:
            key = _item_key(keys, item)
            idx = next((n for n, i in enumerate(out_list) if isinstance(i, dict) and _item_key(keys, i) == key), None)
            if idx is None:
                out_list.append(copy.deepcopy(item))
            else:
                out_list[idx] = merge_applied(out_list[idx], item)
        return out_list
    return copy.deepcopy(applied)


def dotted(path: Path) -> str:
    """``('f:spec', 'f:ports', 'k:{"port":8000,...}', 'f:targetPort')`` -> ``spec.ports[port=8000].targetPort``."""
    out = ""
    for el in path:
        if el == ".":
            continue
        if el.startswith("f:"):
            out += ("." if out else "") + el[2:]
        else:
            key = json.loads(el[2:])
            first = next(iter(k for k in key if k != "protocol"), next(iter(key)))
            out += f"[{first}={key[first]}]"
    return out


# ---------------------------------------------------------------- Pod Security Admission: restricted
_RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                       "projected", "secret"}


def psa_restricted_violations(pod_spec: dict[str, Any]) -> list[str]:
    """The ``restricted`` profile's failed checks, worded as the admission plugin words them."""
    out: list[str] = []
    psc = pod_spec.get("securityContext") or {}
    containers = list(pod_spec.get("containers", []) or []) + list(pod_spec.get("initContainers", []) or [])
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if pod_spec.get(key):
            out.append(f"host namespaces ({key}=true)")
    bad_vols = [v["name"] for v in pod_spec.get("volumes", []) or []
                if not (set(v) - {"name"}) <= _RESTRICTED_VOLUMES]
    if bad_vols:
        out.append(f"restricted volume types (volumes {', '.join(map(repr, bad_vols))} use restricted volume types)")

    def per_container(check, message: str) -> None:
        bad = [c["name"] for c in containers if check(c.get("securityContext") or {})]
        if bad:
            names = ", ".join(f'"{n}"' for n in bad)
            out.append(message.format(names=names, s="s" if len(bad) > 1 else ""))

    per_container(lambda sc: sc.get("privileged"), "privileged (container{s} {names} must not set "
                                                   "securityContext.privileged=true)")
    per_container(lambda sc: sc.get("allowPrivilegeEscalation") is not False,
                  "allowPrivilegeEscalation != false (container{s} {names} must set "
                  "securityContext.allowPrivilegeEscalation=false)")
    per_container(lambda sc: "ALL" not in ((sc.get("capabilities") or {}).get("drop") or []),
                  'unrestricted capabilities (container{s} {names} must set securityContext.capabilities.drop=["ALL"])')
    per_container(lambda sc: set((sc.get("capabilities") or {}).get("add") or []) - {"NET_BIND_SERVICE"},
                  "unrestricted capabilities (container{s} {names} must not include capabilities beyond "
                  "NET_BIND_SERVICE in securityContext.capabilities.add)")
    pod_nonroot = psc.get("runAsNonRoot") is True
    per_container(lambda sc: not (sc.get("runAsNonRoot") is True or (pod_nonroot and sc.get("runAsNonRoot")
                                                                     is not False)),
                  "runAsNonRoot != true (pod or container{s} {names} must set securityContext.runAsNonRoot=true)")
    if psc.get("runAsUser") == 0:
        out.append("runAsUser=0 (pod must not set runAsUser=0)")
    per_container(lambda sc: sc.get("runAsUser") == 0, "runAsUser=0 (container{s} {names} must not set runAsUser=0)")
    pod_seccomp = (psc.get("seccompProfile") or {}).get("type") in ("RuntimeDefault", "Localhost")
    per_container(lambda sc: not ((sc.get("seccompProfile") or {}).get("type") in ("RuntimeDefault", "Localhost")
                                  or (pod_seccomp and not sc.get("seccompProfile"))),
                  'seccompProfile (pod or container{s} {names} must set securityContext.seccompProfile.type to '
                  '"RuntimeDefault" or "Localhost")')
    host_ports = [c["name"] for c in containers for p in c.get("ports", []) or [] if p.get("hostPort")]
    if host_ports:
        out.append(f"hostPort (container{'s' if len(host_ports) > 1 else ''} "
                   f"{', '.join(map(repr, host_ports))} uses hostPort)")
    return out
