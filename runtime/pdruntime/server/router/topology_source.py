"""Where the router's topology comes from, newest generation wins.

Two feeds, one rule:

* the ConfigMap volume file (``--topology-file``), polled: the cold-start source, and the fallback
  when the operator is down. The kubelet refreshes it only every minute or so;
* operator pushes to ``POST /admin/topology`` (bearer token = the router's admin token,
  ``--admin-token-file``; the router never holds the KV-transfer token):
  the fast path. The operator pushes each new topology generation to every router pod, then reads
  ``GET /config`` (``topology_version``, ``draining``) to confirm before it deletes a drained pair.

A topology whose ``generation`` is older than the one running is refused (409 for a push, ignored
for the file), so the lagging file never rolls a push back.
"""

from __future__ import annotations

import hmac
import logging
from typing import Callable

from pdruntime.server.router.topology import Topology, TopologyError, parse_topology

log = logging.getLogger("pdruntime.topology")


class TopologySource:
    """Gatekeeper between the two feeds and the router: ``offer()`` installs a topology if it is not older."""

    def __init__(self, install: Callable[[Topology], None], current: Topology, token: str | None) -> None:
        self.install = install
        self.current = current
        self.token = token
        self.pushes = 0

    def offer(self, topo: Topology, origin: str) -> bool:
        """Install ``topo`` unless its generation is older than the running one; True when installed."""
        if topo.generation < self.current.generation:
            log.info("topology from %s ignored: generation %d < running %d", origin, topo.generation,
                     self.current.generation)
            return False
        self.current = topo
        self.install(topo)
        return True

    def authorized(self, authorization: str | None) -> bool:
        if not self.token or not authorization:
            return False
        scheme, _, value = authorization.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(value.strip().encode(), self.token.encode())

    def push(self, doc: object, authorization: str | None) -> tuple[int, dict]:
        """``POST /admin/topology``: (status, body). 401 unauthenticated, 400 malformed, 409 stale, 200 installed."""
        if not self.token:
            return 403, {"error": "topology pushes are disabled: the router has no admin token "
                                  "(--admin-token-file); it reads only its topology file"}
        if not self.authorized(authorization):
            return 401, {"error": "missing or wrong bearer token; accepted: Authorization: Bearer <admin token> "
                                  "(the router's --admin-token-file)"}
        try:
            topo = parse_topology(doc)
        except TopologyError as exc:
            return 400, {"error": str(exc)}
        if not self.offer(topo, "push"):
            return 409, {"error": f"generation {topo.generation} is older than the running generation "
                                  f"{self.current.generation}", "topology_version": self.current.generation}
        self.pushes += 1
        return 200, {"topology_version": self.current.generation, "draining": self.current.draining()}
