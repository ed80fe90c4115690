"""The router's side of drain-before-delete: pushed topology (authenticated, newest generation wins) and
``/config`` reporting the version it runs and the pairs draining."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from pdruntime.env import RuntimeEnv
from pdruntime.server.router.app import Router, RouterConfig
from pdruntime.server.router.topology import parse_topology
from pdruntime.server.router.topology_source import TopologySource


def doc(generation, *, draining=False):
    return {"version": 1, "generation": generation, "revision": "r1", "pairs": [
        {"index": 0, "ready": True, "draining": draining,
         "prefill": {"url": "http://10.0.0.1:8000", "bootstrap_host": "10.0.0.1", "bootstrap_port": 8998},
         "decode": {"url": "http://10.0.0.2:8000"}}]}


def test_newest_generation_wins_whichever_feed_brings_it():
    installed = []
    src = TopologySource(installed.append, parse_topology(doc(3)), token="t")
    assert src.offer(parse_topology(doc(5, draining=True)), "push")
    assert not src.offer(parse_topology(doc(4)), "file")  # the lagging ConfigMap volume never rolls back
    assert src.offer(parse_topology(doc(5, draining=True)), "file")  # same generation: idempotent
    assert [t.generation for t in installed] == [5, 5] and src.current.draining() == [0]
    assert not src.current.pairs[0].ready  # a draining pair takes no new requests


@pytest.mark.parametrize("auth,body,status", [
    (None, doc(9), 401),
    ("Bearer wrong", doc(9), 401),
    ("Basic t", doc(9), 401),
    ("Bearer t", {"version": 1, "generation": -1, "pairs": []}, 400),
    ("Bearer t", doc(2), 409),
    ("Bearer t", doc(9), 200),
])
def test_push_is_authenticated_validated_and_monotonic(auth, body, status):
    src = TopologySource(lambda t: None, parse_topology(doc(3)), token="t")
    got, answer = src.push(body, auth)
    assert got == status, answer
    if status == 200:
        assert answer == {"topology_version": 9, "draining": []}
    elif status != 401:
        assert "error" in answer


def test_router_without_a_token_refuses_pushes():
    assert TopologySource(lambda t: None, parse_topology(doc(1)), token=None).push(doc(2), "Bearer x")[0] == 403


def test_router_http_push_then_config_reports_version_and_draining():
    """Pushes and /config reads carry the router's admin token; the KV-transfer token opens nothing here."""
    router = Router(RuntimeEnv(kv_auth_token="kv-secret"), topology=parse_topology(doc(1)),
                    config=RouterConfig(admin_token="secret"))
    admin = {"Authorization": "Bearer secret"}
    with TestClient(router.build_app()) as http:
        assert http.get("/config").status_code == 401  # admin-guarded
        assert http.get("/config", headers=admin).json()["topology_version"] == 1
        assert http.post("/admin/topology", json=doc(2), headers={"Authorization": "Bearer kv-secret"}).status_code == 401
        r = http.post("/admin/topology", json=doc(2, draining=True), headers=admin)
        assert r.status_code == 200 and r.json() == {"topology_version": 2, "draining": [0]}
        cfg = http.get("/config", headers=admin).json()
        assert cfg["topology_version"] == 2 and cfg["draining"] == [0] and cfg["inflight_by_pair"] == {}
        assert http.post("/admin/topology", json=doc(3)).status_code == 401
        assert http.get("/health").status_code == 503  # the only pair is draining: nothing to route to
