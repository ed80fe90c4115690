"""Who may act: the operator's own reading of kopf's peering heartbeats (pure).

kopf pauses a replica once it has read a live peer of higher priority, but it starts its watches
before its first peering read, so two replicas started at the same instant can both act for a
moment. The reconcile daemon closes that window for every write it makes: after a start it waits
``PDSTACK_OPERATOR_PEERING_SETTLE_S`` (default 3 s) so that peers started with it have heartbeated,
and before each reconcile it reads the peering object itself and stands by while :func:`outranked`
names anyone.
"""

from __future__ import annotations

import datetime
from typing import Any, Mapping


def _parse(value: Any) -> datetime.datetime | None:
    if not isinstance(value, str):
        return None
    try:
        ts = datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    return ts if ts.tzinfo else ts.replace(tzinfo=datetime.timezone.utc)


def outranked(status: Mapping[str, Any] | None, priority: int, now: datetime.datetime) -> list[str]:
    """Identities of live peers (heartbeat within their lifetime) with a higher priority than ``priority``."""
    out = []
    for identity, peer in (status or {}).items():
        if not isinstance(peer, Mapping):
            continue
        seen = _parse(peer.get("lastseen"))
        lifetime = peer.get("lifetime", 60)
        if seen is None or not isinstance(lifetime, (int, float)):
            continue
        alive = seen + datetime.timedelta(seconds=lifetime) > now
        if alive and int(peer.get("priority", 0)) > priority:
            out.append(identity)
    return sorted(out)
