"""Multi-round agent probe: the requests that hung in the incident, not one-shot prompts.

``agents`` agents each hold one keep-alive connection (their own ``httpx.AsyncClient``) and run ``rounds``
rounds of streaming ``/v1/chat/completions`` with a growing context: a system prompt and a task, then per
round the previous answer as an assistant turn that calls a tool, and the tool's result (``role: tool``),
as an agent harness sends them. Every agent runs round r concurrently; round r+1 starts when all finished.

A round that does not finish within ``round_timeout_s`` is a hang. The probe then reads the router's
``/debug/requests`` (with the same headers) for the hung request, found by the ``X-Request-Id`` it sent
(the router shows it as ``client_request_id``), and reports which round, which stage and how old; then it
closes its connections, so that the stack aborts what it still holds.

Importable without torch, numpy or fastapi (the operator runs it): stdlib + httpx only.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

import httpx

from pdruntime.util.headers import REQUEST_ID_HEADER  # the router shows it as client_request_id
from pdruntime.util.sse import DONE, aiter_sse

DEBUG_TIMEOUT_S = 10.0  # seconds for the evidence fetch after a hang
MAX_DETAIL = 600  # characters of an error body kept in a failure's detail

SYSTEM_PROMPT = ("You are a coding agent working in a repository. Think briefly, then call one tool per turn. "
                 "Answer tersely.")
TOOLS = [{"type": "function", "function": {
    "name": "read_file", "description": "Read a file of the repository",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}]


@dataclass(frozen=True)
class RoundResult:
    round: int  # 1-based
    completed: int  # agents whose request finished within the round's deadline
    failed: int  # agents whose request ended in an error (HTTP status, error event, broken stream)
    hung: int  # agents whose request did not finish within the deadline
    latency_p50_s: float | None  # over completed requests; None when none completed
    latency_max_s: float | None


@dataclass(frozen=True)
class ProbeFailure:
    round: int  # 1-based; 0 = before round 1 (the model lookup)
    agent: int  # 0-based
    kind: str  # "hang" | "error"
    detail: str
    stage: str | None = None  # hang: "<role>:<stage>" of the furthest live leg (e.g. "decode:running")
    age_s: float | None = None  # hang: the request's age at the router, seconds


@dataclass(frozen=True)
class ProbeReport:
    ok: bool  # every round completed for every agent
    rounds: list[RoundResult] = field(default_factory=list)  # the rounds that ran (the failing one last)
    failure: ProbeFailure | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class _RequestFailed(Exception):
    """One agent's request ended in an error (not a hang)."""


class _Agent:
    def __init__(self, index: int, client: httpx.AsyncClient, model: str, max_tokens: int, tag: str) -> None:
        self.index = index
        self.client = client
        self.model = model
        self.max_tokens = max_tokens
        self.tag = tag
        self.messages: list[dict[str, Any]] = [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": f"Task {index}: find where the request timeout is set, read the files you "
                                        "need, and propose a one-line fix."}]

    def request_id(self, rnd: int) -> str:
        return f"{self.tag}-a{self.index}-r{rnd}"

    async def run_round(self, rnd: int) -> float:
        """One streamed request with the conversation so far; its latency in seconds. Raises _RequestFailed."""
        body = {"model": self.model, "messages": self.messages, "tools": TOOLS, "tool_choice": "none",
                "temperature": 0, "max_tokens": self.max_tokens, "stream": True}
        t0 = time.monotonic()
        parts: list[str] = []
        finished = False
        try:
            async with self.client.stream("POST", "/v1/chat/completions", json=body,
                                          headers={REQUEST_ID_HEADER: self.request_id(rnd)}) as resp:
                if resp.status_code != 200:
                    text = (await resp.aread()).decode("utf-8", "replace")
                    raise _RequestFailed(f"HTTP {resp.status_code}: {_error_message(text)}")
                async for ev in aiter_sse(resp.aiter_lines()):
                    if ev == DONE:  # read on to the body's end: an unfinished body closes the connection
                        finished = True
                        continue
                    if "error" in ev:
                        raise _RequestFailed(f"error event in the stream: {_error_message(json.dumps(ev))}")
                    for choice in ev.get("choices") or ():
                        parts.append((choice.get("delta") or {}).get("content") or "")
        except httpx.HTTPError as exc:
            raise _RequestFailed(f"{type(exc).__name__}: {exc}") from None
        except ValueError as exc:
            raise _RequestFailed(f"undecodable stream event: {exc}") from None
        if not finished:
            raise _RequestFailed("the stream ended without [DONE]")
        latency = time.monotonic() - t0
        self._grow(rnd, "".join(parts))
        return latency

    def _grow(self, rnd: int, answer: str) -> None:
        """The answer becomes an assistant turn that calls a tool; the tool's result follows (the context grows)."""
        call_id = f"call_{self.index}_{rnd}"
        path = f"src/service/module_{rnd}.py"
        self.messages.append({"role": "assistant", "content": answer or "Reading the next file.", "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": "read_file",
                                                             "arguments": json.dumps({"path": path})}}]})
        lines = "\n".join(f"    timeout_{rnd}_{k} = {30 * (k + 1)}  # seconds" for k in range(4))
        self.messages.append({"role": "tool", "tool_call_id": call_id,
                              "content": f"# {path}\nclass Settings:\n{lines}\n"})


def _error_message(text: str) -> str:
    try:
        err = json.loads(text).get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])[:MAX_DETAIL]
    except (ValueError, AttributeError):
        pass
    return text[:MAX_DETAIL]


def _validate(url: str, agents: int, rounds: int, round_timeout_s: float, max_tokens: int) -> None:
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"url {url!r} is not accepted; accepted: the router's http(s) URL, e.g. http://127.0.0.1:8000")
    for name, value, lo in (("agents", agents, 1), ("rounds", rounds, 1), ("max_tokens", max_tokens, 1)):
        if not isinstance(value, int) or isinstance(value, bool) or value < lo:
            raise ValueError(f"{name}={value!r} is not accepted; accepted: an integer >= {lo}")
    if not round_timeout_s > 0:
        raise ValueError(f"round_timeout_s={round_timeout_s!r} is not accepted; accepted: seconds > 0")


async def _first_model(client: httpx.AsyncClient) -> str:
    resp = await client.get("/v1/models")
    if resp.status_code != 200:
        raise _RequestFailed(f"GET /v1/models answered HTTP {resp.status_code}: {_error_message(resp.text)}")
    data = resp.json().get("data") or []
    if not data:
        raise _RequestFailed("GET /v1/models lists no model")
    return str(data[0]["id"])


async def _hang_evidence(base: str, headers: Mapping[str, str], rid: str) -> tuple[str | None, float | None, str]:
    """(stage, age_s, what the stack shows) of the live request the router tagged with client id ``rid``."""
    try:
        async with httpx.AsyncClient(base_url=base, headers=dict(headers), timeout=DEBUG_TIMEOUT_S) as c:
            resp = await c.get("/debug/requests")
        if resp.status_code != 200:
            return None, None, f"/debug/requests answered HTTP {resp.status_code}: {_error_message(resp.text)}"
        doc = resp.json()
    except (httpx.HTTPError, ValueError) as exc:
        return None, None, f"/debug/requests unavailable: {type(exc).__name__}: {exc}"
    row = next((r for r in doc.get("requests") or () if r.get("client_request_id") == rid), None)
    if row is None:
        return None, None, ("the router holds no live request with this X-Request-Id: nothing is live inside the "
                            "stack for it (look outside: client, proxy, network)")
    legs = {w.get("role"): r for w in doc.get("workers") or () for r in w.get("requests") or ()
            if r.get("id") == row.get("id")}
    role = "decode" if "decode" in legs else ("prefill" if "prefill" in legs else None)
    stage = f"{role}:{legs[role].get('stage')}" if role else f"router:{row.get('stage')}"
    seen = [f"router {row.get('stage')} (pair {row.get('pair')}, {row.get('tokens')} tokens, idle "
            f"{row.get('idle_s')}s)"]
    seen += [f"{r} {legs[r].get('stage')} ({legs[r].get('tokens', 0)} tokens, idle {legs[r].get('idle_s')}s)"
             for r in ("prefill", "decode") if r in legs]
    return stage, row.get("age_s"), "live in " + "; ".join(seen) + f"; router id {row.get('id')}"


async def run_agents_probe(url: str, *, agents: int = 8, rounds: int = 10, round_timeout_s: float = 60.0,
                           max_tokens: int = 16, headers: Mapping[str, str] | None = None, model: str | None = None,
                           api_key: str | None = None) -> ProbeReport:
    """Run ``agents`` x ``rounds`` against the router at ``url``; stops at the first round with a hang or an error.

    ``headers`` go with every request (``X-PDStack-Pair`` and ``X-PDStack-Admin-Token`` pin it to one group);
    ``api_key`` is sent as ``Authorization: Bearer``. ``model`` defaults to the router's first model.
    Raises ValueError for bad arguments; everything the stack does is in the report."""
    _validate(url, agents, rounds, round_timeout_s, max_tokens)
    base = url.rstrip("/")
    hdrs = dict(headers or {})
    if api_key:
        hdrs["Authorization"] = f"Bearer {api_key}"
    timeout = httpx.Timeout(round_timeout_s + 5.0, connect=min(10.0, round_timeout_s))
    one_connection = httpx.Limits(max_connections=1, max_keepalive_connections=1)  # the agent's keep-alive connection
    clients = [httpx.AsyncClient(base_url=base, headers=hdrs, timeout=timeout, limits=one_connection)
               for _ in range(agents)]
    results: list[RoundResult] = []
    try:
        try:
            model = model or await _first_model(clients[0])
        except (_RequestFailed, httpx.HTTPError, ValueError, KeyError) as exc:
            return ProbeReport(False, results, ProbeFailure(0, 0, "error", f"model lookup failed: {exc}"))
        tag = "probe-" + uuid.uuid4().hex[:8]
        crew = [_Agent(i, c, model, max_tokens, tag) for i, c in enumerate(clients)]
        for rnd in range(1, rounds + 1):
            tasks = {asyncio.create_task(a.run_round(rnd)): a for a in crew}
            done, pending = await asyncio.wait(tasks, timeout=round_timeout_s)
            latencies = [t.result() for t in done if t.exception() is None]
            errors = sorted(((tasks[t].index, t.exception()) for t in done if t.exception() is not None),
                            key=lambda e: e[0])
            hung = sorted(tasks[t].index for t in pending)
            results.append(RoundResult(rnd, len(latencies), len(errors), len(hung),
                                       round(statistics.median(latencies), 3) if latencies else None,
                                       round(max(latencies), 3) if latencies else None))
            if not hung and not errors:
                continue
            if hung:  # read the evidence while the hung requests are still live, then let go of them
                agent = hung[0]
                stage, age, seen = await _hang_evidence(base, hdrs, crew[agent].request_id(rnd))
                failure = ProbeFailure(rnd, agent, "hang", f"{len(hung)} of {agents} agents got no complete answer "
                                       f"within {round_timeout_s:g}s (request {crew[agent].request_id(rnd)}); {seen}",
                                       stage, age)
            else:
                agent, exc = errors[0]
                failure = ProbeFailure(rnd, agent, "error", f"{len(errors)} of {agents} agents failed; agent {agent}: "
                                       f"{exc}")
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            return ProbeReport(False, results, failure)
        return ProbeReport(True, results, None)
    finally:
        await asyncio.gather(*(c.aclose() for c in clients), return_exceptions=True)


def format_table(report: ProbeReport, agents: int) -> str:
    """One line per round, then the verdict and the failure's evidence."""
    def s(v: float | None) -> str:
        return "-" if v is None else f"{v:.3f}"

    out = [f"{'round':>5}  {'completed':>9}  {'p50_s':>7}  {'max_s':>7}  notes"]
    for r in report.rounds:
        notes = ", ".join(x for x in (f"{r.hung} hung" if r.hung else "", f"{r.failed} failed" if r.failed else "") if x)
        out.append(f"{r.round:>5}  {f'{r.completed}/{agents}':>9}  {s(r.latency_p50_s):>7}  {s(r.latency_max_s):>7}  "
                   f"{notes}".rstrip())
    f = report.failure
    if f is None:
        out.append(f"OK: {len(report.rounds)} rounds x {agents} agents completed")
    else:
        where = f"round {f.round}" if f.round else "before round 1"
        evidence = ""
        if f.kind == "hang":
            evidence = f" in stage {f.stage or 'unknown'}" + (f", age {f.age_s:.1f}s" if f.age_s is not None else "")
        out.append(f"FAILED: {where}, agent {f.agent}: {f.kind}{evidence}")
        out.append(f"  {f.detail}")
    return "\n".join(out)
