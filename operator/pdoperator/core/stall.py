"""Stall detection: is a pair stuck while requests are live in it? (pure)

Inputs, per pair, at two moments (the previous and the current :class:`Observation`):

* rows: every live request entry of the pair, from the router's ``/debug/requests`` (which merges its
  workers' rows): the router's own rows (``pair`` = its topology index, mapped to the group) and the
  prefill/decode workers' rows. Fields read: ``id``, ``stage``, ``age_s``, ``tokens``, ``idle_s``
  (seconds since the request's last progress: a token or a stage change), ``client``; runtimes without
  ``idle_s`` are judged by ``tokens`` (or ``completion_tokens``) unchanged across observations, and
  ``in_state_s`` for a row first seen without tokens;
* samples from the pair's workers' ``/metrics``: ``pdrt_watchdog_fired_total`` and, from decode,
  ``pdrt_generated_tokens_total`` (each summed over the pair's workers; None when any is unreadable).

A pair is **Stalled** when it has live requests and

(a) one of them made no progress for ``>= stall.seconds``, or
(b) its oldest request in a pre-decode stage (router ``dispatching``/``waiting_first_token``, every
    prefill stage, decode ``prealloc``/``transfer``) is ``>= stall.seconds`` old, for rows without ``idle_s``
    (runtimes that do not report progress) and router rows no worker lists. pdrt's workers report it, and prefill's and decode's count a prefill
    chunk that advances as progress: a long prompt is never Stalled while it advances. A router row is judged by
    the worker rows of the same request where they list it.

A long generation that keeps producing tokens is never stalled, however old. Watchdog fires over the
interval and tokens/s are evidence reported with the verdict, never a verdict alone (a watchdog that
fired has already failed its request). An unreachable worker is named in the reason.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Iterable, Mapping

from prometheus_client.parser import text_string_to_metric_families

from .render import group_of

WATCHDOG_METRIC = "pdrt_watchdog_fired_total"
TOKENS_METRIC = "pdrt_generated_tokens_total"
# only the pdstack agent (beside SGLang and vLLM) exposes it: a series its text lacks is one the engine does not
# expose (unknown), where a pdrt worker's absent counter is one that has not counted yet (0)
AGENT_METRIC = "pdrt_agent_engine_up"
#: (role, stage) before the first decoded token; a request older than stall.seconds here is stuck
PRE_DECODE = {("router", "dispatching"), ("router", "waiting_first_token"), ("prefill", "bootstrap"),
              ("prefill", "waiting"), ("prefill", "inflight"), ("decode", "prealloc"), ("decode", "transfer")}


@dataclass(frozen=True)
class Row:
    """One live request entry in one process."""

    role: str  # router | prefill | decode
    id: str
    stage: str
    age_s: float
    tokens: int | None = None
    idle_s: float | None = None  # seconds since its last progress, as the process reports it
    in_state_s: float | None = None  # older workers: seconds in the current transfer state
    client: str | None = None
    progressed_at: float | None = None  # observation clock, seconds: its last progress (filled by evaluate)

    @property
    def key(self) -> tuple[str, str]:
        return self.role, self.id

    @property
    def where(self) -> str:
        return f"{self.role}/{self.stage}"

    @property
    def pre_decode(self) -> bool:
        return (self.role, self.stage) in PRE_DECODE


@dataclass(frozen=True)
class Observation:
    """One look at one pair. ``at``: seconds on any clock the caller keeps steady (monotonic)."""

    pair: int
    at: float
    rows: tuple[Row, ...] = ()
    watchdog_fires: float | None = None  # pdrt_watchdog_fired_total summed over the pair's workers
    generated_tokens: float | None = None  # pdrt_generated_tokens_total of its decode workers
    unreachable: tuple[str, ...] = ()  # "decode http://..." whose /debug/requests the router could not read


@dataclass(frozen=True)
class Evidence:
    """The verdict on one pair and what it rests on. ``observation`` (rows with their last progress) is the
    ``prev`` of the next :func:`evaluate`."""

    pair: int
    stalled: bool
    reason: str  # one line a person can act on
    live: int
    oldest: Mapping[str, float]  # "role/stage" -> age in seconds of its oldest live request
    stage: str | None = None  # where the stuck request is ("decode/running")
    age_s: float | None = None  # its age
    idle_s: float | None = None  # seconds it made no progress
    tokens_per_s: float | None = None  # generated over the interval (None: no interval or no readable samples)
    watchdog_fires: int = 0  # over the interval
    interval_s: float | None = None
    observation: Observation | None = None


# ---------------------------------------------------------------- reading what processes report
def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def parse_row(role: str, raw: Mapping[str, Any]) -> Row | None:
    """A ``/debug/requests`` row; None when it lacks an id, a stage or an age."""
    age = _num(raw.get("age_s"))
    if not raw.get("id") or not raw.get("stage") or age is None:
        return None
    tokens = _num(raw.get("tokens", raw.get("completion_tokens")))
    return Row(role=role, id=str(raw["id"]), stage=str(raw["stage"]), age_s=age,
               tokens=None if tokens is None else int(tokens), idle_s=_num(raw.get("idle_s")),
               in_state_s=_num(raw.get("in_state_s")), client=raw.get("client"))


def rows_by_pair(docs: Iterable[Mapping[str, Any]]) -> tuple[dict[int, list[Row]], dict[int, list[str]]]:
    """The routers' ``/debug/requests`` documents -> (rows per group, unreachable workers per group).

    Each router replica lists its own requests; every replica lists the same workers, so worker rows are
    taken once. Router rows not yet dispatched to a pair (``pair`` null) belong to no group.
    """
    rows: dict[int, dict[tuple[str, str], Row]] = {}
    unreachable: dict[int, list[str]] = {}
    for doc in docs:
        for raw in doc.get("requests") or ():
            row = parse_row("router", raw)
            if row is not None and isinstance(raw.get("pair"), int):
                rows.setdefault(group_of(raw["pair"]), {})[row.key] = row
        for w in doc.get("workers") or ():
            if not isinstance(w.get("pair"), int):
                continue
            g = group_of(w["pair"])
            if "error" in w:
                where = f"{w.get('role')} {w.get('url')}"
                if where not in unreachable.setdefault(g, []):
                    unreachable[g].append(where)
                continue
            for raw in w.get("requests") or ():
                row = parse_row(str(w.get("role")), raw)
                if row is not None:
                    rows.setdefault(g, {}).setdefault(row.key, row)
    return {g: list(r.values()) for g, r in rows.items()}, unreachable


def metric_sum(texts: Iterable[str | None], name: str, **labels: str) -> float | None:
    """Sum of the samples called ``name`` with these labels over Prometheus texts; None when any is unreadable,
    or is an agent's (:data:`AGENT_METRIC`) without the series. A pdrt worker's missing series counts 0: its
    labelled counters appear with their first increment."""
    total = 0.0
    for text in texts:
        if text is None:
            return None
        found = agent = False
        try:
            for family in text_string_to_metric_families(text):
                for s in family.samples:
                    agent = agent or s.name == AGENT_METRIC
                    if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                        total += s.value
                        found = True
        except ValueError:
            return None
        if agent and not found:
            return None
    return total


# ---------------------------------------------------------------- the verdict
def _progress(row: Row, prev: Mapping[tuple[str, str], Row], at: float) -> float:
    """When ``row`` last progressed: ``at - idle_s`` when reported; else the previous sighting's time while
    its tokens and stage are unchanged; else now (first sighting: ``in_state_s`` for a row without tokens)."""
    if row.idle_s is not None:
        return at - row.idle_s
    p = prev.get(row.key)
    if p is not None and p.progressed_at is not None and p.stage == row.stage and p.tokens == row.tokens:
        return p.progressed_at
    if p is None and row.tokens is None and row.in_state_s is not None:
        return at - row.in_state_s
    return at


def _delta(prev: float | None, cur: float | None) -> float | None:
    if prev is None or cur is None:
        return None
    return cur - prev if cur >= prev else cur  # a counter reset (the process restarted): counts since then


def evaluate(prev: Observation | None, cur: Observation, stall_s: float) -> Evidence:
    """The verdict on one pair from two observations (``prev`` None: the first look)."""
    before = {r.key: r for r in prev.rows} if prev is not None else {}
    rows = tuple(replace(r, progressed_at=_progress(r, before, cur.at)) for r in cur.rows)
    seen = replace(cur, rows=rows)
    interval = cur.at - prev.at if prev is not None and cur.at > prev.at else None
    oldest: dict[str, float] = {}
    for r in rows:
        oldest[r.where] = max(oldest.get(r.where, 0.0), r.age_s)
    fires = int(_delta(prev.watchdog_fires if prev else None, cur.watchdog_fires) or 0) if interval else 0
    rate = None
    if interval:
        made = _delta(prev.generated_tokens if prev else None, cur.generated_tokens)
        if made is None:  # no readable samples: the rows' own token counts (decode's, else the router's)
            role = "decode" if any(r.role == "decode" and r.tokens is not None for r in rows) else "router"
            made = sum(max(0, r.tokens - before[r.key].tokens) for r in rows
                       if r.role == role and r.tokens is not None and r.key in before
                       and before[r.key].tokens is not None)
        rate = round(made / interval, 3)
    base = dict(pair=cur.pair, live=len(rows), oldest=oldest, tokens_per_s=rate, watchdog_fires=fires,
                interval_s=None if interval is None else round(interval, 3), observation=seen)
    if not rows:
        return Evidence(stalled=False, reason=f"pair {cur.pair}: no live request", **base)

    # (a) no progress for stall_s; (b) pre-decode for stall_s, for rows that do not report progress (idle_s) and
    # the router's (it cannot see a prefill's chunks): where a worker reports progress, a long prefill that advances is progress, never a stall. A router row is judged
    # by the workers' rows of the same request when they list it (they see its progress; the router does not).
    in_workers = {r.id for r in rows if r.role != "router"}
    judged = [r for r in rows if r.role != "router" or r.id not in in_workers]
    stuck = [(cur.at - r.progressed_at, "idle", r) for r in judged if cur.at - r.progressed_at >= stall_s]
    stuck += [(r.age_s, "old", r) for r in judged
              if r.pre_decode and (r.idle_s is None or r.role == "router") and r.age_s >= stall_s]
    evidence = f"{rate:g} tokens/s" if rate is not None else "tokens/s unknown"
    evidence += f", {fires} watchdog fire(s) over {interval:.0f}s" if interval else ", watchdog fires not yet counted"
    if cur.unreachable:
        evidence += f"; unreachable: {', '.join(cur.unreachable)}"
    if not stuck:
        return Evidence(stalled=False, reason=f"pair {cur.pair}: {len(rows)} live, progressing ({evidence})", **base)
    # a worker's row says where the request is stuck (the router's mirrors it): named first, longest held
    held, kind, r = max(stuck, key=lambda s: (s[2].role != "router", s[0]))
    if r.role == "router":  # the router's row crossed first; a worker holding that request still names the stage
        holders = [w for w in rows if w.role != "router" and w.id == r.id]
        if holders:
            r = max(holders, key=lambda w: (w.role == "decode", w.age_s))
            kind = "old" if r.pre_decode and r.age_s >= stall_s else "idle"
    idle = round(cur.at - r.progressed_at, 3)
    who = f"request {r.id}" + (f" (client {r.client})" if r.client else "")
    tokens = f"{r.tokens} tokens" if r.tokens is not None else "no token count"
    if kind == "idle":
        what = f"{who} made no progress for {idle:.0f}s (>= stall.seconds {stall_s:g}; age {r.age_s:.0f}s, {tokens})"
    else:
        what = f"{who} is {r.age_s:.0f}s old before decode (>= stall.seconds {stall_s:g}; idle {idle:.0f}s)"
    reason = f"pair {cur.pair} stalled in {r.where}: {what}; {len(rows)} live; {evidence}"
    return Evidence(stalled=True, reason=reason, stage=r.where, age_s=r.age_s, idle_s=idle, **base)


def observe(pair: int, at: float, rows: Iterable[Row], metrics_texts: Iterable[str | None],
            decode_texts: Iterable[str | None], unreachable: Iterable[str] = ()) -> Observation:
    """An :class:`Observation` from what the shell read (``metrics_texts``: every worker of the pair)."""
    return Observation(pair=pair, at=at, rows=tuple(rows),
                       watchdog_fires=metric_sum(metrics_texts, WATCHDOG_METRIC),
                       generated_tokens=metric_sum(decode_texts, TOKENS_METRIC, role="decode"),
                       unreachable=tuple(unreachable))


def status_entries(evidence: Iterable[Evidence], previous: Iterable[Mapping[str, Any]] | None,
                   now_iso: str) -> list[dict[str, Any]]:
    """``status.stalls``: one entry per stalled pair; ``since`` kept from the previous status while the same
    episode lasts."""
    since = {e.get("pair"): e.get("since") for e in previous or () if isinstance(e, Mapping)}
    return [{"pair": e.pair, "stage": e.stage, "oldestAgeSeconds": e.oldest.get(e.stage or "", e.age_s),
             "idleSeconds": e.idle_s,
             "tokensPerSecond": e.tokens_per_s, "watchdogFires": e.watchdog_fires,
             "since": since.get(e.pair) or now_iso, "reason": e.reason}
            for e in sorted(evidence, key=lambda e: e.pair) if e.stalled]
