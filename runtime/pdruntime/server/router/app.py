"""PD router: OpenAI-compatible API in front of prefill/decode pairs.

Per request: validate -> choose a pair (sticky by conversation, else least outstanding, circuit breaker)
-> dispatch both legs -> stream decode's tokens to the client. A failed leg aborts the other; a client
that goes away aborts both; a request is retried on another pair only before its first token is sent.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Mapping

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdruntime.agent import AGENT_PORT
from pdruntime.env import RuntimeEnv
from pdruntime.server.edge import BodyGuard, GuardedStream, instance_id, lifespan_app, metrics_response
from pdruntime.server.metrics import Metrics
from pdruntime.server.openai.events import TokenEvent
from pdruntime.server.openai.schemas import (MAX_BODY_BYTES, ApiError, ChatCompletionRequest, CompletionRequest,
                                             error_body, openapi_components, parse_body, validate)
from pdruntime.server.router.admission import MAX_PENDING, MAX_QUEUED, WAIT_S, Admission
from pdruntime.server.router.auth import (admin_token, bearer, client_of, client_request_id,
                                          is_loopback, match_api_key, same_secret)
from pdruntime.server.router.health_probe import HealthProber
from pdruntime.server.router.legs import LegError, Legs, Outbound
from pdruntime.server.router.policy import FAILURE, NEUTRAL, SUCCESS, PairPicker, PairState, RoutingConfig
from pdruntime.server.router.prefix_tree import routing_text
from pdruntime.server.router.processes import Peers, ProcessView, Trip, exposition, families, merge
from pdruntime.server.router.protocol import observe_url, protocol_for
from pdruntime.server.router.reply import EdgeCall, EdgeRequest, LiveRequest, Reply, Streamed
from pdruntime.server.router.topology import Topology, TopologyWatcher, parse_topology
from pdruntime.server.router.topology_source import TopologySource
from pdruntime.util import h1
from pdruntime.util.headers import ADMIN_TOKEN_HEADER, PIN_HEADER, REQUEST_ID_HEADER

log = logging.getLogger("pdruntime.router")

MAX_ATTEMPTS = 3  # pairs tried per request (retries happen only before the first token)
DEBUG_FETCH_TIMEOUT_S = 2.0
#: seconds decode gathers token events into one for a client that asked for one response (not a stream): the
#: router then relays a few events a second per request instead of one per token; its live progress (stall
#: detection, /debug/requests) still advances this often
COLLECT_INTERVAL_S = 0.25
COLLECT_INTERVAL = str(COLLECT_INTERVAL_S)


@dataclass
class RouterConfig:
    request_timeout_s: float = 600.0  # per-request deadline, seconds (client may lower it with X-Request-Timeout)
    breaker_threshold: int = 3
    breaker_cooldown_s: float = 5.0
    breaker_trial_timeout_s: float = 30.0  # a half-open trial unresolved this long lets another through
    max_pending_per_pair: int = MAX_PENDING  # requests a pair holds before their first token (admission.py)
    admission_wait_s: float = WAIT_S  # seconds a request may wait in the router for a pair with room
    max_queued_requests: int = MAX_QUEUED  # requests waiting in the router at once
    topology_poll_s: float = 1.0
    body_timeout_s: float = 30.0  # seconds to receive a request body (slow-drip bodies get 408)
    max_body_bytes: int = MAX_BODY_BYTES
    api_keys: dict[str, str] = field(default_factory=dict, repr=False)  # key -> client name; empty: no auth
    admin_token: str | None = field(default=None, repr=False)  # /config, /debug/*: None = loopback clients only
    routing: RoutingConfig = field(default_factory=RoutingConfig)  # --routing-policy and its thresholds
    worker_protocol: str = "pdrt"  # --worker-protocol: pdrt | sglang | vllm (protocol.py)
    worker_agent_port: int = AGENT_PORT  # --worker-agent-port: the sidecar's /config and /debug/requests (0: the worker)


class RequestIds:
    """Request ids: 16 random bytes each, in hex, cut from ``os.urandom`` 4 KiB at a time (one ``getrandom`` system
    call per 256 requests instead of one per request)."""

    __slots__ = ("_pool", "_at")

    def __init__(self) -> None:
        self._pool, self._at = b"", 0

    def new(self) -> str:
        at = self._at
        if at >= len(self._pool):
            self._pool, at = os.urandom(4096), 0
        self._at = at + 16
        return self._pool[at:at + 16].hex()


class Router:
    def __init__(self, env: RuntimeEnv, *, topology: Topology | None = None, topology_file: str | None = None,
                 config: RouterConfig | None = None, host: str = "127.0.0.1", port: int = 8000,
                 peers: Peers | None = None) -> None:
        self.env = env
        self.cfg = config or RouterConfig()
        #: the router's sibling processes (--router-processes N > 1; processes.py), None when it is one process
        self.peers = peers
        self._counts_before: list = []  # with peers: the counts this process index's predecessor left
        share = peers.count if peers is not None else 1
        self.topology = topology or Topology(1, "", ())
        self.topology_file = topology_file
        self.host, self.port = host, port
        self.metrics = Metrics("router")
        self.protocol = protocol_for(self.cfg.worker_protocol)
        self.picker = PairPicker(self.cfg.breaker_threshold, self.cfg.breaker_cooldown_s, self.cfg.breaker_trial_timeout_s,
                                 self.cfg.routing)
        # N processes split the admission bounds (processes.py): together they hold no more than one did
        self.admission = Admission(max(1, self.cfg.max_pending_per_pair // share), self.cfg.admission_wait_s,
                                   self.cfg.max_queued_requests // share)
        self.request_ids = RequestIds()
        self.live: dict[str, LiveRequest] = {}
        self.models: dict[str, dict] = {}  # model id -> /get_model_info of a worker
        self.client: h1.Client | None = None
        self.watcher: TopologyWatcher | None = None
        self.topology_error: str | None = None
        self.prober: HealthProber | None = None  # worker /health polling: stale (frozen) workers' pairs are skipped
        self.instance_id = instance_id(env)
        #: metric children every request updates, looked up once (labels() costs ~2 us a call) and updated on the loop's
        #: thread without prometheus_client's lock per update (Metrics.on_loop); per client label in child()
        self._children: dict[tuple, object] = {}
        m = self.metrics
        self.ttft_seconds, self.e2e_seconds, self.itl_seconds = (m.on_loop(m.ttft.labels("router")),
                                                                 m.on_loop(m.e2e.labels("router")),
                                                                 m.on_loop(m.itl.labels("router")))
        self._set_topology(self.topology)
        self.topology_source = TopologySource(self._set_topology, self.topology, self.cfg.admin_token)

    # ---- topology --------------------------------------------------------------------------------
    def _set_topology(self, topo: Topology) -> None:
        self.topology = topo
        self.picker.set_pairs(topo.pairs)
        ready = sum(p.ready for p in topo.pairs)
        self.metrics.topology_pairs.labels("true").set(ready)
        self.metrics.topology_pairs.labels("false").set(len(topo.pairs) - ready)
        log.info("topology revision=%r: %d pairs (%d ready)", topo.revision, len(topo.pairs), ready)
        if self.client is not None:
            asyncio.get_running_loop().create_task(self.refresh_models())

    def _on_reload(self, topo: Topology) -> None:
        self.topology_error = None
        self.metrics.topology_reloads.labels("ok").inc()
        self.topology_source.offer(topo, "file")

    def _on_reload_error(self, msg: str) -> None:
        if msg != self.topology_error:
            self.metrics.topology_reloads.labels("error").inc()
        self.topology_error = msg

    async def refresh_models(self) -> None:
        urls = [u for p in self.topology.pairs for u in (p.decode_url, p.prefill_url)]
        models: dict[str, dict] = {}
        for res in await asyncio.gather(*(self.protocol.model_info(self.client, u, DEBUG_FETCH_TIMEOUT_S) for u in urls)):
            if res and res.get("model_name"):
                models[res["model_name"]] = res
        if models:
            self.models = models

    async def start(self) -> None:
        # the workers' calls: a pooled HTTP/1.1 client (util/h1.py) at a quarter of httpx's CPU per request
        self.client = h1.Client(timeout=30.0)
        if self.topology_file:
            self.watcher = TopologyWatcher(self.topology_file, self._on_reload, self._on_reload_error, self.cfg.topology_poll_s)
            self.watcher.load_now()
            self.watcher.start()
        self.prober = HealthProber(self.client, lambda: self.topology.pairs,
                                   on_change=lambda url, stale: stale and self.metrics.worker_stale.inc())
        self.prober.start()
        await self.refresh_models()

    def stale_pairs(self) -> frozenset[int]:
        return self.prober.stale() if self.prober is not None else frozenset()

    async def join_peers(self) -> None:
        """With sibling processes: answer their questions, and run the newest topology any of them runs (this
        process may be a restarted one that missed pushes)."""
        if self.peers is None:
            return
        self._counts_before = self.peers.counts_before()
        await self.peers.open({"rows": self._peer_rows, "config": self._peer_config, "metrics": self._peer_metrics,
                               "topology": self._peer_topology, "trip": self._peer_trip})
        newest = None
        for doc in (await self.peers.ask("topology")).values():
            if isinstance(doc, dict) and doc.get("generation", -1) > (newest or {}).get("generation", -1):
                newest = doc
        if newest is not None and newest["generation"] > self.topology_source.current.generation:
            self.topology_source.offer(parse_topology(newest), "sibling")

    async def _peer_rows(self, _body: object) -> list[dict]:
        return self.own_rows()

    def _view(self) -> ProcessView:
        return ProcessView(self.topology.generation, self.topology.draining(),
                           {str(k): n for k, n in self._inflight_by_pair().items()})

    async def _peer_config(self, _body: object) -> dict:
        return asdict(self._view())

    async def _peer_metrics(self, _body: object) -> list:
        """This process's samples, with the counts its predecessors left (processes.py), which it keeps on."""
        self._read_gauges()
        self.metrics.flush()
        fams = merge([families(self.metrics.registry), self._counts_before])
        self.peers.keep_counts(fams)
        return fams

    async def _peer_topology(self, doc: object) -> dict:
        """A sibling relays a push it took (``doc``), or asks which topology runs here (None)."""
        if doc is not None:
            self.topology_source.offer(parse_topology(doc), "sibling")
        return self.topology_source.current.as_dict()

    async def _peer_trip(self, body: dict) -> None:
        """A sibling's breaker for this pair (same workers) tripped: rest it here too."""
        trip = Trip(**body)
        st = self.picker.states.get(trip.pair)
        if st is not None and (st.pair.prefill_url, st.pair.decode_url) == (trip.prefill, trip.decode):
            st.breaker.trip(time.monotonic())

    async def stop(self) -> None:
        if self.peers is not None:
            await self.peers.close()
        if self.prober is not None:
            await self.prober.stop()
        if self.watcher is not None:
            await self.watcher.stop()
        if self.client is not None:
            await self.client.aclose()

    def child(self, metric, *labels: str):
        """``metric.labels(*labels)`` (a counter's), cached and updated on the loop's thread (Metrics.on_loop): the hot
        path counts into the same few children on every request."""
        key = (id(metric), labels)
        got = self._children.get(key)
        if got is None:
            got = self._children[key] = self.metrics.on_loop(metric.labels(*labels))
        return got

    # ---- request handling ------------------------------------------------------------------------
    def _resolve_model(self, model: str) -> str:
        """The served model id ``model`` names (its id, path, file name or stem). Raises ApiError (503 while no
        worker has said what it serves, 404 for a name no worker serves)."""
        if not self.models:
            raise ApiError(503, "no worker answered /get_model_info; the model list is unknown (is any PD pair up?)",
                           type="server_error", code="no_workers")
        if model in self.models:
            return model
        for name, info in self.models.items():
            path = str(info.get("model_path") or "")
            base = os.path.basename(path.rstrip("/"))
            if model in (path, base, os.path.splitext(base)[0]):  # aliases: the path, the file name, its stem
                return name
        raise ApiError(404, f"model {model!r} does not exist here; accepted: {', '.join(sorted(self.models))}",
                       param="model", code="model_not_found")

    def _deadline(self, headers: Mapping[str, str]) -> float:
        timeout = self.cfg.request_timeout_s
        raw = headers.get("x-request-timeout")
        if raw is not None:
            try:
                asked = float(raw)
            except ValueError:
                raise ApiError(400, f"X-Request-Timeout {raw!r} is not a number; accepted: seconds > 0",
                               param="X-Request-Timeout") from None
            if not asked > 0:
                raise ApiError(400, "X-Request-Timeout must be > 0 seconds", param="X-Request-Timeout")
            timeout = min(timeout, asked)
        return time.monotonic() + timeout

    async def _dispatch(self, live: LiveRequest, out: Outbound) -> tuple[Legs, PairState, TokenEvent]:
        """Try pairs until one yields a first token. Raises ApiError.

        Every dispatch resolves its pair's breaker exactly once (success, failure or neutral), whatever ends
        it: a first token, a leg error, our deadline, the client leaving (cancellation), or a bug."""
        tried: set[int] = set()
        last: LegError | None = None
        busy: list[LegError] = []
        pinned = live.pinned
        prompt = routing_text(out.body) if self.picker.tree is not None and pinned is None else None
        while len(tried) < (MAX_ATTEMPTS if pinned is None else 1):  # a pinned request is never retried elsewhere
            now = time.monotonic()
            exclude = tried | self.stale_pairs()
            state, blocked = self._pick(live, exclude, now, prompt)
            if state is None and blocked:  # the pairs with room are at their bound: wait in the router's queue
                state = await self._admit(live, exclude, now, prompt, blocked)
            if state is None:
                break
            if tried:
                self.metrics.retries.inc()
            tried.add(state.pair.index)
            live.pair = state.pair.index
            live.attempts += 1
            live.advance("waiting_first_token")
            state.outstanding += 1
            self.admission.dispatched(state.pair.index)
            trial = state.breaker.on_dispatch(now)
            outcome = NEUTRAL  # client gone, 4xx, deadline, unexpected error: says nothing about the pair
            try:
                legs = Legs(self.client, state.pair, out, self.protocol)
                first = await legs.first_event()
                outcome = SUCCESS
                return legs, state, first
            except LegError as exc:
                if exc.busy:  # at capacity, not failing: neutral for the breaker; another pair may have room
                    busy.append(exc)
                    if exc.leg == "decode":  # its pool is full (prefill's 429 is about this request's deadline)
                        self.admission.busy(state.pair.index, state.outstanding - 1, exc.retry_after, time.monotonic())
                    continue
                last = exc
                if not exc.retryable:
                    raise ApiError(exc.status, exc.message, code=exc.code, param=exc.param,
                                   type="invalid_request_error" if exc.status < 500 else "server_error") from None
                outcome = FAILURE
                self.metrics.pair_failures.labels(state.pair.key, exc.leg).inc()
                log.warning("rid=%s pair=%d %s leg failed: %s", live.rid, state.pair.index, exc.leg, exc.message)
            finally:
                self.admission.first_token(state.pair.index)
                if state.breaker.record(outcome, time.monotonic(), trial=trial) and self.peers is not None:
                    self._tell_trip(state)  # the breaker that opened here opens in every process
                if outcome is not SUCCESS:
                    self.release(state, served=False)
        if busy and last is None:
            wait = min(e.retry_after or 1 for e in busy)
            self.metrics.refused.labels("router", "pairs_busy").inc()
            raise ApiError(429, f"every PD pair tried is at capacity ({busy[-1].leg}: {busy[-1].message}); retry after "
                           f"{wait}s", type="server_overloaded", code="pairs_busy", headers={"Retry-After": str(wait)})
        if last is not None and pinned is not None:
            raise ApiError(502, f"pinned group {pinned} failed ({last.leg} leg: {last.message}); a pinned request is not "
                           "retried on another group", type="server_error", code="upstream_failed")
        if last is not None:
            raise ApiError(502, f"every PD pair tried failed; last: {last.leg} leg: {last.message}", type="server_error",
                           code="upstream_failed")
        if pinned is not None:
            reason = self.picker.unroutable(time.monotonic(), pinned, self.stale_pairs())
            raise ApiError(503, f"group {pinned} (X-PDStack-Pair) is not routable: {reason}", type="server_error",
                           code="pinned_group_unavailable")
        raise self._no_pair_error()

    def _tell_trip(self, state: PairState) -> None:
        p = state.pair
        self.peers.tell("trip", asdict(Trip(p.index, p.prefill_url, p.decode_url)))

    def _pick(self, live: LiveRequest, exclude: set[int], now: float,
              prompt: str | None) -> tuple[PairState | None, set[int]]:
        """(the pair for the next attempt among those with room now, or None; the pairs at their admission bound)."""
        admission = self.admission
        load = {i: st.outstanding for i, st in self.picker.states.items()} if admission.marks else {}
        blocked = admission.blocked(now, load)
        state = self.picker.choose(now, live.conversation, exclude=exclude | blocked if blocked else exclude,
                                   group=live.pinned, prompt=prompt)
        return state, blocked

    async def _admit(self, live: LiveRequest, exclude: set[int], now: float, prompt: str | None,
                     blocked: set[int]) -> PairState | None:
        """The pair for the next attempt once one has room, for a request whose :meth:`_pick` found every eligible
        pair with room at its bound (``blocked``; admission.py): it waits in the router's queue until
        ``admission.wait_s`` after its arrival, then gets a 429."""
        woken: int | None = None  # the hops of the wake that ended its last wait (None: not woken)
        while True:
            if woken is not None:  # the slot that woke it is not one it may take: the next waiter's
                self.admission.pass_on(woken)
            if not any(st.pair.index in blocked for st in self.picker.eligible(now, exclude, live.pinned)):
                return None
            left = live.started + self.admission.wait_s - now
            if left <= 0 or not self.admission.can_queue():
                wait = self.admission.retry_after(now)
                reason = "queue_full" if left > 0 else "pairs_busy"
                self.metrics.refused.labels("router", reason).inc()
                what = (f"{self.admission.queued} requests already wait in the router (--max-queued-requests "
                        f"{self.admission.max_queued})" if reason == "queue_full" else
                        f"none had room within {self.admission.wait_s:g}s of its arrival")
                raise ApiError(429, f"every PD pair is at capacity ({len(blocked)} at their bound: requests before their "
                               f"first token, or KV pages); {what}; retry after {wait}s", type="server_overloaded",
                               code="pairs_busy" if reason == "pairs_busy" else "router_queue_full",
                               headers={"Retry-After": str(wait)})
            self.metrics.router_queue.set(self.admission.queued + 1)
            woken = await self.admission.wait(left)
            self.metrics.router_queue.set(self.admission.queued)
            now = time.monotonic()
            state, blocked = self._pick(live, exclude, now, prompt)
            if state is not None or not blocked:
                return state

    def _no_pair_error(self) -> ApiError:
        now = time.monotonic()
        at = self.picker.reopens_at(now)
        if at is None:
            canaries = sorted({p.group_id for p in self.topology.pairs if p.canary and p.ready})
            note = f"; canary groups {', '.join(map(str, canaries))} take pinned requests only" if canaries else ""
            return ApiError(503, f"no ready PD pair (the topology has none ready{note})", type="server_error",
                            code="no_ready_pair")
        wait = max(1, int(at - now + 0.999))
        return ApiError(503, f"no ready PD pair: every ready pair's circuit breaker is open after failures; the next "
                        f"trial is in {wait}s", type="server_error", code="no_ready_pair", headers={"Retry-After": str(wait)})

    async def _dispatch_unless_gone(self, call: EdgeCall, live: LiveRequest,
                                    out: Outbound) -> tuple[Legs, PairState, TokenEvent]:
        """_dispatch, abandoned (legs aborted by their own cleanup) if the client disconnects first, watched through
        ``call.gone`` (the ASGI app; the router's own server cancels the handler instead)."""
        dispatch = asyncio.create_task(self._dispatch(live, out))
        watcher = asyncio.create_task(call.gone())
        try:
            await asyncio.wait({dispatch, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
        if not dispatch.done():
            self.metrics.disconnects.inc()
            dispatch.cancel()  # Legs.first_event aborts both legs on cancellation
            try:
                await dispatch
            except (asyncio.CancelledError, ApiError):
                pass
            raise ApiError(499, "client disconnected before the first token", code="client_disconnected")
        return dispatch.result()

    def _forget(self, live: LiveRequest, state: PairState) -> None:
        """A reply finished (or was abandoned): its pair slot and its /debug/requests entry go."""
        self.release(state)
        self.live.pop(live.rid, None)

    def release(self, state: PairState, *, served: bool = True) -> None:
        state.outstanding = max(0, state.outstanding - 1)
        self.admission.release(state.pair.index if served else None)

    def authenticate(self, headers: Mapping[str, str]) -> str:
        """The client a request is attributed to. With API keys configured: the name of the caller's key
        (401 without a valid one); else client_of()."""
        if not self.cfg.api_keys:
            return client_of(headers)
        name = match_api_key(self.cfg.api_keys, bearer(headers))
        if name is None:
            raise ApiError(401, "missing or unknown API key; accepted: an 'Authorization: Bearer <key>' header with a "
                           "key from the router's --api-key-file", type="authentication_error", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})
        return name

    def require_admin(self, request: Request) -> None:
        """/config and /debug/*: the admin token when one is configured (as 'Authorization: Bearer' or as
        X-PDStack-Admin-Token, which survives the API server's pods/proxy), else loopback clients only."""
        if self.cfg.admin_token is not None:
            if not same_secret(admin_token(request.headers) or "", self.cfg.admin_token):
                raise ApiError(401, f"{request.url.path} needs the admin token; accepted: 'Authorization: Bearer "
                               "<admin token>' or 'X-PDStack-Admin-Token: <admin token>' (the router's "
                               "--admin-token-file)", type="authentication_error",
                               code="admin_token_required", headers={"WWW-Authenticate": "Bearer"})
        elif not is_loopback(request.client.host if request.client else None):
            raise ApiError(403, f"{request.url.path} is served only to loopback clients when the router has no admin "
                           "token; accepted: a request from 127.0.0.1/::1, or start the router with --admin-token-file "
                           "and send 'Authorization: Bearer <admin token>'", type="permission_error",
                           code="admin_only")

    def pinned_group(self, headers: Mapping[str, str], peer: tuple[str, int] | None) -> int | None:
        """The group an ``X-PDStack-Pair`` header pins this request to (None: normal routing). Pinning reaches canary
        groups, so it needs admin credentials: X-PDStack-Admin-Token (the Authorization header carries the API
        key), or a loopback client when the router has no admin token. 403 otherwise, 400 for a bad value."""
        raw = headers.get(PIN_HEADER)
        if raw is None:
            return None
        if self.cfg.admin_token is not None:
            given = (headers.get(ADMIN_TOKEN_HEADER) or "").strip()
            if not given:
                raise ApiError(403, "X-PDStack-Pair pins a request to one group and needs admin credentials; accepted: "
                               "an 'X-PDStack-Admin-Token: <admin token>' header (the router's --admin-token-file)",
                               type="permission_error", code="pin_not_allowed")
            if not same_secret(given, self.cfg.admin_token):
                raise ApiError(403, "X-PDStack-Admin-Token does not match the router's admin token; X-PDStack-Pair "
                               "needs the token from the router's --admin-token-file", type="permission_error",
                               code="pin_not_allowed")
        elif not is_loopback(peer[0] if peer else None):
            raise ApiError(403, "X-PDStack-Pair is accepted only from loopback clients when the router has no admin "
                           "token; accepted: a request from 127.0.0.1/::1, or start the router with --admin-token-file "
                           "and send 'X-PDStack-Admin-Token: <admin token>'", type="permission_error",
                           code="pin_not_allowed")
        value = raw.strip()
        if not value.isdigit():
            raise ApiError(400, f"X-PDStack-Pair {raw[:32]!r} is not accepted; accepted: a group index, an integer >= 0",
                           param="X-PDStack-Pair")
        return int(value)

    def count_rejection(self, client: str, status: int) -> None:
        """A request the router answered itself with an error (before or instead of any worker)."""
        self.child(self.metrics.requests, "router", self.metrics.clients.label(client),
                   "client_error" if status < 500 else "failed").inc()

    async def completion(self, call: EdgeCall) -> dict | Streamed:
        """``/v1/chat/completions`` and ``/v1/completions``: validated here, once, into an :class:`EdgeRequest`;
        answered with the response body (a dict) or a :class:`Streamed` answer. Raises ApiError.

        Then one PD request: dispatch to a pair, then stream or collect decode's events, shaped as OpenAI's (one
        coroutine for both halves: each level of coroutines is a frame more on every resume of the request).
        ``n`` > 1 is still one PD request (one prefill, one KV transfer): its sampling_params carry ``n`` and the
        decode worker forks the choices off the transferred prompt pages (see worker/decode.py); its events carry
        their choice's ``index``, and failing or aborting the request ends every choice."""
        t0 = time.monotonic()
        client = "unauthenticated"
        try:
            client = self.authenticate(call.headers)
            raw = parse_body(call.body)
            oreq = validate(ChatCompletionRequest if call.chat else CompletionRequest, raw)
            if not self.models:
                await self.refresh_models()
            model = self._resolve_model(oreq.model)
            deadline = self._deadline(call.headers)
        except ApiError as exc:
            self.count_rejection(client, exc.status)
            raise
        parser = self.models[model].get("tool_call_parser") or "hermes"
        fields = oreq.__dict__
        req = EdgeRequest(oreq, call.chat, client, model, deadline, t0, parser, raw, n=fields["n"],
                          stream=fields["stream"], logprobs=oreq.logprobs_n())

        client_label = self.metrics.clients.label(client)
        rid = self.request_ids.new()
        headers = {"x-client-id": client, REQUEST_ID_HEADER: rid}
        body = {"sampling_params": oreq.sampling_params(), **oreq.worker_input()}
        # a request waits for capacity at most admission.wait_s after its arrival: in the router's queue, then in decode
        out = Outbound(rid, body, headers, deadline, req.n, busy_until=t0 + self.admission.wait_s, openai=raw,
                       chat=call.chat, stream_interval=None if req.stream else COLLECT_INTERVAL,
                       connection=f"{call.peer[0]}:{call.peer[1]}" if call.peer else "")
        live = LiveRequest(rid, client, fields["user"] or call.headers.get("x-session-id"), t0,
                           client_request_id=client_request_id(call.headers))
        self.live[rid] = live
        try:
            live.pinned = self.pinned_group(call.headers, call.peer)
            if call.gone is None:  # the router's server: a client that leaves cancels this handler
                legs, state, first = await self._dispatch(live, out)
            else:
                legs, state, first = await self._dispatch_unless_gone(call, live, out)
        except BaseException as exc:  # rejected, cancelled or a bug: the live entry never outlives its request
            self.live.pop(rid, None)
            if isinstance(exc, ApiError):
                self.count_rejection(client, exc.status)
            elif isinstance(exc, asyncio.CancelledError):
                if call.gone is None:
                    self.metrics.disconnects.inc()
                self.child(self.metrics.requests, "router", client_label, "aborted").inc()
            else:
                self.count_rejection(client, 500)
            raise
        live.advance("streaming")
        self.ttft_seconds.observe(time.monotonic() - t0)
        reply = Reply(self, req, live, legs, state, first, client_label)
        if req.stream:
            return Streamed(reply.stream(), reply.finish)
        return await reply.collect()

    # ---- observability -----------------------------------------------------------------------------
    def own_rows(self) -> list[dict]:
        """This process's live requests as /debug/requests rows (with the process index when there are several)."""
        now = time.monotonic()
        extra = {"process": self.peers.index} if self.peers is not None else {}
        return [{"id": r.rid, "client": r.client, "conversation": r.conversation, "stage": r.stage, "pair": r.pair,
                 "age_s": round(now - r.started, 3), "tokens": r.tokens, "idle_s": round(now - r.progressed_at, 3),
                 "attempts": r.attempts, "client_request_id": r.client_request_id, "pinned": r.pinned, **extra}
                for r in self.live.values()]

    async def debug_requests(self) -> dict:
        own = self.own_rows()
        unanswered: list[int] = []
        if self.peers is not None:
            for i, rows in sorted((await self.peers.ask("rows")).items()):
                if isinstance(rows, Exception):
                    unanswered.append(i)
                else:
                    own.extend(rows)

        async def fetch(pair_index: int, role: str, url: str) -> dict:
            try:
                r = await self.client.get(url + "/debug/requests", timeout=DEBUG_FETCH_TIMEOUT_S)
                data = r.json()
            except (httpx.HTTPError, ValueError) as exc:
                return {"pair": pair_index, "role": role, "url": url, "error": f"{type(exc).__name__}: {exc}"}
            return {"pair": pair_index, **data, "role": role, "url": url}

        workers = await asyncio.gather(*(fetch(p.index, role, self.observe_url(url)) for p in self.topology.pairs
                                         for role, url in (("prefill", p.prefill_url), ("decode", p.decode_url))))
        total = len(own) + sum(len(w.get("requests", ())) for w in workers)
        unreachable = [w["url"] for w in workers if "error" in w]
        if total == 0:
            verdict = "nothing is live in the stack (router and every reachable worker are idle): if a client is " \
                      "waiting, look outside pdstack (client, proxy, network)"
        else:
            verdict = f"{total} live request entries across router and workers"
        if unreachable:
            verdict += f"; unreachable workers: {', '.join(unreachable)}"
        if unanswered:
            verdict += f"; router processes that did not answer: {', '.join(map(str, unanswered))}"
        return {"role": "router", "live": len(own), "requests": own, "workers": workers, "live_total": total,
                "verdict": verdict}

    def observe_url(self, worker_url: str) -> str:
        """Where this worker's /config and /debug/requests are read (its sidecar agent for a real engine)."""
        return observe_url(worker_url, self.cfg.worker_protocol, self.cfg.worker_agent_port)

    def oldest_by_stage(self) -> dict[str, float]:
        """Age in seconds of the oldest live request per router stage (stages with none are absent)."""
        now = time.monotonic()
        out: dict[str, float] = {}
        for r in self.live.values():
            out[r.stage] = max(out.get(r.stage, 0.0), now - r.started)
        return out

    def _inflight_by_pair(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for live in self.live.values():
            if live.pair is not None:
                out[live.pair] = out.get(live.pair, 0) + 1
        return out

    def config(self) -> dict:
        """Effective configuration; secrets appear only as whether they are set (API keys: their names)."""
        return {"role": "router", "env": self.env.as_config(), "topology": self.topology.as_dict(),
                "topology_version": self.topology.generation, "draining": self.topology.draining(),
                "inflight_by_pair": {str(k): n for k, n in sorted(self._inflight_by_pair().items())},
                "topology_file": self.topology_file, "topology_error": self.topology_error,
                "router": {"request_timeout_s": self.cfg.request_timeout_s, "breaker_threshold": self.cfg.breaker_threshold,
                           "breaker_cooldown_s": self.cfg.breaker_cooldown_s,
                           "breaker_trial_timeout_s": self.cfg.breaker_trial_timeout_s, "max_attempts": MAX_ATTEMPTS,
                           "body_timeout_s": self.cfg.body_timeout_s, "max_body_bytes": self.cfg.max_body_bytes,
                           "api_keys": {"enabled": bool(self.cfg.api_keys), "clients": sorted(set(self.cfg.api_keys.values()))},
                           "admin": "token" if self.cfg.admin_token is not None else "loopback-only",
                           "routing": {**asdict(self.cfg.routing), "decisions": dict(self.picker.decisions)},
                           "worker_protocol": self.cfg.worker_protocol,
                           "worker_agent_port": self.cfg.worker_agent_port,
                           "processes": self.peers.count if self.peers is not None else 1,
                           "max_pending_per_pair": self.cfg.max_pending_per_pair,
                           "max_pending_per_pair_per_process": self.admission.max_pending},
                "models": sorted(self.models),
                "worker_health": self.prober.snapshot() if self.prober is not None else []}

    async def router_config(self) -> dict:
        """``/config`` for the whole router: with sibling processes, their in-flight requests added and the lowest
        topology version any runs (-1 while one does not answer), with the pairs every process has draining."""
        out = self.config()
        if self.peers is None:
            return out
        answers = {self.peers.index: self._view(), **{i: a if isinstance(a, Exception) else ProcessView(**a)
                                                       for i, a in (await self.peers.ask("config")).items()}}
        views = [v for v in answers.values() if isinstance(v, ProcessView)]
        unanswered = sorted(i for i, v in answers.items() if not isinstance(v, ProcessView))
        inflight: dict[str, int] = {}
        for view in views:
            for k, n in view.inflight_by_pair.items():
                inflight[k] = inflight.get(k, 0) + n
        out["topology_version"] = -1 if unanswered else min(v.topology_version for v in views)
        out["draining"] = sorted(set.intersection(*(set(v.draining) for v in views)))
        out["inflight_by_pair"] = dict(sorted(inflight.items(), key=lambda kv: int(kv[0])))
        out["processes"] = {"count": self.peers.count, "answered_by": self.peers.index, "unanswered": unanswered,
                            "topology_versions": {str(i): v.topology_version if isinstance(v, ProcessView) else None
                                                  for i, v in sorted(answers.items())}}
        return out

    def _reject_scope(self, scope: dict, status: int) -> None:
        """BodyGuard rejections (413, 408) counted like the router's other own answers."""
        self.reject_headers({k.decode("latin-1"): v.decode("latin-1") for k, v in scope.get("headers", ())}, status)

    def reject_headers(self, headers: Mapping[str, str], status: int) -> None:
        """A request refused before it reached a route (body too large or too slow, a malformed head), counted
        like the router's other own answers, by the client its headers name."""
        if self.cfg.api_keys:
            client = match_api_key(self.cfg.api_keys, bearer(headers)) or "unauthenticated"
        else:
            client = client_of(headers)
        self.count_rejection(client, status)

    def health_response(self) -> JSONResponse:
        """``/health``: 200 while a pair can take traffic, else 503 with when the next breaker trial opens."""
        now = time.monotonic()
        stale = self.stale_pairs()
        ok = bool(self.picker.eligible(now, exclude=stale))
        body = {"status": "ok" if ok else "no ready pair", "pairs": len(self.topology.pairs),
                "stale_pairs": sorted(stale), "revision": self.topology.revision, "instance": self.instance_id}
        at = None if ok else self.picker.reopens_at(now)
        if at is not None:
            body["next_trial_in_s"] = round(at - now, 3)
        return JSONResponse(body, status_code=200 if ok else 503)

    async def metrics_body(self) -> bytes:
        """``/metrics`` for the whole router: with sibling processes, their samples merged in (processes.py)."""
        if self.peers is None:
            return self.render_metrics()
        parts = [await self._peer_metrics(None)]
        parts.extend(fams for _, fams in sorted((await self.peers.ask("metrics")).items())
                     if not isinstance(fams, Exception))
        return exposition(merge(parts))

    def render_metrics(self) -> bytes:
        """This process's ``/metrics``."""
        self._read_gauges()
        return self.metrics.render()

    def _read_gauges(self) -> None:
        """The gauges that are read rather than kept (live, oldest age, per-pair state)."""
        self.metrics.live.labels("router").set(len(self.live))
        self.metrics.set_oldest_age(self.oldest_by_stage())
        stale = self.stale_pairs()
        for p in self.topology.pairs:
            self.metrics.pair_stale.labels(p.key).set(int(p.index in stale))
        now = time.monotonic()
        for st in self.picker.states.values():  # per-pair gauges read here, not written on every request
            self.metrics.pair_outstanding.labels(st.pair.key).set(st.outstanding)
            self.metrics.circuit_open.labels(st.pair.key).set(int(st.breaker.state(now) != "closed"))

    def build_app(self) -> FastAPI:
        app = lifespan_app("pdrt router", self.start, self.stop)
        app.add_middleware(BodyGuard, max_bytes=self.cfg.max_body_bytes, timeout_s=self.cfg.body_timeout_s,
                           on_reject=self._reject_scope)

        @app.exception_handler(StarletteHTTPException)
        async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
            # unknown paths (404) and wrong methods (405, with Allow) are the router's own 4xx answers too
            self.count_rejection(client_of(request.headers) if not self.cfg.api_keys else "unauthenticated", exc.status_code)
            return JSONResponse(error_body(exc.status_code, str(exc.detail), code="http_error"),
                                status_code=exc.status_code, headers=getattr(exc, "headers", None))

        def body_of(model: str) -> dict:
            return {"requestBody": {"required": True, "content": {"application/json": {
                "schema": {"$ref": f"#/components/schemas/{model}"}}}}}

        async def answer(request: Request, chat: bool):
            async def gone() -> None:
                while (await request.receive())["type"] != "http.disconnect":
                    pass

            peer = (request.client.host, request.client.port) if request.client else None
            out = await self.completion(EdgeCall(chat, request.headers, await request.body(), peer, gone))
            if isinstance(out, Streamed):
                return GuardedStream(out.chunks, out.finish)
            return JSONResponse(out)

        # the router's own server (router/server.py) answers these two itself; these serve the ASGI app in-process
        # and describe the routes in /openapi.json
        @app.post("/v1/chat/completions", openapi_extra=body_of("ChatCompletionRequest"))
        async def chat_completions(request: Request):
            return await answer(request, chat=True)

        @app.post("/v1/completions", openapi_extra=body_of("CompletionRequest"))
        async def completions(request: Request):
            return await answer(request, chat=False)

        @app.get("/v1/models")
        async def models(request: Request):
            try:
                self.authenticate(request.headers)
            except ApiError as exc:
                self.count_rejection("unauthenticated", exc.status)
                raise
            if not self.models:
                await self.refresh_models()
            return {"object": "list", "data": [{"id": m, "object": "model", "created": 0, "owned_by": "pdstack",
                                                "max_model_len": info.get("max_model_len"),
                                                "sampling_defaults": info.get("sampling_defaults")}
                                               for m, info in self.models.items()]}

        @app.get("/health")
        async def health():
            return self.health_response()

        @app.get("/metrics")
        async def metrics():
            return metrics_response(await self.metrics_body())

        @app.get("/config")
        async def config(request: Request):
            self.require_admin(request)
            return await self.router_config()

        @app.post("/admin/topology")
        async def push_topology(request: Request):
            try:
                doc = await request.json()
            except ValueError:
                doc = None
            token = (request.headers.get(ADMIN_TOKEN_HEADER) or "").strip()
            status, body = self.topology_source.push(doc, f"Bearer {token}" if token else request.headers.get("authorization"))
            if status == 200 and self.peers is not None:  # every process runs what the operator pushed
                got = await self.peers.ask("topology", doc)
                behind = sorted(i for i, v in got.items() if isinstance(v, Exception)
                                or v.get("generation", -1) < body["topology_version"])
                body["processes"] = {"count": self.peers.count, "behind": behind}
            return JSONResponse(body, status_code=status)

        @app.get("/debug/requests")
        async def debug_requests(request: Request):
            self.require_admin(request)
            return await self.debug_requests()

        def openapi() -> dict:
            if app.openapi_schema is None:
                from fastapi.openapi.utils import get_openapi

                schema = get_openapi(title=app.title, version="0.1.0", routes=app.routes)
                schema.setdefault("components", {}).setdefault("schemas", {}).update(openapi_components())
                app.openapi_schema = schema
            return app.openapi_schema

        app.openapi = openapi
        return app

