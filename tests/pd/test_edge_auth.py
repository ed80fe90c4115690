"""The router's authentication edge (issue 13, defect 7 and Security): admin endpoints, API keys with
per-key client attribution, secrets redacted, and each process given only the secrets it uses.

Run against the unfixed code (main at 1c0b2fc's runtime on PYTHONPATH): the admin tests failed there
(/config and /debug/requests answered any client), the API-key tests could not start a router (no
--api-key-file), and the pdrt-up test failed (the router's environment held PDRT_KV_AUTH_TOKEN). The operator-render
test is a guard: the operator already gave its router no KV key (render.py needed no change).
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from pd_harness import base_env, free_port, spawn, wait_healthy
from pdruntime.env import RuntimeEnv
from pdruntime.server.router.app import Router, RouterConfig
from pdruntime.server.router.auth import match_api_key, parse_api_keys

pytestmark = pytest.mark.timeout(180)
SHARED_STACK = True  # its traffic leaves the stack as it found it: the process's shared stack (tiny_stack.py)

KEY_A = "sk-alpha-0123456789abcdef"
KEY_B = "sk-bravo-0123456789abcdef"
ADMIN = "admin-token-0123456789"


def _asgi(router: Router, client_host: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=router.build_app(), client=(client_host, 40000)),
                             base_url="http://router")


@pytest.mark.parametrize("path", ["/config", "/debug/requests"])
async def test_admin_endpoints_refuse_remote_clients_without_a_token(path):
    async with _asgi(Router(RuntimeEnv()), "10.1.2.3") as c:
        r = await c.get(path)
    assert r.status_code == 403 and "--admin-token-file" in r.json()["error"]["message"]


@pytest.mark.parametrize("path", ["/config", "/debug/requests"])
async def test_admin_token_is_required_from_everyone_once_configured(path):
    router = Router(RuntimeEnv(), config=RouterConfig(admin_token=ADMIN))
    router.client = httpx.AsyncClient()  # /debug/requests asks the (absent) workers
    try:
        async with _asgi(router, "127.0.0.1") as c:
            assert (await c.get(path)).status_code == 401  # loopback is not enough with a token configured
            wrong = await c.get(path, headers={"Authorization": "Bearer nope"})
            assert wrong.status_code == 401 and wrong.headers["www-authenticate"] == "Bearer"
            assert (await c.get(path, headers={"Authorization": f"Bearer {ADMIN}"})).status_code == 200
        async with _asgi(router, "10.1.2.3") as c:
            assert (await c.get(path, headers={"Authorization": f"Bearer {ADMIN}"})).status_code == 200
    finally:
        await router.client.aclose()


async def test_config_redacts_every_secret():
    router = Router(RuntimeEnv(kv_auth_token="kv-secret-xyz"),
                    config=RouterConfig(admin_token=ADMIN, api_keys=parse_api_keys(f"{KEY_A} team-a\n{KEY_B}")))
    async with _asgi(router, "127.0.0.1") as c:
        text = (await c.get("/config", headers={"Authorization": f"Bearer {ADMIN}"})).text
    for secret in (ADMIN, KEY_A, KEY_B, "kv-secret-xyz"):
        assert secret not in text
    assert "team-a" in text


def test_api_key_file_parsing_names_lines_never_keys():
    keys = parse_api_keys(f"# comment\n\n{KEY_A} team-a\n{KEY_B}\n")
    assert keys[KEY_A] == "team-a" and keys[KEY_B].startswith("key-") and KEY_B not in keys[KEY_B]
    for text, words in (("short x", "line 1"), (f"{KEY_A}\n{KEY_A}", "line 2"), ("# only\n", "no key"),
                        (f"{KEY_A} bad/name", "line 1")):
        with pytest.raises(ValueError) as e:
            parse_api_keys(text)
        assert words in str(e.value) and KEY_A not in str(e.value)
    assert match_api_key(keys, KEY_A) == "team-a" and match_api_key(keys, KEY_A + "x") is None
    assert match_api_key(keys, None) is None


@pytest.fixture(scope="module")
def keyed_router(stack, tmp_path_factory):
    """A second router with API keys, in front of the shared stack's pair."""
    d = tmp_path_factory.mktemp("keyed")
    keyfile = d / "keys"
    keyfile.write_text(f"{KEY_A} team-a\n{KEY_B}\n")
    port = free_port()
    p = spawn("keyed-router", ["--role", "router", "--port", str(port), "--prefill", stack.prefill.url,
                               "--decode", stack.decode.url, "--bootstrap-ports", str(stack.bootstrap_port),
                               "--api-key-file", str(keyfile)], base_env(), str(d), port)
    wait_healthy([p], timeout=60)
    yield p
    p.stop()


def test_api_keys_gate_the_openai_routes_and_attribute_clients(stack, model_id, keyed_router):
    url = keyed_router.url
    body = {"model": model_id, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    for headers in ({}, {"Authorization": "Bearer sk-wrong-0123456789abcdef"}):
        r = httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=30)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", r.text
        assert r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(url + "/v1/models", headers=headers, timeout=30).status_code == 401
    ok = httpx.post(url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY_A}"}, timeout=60)
    assert ok.status_code == 200, ok.text
    assert httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {KEY_B}"}, timeout=30).status_code == 200

    # a live request shows its key's name as the client in /debug/requests (prefill holds it there)
    stack.hooks(stack.prefill, stall_prefill=1)
    seen: dict = {}

    def slow() -> None:
        try:
            httpx.post(url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY_A}",
                                                                      "X-Request-Timeout": "3"}, timeout=30)
        except httpx.HTTPError:
            pass

    t = threading.Thread(target=slow)
    t.start()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not seen:
        rows = httpx.get(url + "/debug/requests", timeout=10).json()["requests"]
        seen.update({"clients": [r["client"] for r in rows]} if rows else {})
        time.sleep(0.1)
    t.join(30)
    assert seen.get("clients") == ["team-a"], seen
    metrics = httpx.get(url + "/metrics", timeout=10).text
    assert 'client="team-a"' in metrics and 'client="unauthenticated",outcome="client_error"' in metrics
    for secret in (KEY_A, KEY_B):
        assert secret not in metrics and secret not in keyed_router.log_text()
    stack.wait_idle()


def test_pdrt_up_gives_the_router_no_kv_key(monkeypatch, tmp_path):
    """`pdrt up` spawns each process with only the secrets it uses: workers get the KV token, the router not."""
    from pdruntime.server.local import supervisor

    envs: dict[str, dict] = {}

    class FakePopen:
        def __init__(self, cmd, env, **kw):
            envs[cmd[cmd.index("--role") + 1]] = env
            self.pid = 0

    monkeypatch.setattr(supervisor.subprocess, "Popen", FakePopen)
    monkeypatch.setenv("PDRT_KV_AUTH_TOKEN_FILE", "/dev/null")
    st = supervisor.LocalStack(pairs=1, log_dir=str(tmp_path))
    st.start()
    assert envs["prefill"]["PDRT_KV_AUTH_TOKEN"] and envs["decode"]["PDRT_KV_AUTH_TOKEN"]
    assert "PDRT_KV_AUTH_TOKEN" not in envs["router"] and "PDRT_KV_AUTH_TOKEN_FILE" not in envs["router"]


def test_operator_rendered_router_gets_no_kv_key():
    """The operator's router Deployment mounts no KV-auth Secret and sets no KV env (only workers do)."""
    from pdoperator.core.render import Owner, render
    from pdoperator.core.spec import parse_spec

    objs = render(parse_spec({"image": "pdrt:1"}, name="llm"), Owner("llm", "ns", "u"), "r1", kv_token="t")
    router = next(o for o in objs if o["kind"] == "Deployment")
    pod = router["spec"]["template"]["spec"]
    text = repr(pod)
    assert "kv-auth" not in text and "PDRT_KV_AUTH" not in text
    workers = [o for o in objs if o["kind"] == "Pod"]
    assert workers and all("PDRT_KV_AUTH_TOKEN_FILE" in repr(w) for w in workers)
