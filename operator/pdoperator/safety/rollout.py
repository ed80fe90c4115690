"""Rollout safety, the shell: what :mod:`canary` decides, done against the cluster.

* the canary: the revision each pair runs (the old revision's spec restored from its ControllerRevision for
  the pairs that keep it), the agent probe run as a background task kept in the deployment's state by revision
  and never awaited by a reconcile, its result turned into status, Events and the canary pair's rollback;
* known-good: recorded in status and as ``pdstack.io/known-good-since`` on the ControllerRevision;
* auto-rollback: the spec patched back to a known-good revision on an early stall, once per revision;
* pod drift: declared pod fields another manager owns (``kubectl edit``), the pairs to recreate under Revert.

Called by :func:`reconcile.reconcile` with its :class:`context.Context`; Events go through ``ctx.events``.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, Mapping

from ..core import drift
from ..core.drift import DriftEntry
from ..core.pairs import Plan, parse_iso, pod_view
from ..core.render import Owner, worker_pod
from ..core.revisions import (ANN_CURRENT_SINCE, ANN_KNOWN_GOOD, diff_configs, known_good, last_known_good,
                              merge_patch, recorded_spec, restore_spec, revision_view, show)
from ..core.spec import KIND, SpecError, parse_spec
from ..core.status import iso
from ..shell.context import API, Context, Observed
from ..shell.kube import ApiError, Kube, path
from ..shell.routerlink import RouterLink
from . import canary as rollout_safety

ROLLBACK_MANAGER = "pdstack-rollback"  # the field manager of spec patches by a rollback
ROLLBACK_ATTEMPTS = 4  # a rollback's patch is recomputed from a fresh read after a 409 (status writes race it)
CANARY_POLL_S = 1.0  # while a probe runs in the background, look at it this often
WATCHDOG_METRIC = "pdrt_watchdog_fired_total"


async def plan_rollout(ctx: Context, crs: Mapping[str, Mapping[str, Any]]) -> tuple[Any, Any, dict[str, Any]]:
    """(the canary in status, the canary for this reconcile, revision -> spec its pods render from). During a
    canary the pairs that keep the old revision render from its recorded spec; without one, no canary."""
    spec, revision, old_status, name = ctx.spec, ctx.revision, ctx.old_status, ctx.name
    specs: dict[str, Any] = {revision: spec}
    prior = rollout_safety.CanaryState.from_status(old_status.get("canary"))
    # (sglang-router takes a static list and cannot hold a pair out of traffic: no canary with router kind sglang)
    canary = rollout_safety.plan_canary(spec.rollout.canary if spec.pdstack_router else None, pairs=spec.pairs,
                                        desired=revision, current=old_status.get("currentRevision"), prior=prior,
                                        known_good=old_status.get("lastKnownGoodRevision"), now=ctx.now)
    if canary is not None:
        old_spec = revision_spec_of(crs.get(canary.from_revision), ctx.raw_spec, name)
        if old_spec is None:
            if revision not in ctx.state.no_canary_logged:
                ctx.state.no_canary_logged.add(revision)
                ctx.log.warning("%s: no canary for revision %s: revision %s recorded no spec (that still parses) to "
                            "keep the other pairs on", name, revision, canary.from_revision)
            canary = None
        else:
            specs[canary.from_revision] = old_spec
    if canary is not None and (prior is None or prior.revision != canary.revision):
        await ctx.events("Normal", "CanaryStarted",
                   f"revision {revision} goes to pair {canary.pair} first (out of normal traffic); the other "
                   f"pairs keep {canary.from_revision} until the agent probe passes")
    return prior, canary, specs


def revision_spec_of(cr: Mapping[str, Any] | None, current_raw: Mapping[str, Any] | None, name: str) -> Any:
    """The PDSpec a recorded revision ran: its raw revision fields over the current spec's other fields.
    None when the record kept no spec (made by an older operator) or it no longer parses."""
    raw = recorded_spec(cr) if cr else None
    if raw is None:
        return None
    try:
        return parse_spec(restore_spec(current_raw, raw), name=name)
    except SpecError:
        return None


def pod_drift(specs: Mapping[str, Any], owner: Owner, pods: list[dict[str, Any]],
              policy: str) -> tuple[list[DriftEntry], dict[int, str]]:
    """Declared fields of live worker pods that another manager now owns (``kubectl edit``; managedFields).
    Returns (drift entries, pair -> what to undo under Revert). A pod is judged against the spec of its own
    revision; pods of a revision we cannot render are not judged."""
    entries: list[DriftEntry] = []
    reverts: dict[int, str] = {}
    for pod in pods:
        v = pod_view(pod)
        if v is None or v.terminating or v.revision not in specs:
            continue
        suffix = v.name[len(f"{owner.name}-{v.pair}-{v.slot}-"):]
        desired = worker_pod(specs[v.revision], owner, v.revision, v.pair, v.slot, suffix)
        paths = drift.owned_elsewhere(desired, pod)
        if not paths:
            continue
        entries += drift.children_entries(f"Pod/{v.name}", desired, pod, paths[:5])
        if policy == "Revert":
            what = f"{v.slot} pod {v.name}: {', '.join(paths[:5])} edited by someone else"
            reverts[v.pair] = f"{reverts[v.pair]}; {what}" if v.pair in reverts else what
    return entries, reverts


def change_lines(crs: Mapping[str, Mapping[str, Any]], old: str, new: str) -> list[str]:
    """``field: old -> new`` over the recorded effective configs of two revisions (``kubectl-pd diff``)."""
    a, b = crs.get(old), crs.get(new)
    if a is None or b is None:
        return [f"revision {old} -> {new} (a record is missing)"]
    return [f"{p}: {show(x)} -> {show(y)}" for p, x, y in diff_configs(revision_view(a), revision_view(b))]


async def _watchdog_fires(http: RouterLink, urls: list[str]) -> int:
    """Watchdog fires counted by the workers' ``/metrics`` (unreadable: 0, no evidence)."""
    total = 0.0
    for text in await asyncio.gather(*(http.get_text(u) for u in urls)):
        for line in (text or "").splitlines():
            if line.startswith(WATCHDOG_METRIC):
                try:
                    total += float(line.rsplit(" ", 1)[1])
                except (IndexError, ValueError):
                    pass
    return int(total)


async def _canary_probe(http: RouterLink, url: str, headers: dict[str, str], spec: Any,
                        metrics_urls: list[str]) -> tuple[dict[str, Any], int]:
    """The multi-round agent probe against a router, pinned to the canary pair; (report, watchdog fires)."""
    c = spec.rollout.canary
    try:
        from pdruntime.probe_agents import run_agents_probe
        before = await _watchdog_fires(http, metrics_urls)
        report = await run_agents_probe(url, agents=c.agents, rounds=c.rounds, round_timeout_s=c.round_timeout_s,
                                        max_tokens=c.max_tokens, headers=headers, model=spec.model.served_name)
        return report.to_dict(), max(0, await _watchdog_fires(http, metrics_urls) - before)
    except asyncio.CancelledError:
        raise
    except Exception as e:  # noqa: BLE001 - a probe that cannot run is no evidence of health: the canary fails
        return {"ok": False, "rounds": [], "failure": {"round": None, "agent": None, "kind": "error",
                                                         "detail": f"the probe could not run: {e!r}"}}, 0


async def _advance_canary(ctx: Context, obs: Observed, state: Any, plan: Plan, routers_confirmed: bool,
                          stall: Mapping[str, Any] | None) -> Any:
    """Pending -> Probing (start the background probe) -> Passed | Failed (its result). Never waits on it."""
    pair = plan.pairs[state.pair] if state.pair < len(plan.pairs) else None
    http = ctx.router if ctx.drains else None
    if pair is None or http is None:
        return state
    router_ips, token, now = obs.router_ips, obs.token, ctx.now
    state = rollout_safety.crashed(state, last_co_restart_at=pair.memory.last_co_restart_at,
                                   reason=pair.memory.last_co_restart_reason, now=now)
    if state.phase == rollout_safety.PENDING:
        if not (router_ips and token and rollout_safety.ready_to_probe(
                state, pair_revision=pair.revision, pair_ready=pair.ready, routers_confirmed=routers_confirmed)):
            return state
        state = rollout_safety.start_probe(state, now)
    if state.phase != rollout_safety.PROBING:
        return state
    probes = ctx.state.probes
    task = probes.get(state.revision)
    if task is None:  # just started, or the operator restarted while probing: (re)start it once a router is up
        if router_ips and token:
            headers = {"X-PDStack-Pair": str(state.pair), "X-PDStack-Admin-Token": token}
            metrics_urls = [f"http://{ip}:{ctx.config.evidence_port(ctx.spec)}/metrics"
                            for ip in (pair.members or {}).values() if ip]
            probes[state.revision] = asyncio.create_task(_canary_probe(
                http, f"http://{router_ips[0]}:{http.port}", headers, ctx.spec, metrics_urls))
        return state
    if not task.done():
        return state
    probes.pop(state.revision, None)
    report, fires = task.result() if not task.cancelled() else ({"ok": False, "failure": {"detail": "cancelled"}}, 0)
    return rollout_safety.finish_probe(state, report, now, watchdog_fires=fires,
                                       stall=rollout_safety.pair_stall(stall, state.pair))


async def _rollback_spec(kube: Kube, body: Mapping[str, Any], cr: Mapping[str, Any]) -> None:
    """Patch the PDDeployment's spec back to a recorded revision's fields. The patch carries the
    resourceVersion it was computed from (a concurrent spec edit is never overwritten); on 409 (a status
    write or an edit in between) it is recomputed from a fresh read, a few times (:meth:`kube.Kube.merge_patch`)."""
    raw = recorded_spec(cr)
    if raw is None:
        raise ValueError(f"ControllerRevision {cr['metadata']['name']} recorded no spec to restore")
    url = path(API, KIND, body["metadata"]["namespace"], body["metadata"]["name"])
    done = await kube.merge_patch(url, body, lambda cur: {"spec": rollback_patch(cur.get("spec") or {}, raw)},
                                  field_manager=ROLLBACK_MANAGER, attempts=ROLLBACK_ATTEMPTS)
    if done is None:
        raise ValueError("the PDDeployment is gone")


def rollback_patch(current: Mapping[str, Any], recorded: Mapping[str, Any]) -> dict[str, Any]:
    """The merge patch of ``spec`` that restores a revision's fields (the others untouched)."""
    return merge_patch(dict(current), restore_spec(current, recorded))


async def _known_good(ctx: Context, crs: Mapping[str, Mapping[str, Any]], plan: Plan, revision: str,
                      stall: Mapping[str, Any] | None) -> tuple[str | None, float | None]:
    """(lastKnownGoodRevision, seconds until the soak ends) for the ``revision`` every pair serves. Recorded in
    status and as an annotation on the revision's ControllerRevision (so a lost status can be rebuilt)."""
    spec, now = ctx.spec, ctx.now
    previous = last_known_good(ctx.old_status.get("lastKnownGoodRevision"), crs.values())
    left = rollout_safety.soak_left(revision=revision, pairs=plan.pairs, n_pairs=spec.pairs, stall=stall,
                                    soak_s=spec.rollout.soak_s, now=now)
    if left is None or left > 0:
        return previous, left
    cr = crs.get(revision)
    if cr is not None and not ((cr.get("metadata") or {}).get("annotations") or {}).get(ANN_KNOWN_GOOD):
        meta = cr["metadata"]
        await ctx.steps.run(ctx.kube.request(
            "PATCH", path("apps/v1", "ControllerRevision", meta["namespace"], meta["name"]),
            body={"metadata": {"annotations": {ANN_KNOWN_GOOD: iso(now)}}}, query={"fieldManager": "pdstack-operator"},
            content_type="application/merge-patch+json"))
    if previous != revision:
        msg = (f"revision {revision} is known-good: every pair served it for {spec.rollout.soak_s}s "
               "with no stall")
        ctx.say(logging.INFO, msg)
        await ctx.events("Normal", "KnownGood", msg)
    return revision, None


async def _canary_event(ctx: Context, canary: Any, crs: Mapping[str, Mapping[str, Any]]) -> None:
    tried = "; ".join(change_lines(crs, canary.from_revision, canary.revision))
    if canary.phase == rollout_safety.PROBING:
        etype, reason, msg = "Normal", "CanaryProbing", (f"pair {canary.pair} runs revision {canary.revision}: "
                                                         "the agent probe starts")
    elif canary.phase == rollout_safety.PASSED:
        etype, reason, msg = "Normal", "CanaryPassed", (f"revision {canary.revision} passed its canary on pair "
                                                        f"{canary.pair} ({canary.evidence}); rolling out to every pair")
    elif canary.phase == rollout_safety.FAILED:
        etype, reason, msg = "Warning", "CanaryFailed", (
            f"revision {canary.revision} failed its canary on pair {canary.pair}: {canary.evidence}; pair "
            f"{canary.pair} rolls back to {canary.from_revision} and the rollout stops; tried: {tried}")
    else:
        return
    ctx.say(logging.WARNING if etype == "Warning" else logging.INFO, msg)
    await ctx.events(etype, reason, msg)


async def _auto_rollback(ctx: Context, crs: Mapping[str, Mapping[str, Any]], good: str | None,
                         stall: Mapping[str, Any] | None, canary: Any) -> dict[str, Any] | None:
    """Roll the spec back to the last known-good revision when a stall began soon after this revision
    became current (``rollout.autoRollback``). Returns the new ``status.autoRollback`` (None: unchanged)."""
    spec, revision, now = ctx.spec, ctx.revision, ctx.now
    previous = ctx.old_status.get("autoRollback")
    reverted = list((previous or {}).get("reverted") or [])
    cr = crs.get(revision)
    changed_at = parse_iso(((cr or {}).get("metadata") or {}).get("annotations", {}).get(ANN_CURRENT_SINCE))
    target = good if good != revision else rollout_safety.rollback_target(known_good(crs.values()), revision)
    to = rollout_safety.auto_rollback(enabled=spec.rollout.auto_rollback, window_s=spec.rollout.rollback_window_s,
                                      desired=revision, last_known_good=target, changed_at=changed_at, stall=stall,
                                      reverted=reverted, canary=canary)
    if to is None:
        return None
    changes = change_lines(crs, to, revision)
    record = {"from": revision, "to": to, "time": iso(now), "reverted": (reverted + [revision])[-10:],
              "changes": changes, "error": None}  # (a merge patch: None clears an earlier failure's error)
    try:
        if crs.get(to) is None:
            raise ValueError(f"revision {to} is no longer recorded")
        await _rollback_spec(ctx.kube, ctx.body, crs[to])
    except (ApiError, ValueError) as e:  # not counted as done: the next reconcile tries again
        msg = f"stall after revision {revision} became current, but rolling back to {to} failed: {e}"
        ctx.say(logging.ERROR, msg)
        if (previous or {}).get("error") != str(e)[:300]:
            await ctx.events("Warning", "AutoRollbackFailed", msg)
        return dict(record, reverted=reverted[-10:], error=str(e)[:300])
    msg = (f"stalled within {spec.rollout.rollback_window_s}s of revision {revision} becoming current "
           f"({(stall or {}).get('message') or 'Stalled'}); rolled the spec back to last known-good revision {to}, "
           f"reverting: {'; '.join(changes)}")
    ctx.say(logging.WARNING, msg)
    await ctx.events("Warning", "AutoRollback", msg)
    return record


@dataclass(frozen=True)
class Safety:
    """What one reconcile's rollout-safety step leaves for the status and the requeue."""

    canary: dict[str, Any] | None  # status.canary
    canary_failed: str | None  # the CanaryFailed message
    last_known_good: str | None
    auto_rollback: dict[str, Any] | None  # a new status.autoRollback (None: unchanged)
    wait: float | None  # look again this soon (a probe running, a soak ending)


async def rollout_safety_step(ctx: Context, obs: Observed, plan: Plan, routers_confirmed: bool) -> Safety:
    """The canary's next step, known-good after the soak, auto-rollback on an early stall (canary.py decides)."""
    revision, crs, canary = ctx.revision, obs.crs, obs.canary
    stall = next((c for c in ctx.old_status.get("conditions") or [] if c.get("type") == "Stalled"), None)
    ctx.state.cancel_probes(keep=canary.revision if canary is not None and canary.holds_traffic_off else None)
    wait: float | None = None
    canary_failed = None
    if canary is not None:
        before = canary.phase
        canary = await _advance_canary(ctx, obs, canary, plan, routers_confirmed, stall)
        if canary.phase in (rollout_safety.PENDING, rollout_safety.PROBING):
            wait = CANARY_POLL_S
        elif canary.phase != before:
            wait = 0.05  # promote, or roll the canary pair back, at once
        if canary.phase != before:
            await _canary_event(ctx, canary, crs)
        if canary.phase == rollout_safety.FAILED:
            canary_failed = (f"revision {canary.revision} failed its canary on pair {canary.pair}: {canary.evidence}; "
                             f"tried: {'; '.join(change_lines(crs, canary.from_revision, canary.revision))}")
    serving = {p.revision for p in plan.pairs}  # the revision every pair runs (the spec's, or a canary's old one)
    good, soak = await _known_good(ctx, crs, plan, serving.pop() if len(serving) == 1 else revision, stall)
    auto = await _auto_rollback(ctx, crs, good, stall, canary)
    return Safety(canary_record(canary, obs.prior, revision), canary_failed, good, auto,
                  min((w for w in (wait, soak) if w is not None), default=None))


def canary_record(canary: Any, prior: Any, revision: str) -> dict[str, Any] | None:
    """``status.canary``: the canary in progress, else the last one of the spec's revision (it passed and the
    rollout finished), else none."""
    if canary is None and prior is not None and prior.revision == revision:
        canary = prior
    return canary.to_status(iso) if canary is not None else None
