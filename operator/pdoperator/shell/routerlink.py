"""The operator's side of drain-before-delete: read each router pod's ``/config``, push new topology.

Every router pod of a deployment is asked (not the Service, which would answer for one random
replica). The routers' lowest ``topology_version`` is what the planner may trust: a pair is
confirmed draining only when every router runs a version that shows it draining.
"""

from __future__ import annotations

import asyncio
from typing import Any, Mapping, Sequence

import aiohttp

from ..core.pairs import RouterView, pod_ready
from ..core.render import group_of

DEBUG_TIMEOUT_S = 5.0  # a router's /debug/requests waits up to 2 s (in parallel) for each worker's rows


def router_pods_ready(pods: Sequence[Mapping[str, Any]]) -> list[str]:
    """IPs of running, ready, not-terminating router pods (pure)."""
    out = []
    for p in pods:
        st = p.get("status") or {}
        if (st.get("phase") == "Running" and pod_ready(p) and st.get("podIP")
                and not p["metadata"].get("deletionTimestamp")):
            out.append(st["podIP"])
    return out


def router_view(present: bool, configs: Sequence[Mapping[str, Any] | None]) -> RouterView:
    """Fold the routers' ``/config`` answers (None = no answer) into one :class:`RouterView` (pure)."""
    if not present:
        return RouterView()
    versions: list[int] = []
    inflight: dict[int, int] = {}
    for cfg in configs:
        if cfg is None or not isinstance(cfg.get("topology_version"), int):
            return RouterView(True, None, inflight)
        versions.append(cfg["topology_version"])
        for k, n in (cfg.get("inflight_by_pair") or {}).items():
            g = group_of(int(k))  # a group's entries (one per prefill x decode) count toward the group
            inflight[g] = inflight.get(g, 0) + int(n)
    return RouterView(True, min(versions) if versions else None, inflight)


class RouterLink:
    """HTTP to router pods (aiohttp, short timeouts: a stuck router must not stall a reconcile)."""

    def __init__(self, port: int, timeout_s: float) -> None:
        self.port = port
        self._session: aiohttp.ClientSession | None = None
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self._timeout)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def config(self, ip: str, token: str | None) -> dict[str, Any] | None:
        """The router's ``/config`` (admin-guarded: bearer = the router-admin token); None when unreadable."""
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        try:
            async with self._http().get(f"http://{ip}:{self.port}/config", headers=headers) as r:
                return await r.json() if r.status == 200 else None
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            return None

    async def debug_requests(self, ip: str, token: str | None) -> dict[str, Any] | None:
        """The router's ``/debug/requests`` (admin-guarded, as ``/config``): its live requests merged with its
        workers' rows; None when unreadable."""
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        try:
            async with self._http().get(f"http://{ip}:{self.port}/debug/requests", headers=headers,
                                        timeout=aiohttp.ClientTimeout(total=DEBUG_TIMEOUT_S)) as r:
                body = await r.json() if r.status == 200 else None
                return body if isinstance(body, dict) else None
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            return None

    async def get_json(self, url: str) -> dict[str, Any] | None:
        """GET ``url`` as JSON (a worker's ``/config``); None when unreachable or not a 200 JSON object."""
        try:
            async with self._http().get(url) as r:
                body = await r.json() if r.status == 200 else None
                return body if isinstance(body, dict) else None
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            return None

    async def get_text(self, url: str) -> str | None:
        """GET ``url`` as text (a worker's ``/metrics``); None when unreachable or not a 200."""
        try:
            async with self._http().get(url) as r:
                return await r.text() if r.status == 200 else None
        except (aiohttp.ClientError, asyncio.TimeoutError, UnicodeDecodeError):
            return None

    async def push(self, ip: str, doc: Mapping[str, Any], token: str) -> int | None:
        """POST the topology (bearer = the router-admin token); the HTTP status (None when unreachable)."""
        try:
            async with self._http().post(f"http://{ip}:{self.port}/admin/topology", json=dict(doc),
                                         headers={"Authorization": f"Bearer {token}"}) as r:
                await r.read()
                return r.status
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return None

    async def sync(self, ips: Sequence[str], doc: Mapping[str, Any] | None, token: str | None) -> RouterView:
        """Read every router's /config; push ``doc`` to those behind its generation; read those again.

        ``token`` is the deployment's router-admin token (never the KV-transfer token: routers do not hold it).
        """
        configs = list(await asyncio.gather(*(self.config(ip, token) for ip in ips)))
        if doc is not None and token:
            behind = [i for i, c in enumerate(configs)
                      if c is None or c.get("topology_version", -1) < doc["generation"]]
            if behind:
                await asyncio.gather(*(self.push(ips[i], doc, token) for i in behind))
                again = await asyncio.gather(*(self.config(ips[i], token) for i in behind))
                for i, c in zip(behind, again):
                    configs[i] = c
        return router_view(bool(ips), configs)
