"""Integration: bad input at the router's edge (issue 13, defects 2/3, 5 and 7), real processes on loopback.

Every defect test here was run against the unfixed code (main at 1c0b2fc: the runtime of that commit on
PYTHONPATH, same tests) and failed there, as its docstring says; all pass after the fix. Tests marked
"guard" pin a property that already held.
"""

from __future__ import annotations

import json

import httpx
import pytest

from pd_harness import wait_for

pytestmark = pytest.mark.timeout(180)
SHARED_STACK = True  # its traffic leaves the stack as it found it: the process's shared stack (tiny_stack.py)

MARKER = "PROMPT-MARKER-7f3a"  # text that must never reach a log


def chat(model_id, content="hello there", **kw):
    return {"model": model_id, "messages": [{"role": "user", "content": content}], **kw}


def post(stack, body, path="/v1/chat/completions", **kw):
    headers = {"X-Request-Timeout": "20", **kw.pop("headers", {})}
    return httpx.post(stack.router.url + path, json=body, headers=headers, timeout=60, **kw)


def settled(stack) -> None:
    """Wait until no process has a live request and every KV page is free: what those requests logged is written
    (each process logs a request's failure before it drops the request)."""
    p, d = stack.wait_idle()
    assert all(x["live"] == 0 and x["pool"]["free"] == x["pool"]["total"] for x in (p, d)), (p, d)
    wait_for(lambda: stack.debug(stack.router)["live"] == 0, 20, "no live request on the router")


def router_totals(stack) -> tuple[float, float, float]:
    return (stack.metric(stack.router, "pdrt_router_leg_failures_total"),
            stack.metric(stack.router, "pdrt_router_circuit_open"),
            stack.metric(stack.router, "pdrt_router_pair_outstanding_requests"))


# Values that passed the old validation and made an engine step raise (temperature: logits / T overflows fp32
# and multinomial raises; seed: torch.Generator.manual_seed overflows; top_p: rounds to 0 in fp32 and keeps no
# token; input_ids past the vocabulary: the embedding lookup raises).
POISON = [
    ("temperature", {"temperature": 1e-45}),
    ("temperature", {"temperature": 5e-324}),
    ("seed", {"seed": 2 ** 64}),
    ("top_p", {"top_p": 1e-300}),
    ("top_k", {"top_k": 2 ** 40}),
    ("max_tokens", {"max_tokens": 2 ** 62}),
]


@pytest.mark.parametrize("param,extra", POISON, ids=[f"{p}={list(e.values())[0]}" for p, e in POISON])
def test_values_that_made_engine_steps_raise_are_400_naming_the_parameter_and_never_trip_the_breaker(
        stack, model_id, param, extra):
    """Defects 2 and 3. Unfixed code: temperature=1e-45 and seed=2**64 reached the engine, the prefill step
    raised (HTTP 500 after stalling other requests), the router counted a leg failure per request and the
    third one opened the breaker, so the clean request below got 503."""
    before = router_totals(stack)
    for _ in range(4):  # more than the breaker threshold (3)
        r = post(stack, chat(model_id, **extra))
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and "accepted:" in err["message"], err
    clean = post(stack, chat(model_id, max_tokens=4, temperature=0))
    assert clean.status_code == 200, clean.text
    after = router_totals(stack)
    assert after[0] == before[0] and after[1] == 0 and after[2] == 0  # no leg failure, breaker closed, nothing held


def test_worker_generate_applies_the_same_bounds(stack):
    """The workers' SGLang /generate takes the same request model (an SGLang router fronting them gets the same
    400s). Unfixed code: the worker accepted these and the engine raised."""
    for sp in ({"temperature": 1e-45}, {"seed": 2 ** 64}, {"top_p": 1e-300}):
        r = httpx.post(stack.decode.url + "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2, **sp}},
                       timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == f"sampling_params.{next(iter(sp))}", r.text
    r = httpx.post(stack.decode.url + "/generate", json={"input_ids": [1, 10 ** 6], "sampling_params": {"max_new_tokens": 2}},
                   timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "input_ids" and "vocabulary" in r.text, r.text


@pytest.mark.parametrize("raw,param", [
    ('"hello \\ud800 ' + MARKER + '"', "messages.0.content"),  # lone high surrogate
    ('"' + MARKER + ' \\udfff"', "messages.0.content"),  # lone low surrogate
    ('"\\udc00\\ud800 ' + MARKER + '"', "messages.0.content"),  # reversed pair
], ids=["lone-high", "lone-low", "reversed-pair"])
def test_invalid_unicode_is_400_leaks_nothing_and_is_never_logged(stack, model_id, raw, param):
    """Defect 5. Unfixed code: HTTP 500 ("internal error: UnicodeEncodeError ... surrogates not allowed") with
    the exception logged as a traceback; the issue's run also saw the live entry and the pair's outstanding count
    leak (the dispatch raised past its cleanup), which the assertions below pin."""
    body = '{"model": %s, "messages": [{"role": "user", "content": %s}]}' % (json.dumps(model_id), raw)
    r = httpx.post(stack.router.url + "/v1/chat/completions", content=body.encode(),
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["code"] == "invalid_unicode" and "accepted:" in err["message"]
    assert MARKER not in r.text  # not echoed either
    # the worker's own edge rejects it the same way
    w = httpx.post(stack.decode.url + "/generate", content=('{"text": %s}' % raw).encode(), timeout=30)
    assert w.status_code == 400 and w.json()["error"]["code"] == "invalid_unicode"
    assert stack.debug(stack.router)["live"] == 0
    assert stack.metric(stack.router, "pdrt_router_pair_outstanding_requests") == 0
    assert post(stack, chat(model_id, max_tokens=2)).status_code == 200
    settled(stack)
    for proc in (stack.router, stack.prefill, stack.decode):
        assert MARKER not in proc.log_text(), f"prompt text in the {proc.name} log"


def test_worker_4xx_is_neutral_for_the_breaker_and_its_prompt_never_reaches_a_log(stack, model_id):
    """Guard (passed on the unfixed code too): a request the worker rejects (context overflow, a 4xx) is
    neutral for the breaker, its prompt text stays out of every log and out of the error body."""
    before = router_totals(stack)
    for _ in range(4):  # more than the breaker threshold: a worker's 4xx is neutral for the breaker
        r = post(stack, chat(model_id, MARKER + " x" * 5000, max_tokens=4))
        assert r.status_code == 400 and MARKER not in r.text
        assert r.json()["error"]["param"] == "messages"  # the worker's param reaches the client through the router
    assert router_totals(stack) == (before[0], 0, 0)
    assert post(stack, chat(model_id, max_tokens=2)).status_code == 200
    settled(stack)
    for proc in (stack.router, stack.prefill, stack.decode):
        assert MARKER not in proc.log_text()


@pytest.mark.parametrize("depth", [40, 100_000])
def test_deeply_nested_json_is_400(stack, depth):
    """Defect 7. Unfixed code: a body nested 100000 deep was a 500 (RecursionError in json.loads)."""
    body = '{"model": "m", "messages": ' + "[" * depth + "]" * depth + "}"
    r = httpx.post(stack.router.url + "/v1/chat/completions", content=body.encode(),
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400 and "nested" in r.json()["error"]["message"], r.text


def test_router_counts_its_own_4xx_answers(stack, model_id):
    """Defect 7. Unfixed code: bad JSON, validation errors, unknown models, 404 and 405 were missing from
    pdrt_requests_total."""
    def client_errors() -> float:
        return stack.metric(stack.router, "pdrt_requests_total", {"role": "router", "outcome": "client_error"})

    before = client_errors()
    answers = [
        httpx.post(stack.router.url + "/v1/chat/completions", content=b"{nope", timeout=10).status_code,
        post(stack, chat(model_id, temperature=7)).status_code,
        post(stack, chat("no-such-model")).status_code,
        httpx.get(stack.router.url + "/v1/nothing-here", timeout=10).status_code,
        httpx.get(stack.router.url + "/v1/chat/completions", timeout=10).status_code,
    ]
    assert answers == [400, 400, 404, 404, 405]
    assert client_errors() - before == len(answers)


def test_405_carries_allow(stack):
    """Defect 7. Unfixed code: the 405 had no Allow header (the error handler dropped the exception's headers)."""
    r = httpx.get(stack.router.url + "/v1/completions", timeout=10)
    assert r.status_code == 405 and r.headers.get("allow") == "POST", dict(r.headers)
    r = httpx.post(stack.router.url + "/health", timeout=10)
    assert r.status_code == 405 and "GET" in r.headers.get("allow", "")


def test_openapi_describes_request_bodies_with_their_bounds(stack):
    """Defect 7. Unfixed code: neither POST route had a requestBody."""
    doc = httpx.get(stack.router.url + "/openapi.json", timeout=10).json()
    for path, model in (("/v1/chat/completions", "ChatCompletionRequest"), ("/v1/completions", "CompletionRequest")):
        rb = doc["paths"][path]["post"]["requestBody"]
        assert rb["content"]["application/json"]["schema"] == {"$ref": f"#/components/schemas/{model}"}
        props = doc["components"]["schemas"][model]["properties"]
        t = props["temperature"]["anyOf"][0]  # optional: omitted = the model's default
        assert t["minimum"] == 0 and t["maximum"] == 2
        assert props["seed"]["anyOf"][0]["maximum"] == 2 ** 63 - 1


def test_workers_serve_openai_routes_with_pd_bootstrap_fields(stack, model_id):
    """Defect 8 (the pdrt side; tests/pd/test_edge_sglang_openai.py runs it behind SGLang's router): the same
    OpenAI body, with bootstrap fields, sent to both workers at once. Unfixed code: 404 on both."""
    import threading

    models = httpx.get(stack.decode.url + "/v1/models", timeout=10).json()
    assert models["data"][0]["id"] == model_id
    room = 4242
    body = chat(model_id, "hi", max_tokens=4, temperature=0, bootstrap_host="127.0.0.1",
                bootstrap_port=stack.bootstrap_port, bootstrap_room=room)
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(p=httpx.post(stack.prefill.url + "/v1/chat/completions", json=body,
                                                                 timeout=60)))
    t.start()
    d = httpx.post(stack.decode.url + "/v1/chat/completions", json=body, timeout=60)
    t.join(60)
    assert d.status_code == 200, d.text
    assert d.json()["object"] == "chat.completion" and d.json()["usage"]["completion_tokens"] == 4
    assert out["p"].status_code == 200, out["p"].text
    ref = post(stack, chat(model_id, "hi", max_tokens=4, temperature=0)).json()
    assert d.json()["choices"][0]["message"]["content"] == ref["choices"][0]["message"]["content"]


def test_admin_endpoints_answer_loopback_clients(stack):
    """/config and /debug/requests are served to loopback clients without a token (tests/pd/test_edge_auth.py
    covers the non-loopback and admin-token cases)."""
    assert httpx.get(stack.router.url + "/config", timeout=10).status_code == 200
    assert httpx.get(stack.router.url + "/debug/requests", timeout=10).status_code == 200
