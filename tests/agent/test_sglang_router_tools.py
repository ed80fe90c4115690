"""Behind the real SGLang router (PD mode): the fields SGLang's worker API carries to pdrt's workers' /v1
routes (tools + a named tool_choice, response_format json_schema, penalties) work there too, through the
official openai client. Prefill's answer is dropped by SGLang's router, so chat logprobs are pdrt-router only
(docs/api.md)."""

from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "pd"))
try:
    from test_sglang_router import SGLangRouter  # noqa: E402
except ImportError as exc:  # pragma: no cover
    pytest.skip(f"sglang-router is not installed ({exc})", allow_module_level=True)
try:
    import sglang_router  # noqa: F401
except ImportError as exc:  # pragma: no cover
    pytest.skip(f"sglang-router is not installed ({exc})", allow_module_level=True)

pytestmark = pytest.mark.timeout(300)
SHARED_STACK = True  # its traffic leaves the stack as it found it: the process's shared stack (tiny_stack.py)

from .test_openai_client import WEATHER, _validate  # noqa: E402


@pytest.fixture(scope="module")
def sgl_client(stack, tmp_path_factory):
    openai = pytest.importorskip("openai")
    r = SGLangRouter(stack, str(tmp_path_factory.mktemp("sgl-agent")))
    try:
        r.workers = r.wait_workers()
        yield openai.OpenAI(base_url=r.url + "/v1", api_key="unused", timeout=120, max_retries=0)
    finally:
        r.stop()


def test_named_tool_call_and_json_schema_behind_the_sglang_router(sgl_client):
    model = sgl_client.models.list().data[0].id
    r = sgl_client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=240, temperature=0.9,
        seed=4, presence_penalty=0.5)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.tool_calls[0].function.name == "get_weather", ch
    _validate(json.loads(ch.message.tool_calls[0].function.arguments), WEATHER["function"]["parameters"])
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    r = sgl_client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "ok?"}], max_tokens=40, temperature=1.0, seed=1,
        response_format={"type": "json_schema", "json_schema": {"name": "ok", "schema": schema, "strict": True}})
    _validate(json.loads(r.choices[0].message.content), schema)
