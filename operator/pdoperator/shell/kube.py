"""Kubernetes access through ``kubernetes_asyncio`` (the async twin of the official client).

The library resolves credentials exactly as kubectl does (kubeconfig: CA data or file, client
certificates, bearer tokens and token files, exec credential plugins; in-cluster: the projected,
rotating service-account token) and owns TLS, connection pooling and auth headers. This module adds
what the operator needs on top, as plain JSON (no model classes, so no field is lost on a round trip):

* :class:`Credentials`: one resolved ``Configuration``, re-resolved on demand (a 401, a rotated
  token file, an expired exec credential), and the same facts as a ``kopf.ConnectionInfo`` so kopf's
  own watches log in with what the client resolved (kopf's built-in kubeconfig login mishandles
  ``certificate-authority-data``);
* :class:`Kube`: get / list (label + field selectors) / server-side apply / create / delete /
  status patch with a resourceVersion precondition / a merge patch recomputed on conflict (rollbacks, by the
  operator and ``kubectl pd``), every failure an :class:`ApiError`
  naming the verb, the object and the server's message.
"""

from __future__ import annotations

import datetime
import json
import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from kubernetes_asyncio import client as k8s_client
from kubernetes_asyncio import config as k8s_config

FIELD_MANAGER = "pdstack-operator"
SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
IN_CLUSTER_RELOGIN = datetime.timedelta(minutes=1)  # as kubernetes_asyncio re-reads the token file

# (apiVersion, kind) -> (plural, namespaced)
RESOURCES: dict[tuple[str, str], tuple[str, bool]] = {
    ("v1", "Pod"): ("pods", True),
    ("v1", "Service"): ("services", True),
    ("v1", "ConfigMap"): ("configmaps", True),
    ("v1", "Secret"): ("secrets", True),
    ("v1", "Event"): ("events", True),
    ("v1", "Node"): ("nodes", False),
    ("apps/v1", "Deployment"): ("deployments", True),
    ("apps/v1", "ControllerRevision"): ("controllerrevisions", True),
    ("networking.k8s.io/v1", "NetworkPolicy"): ("networkpolicies", True),
    ("policy/v1", "PodDisruptionBudget"): ("poddisruptionbudgets", True),
    ("pdstack.io/v1alpha1", "PDDeployment"): ("pddeployments", True),
    ("kopf.dev/v1", "KopfPeering"): ("kopfpeerings", True),
    ("kopf.dev/v1", "ClusterKopfPeering"): ("clusterkopfpeerings", False),
}


class ApiError(Exception):
    """An API request failed. ``verb``/``target`` say which; ``message`` is the server's own words."""

    def __init__(self, status: int, message: str, *, verb: str = "", target: str = "", reason: str = ""):
        self.status, self.message, self.verb, self.target, self.reason = status, message, verb, target, reason
        super().__init__(f"{verb} {target}: HTTP {status}{' ' + reason if reason else ''}: {message}")


def path(api_version: str, kind: str, namespace: str | None = None, name: str | None = None,
         subresource: str | None = None) -> str:
    plural, namespaced = RESOURCES[(api_version, kind)]
    base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    if namespaced and namespace:
        base += f"/namespaces/{namespace}"
    base += f"/{plural}"
    if name:
        base += f"/{name}"
    if subresource:
        base += f"/{subresource}"
    return base


def object_path(obj: Mapping[str, Any], *, collection: bool = False) -> str:
    meta = obj["metadata"]
    return path(obj["apiVersion"], obj["kind"], meta.get("namespace"), None if collection else meta["name"])


def _target(url_path: str) -> str:
    """``/api/v1/namespaces/ns/pods/x`` -> ``pods/x`` (what a person reading a condition wants)."""
    parts = url_path.strip("/").split("/")
    if "namespaces" in parts and len(parts) > parts.index("namespaces") + 2:
        parts = parts[parts.index("namespaces") + 2:]
    else:
        parts = parts[2:] if parts[0] == "api" else parts[3:]
    return "/".join(parts)


# ---------------------------------------------------------------- credentials
class CredentialsError(RuntimeError):
    """No kubeconfig or service account could be loaded; the message says what was tried."""


@dataclass
class Credentials:
    """What ``kubernetes_asyncio`` resolved; ``refresh()`` re-resolves (rotated tokens, exec plugins)."""

    configuration: k8s_client.Configuration
    source: str  # "in-cluster" | "kubeconfig:<path>"
    _loader: Any = None

    @classmethod
    async def load(cls, kubeconfig: str | None = None, context: str | None = None) -> "Credentials":
        """In-cluster when a service-account token is mounted and no kubeconfig is named, else kubeconfig."""
        cfg = k8s_client.Configuration()
        token_file = os.path.join(os.environ.get("PDSTACK_SA_DIR", SA_DIR), "token")
        if kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST") and os.path.exists(token_file):
            sa_dir = os.path.dirname(token_file)
            loader = k8s_config.incluster_config.InClusterConfigLoader(
                token_filename=token_file, cert_filename=os.path.join(sa_dir, "ca.crt"), try_refresh_token=True)
            loader.load_and_set(cfg)
            return cls(cfg, "in-cluster", loader)
        path_ = kubeconfig or os.environ.get("KUBECONFIG", "").split(os.pathsep)[0] or os.path.expanduser(
            "~/.kube/config")
        try:
            loader = await k8s_config.load_kube_config(config_file=path_, context=context, client_configuration=cfg,
                                                       persist_config=False)
        except (k8s_config.ConfigException, OSError, ValueError, KeyError) as e:
            raise CredentialsError(
                f"no usable Kubernetes credentials: kubeconfig {path_!r}: {e}; accepted: a kubeconfig "
                f"($KUBECONFIG, --kubeconfig, ~/.kube/config) or a pod with a service account "
                f"(KUBERNETES_SERVICE_HOST and {token_file})") from None
        return cls(cfg, f"kubeconfig:{path_}", loader)

    async def refresh(self) -> None:
        """Re-read the token file / re-run the exec plugin (called after a 401, and by kopf's re-login)."""
        if self.source == "in-cluster":
            self._loader.load_and_set(self.configuration)
        else:
            if hasattr(self._loader, "exec_plugin_expiry"):
                del self._loader.exec_plugin_expiry
            await self._loader.load_and_set(self.configuration)

    def namespace(self) -> str:
        """The default namespace, as kubectl picks it: the context's, in-cluster the pod's, else ``default``."""
        if self.source == "in-cluster":
            try:
                with open(os.path.join(os.path.dirname(self._loader._token_filename), "namespace")) as fh:
                    return fh.read().strip() or "default"
            except OSError:
                return "default"
        ctx = getattr(self._loader, "current_context", None) or {}
        return (ctx.get("context") or {}).get("namespace") or "default"

    async def authorization(self) -> str | None:
        return await self.configuration.get_api_key_with_prefix("BearerToken")

    async def connection_info(self) -> Any:
        """The same credentials as a ``kopf.ConnectionInfo`` (kopf's watches, peering, posting)."""
        import kopf

        cfg = self.configuration
        scheme = token = None
        auth = await self.authorization()
        if auth:
            scheme, _, token = auth.partition(" ")
            if not token:
                scheme, token = "Bearer", scheme
        return kopf.ConnectionInfo(server=cfg.host, ca_path=cfg.ssl_ca_cert or None, insecure=not cfg.verify_ssl,
                                   scheme=scheme, token=token, certificate_path=cfg.cert_file or None,
                                   private_key_path=cfg.key_file or None, priority=100,
                                   expiration=self.expiration())

    def expiration(self) -> datetime.datetime | None:
        """When kopf should log in again on its own (besides after a 401): a rotating in-cluster token is
        re-read every minute; an exec credential expires when its plugin said so."""
        if self.source == "in-cluster":
            return datetime.datetime.now(datetime.timezone.utc) + IN_CLUSTER_RELOGIN
        expiry = getattr(self._loader, "exec_plugin_expiry", None)
        if isinstance(expiry, datetime.datetime):
            return expiry if expiry.tzinfo else expiry.replace(tzinfo=datetime.timezone.utc)
        return None


# ---------------------------------------------------------------- client
class Kube:
    """JSON requests through ``kubernetes_asyncio.ApiClient``. One per event loop; ``close()`` when done."""

    def __init__(self, credentials: Credentials, *, timeout_s: float = 30.0):
        self.credentials = credentials
        self.api = k8s_client.ApiClient(credentials.configuration)
        self.timeout_s = timeout_s

    async def close(self) -> None:
        await self.api.close()

    async def request(self, method: str, url_path: str, *, body: Any = None,
                      query: Mapping[str, str] | None = None, content_type: str = "application/json",
                      headers: Mapping[str, str] | None = None) -> Any:
        """One request; on 401 the credentials are re-resolved once and the request repeated. ``headers``: extra
        ones (a pods/proxy request's header for the pod)."""
        for attempt in (0, 1):
            sent = {"Accept": "application/json", "Content-Type": content_type, **(headers or {})}
            resp = await self.api.call_api(
                url_path, method, query_params=list((query or {}).items()), header_params=sent,
                body=body, auth_settings=["BearerToken"], _preload_content=False, _request_timeout=self.timeout_s)
            async with resp:
                status, raw = resp.status, await resp.read()
            if status < 300:
                return json.loads(raw) if raw else None
            if status == 401 and attempt == 0:
                await self.credentials.refresh()
                continue
            try:
                doc = json.loads(raw or b"{}")
                message, reason = doc.get("message", raw.decode(errors="replace")), doc.get("reason", "")
            except (ValueError, AttributeError):
                message, reason = raw.decode(errors="replace"), ""
            raise ApiError(status, message, verb=_verb(method, url_path, query, content_type),
                           target=_target(url_path), reason=reason)
        raise AssertionError("unreachable")

    async def get(self, url_path: str) -> dict[str, Any] | None:
        try:
            return await self.request("GET", url_path)
        except ApiError as e:
            if e.status == 404:
                return None
            raise

    async def list(self, url_path: str, *, label_selector: str | None = None,
                   field_selector: str | None = None) -> list[dict[str, Any]]:
        query = {k: v for k, v in (("labelSelector", label_selector), ("fieldSelector", field_selector)) if v}
        result = await self.request("GET", url_path, query=query)
        return list(result.get("items", []) or [])

    async def create(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        return await self.request("POST", object_path(obj, collection=True), body=dict(obj),
                                  query={"fieldManager": FIELD_MANAGER})

    async def apply(self, obj: Mapping[str, Any], *, force: bool = True) -> dict[str, Any]:
        """Server-side apply as ``pdstack-operator`` (force: the operator owns what it declares)."""
        query = {"fieldManager": FIELD_MANAGER}
        if force:
            query["force"] = "true"
        return await self.request("PATCH", object_path(obj), body=dict(obj), query=query,
                                  content_type="application/apply-patch+yaml")

    async def patch_status(self, url_path: str, status: Mapping[str, Any], resource_version: str) -> dict[str, Any]:
        """Merge-patch ``/status`` with a resourceVersion precondition (409 when someone wrote in between)."""
        body = {"metadata": {"resourceVersion": resource_version}, "status": dict(status)}
        return await self.request("PATCH", url_path + "/status", body=body, query={"fieldManager": FIELD_MANAGER},
                                  content_type="application/merge-patch+json")

    async def merge_patch(self, url_path: str, current: Mapping[str, Any] | None,
                          make: Callable[[Mapping[str, Any]], Mapping[str, Any] | None], *, field_manager: str,
                          attempts: int = 4) -> Mapping[str, Any] | None:
        """A merge patch computed from the object as read, sent with its resourceVersion as a precondition (a
        concurrent write is never overwritten); on 409 the object is read again and the patch recomputed, up to
        ``attempts`` times, then the 409 is raised. ``make(obj)``: the patch (its resourceVersion is added); empty:
        nothing to write. ``current``: the object as already read (None: read it first). Returns the object the
        last patch was computed from (written, or nothing to write); None when the object is gone."""
        cur = current if current is not None else await self.get(url_path)
        for attempt in range(attempts):
            if cur is None:
                return None
            patch = make(cur)
            if not patch:
                return cur
            meta = {**(patch.get("metadata") or {}), "resourceVersion": cur["metadata"]["resourceVersion"]}
            try:
                await self.request("PATCH", url_path, body={**patch, "metadata": meta},
                                   query={"fieldManager": field_manager}, content_type="application/merge-patch+json")
                return cur
            except ApiError as e:
                if e.status != 409 or attempt == attempts - 1:
                    raise
                cur = await self.get(url_path)
        return cur

    async def delete(self, url_path: str, *, grace_period_s: int | None = None,
                     uid: str | None = None) -> bool:
        """Delete (background propagation); False when it was already gone. ``uid``: only that incarnation."""
        body: dict[str, Any] = {"apiVersion": "v1", "kind": "DeleteOptions", "propagationPolicy": "Background"}
        if grace_period_s is not None:
            body["gracePeriodSeconds"] = grace_period_s
        if uid:
            body["preconditions"] = {"uid": uid}
        try:
            await self.request("DELETE", url_path, body=body)
            return True
        except ApiError as e:
            if e.status == 404:
                return False
            raise


def _verb(method: str, url_path: str, query: Mapping[str, str] | None, content_type: str) -> str:
    """The RBAC verb of a request (what an error condition names)."""
    method = method.upper()
    if method == "GET":
        last = url_path.rstrip("/").split("/")
        return "watch" if (query or {}).get("watch") else ("list" if _is_collection(last) else "get")
    if method == "PATCH" and content_type == "application/apply-patch+yaml":
        return "apply"
    return {"POST": "create", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}.get(method, method.lower())


def _is_collection(parts: list[str]) -> bool:
    plurals = {p for p, _ in RESOURCES.values()}
    return parts[-1] in plurals
