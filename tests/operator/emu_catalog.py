"""What the API server serves: its resources, discovery documents and OpenAPI v2/v3 (pure functions).

The shapes follow the real server (k8s.io/apiserver ``endpoints/discovery``, kube-openapi ``spec3``):

* ``/api`` is ``APIVersions``; ``/api/v1`` an ``APIResourceList`` with ``groupVersion: v1``; ``/apis`` an
  ``APIGroupList``; each resource lists its verbs, short names, categories and subresources
  (``pods/status``, ``deployments/scale`` as ``autoscaling/v1 Scale``). Aggregated discovery
  (``apidiscovery.k8s.io/v2``) is optional and not served: clients fall back to these legacy documents.
* ``/openapi/v3`` indexes one document per group version (``serverRelativeURL`` with a hash); each
  document's PATCH operations carry ``x-kubernetes-group-version-kind`` and the ``dryRun``,
  ``fieldManager``, ``fieldValidation`` and ``force`` query parameters, which is how kubectl decides to
  leave validation to the server (``QueryParamVerifierV3``). Schemas are the Kubernetes 1.33 definitions
  (``kubernetes-validate``'s copy of the upstream OpenAPI) and, for custom resources, the stored CRD's
  ``openAPIV3Schema`` with ``metadata`` as ``ObjectMeta``.
* ``/openapi/v2`` is served as JSON, and as gnostic protobuf (``emu_protobuf.encode_openapi_v2``) to
  clients that ask for it: kubectl validates client-side against v2 whatever the v3 verifier does not
  cover (a ``kind: List``, resources without the ``fieldValidation`` parameter).
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import kubernetes_validate

SERVER_VERSION = {"major": "1", "minor": "33", "gitVersion": "v1.33.0-pdstack-testcluster",
                  "gitCommit": "0000000000000000000000000000000000000000", "gitTreeState": "clean",
                  "buildDate": "2025-04-23T00:00:00Z", "goVersion": "go1.24.2", "compiler": "gc",
                  "platform": "linux/amd64"}
VERBS = ("create", "delete", "deletecollection", "get", "list", "patch", "update", "watch")


@dataclass
class Resource:
    """One served resource (built-in or from a stored CRD)."""

    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool
    short_names: tuple[str, ...] = ()
    categories: tuple[str, ...] = ()
    status: bool = False
    scale: tuple[str, str, str] | None = None  # CRD scale: specReplicasPath, statusReplicasPath, labelSelectorPath
    verbs: tuple[str, ...] = VERBS
    extra_subresources: tuple[tuple[str, str, str, str, tuple[str, ...]], ...] = ()  # name, group, version, kind, verbs
    definition: str | None = None  # built-in: the OpenAPI definition name
    crd: dict[str, Any] | None = None  # custom: the stored CRD
    crd_version: dict[str, Any] | None = None  # custom: the CRD's entry in spec.versions

    @property
    def group_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def singular(self) -> str:
        if self.crd is not None:
            return self.crd["spec"]["names"].get("singular") or self.kind.lower()
        return self.kind.lower()

    @property
    def subresources(self) -> list[str]:
        return (["status"] if self.status else []) + (["scale"] if self.scale else []) + \
            [s[0] for s in self.extra_subresources]

    @property
    def printer_columns(self) -> list[dict[str, Any]]:
        return list((self.crd_version or {}).get("additionalPrinterColumns") or [])

    @property
    def schema(self) -> dict[str, Any] | None:
        return ((self.crd_version or {}).get("schema") or {}).get("openAPIV3Schema")


_SCALE = ("scale", "autoscaling", "v1", "Scale", ("get", "patch", "update"))
_D = "io.k8s.api."
BUILTINS: list[Resource] = [
    Resource("", "v1", "namespaces", "Namespace", False, ("ns",), (), True, definition=_D + "core.v1.Namespace"),
    Resource("", "v1", "nodes", "Node", False, ("no",), (), True, definition=_D + "core.v1.Node"),
    Resource("", "v1", "pods", "Pod", True, ("po",), ("all",), True, definition=_D + "core.v1.Pod",
             extra_subresources=(("eviction", "policy", "v1", "Eviction", ("create",)),
                                 ("proxy", "", "v1", "PodProxyOptions",
                                  ("create", "delete", "get", "patch", "update")),
                                 ("log", "", "v1", "Pod", ("get",)))),
    Resource("", "v1", "services", "Service", True, ("svc",), ("all",), True, definition=_D + "core.v1.Service"),
    Resource("", "v1", "configmaps", "ConfigMap", True, ("cm",), definition=_D + "core.v1.ConfigMap"),
    Resource("", "v1", "secrets", "Secret", True, definition=_D + "core.v1.Secret"),
    Resource("", "v1", "serviceaccounts", "ServiceAccount", True, ("sa",), definition=_D + "core.v1.ServiceAccount"),
    Resource("", "v1", "events", "Event", True, ("ev",), definition=_D + "core.v1.Event"),
    Resource("", "v1", "endpoints", "Endpoints", True, ("ep",), definition=_D + "core.v1.Endpoints"),
    Resource("apps", "v1", "deployments", "Deployment", True, ("deploy",), ("all",), True,
             definition=_D + "apps.v1.Deployment", extra_subresources=(_SCALE,)),
    Resource("apps", "v1", "replicasets", "ReplicaSet", True, ("rs",), ("all",), True,
             definition=_D + "apps.v1.ReplicaSet", extra_subresources=(_SCALE,)),
    Resource("apps", "v1", "controllerrevisions", "ControllerRevision", True,
             definition=_D + "apps.v1.ControllerRevision"),
    Resource("networking.k8s.io", "v1", "networkpolicies", "NetworkPolicy", True, ("netpol",),
             definition=_D + "networking.v1.NetworkPolicy"),
    Resource("policy", "v1", "poddisruptionbudgets", "PodDisruptionBudget", True, ("pdb",), (), True,
             definition=_D + "policy.v1.PodDisruptionBudget"),
    Resource("coordination.k8s.io", "v1", "leases", "Lease", True, definition=_D + "coordination.v1.Lease"),
    Resource("rbac.authorization.k8s.io", "v1", "roles", "Role", True, definition=_D + "rbac.v1.Role"),
    Resource("rbac.authorization.k8s.io", "v1", "rolebindings", "RoleBinding", True,
             definition=_D + "rbac.v1.RoleBinding"),
    Resource("rbac.authorization.k8s.io", "v1", "clusterroles", "ClusterRole", False,
             definition=_D + "rbac.v1.ClusterRole"),
    Resource("rbac.authorization.k8s.io", "v1", "clusterrolebindings", "ClusterRoleBinding", False,
             definition=_D + "rbac.v1.ClusterRoleBinding"),
    Resource("apiextensions.k8s.io", "v1", "customresourcedefinitions", "CustomResourceDefinition", False,
             ("crd", "crds"), ("api-extensions",), True,
             definition="io.k8s.apiextensions-apiserver.pkg.apis.apiextensions.v1.CustomResourceDefinition"),
    Resource("authorization.k8s.io", "v1", "selfsubjectaccessreviews", "SelfSubjectAccessReview", False,
             verbs=("create",), definition=_D + "authorization.v1.SelfSubjectAccessReview"),
    Resource("authorization.k8s.io", "v1", "selfsubjectrulesreviews", "SelfSubjectRulesReview", False,
             verbs=("create",), definition=_D + "authorization.v1.SelfSubjectRulesReview"),
    Resource("authorization.k8s.io", "v1", "subjectaccessreviews", "SubjectAccessReview", False,
             verbs=("create",), definition=_D + "authorization.v1.SubjectAccessReview"),
    Resource("authentication.k8s.io", "v1", "selfsubjectreviews", "SelfSubjectReview", False,
             verbs=("create",), definition=_D + "authentication.v1.SelfSubjectReview"),
]
REVIEW_KINDS = {"SelfSubjectAccessReview", "SelfSubjectRulesReview", "SubjectAccessReview", "SelfSubjectReview"}


def from_crd(crd: dict[str, Any]) -> list[Resource]:
    """The resources a CRD serves (one per served version)."""
    spec, names = crd["spec"], crd["spec"]["names"]
    out = []
    for v in spec.get("versions") or []:
        if not v.get("served", True):
            continue
        sub = v.get("subresources") or {}
        scale = None
        if "scale" in sub:
            s = sub["scale"]
            scale = (s["specReplicasPath"], s["statusReplicasPath"], s.get("labelSelectorPath") or "")
        out.append(Resource(spec["group"], v["name"], names["plural"], names["kind"], spec["scope"] == "Namespaced",
                            tuple(names.get("shortNames") or ()), tuple(names.get("categories") or ()),
                            "status" in sub, scale, crd=crd, crd_version=v))
    return out


# ---------------------------------------------------------------- discovery
def _api_resource(r: Resource) -> list[dict[str, Any]]:
    main = {"name": r.plural, "singularName": r.singular, "namespaced": r.namespaced, "kind": r.kind,
            "verbs": sorted(r.verbs)}
    if r.short_names:
        main["shortNames"] = list(r.short_names)
    if r.categories:
        main["categories"] = list(r.categories)
    main["storageVersionHash"] = hashlib.sha256(f"{r.group_version}/{r.kind}".encode()).hexdigest()[:12]
    out = [main]
    if r.status:
        out.append({"name": f"{r.plural}/status", "singularName": "", "namespaced": r.namespaced, "kind": r.kind,
                    "verbs": ["get", "patch", "update"]})
    if r.scale:
        out.append({"name": f"{r.plural}/scale", "singularName": "", "namespaced": r.namespaced,
                    "group": "autoscaling", "version": "v1", "kind": "Scale", "verbs": ["get", "patch", "update"]})
    for name, group, version, kind, verbs in r.extra_subresources:
        entry = {"name": f"{r.plural}/{name}", "singularName": "", "namespaced": r.namespaced, "kind": kind,
                 "verbs": list(verbs)}
        if (group, version) != (r.group, r.version):
            entry.update(group=group, version=version)
        out.append(entry)
    return out


def api_versions(host: str) -> dict[str, Any]:
    return {"kind": "APIVersions", "versions": ["v1"],
            "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": host}]}


def resource_list(resources: Iterable[Resource], group_version: str) -> dict[str, Any] | None:
    served = [r for r in resources if r.group_version == group_version]
    if not served:
        return None
    return {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": group_version,
            "resources": [e for r in sorted(served, key=lambda r: r.plural) for e in _api_resource(r)]}


def _groups(resources: Iterable[Resource]) -> dict[str, list[str]]:
    groups: dict[str, list[str]] = {}
    for r in resources:
        if r.group and r.version not in groups.setdefault(r.group, []):
            groups[r.group].append(r.version)
    return groups


def _group_doc(name: str, versions: list[str]) -> dict[str, Any]:
    gvs = [{"groupVersion": f"{name}/{v}", "version": v} for v in versions]
    return {"name": name, "versions": gvs, "preferredVersion": gvs[0]}


def group_list(resources: Iterable[Resource]) -> dict[str, Any]:
    return {"kind": "APIGroupList", "apiVersion": "v1",
            "groups": [_group_doc(g, vs) for g, vs in _groups(resources).items()]}


def group(resources: Iterable[Resource], name: str) -> dict[str, Any] | None:
    versions = _groups(resources).get(name)
    return None if not versions else {"kind": "APIGroup", "apiVersion": "v1", **_group_doc(name, versions)}


# ---------------------------------------------------------------- OpenAPI
@functools.lru_cache(maxsize=1)
def builtin_definitions() -> dict[str, Any]:
    """Kubernetes 1.33's OpenAPI definitions (JSON-schema form, ``#/$defs/NAME`` references)."""
    path = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema" / "v1.33.0-local" / "_definitions.json"
    return json.loads(path.read_text())["$defs"]


def _to_openapi(schema: Any, ref_prefix: str, *, v3: bool) -> Any:
    """JSON-schema form -> OpenAPI form: single types, ``int-or-string``, references under ``ref_prefix``."""
    if isinstance(schema, list):
        return [_to_openapi(s, ref_prefix, v3=v3) for s in schema]
    if not isinstance(schema, dict):
        return schema
    one_of = schema.get("oneOf")
    if one_of and {tuple(o.get("type", ())) for o in one_of} in (
            {("string", "null"), ("integer", "null")}, {("string", "null"), ("number", "null")}):
        out = {k: v for k, v in schema.items() if k != "oneOf"}
        out.update(type="string", format="int-or-string" if ("integer", "null") in
                   {tuple(o["type"]) for o in one_of} else "quantity")
        return out
    out = {}
    for k, v in schema.items():
        if k == "type" and isinstance(v, list):
            v = next((t for t in v if t != "null"), "string")
        elif k == "$ref":
            v = ref_prefix + v.rsplit("/", 1)[-1]
        elif k in ("properties", "patternProperties"):
            v = {pk: _to_openapi(pv, ref_prefix, v3=v3) for pk, pv in v.items()}
            if k == "properties":
                for ident in ("apiVersion", "kind"):
                    if isinstance(v.get(ident), dict):
                        v[ident] = {kk: vv for kk, vv in v[ident].items() if kk != "enum"}
        else:
            v = _to_openapi(v, ref_prefix, v3=v3)
        out[k] = v
    if v3 and "$ref" in out and len(out) > 1:  # kube-openapi v3: a described reference is allOf: [ref]
        ref = out.pop("$ref")
        out = {"allOf": [{"$ref": ref}], **out}
    return out


def _refs(schema: Any) -> set[str]:
    if isinstance(schema, dict):
        out = {schema["$ref"].rsplit("/", 1)[-1]} if isinstance(schema.get("$ref"), str) else set()
        for v in schema.values():
            out |= _refs(v)
        return out
    if isinstance(schema, list):
        return set().union(*map(_refs, schema)) if schema else set()
    return set()


def _closure(names: Iterable[str]) -> list[str]:
    defs = builtin_definitions()
    seen: set[str] = set()
    todo = [n for n in names if n in defs]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        todo += [m for m in _refs(defs[n]) if m not in seen and m in defs]
    return sorted(seen)


_META = "io.k8s.apimachinery.pkg.apis.meta.v1."
_COMMON = [_META + "Status", _META + "DeleteOptions", _META + "Patch", _META + "ObjectMeta", _META + "ListMeta"]


def _definition_name(r: Resource) -> str:
    if r.definition:
        return r.definition
    rev = ".".join(reversed(r.group.split(".")))
    return f"{rev}.{r.version}.{r.kind}"


def _crd_schema(r: Resource, ref_prefix: str) -> dict[str, Any]:
    schema = copy.deepcopy(r.schema or {"type": "object", "x-kubernetes-preserve-unknown-fields": True})
    props = schema.setdefault("properties", {})
    props["metadata"] = {"$ref": ref_prefix + _META + "ObjectMeta",
                         "description": "Standard object's metadata. More info: https://git.k8s.io/community/"
                                        "contributors/devel/sig-architecture/api-conventions.md#metadata"}
    props.setdefault("apiVersion", {"type": "string"})
    props.setdefault("kind", {"type": "string"})
    return schema


def _schemas(resources: list[Resource], ref_prefix: str, *, v3: bool) -> dict[str, Any]:
    defs = builtin_definitions()
    builtin = [r for r in resources if r.crd is None]
    names = _closure([_definition_name(r) for r in builtin] + _COMMON)
    out = {n: _to_openapi(defs[n], ref_prefix, v3=v3) for n in names}
    for r in resources:
        if r.crd is None:
            continue
        gvk = [{"group": r.group, "kind": r.kind, "version": r.version}]
        out[_definition_name(r)] = {**_crd_schema(r, ref_prefix), "x-kubernetes-group-version-kind": gvk}
        out[_definition_name(r) + "List"] = {
            "type": "object", "required": ["items"],
            "properties": {"apiVersion": {"type": "string"}, "kind": {"type": "string"},
                           "items": {"type": "array", "items": {"$ref": ref_prefix + _definition_name(r)}},
                           "metadata": {"$ref": ref_prefix + _META + "ListMeta"}},
            "x-kubernetes-group-version-kind": [{**gvk[0], "kind": r.kind + "List"}]}
    return out


def _param(name: str, description: str) -> dict[str, Any]:
    return {"name": name, "in": "query", "description": description, "schema": {"type": "string"},
            "uniqueItems": True}


_WRITE_PARAMS = [
    _param("dryRun", "When present, indicates that modifications should not be persisted."),
    _param("fieldManager", "fieldManager is a name associated with the actor or entity that is making these "
                           "changes."),
    _param("fieldValidation", "fieldValidation instructs the server on how to handle objects in the request "
                              "(POST/PUT/PATCH) containing unknown or duplicate fields: Ignore, Warn or Strict."),
]
_PATCH_PARAMS = _WRITE_PARAMS + [_param("force", "Force is going to \"force\" Apply requests.")]


def _body(ref: str, v3: bool) -> dict[str, Any]:
    return {"content": {"application/json": {"schema": {"$ref": ref}}}} if v3 else {"schema": {"$ref": ref}}


def _paths(resources: list[Resource], ref_prefix: str, *, v3: bool) -> dict[str, Any]:
    paths: dict[str, Any] = {}
    for r in resources:
        base = f"/api/{r.version}" if not r.group else f"/apis/{r.group}/{r.version}"
        coll = f"{base}/namespaces/{{namespace}}/{r.plural}" if r.namespaced else f"{base}/{r.plural}"
        ref = ref_prefix + _definition_name(r)
        gvk = {"group": r.group, "version": r.version, "kind": r.kind}

        def op(action: str, op_id: str, params: list[dict[str, Any]], body: bool) -> dict[str, Any]:
            out: dict[str, Any] = {"operationId": op_id, "tags": [r.group_version.replace("/", "_")],
                                   "parameters": [dict(p) if v3 else {**{k: v for k, v in p.items()
                                                                         if k != "schema"}, "type": "string"}
                                                  for p in params],
                                   "responses": {"200": {"description": "OK", **_body(ref, v3)}},
                                   "x-kubernetes-action": action, "x-kubernetes-group-version-kind": gvk}
            if body:
                if v3:
                    out["requestBody"] = _body(ref, True)
                else:
                    out["parameters"].append({"name": "body", "in": "body", "required": True, "schema": {"$ref": ref}})
            return out

        name = f"{r.kind}{'Namespaced' if r.namespaced else ''}"
        if r.verbs == ("create",):
            paths[coll] = {"post": op("post", f"create{name}", _WRITE_PARAMS, True)}
            continue
        paths[coll] = {"get": op("list", f"list{name}", [], False),
                       "post": op("post", f"create{name}", _WRITE_PARAMS, True)}
        paths[coll + "/{name}"] = {"get": op("get", f"read{name}", [], False),
                                   "put": op("put", f"replace{name}", _WRITE_PARAMS, True),
                                   "patch": op("patch", f"patch{name}", _PATCH_PARAMS, True),
                                   "delete": op("delete", f"delete{name}", [_WRITE_PARAMS[0]], False)}
        if r.status:
            paths[coll + "/{name}/status"] = {"get": op("get", f"read{name}Status", [], False),
                                              "patch": op("patch", f"patch{name}Status", _PATCH_PARAMS, True)}
            paths[coll + "/{name}/status"]["patch"]["operationId"] = f"patch{name}Status"
    return paths


def _gv_key(gv: str) -> str:
    return f"api/{gv}" if "/" not in gv else f"apis/{gv}"


def openapi_v3_index(resources: list[Resource]) -> dict[str, Any]:
    gvs = sorted({r.group_version for r in resources})
    out = {}
    for gv in gvs:
        doc_hash = hashlib.sha512(json.dumps(openapi_v3(resources, gv), sort_keys=True).encode()).hexdigest().upper()
        out[_gv_key(gv)] = {"serverRelativeURL": f"/openapi/v3/{_gv_key(gv)}?hash={doc_hash[:128]}"}
    return {"paths": out}


def openapi_v3(resources: list[Resource], gv: str) -> dict[str, Any] | None:
    served = [r for r in resources if r.group_version == gv]
    if not served:
        return None
    if all(r.crd is None for r in served):
        return _builtin_v3(gv)
    return _openapi_v3(served)


@functools.lru_cache(maxsize=32)
def _builtin_v3(gv: str) -> dict[str, Any]:
    return _openapi_v3([r for r in BUILTINS if r.group_version == gv])


def _openapi_v3(served: list[Resource]) -> dict[str, Any]:
    prefix = "#/components/schemas/"
    return {"openapi": "3.0.0", "info": {"title": "Kubernetes", "version": SERVER_VERSION["gitVersion"]},
            "paths": _paths(served, prefix, v3=True),
            "components": {"schemas": _schemas(served, prefix, v3=True)}}


def openapi_v3_path_gv(path: str) -> str | None:
    """``/openapi/v3/api/v1`` -> ``v1``; ``/openapi/v3/apis/apps/v1`` -> ``apps/v1``."""
    rest = path[len("/openapi/v3/"):].strip("/")
    if rest.startswith("api/"):
        return rest[4:]
    if rest.startswith("apis/"):
        return rest[5:]
    return None


def openapi_v2(resources: list[Resource]) -> dict[str, Any]:
    prefix = "#/definitions/"
    return {"swagger": "2.0", "info": {"title": "Kubernetes", "version": SERVER_VERSION["gitVersion"]},
            "paths": _paths(resources, prefix, v3=False), "definitions": _schemas(resources, prefix, v3=False)}


def schema_of(r: Resource) -> tuple[dict[str, Any], dict[str, Any]]:
    """(root schema, definitions) in OpenAPI v3 form for validation and strategic merge (``$ref`` resolved
    through the definitions). Built-in kinds' are computed once per process (read-only)."""
    if r.crd is None:
        return _builtin_schema(r.group, r.version, r.plural)
    prefix = "#/components/schemas/"
    defs = _schemas([r], prefix, v3=True)
    return defs[_definition_name(r)], defs


@functools.lru_cache(maxsize=64)
def _builtin_schema(group: str, version: str, plural: str) -> tuple[dict[str, Any], dict[str, Any]]:
    r = find(BUILTINS, group, version, plural)
    assert r is not None
    defs = _schemas([r], "#/components/schemas/", v3=True)
    return defs[_definition_name(r)], defs


def resolve(schema: dict[str, Any] | None, defs: dict[str, Any]) -> dict[str, Any]:
    """A schema with its ``$ref`` / ``allOf: [$ref]`` followed (the referring node's extensions kept)."""
    seen = 0
    while isinstance(schema, dict) and seen < 16:
        ref = schema.get("$ref") or next((a.get("$ref") for a in schema.get("allOf") or [] if "$ref" in a), None)
        if not ref:
            break
        target = defs.get(ref.rsplit("/", 1)[-1], {})
        extra = {k: v for k, v in schema.items() if k.startswith("x-kubernetes-patch")}
        schema = {**target, **extra}
        seen += 1
    return schema or {}


def find(resources: Iterable[Resource], group: str, version: str, plural: str) -> Resource | None:
    return next((r for r in resources if (r.group, r.version, r.plural) == (group, version, plural)), None)


@dataclass
class Catalog:
    """The served resources: the built-ins plus every Established CRD's."""

    resources: list[Resource] = field(default_factory=lambda: list(BUILTINS))

    def add_crd(self, crd: dict[str, Any]) -> list[Resource]:
        self.remove_crd(crd["metadata"]["name"])
        new = from_crd(crd)
        self.resources += new
        return new

    def remove_crd(self, name: str) -> list[Resource]:
        gone = [r for r in self.resources if r.crd is not None and r.crd["metadata"]["name"] == name]
        self.resources = [r for r in self.resources if r not in gone]
        return gone
