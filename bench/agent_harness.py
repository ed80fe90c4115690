"""A small agent harness on the official ``openai`` client: N agents x R rounds of tool use against a router.

Each agent keeps its own conversation. Every round it asks the model (with two tools: ``add`` and
``lookup_capital``), executes the tool call it gets back, validates the arguments against the tool's schema,
and feeds the result back as a ``role: tool`` message. An error is any failed request, a round without a
tool call, or arguments that do not validate. Prints a table and exits non-zero on any error.

    .venv/bin/python bench/agent_harness.py --url http://127.0.0.1:8000 [--agents 8] [--rounds 5] \\
        [--tool-choice required|auto]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field

TOOLS = [
    {"type": "function", "function": {
        "name": "add", "description": "Add two integers and return the sum",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9999},
                                                        "b": {"type": "integer", "minimum": 0, "maximum": 9999}},
                       "required": ["a", "b"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "lookup_capital", "description": "The capital city of a country",
        "parameters": {"type": "object", "properties": {"country": {"type": "string", "maxLength": 24}},
                       "required": ["country"], "additionalProperties": False}}},
]
CAPITALS = {"france": "Paris", "japan": "Tokyo", "italy": "Rome"}


def run_tool(name: str, args: dict) -> str:
    if name == "add":
        return json.dumps({"sum": args["a"] + args["b"]})
    return json.dumps({"capital": CAPITALS.get(args["country"].strip().lower(), "unknown")})


@dataclass
class AgentResult:
    rounds: int = 0
    errors: list[str] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)


def run_agent(client, model: str, idx: int, rounds: int, tool_choice: str, max_tokens: int) -> AgentResult:
    import jsonschema

    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    res = AgentResult()
    messages = [{"role": "system", "content": "You are an agent. Use the tools to answer."},
                {"role": "user", "content": f"Agent {idx}: add {idx} and {idx * 7}, then find the capital of France."}]
    for r in range(rounds):
        t0 = time.monotonic()
        try:
            resp = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, tool_choice=tool_choice,
                                                  parallel_tool_calls=False, max_tokens=max_tokens, seed=idx * 100 + r)
        except Exception as exc:  # noqa: BLE001 - every failure is an error of the run, with its type
            res.errors.append(f"agent {idx} round {r}: {type(exc).__name__}: {exc}")
            return res
        res.latencies.append(time.monotonic() - t0)
        msg = resp.choices[0].message
        if not msg.tool_calls:
            res.errors.append(f"agent {idx} round {r}: no tool call (finish_reason {resp.choices[0].finish_reason})")
            return res
        call = msg.tool_calls[0]
        try:
            args = json.loads(call.function.arguments)
            jsonschema.validate(args, schemas[call.function.name])
        except Exception as exc:  # noqa: BLE001
            res.errors.append(f"agent {idx} round {r}: bad arguments {call.function.arguments!r}: {exc}")
            return res
        messages.append({"role": "assistant", "content": msg.content, "tool_calls": [
            {"id": call.id, "type": "function",
             "function": {"name": call.function.name, "arguments": call.function.arguments}}]})
        messages.append({"role": "tool", "tool_call_id": call.id, "content": run_tool(call.function.name, args)})
        res.rounds += 1
    return res


def run(url: str, agents: int, rounds: int, tool_choice: str = "required", max_tokens: int = 200,
        api_key: str = "unused") -> list[AgentResult]:
    import openai

    client = openai.OpenAI(base_url=url.rstrip("/") + "/v1", api_key=api_key, timeout=600, max_retries=0)
    model = client.models.list().data[0].id
    results: list[AgentResult | None] = [None] * agents

    def go(i: int) -> None:
        results[i] = run_agent(client, model, i, rounds, tool_choice, max_tokens)

    threads = [threading.Thread(target=go, args=(i,)) for i in range(agents)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [r for r in results if r is not None]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--agents", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tool-choice", default="required", choices=("required", "auto"))
    ap.add_argument("--max-tokens", type=int, default=200)
    a = ap.parse_args()
    t0 = time.monotonic()
    results = run(a.url, a.agents, a.rounds, a.tool_choice, a.max_tokens)
    wall = time.monotonic() - t0
    lat = [x for r in results for x in r.latencies]
    errors = [e for r in results for e in r.errors]
    print(f"{'agents':>6} {'rounds':>6} {'tool calls':>10} {'errors':>6} {'p50 s':>7} {'max s':>7} {'wall s':>7}")
    print(f"{a.agents:>6} {a.rounds:>6} {sum(r.rounds for r in results):>10} {len(errors):>6} "
          f"{statistics.median(lat) if lat else 0:>7.2f} {max(lat, default=0):>7.2f} {wall:>7.1f}")
    for e in errors[:10]:
        print("  " + e)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
