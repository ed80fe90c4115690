"""Tool schemas as frameworks write them (issue 20, build item 7): nested pydantic models give parameters with
``$defs`` and ``$ref`` (the official client's ``pydantic_function_tool``, the openai-agents SDK's
``function_tool``), and the tool-call grammar nests parameters under ``arguments``, so their root-relative refs
are rebased into the call schema's root. Pure grammar checks, then real clients through the PD router."""

from __future__ import annotations

import asyncio
import json

import llguidance
import pytest
from pydantic import BaseModel, Field

from pdruntime.server.openai.schemas import Tool
from pdruntime.server.openai.structured import tool_grammar
from pdruntime.server.openai.tools import parser_for

pytestmark = pytest.mark.timeout(600)
SHARED_STACK = True  # its traffic leaves the stack as it found it: the process's shared stack (tiny_stack.py)


class City(BaseModel):
    name: str = Field(max_length=12)
    country: str = Field(max_length=12)


class GetWeather(BaseModel):
    """Current weather of a city."""

    city: City
    days: int = Field(ge=1, le=7)


class Node(BaseModel):
    label: str = Field(max_length=6)
    children: list["Node"] = Field(max_length=2)


class SaveTree(BaseModel):
    """Store a small tree."""

    root: Node


def _tool(model: type[BaseModel]) -> Tool:
    openai = pytest.importorskip("openai")
    return Tool.model_validate(openai.pydantic_function_tool(model))


def _accepts(grammar: str, text: str) -> bool:
    """Whether the grammar's matcher takes ``text`` whole, token by token of a byte-level tokenizer."""
    tok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteTokenizer()))
    m = llguidance.LLMatcher(tok, grammar)
    assert not m.is_error(), m.get_error()
    return all(m.consume_token(b) for b in text.encode()) and m.is_accepting()


class _ByteTokenizer:
    """256 byte tokens and an EOS: enough for llguidance to run a grammar over raw text."""

    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([i]) for i in range(256)] + [b"<eos>"]
    special_token_ids = [256]

    def __call__(self, s):
        return list(s.encode() if isinstance(s, str) else s)


def test_pydantic_function_tool_parameters_carry_defs_and_refs():
    params = _tool(GetWeather).function.parameters
    assert "$defs" in params and params["properties"]["city"]["$ref"] == "#/$defs/City"


@pytest.mark.parametrize("parser", ["hermes", "llama3_json"])
def test_a_nested_model_tool_compiles_and_takes_a_valid_call(parser):
    g = tool_grammar([_tool(GetWeather)], "GetWeather", parallel=False, parser=parser)
    p = parser_for(parser)
    call = json.dumps({"name": "GetWeather", p.args_key: {"city": {"name": "Paris", "country": "FR"}, "days": 3}},
                      separators=(", ", ": "))
    text = f"{p.start}\n{call}\n{p.end}" if p.start else call
    assert _accepts(g, text)
    bad = text.replace('"days": 3', '"days": 30')
    assert not _accepts(g, bad)


def test_a_recursive_model_and_two_tools_with_the_same_def_name_compile():
    class Other(BaseModel):
        city: str = Field(max_length=4)

    class Twin(BaseModel):  # its own $defs/City, unrelated to GetWeather's
        city: "Other"

    Twin.model_rebuild()
    tools = [_tool(GetWeather), _tool(SaveTree), _tool(Twin)]
    g = tool_grammar(tools, None, parallel=True, parser="hermes")
    call = json.dumps({"name": "SaveTree", "arguments": {"root": {"label": "a", "children": [
        {"label": "b", "children": []}]}}}, separators=(", ", ": "))
    assert _accepts(g, f"<tool_call>\n{call}\n</tool_call>")


# ---- real clients through the PD router ---------------------------------------------------------------

def test_official_client_pydantic_function_tool_with_a_nested_model_completes_a_tool_call(client, model_id):
    openai = pytest.importorskip("openai")
    r = client.chat.completions.create(
        model=model_id, messages=[{"role": "user", "content": "Weather in Paris for 3 days?"}],
        tools=[openai.pydantic_function_tool(GetWeather)], max_tokens=200, temperature=0.8, seed=3,
        tool_choice={"type": "function", "function": {"name": "GetWeather"}})
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls", ch
    call = ch.message.tool_calls[0]
    assert call.function.name == "GetWeather"
    GetWeather.model_validate_json(call.function.arguments)  # nested City, days within 1..7


def test_openai_agents_sdk_agent_with_a_nested_model_tool_completes_a_tool_call(stack, model_id):
    agents = pytest.importorskip("agents", reason="the openai-agents SDK is in the dev extra")
    openai = pytest.importorskip("openai")
    agents.set_tracing_disabled(True)  # no trace export: nothing leaves loopback
    seen: list[GetWeather] = []

    @agents.function_tool
    def get_weather(query: GetWeather) -> str:
        """Current weather of a city."""
        seen.append(query)
        return f"sunny in {query.city.name}"

    model = agents.OpenAIChatCompletionsModel(model=model_id, openai_client=openai.AsyncOpenAI(
        base_url=stack.router.url + "/v1", api_key="unused", max_retries=0, timeout=120))
    agent = agents.Agent(name="weather", instructions="Answer with the tool.", model=model, tools=[get_weather],
                         model_settings=agents.ModelSettings(tool_choice="get_weather", max_tokens=200,
                                                             temperature=0.8),
                         tool_use_behavior="stop_on_first_tool")
    result = asyncio.run(agents.Runner.run(agent, "Weather in Paris for 3 days?", max_turns=2))
    assert len(seen) == 1 and isinstance(seen[0].city, City) and 1 <= seen[0].days <= 7
    assert result.final_output == f"sunny in {seen[0].city.name}"
