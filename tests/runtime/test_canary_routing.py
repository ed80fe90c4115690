"""Canary pairs and pinned routing in the router.

A pair with ``canary: true`` in the topology takes no normal traffic; ``X-PDStack-Pair: <group>`` pins a request
to one group (canary or not) and needs admin credentials (``X-PDStack-Admin-Token``); a pinned request is never
retried elsewhere. ``X-PDStack-Admin-Token`` also opens /config and /debug/* (the API server's pods/proxy does
not pass Authorization on). Pure picker decisions first, then a real router with two real pairs.
"""

from __future__ import annotations

import os
import sys

import httpx
import pytest

from pdruntime.model.testing import write_tiny_checkpoint
from pdruntime.server.router.policy import PairPicker
from pdruntime.server.router.topology import TopologyError, parse_topology

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "pd"))
from pd_harness import start_pairs  # noqa: E402

ADMIN = "canary-admin-token-0123456789"


def topo(*pairs: dict):
    return parse_topology({"version": 1, "revision": "t", "pairs": [
        {"index": i, "prefill": {"url": f"http://10.0.0.{i}:1"}, "decode": {"url": f"http://10.0.1.{i}:1"}, **p}
        for i, p in enumerate(pairs)]})


# ---------------------------------------------------------------- pure
def test_topology_reads_and_shows_the_canary_flag_and_rejects_non_booleans():
    t = topo({}, {"canary": True})
    assert [p.canary for p in t.pairs] == [False, True]
    assert [p["canary"] for p in t.as_dict()["pairs"]] == [False, True]
    assert parse_topology(t.as_dict()) == t
    with pytest.raises(TopologyError, match=r"pairs\[0\]\.canary: 'yes' is not accepted; accepted: true or false"):
        topo({"canary": "yes"})


def test_normal_traffic_never_chooses_a_canary_pair_even_when_it_is_the_least_loaded():
    picker = PairPicker()
    picker.set_pairs(topo({}, {"canary": True}).pairs)
    picker.states[0].outstanding = 50
    for key in (None, "conv-a", "conv-b"):
        assert picker.choose(0.0, key).pair.index == 0
    picker.set_pairs(topo({"canary": True}).pairs)
    assert picker.choose(0.0, None) is None and picker.eligible(0.0) == []
    assert picker.reopens_at(0.0) is None  # a canary is not a pair normal traffic waits for


def test_pinned_choice_reaches_exactly_its_group_canary_or_not_and_leaves_stickiness_alone():
    picker = PairPicker()
    picker.set_pairs(topo({}, {"canary": True}, {"group": 1}).pairs)  # group 1: pairs 1 (canary) and 2
    assert picker.choose(0.0, "conv", group=0).pair.index == 0
    assert picker.choose(0.0, "conv", group=1).pair.index in (1, 2)
    assert "conv" not in picker.sticky
    picker.states[1].outstanding = 5
    assert picker.choose(0.0, None, group=1).pair.index == 2  # least loaded within the group
    assert picker.choose(0.0, None, group=1, exclude={2}).pair.index == 1


def test_an_unroutable_pinned_group_is_explained():
    picker = PairPicker(threshold=1)
    picker.set_pairs(topo({}, {"ready": False}, {"draining": True}).pairs)
    assert picker.choose(0.0, None, group=9) is None
    assert picker.unroutable(0.0, 9) == "the topology has no group 9 (groups: 0, 1, 2)"
    assert picker.unroutable(0.0, 1) == "group 1 is not ready"
    assert picker.unroutable(0.0, 2) == "group 2 is draining"
    assert "stale" in picker.unroutable(0.0, 0, stale={0})
    from pdruntime.server.router.policy import Outcome

    picker.states[0].breaker.record(Outcome.FAILURE, 0.0, trial=False)
    assert picker.choose(0.1, None, group=0) is None
    assert "circuit breaker is open" in picker.unroutable(0.1, 0)


# ---------------------------------------------------------------- a real router with two real pairs
@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("canary-stack")
    model = str(write_tiny_checkpoint(str(tmp / "model")))
    token = tmp / "admin-token"
    token.write_text(ADMIN + "\n")
    s = start_pairs(str(tmp), model, [{}, {"canary": True}], router_flags=["--admin-token-file", str(token)])
    yield s
    s.stop()


@pytest.fixture(scope="module")
def model_id(stack) -> str:
    return httpx.get(stack.router.url + "/v1/models", timeout=10).json()["data"][0]["id"]


def chat(stack, model_id: str, headers: dict | None = None, **extra) -> httpx.Response:
    return httpx.post(stack.router.url + "/v1/chat/completions", headers=headers or {}, timeout=60,
                      json={"model": model_id, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3,
                            **extra})


def served(stack) -> list[float]:
    """Requests each pair's decode worker finished (any outcome)."""
    return [stack.metric(dec, "pdrt_requests_total") for _, dec in stack.pairs]


def test_normal_traffic_never_reaches_the_canary_pair(stack, model_id):
    before = served(stack)
    for i in range(6):
        r = chat(stack, model_id, {"X-Session-Id": f"s{i % 3}"}, **({} if i % 2 else {"user": f"u{i}"}))
        assert r.status_code == 200, r.text
    after = served(stack)
    assert after[0] - before[0] == 6
    assert after[1] == before[1]
    assert stack.metric(stack.pairs[1][0], "pdrt_requests_total") == 0  # nor its prefill worker


def test_pinned_requests_reach_exactly_the_named_group(stack, model_id):
    admin = {"X-PDStack-Admin-Token": ADMIN}
    before = served(stack)
    for _ in range(2):
        assert chat(stack, model_id, {**admin, "X-PDStack-Pair": "1"}).status_code == 200
    mid = served(stack)
    assert (mid[0] - before[0], mid[1] - before[1]) == (0, 2)
    r = chat(stack, model_id, {**admin, "X-PDStack-Pair": "0"}, stream=True)
    assert r.status_code == 200 and "[DONE]" in r.text
    after = served(stack)
    assert (after[0] - mid[0], after[1] - mid[1]) == (1, 0)


def test_pinning_without_or_with_a_wrong_admin_token_is_403(stack, model_id):
    before = served(stack)
    r = chat(stack, model_id, {"X-PDStack-Pair": "1"})
    assert r.status_code == 403, r.text
    msg = r.json()["error"]["message"]
    assert "X-PDStack-Pair" in msg and "X-PDStack-Admin-Token" in msg and "accepted" in msg
    r = chat(stack, model_id, {"X-PDStack-Pair": "1", "X-PDStack-Admin-Token": "wrong-token"})
    assert r.status_code == 403, r.text
    assert "does not match the router's admin token" in r.json()["error"]["message"]
    # the admin token as a bearer token is the API key's place: it does not pin
    r = chat(stack, model_id, {"X-PDStack-Pair": "1", "Authorization": f"Bearer {ADMIN}"})
    assert r.status_code == 403
    assert served(stack) == before  # nothing reached any worker


def test_an_unknown_or_malformed_pinned_group_is_named_in_the_answer(stack, model_id):
    admin = {"X-PDStack-Admin-Token": ADMIN}
    r = chat(stack, model_id, {**admin, "X-PDStack-Pair": "7"})
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert err["code"] == "pinned_group_unavailable"
    assert err["message"] == ("group 7 (X-PDStack-Pair) is not routable: the topology has no group 7 "
                              "(groups: 0, 1)")
    r = chat(stack, model_id, {**admin, "X-PDStack-Pair": "one"})
    assert r.status_code == 400 and "accepted: a group index" in r.json()["error"]["message"]


def test_the_admin_token_header_opens_debug_and_config(stack):
    url = stack.router.url
    assert httpx.get(url + "/debug/requests", timeout=10).status_code == 401
    wrong = httpx.get(url + "/debug/requests", headers={"X-PDStack-Admin-Token": "nope"}, timeout=10)
    assert wrong.status_code == 401 and "X-PDStack-Admin-Token" in wrong.json()["error"]["message"]
    for headers in ({"X-PDStack-Admin-Token": ADMIN}, {"Authorization": f"Bearer {ADMIN}"}):
        r = httpx.get(url + "/debug/requests", headers=headers, timeout=10)
        assert r.status_code == 200 and r.json()["role"] == "router"
    cfg = httpx.get(url + "/config", headers={"X-PDStack-Admin-Token": ADMIN}, timeout=10)
    assert cfg.status_code == 200
    assert [p["canary"] for p in cfg.json()["topology"]["pairs"]] == [False, True]


def push(stack, pairs: list[dict]) -> None:
    admin = {"X-PDStack-Admin-Token": ADMIN}
    cfg = httpx.get(stack.router.url + "/config", headers=admin, timeout=10).json()
    doc = {**cfg["topology"], "generation": cfg["topology_version"] + 1, "pairs": pairs}
    r = httpx.post(stack.router.url + "/admin/topology", json=doc, headers=admin, timeout=10)
    assert r.status_code == 200, r.text


def test_a_pinned_request_whose_group_fails_is_not_retried_on_another_pair(stack, model_id):
    from pd_harness import free_port

    admin = {"X-PDStack-Admin-Token": ADMIN}
    original = httpx.get(stack.router.url + "/config", headers=admin, timeout=10).json()["topology"]["pairs"]
    dead = {**original[0], "index": 2, "canary": True, "decode": {"url": f"http://127.0.0.1:{free_port()}"}}
    push(stack, original + [dead])  # group 2: pair 0's prefill with a decode worker that is not there
    try:
        before = served(stack)
        r = chat(stack, model_id, {**admin, "X-PDStack-Pair": "2"})
        assert r.status_code == 502, r.text
        msg = r.json()["error"]["message"]
        assert msg.startswith("pinned group 2 failed (decode leg:") and "not retried on another group" in msg
        assert served(stack) == before  # no other pair's decode worker saw it
    finally:
        push(stack, original)


def test_a_topology_push_with_the_admin_token_header_can_take_the_canary_flag_off(stack, model_id):
    """The operator promotes a canary by pushing a topology without the flag: normal traffic then reaches it."""
    admin = {"X-PDStack-Admin-Token": ADMIN}
    cfg = httpx.get(stack.router.url + "/config", headers=admin, timeout=10).json()
    doc = {**cfg["topology"], "generation": cfg["topology_version"] + 1}
    doc["pairs"] = [{**p, "canary": False} for p in doc["pairs"]]
    r = httpx.post(stack.router.url + "/admin/topology", json=doc, headers=admin, timeout=10)
    assert r.status_code == 200, r.text
    from concurrent.futures import ThreadPoolExecutor

    before = served(stack)
    for _, dec in stack.pairs:  # slower decode steps: the concurrent requests overlap even on a loaded machine
        stack.hooks(dec, step_delay_s=0.05)
    try:
        with ThreadPoolExecutor(8) as pool:  # concurrent: least-outstanding routing spreads them over both pairs
            codes = list(pool.map(lambda _: chat(stack, model_id, max_tokens=16).status_code, range(8)))
    finally:
        for _, dec in stack.pairs:
            stack.hooks(dec, step_delay_s=0)
    assert codes == [200] * 8
    after = served(stack)
    assert after[1] > before[1] and after[0] > before[0]
