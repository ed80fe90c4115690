"""A small async Kubernetes API client (aiohttp), sharing kopf's credentials.

The operator's reads and writes run inside kopf's event loop; the synchronous ``kubernetes``
client would need threads and validates bodies into models. This client speaks JSON over the
same connection info kopf logged in with, and maps API errors to :class:`ApiError`.
"""

from __future__ import annotations

import json
import ssl
from typing import Any, Mapping

import aiohttp

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
}


class ApiError(Exception):
    def __init__(self, status: int, message: str):
        self.status = status
        super().__init__(f"HTTP {status}: {message}")


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


class Kube:
    """JSON over HTTP to the API server. Use inside one event loop; ``close()`` when done."""

    def __init__(self, server: str, *, token: str | None = None, scheme: str | None = None,
                 ca_path: str | None = None, ca_data: str | bytes | None = None, insecure: bool = False,
                 cert_path: str | None = None, key_path: str | None = None,
                 username: str | None = None, password: str | None = None):
        self.server = server.rstrip("/")
        headers = {"Accept": "application/json"}
        if token:
            headers["Authorization"] = f"{scheme or 'Bearer'} {token}"
        auth = aiohttp.BasicAuth(username, password or "") if username else None
        ctx: ssl.SSLContext | bool | None = None
        if self.server.startswith("https"):
            if insecure:
                ctx = False
            else:
                cadata = ca_data.decode() if isinstance(ca_data, bytes) else ca_data
                ctx = ssl.create_default_context(cafile=ca_path, cadata=cadata)
                if cert_path:
                    ctx.load_cert_chain(cert_path, key_path)
        self._session = aiohttp.ClientSession(headers=headers, auth=auth,
                                              connector=aiohttp.TCPConnector(ssl=ctx) if ctx is not None else None,
                                              timeout=aiohttp.ClientTimeout(total=30))

    @classmethod
    def from_connection_info(cls, info: Any) -> "Kube":
        """Build from a ``kopf.ConnectionInfo`` (what the operator logged in with)."""
        return cls(info.server, token=info.token, scheme=info.scheme, ca_path=info.ca_path, ca_data=info.ca_data,
                   insecure=bool(info.insecure), cert_path=info.certificate_path, key_path=info.private_key_path,
                   username=info.username, password=info.password)

    async def close(self) -> None:
        await self._session.close()

    async def _request(self, method: str, url_path: str, *, body: Any = None, params: Mapping[str, str] | None = None,
                       content_type: str = "application/json") -> Any:
        data = json.dumps(body) if body is not None else None
        headers = {"Content-Type": content_type} if data is not None else None
        async with self._session.request(method, self.server + url_path, data=data, params=params,
                                         headers=headers) as resp:
            text = await resp.text()
            if resp.status >= 400:
                try:
                    message = json.loads(text).get("message", text)
                except ValueError:
                    message = text
                raise ApiError(resp.status, f"{method} {url_path}: {message}")
            return json.loads(text) if text else None

    async def get(self, url_path: str) -> dict[str, Any] | None:
        try:
            return await self._request("GET", url_path)
        except ApiError as e:
            if e.status == 404:
                return None
            raise

    async def list(self, url_path: str, *, label_selector: str | None = None) -> list[dict[str, Any]]:
        params = {"labelSelector": label_selector} if label_selector else None
        result = await self._request("GET", url_path, params=params)
        return list(result.get("items", []) or [])

    async def create(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        return await self._request("POST", object_path(obj, collection=True), body=obj)

    async def merge_patch(self, url_path: str, patch: Mapping[str, Any]) -> dict[str, Any]:
        return await self._request("PATCH", url_path, body=patch, content_type="application/merge-patch+json")

    async def delete(self, url_path: str) -> bool:
        """Delete; False when it was already gone."""
        try:
            await self._request("DELETE", url_path, body={"propagationPolicy": "Background"})
            return True
        except ApiError as e:
            if e.status == 404:
                return False
            raise
