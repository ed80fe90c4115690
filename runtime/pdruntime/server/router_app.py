"""PD router: OpenAI-compatible API in front of prefill/decode pairs.

Per request: validate -> choose a pair (sticky by conversation, else least outstanding, circuit breaker)
-> dispatch both legs -> stream decode's tokens to the client. A failed leg aborts the other; a client
that goes away aborts both; a request is retried on another pair only before its first token is sent.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from pdruntime.env import RuntimeEnv
from pdruntime.server.common import SSE_DONE, GuardedStream, lifespan_app, metrics_response, sse
from pdruntime.server.metrics import Metrics
from pdruntime.server.router_legs import LegError, Legs
from pdruntime.server.router_policy import PairPicker, PairState
from pdruntime.server.schemas import (ApiError, ChatCompletionRequest, CompletionRequest, error_body, parse_body,
                                      validate)
from pdruntime.server.topology import Topology, TopologyWatcher
from pdruntime.server.topology_source import TopologySource

log = logging.getLogger("pdruntime.router")

MAX_ATTEMPTS = 3  # pairs tried per request (retries happen only before the first token)
DEBUG_FETCH_TIMEOUT_S = 2.0


def client_identity(request: Request) -> str:
    """Who sent a request: the X-Client-Id header, else a name derived from the API key (a hash prefix,
    never the key), else "anonymous". Metric labels built from it have bounded cardinality."""
    explicit = request.headers.get("x-client-id")
    if explicit:
        return explicit[:64]
    auth = request.headers.get("authorization", "")
    if auth.lower().startswith("bearer ") and auth[7:].strip():
        return "key-" + hashlib.sha256(auth[7:].strip().encode()).hexdigest()[:12]
    return "anonymous"


@dataclass
class RouterConfig:
    request_timeout_s: float = 600.0  # per-request deadline, seconds (client may lower it with X-Request-Timeout)
    breaker_threshold: int = 3
    breaker_cooldown_s: float = 5.0
    topology_poll_s: float = 1.0


@dataclass(eq=False)
class LiveRequest:
    rid: str
    client: str
    conversation: str | None
    started: float  # time.monotonic()
    stage: str = "dispatching"
    pair: int | None = None
    tokens: int = 0
    attempts: int = 0


class Router:
    def __init__(self, env: RuntimeEnv, *, topology: Topology | None = None, topology_file: str | None = None,
                 config: RouterConfig | None = None, host: str = "127.0.0.1", port: int = 8000) -> None:
        self.env = env
        self.cfg = config or RouterConfig()
        self.topology = topology or Topology(1, "", ())
        self.topology_file = topology_file
        self.host, self.port = host, port
        self.metrics = Metrics("router")
        self.picker = PairPicker(self.cfg.breaker_threshold, self.cfg.breaker_cooldown_s)
        self.live: dict[str, LiveRequest] = {}
        self.models: dict[str, dict] = {}  # model id -> /get_model_info of a worker
        self.client: httpx.AsyncClient | None = None
        self.watcher: TopologyWatcher | None = None
        self.topology_error: str | None = None
        self._set_topology(self.topology)
        self.topology_source = TopologySource(self._set_topology, self.topology, env.resolve_kv_auth_token())

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
        async def info(url: str) -> dict | None:
            try:
                r = await self.client.get(url + "/get_model_info", timeout=DEBUG_FETCH_TIMEOUT_S)
                return r.json() if r.status_code == 200 else None
            except (httpx.HTTPError, ValueError):
                return None

        urls = [u for p in self.topology.pairs for u in (p.decode_url, p.prefill_url)]
        models: dict[str, dict] = {}
        for res in await asyncio.gather(*(info(u) for u in urls)):
            if res and res.get("model_name"):
                models[res["model_name"]] = res
        if models:
            self.models = models

    async def start(self) -> None:
        self.client = httpx.AsyncClient(limits=httpx.Limits(max_connections=2048, max_keepalive_connections=256),
                                        timeout=httpx.Timeout(30.0))
        if self.topology_file:
            self.watcher = TopologyWatcher(self.topology_file, self._on_reload, self._on_reload_error, self.cfg.topology_poll_s)
            self.watcher.load_now()
            self.watcher.start()
        await self.refresh_models()

    async def stop(self) -> None:
        if self.watcher is not None:
            await self.watcher.stop()
        if self.client is not None:
            await self.client.aclose()

    # ---- request handling ------------------------------------------------------------------------
    async def _check_model(self, model: str) -> str:
        if not self.models:
            await self.refresh_models()
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

    def _deadline(self, request: Request) -> float:
        timeout = self.cfg.request_timeout_s
        raw = request.headers.get("x-request-timeout")
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

    async def _dispatch(self, live: LiveRequest, body: dict, headers: dict, deadline: float) -> tuple[Legs, PairState, dict]:
        """Try pairs until one yields a first token. Raises ApiError."""
        tried: set[int] = set()
        last: LegError | None = None
        while len(tried) < MAX_ATTEMPTS:
            now = time.monotonic()
            state = self.picker.choose(now, live.conversation, exclude=tried)
            if state is None:
                break
            if tried:
                self.metrics.retries.inc()
            tried.add(state.pair.index)
            live.pair = state.pair.index
            live.attempts += 1
            live.stage = "waiting_first_token"
            state.outstanding += 1
            state.breaker.on_dispatch(now)
            self.metrics.pair_outstanding.labels(state.pair.key).set(state.outstanding)
            legs = Legs(self.client, state.pair, live.rid, body, headers, deadline)
            try:
                first = await legs.first_event()
                state.breaker.record_success()
                self.metrics.circuit_open.labels(state.pair.key).set(0)
                return legs, state, first
            except asyncio.CancelledError:
                self._release(state)
                raise
            except LegError as exc:
                self._release(state)
                last = exc
                if exc.retryable:
                    self.metrics.pair_failures.labels(state.pair.key, exc.leg).inc()
                    state.breaker.record_failure(time.monotonic())
                    if state.breaker.state(time.monotonic()) != "closed":
                        self.metrics.circuit_open.labels(state.pair.key).set(1)
                    log.warning("rid=%s pair=%d %s leg failed: %s", live.rid, state.pair.index, exc.leg, exc.message)
                    continue
                raise ApiError(exc.status, exc.message, type="invalid_request_error" if exc.status < 500 else "server_error",
                               code=exc.code) from None
        if last is not None:
            raise ApiError(502, f"every PD pair tried failed; last: {last.leg} leg: {last.message}", type="server_error",
                           code="upstream_failed")
        raise ApiError(503, "no ready PD pair (topology has none ready, or every circuit breaker is open)",
                       type="server_error", code="no_ready_pair")

    async def _dispatch_unless_gone(self, request: Request, live: LiveRequest, body: dict, headers: dict,
                                    deadline: float) -> tuple[Legs, PairState, dict]:
        """_dispatch, abandoned (legs aborted by their own cleanup) if the client disconnects first."""

        async def gone() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass

        dispatch = asyncio.create_task(self._dispatch(live, body, headers, deadline))
        watcher = asyncio.create_task(gone())
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

    def _release(self, state: PairState) -> None:
        state.outstanding = max(0, state.outstanding - 1)
        self.metrics.pair_outstanding.labels(state.pair.key).set(state.outstanding)

    async def completions(self, request: Request, chat: bool):
        t0 = time.monotonic()
        body = parse_body(await request.body())
        oreq = validate(ChatCompletionRequest if chat else CompletionRequest, body)
        model = await self._check_model(oreq.model)
        deadline = self._deadline(request)
        client = client_identity(request)
        client_label = self.metrics.clients.label(client)
        conversation = oreq.user or request.headers.get("x-session-id")
        rid = uuid.uuid4().hex
        worker_body: dict[str, Any] = {"sampling_params": oreq.sampling_params()}
        if chat:
            worker_body["messages"] = [{"role": m.role, "content": m.text()} for m in oreq.messages]
        else:
            worker_body["text"] = oreq.prompt_text()
        headers = {"x-client-id": client, "x-request-id": rid}
        live = LiveRequest(rid, client, conversation, t0)
        self.live[rid] = live
        try:
            legs, state, first = await self._dispatch_unless_gone(request, live, worker_body, headers, deadline)
        except ApiError as exc:
            del self.live[rid]
            self.metrics.requests.labels("router", client_label, "client_error" if exc.status < 500 else "failed").inc()
            raise
        live.stage = "streaming"
        self.metrics.ttft.labels("router").observe(time.monotonic() - t0)
        oid = ("chatcmpl-" if chat else "cmpl-") + rid
        created = int(time.time())
        include_usage = bool(oreq.stream_options and oreq.stream_options.include_usage)
        outcome = {"v": "aborted"}
        last_tok = [time.monotonic()]

        async def token_events() -> AsyncIterator[dict]:
            yield first
            async for ev in legs.events():
                yield ev

        def count(ev: dict) -> None:
            n = len(ev.get("token_ids") or ())
            if n:
                now = time.monotonic()
                if live.tokens:
                    self.metrics.itl.labels("router").observe(now - last_tok[0])
                last_tok[0] = now
                live.tokens += n
                self.metrics.tokens.labels("router", client_label).inc(n)

        async def finish(completed: bool) -> None:
            self._release(state)
            self.live.pop(rid, None)
            if completed and outcome["v"] == "aborted":  # finished normally (not failed mid-stream)
                outcome["v"] = "ok"
                await legs.close()
                asyncio.get_running_loop().create_task(legs.join_prefill())
            else:
                if outcome["v"] == "aborted":
                    self.metrics.disconnects.inc()
                await legs.abort()
            self.metrics.requests.labels("router", client_label, outcome["v"]).inc()
            self.metrics.e2e.labels("router").observe(time.monotonic() - t0)

        def usage(ev: dict) -> dict:
            mi = ev.get("meta_info", {})
            p, c = int(mi.get("prompt_tokens", 0)), int(mi.get("completion_tokens", 0))
            return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

        def finish_reason(ev: dict) -> str | None:
            fr = (ev.get("meta_info") or {}).get("finish_reason")
            if not fr:
                return None
            t = fr.get("type") if isinstance(fr, dict) else str(fr)
            return "length" if t == "length" else "stop"

        if oreq.stream:
            def chunk(ev: dict | None, *, role: bool = False, reason: str | None = None, use: dict | None = None) -> dict:
                delta = ev.get("delta", "") if ev else ""
                if chat:
                    d: dict = {"content": delta} if ev else {}
                    if role:
                        d = {"role": "assistant", **d}
                    choice = {"index": 0, "delta": d, "finish_reason": reason}
                    obj = {"id": oid, "object": "chat.completion.chunk", "created": created, "model": model,
                           "choices": [choice]}
                else:
                    obj = {"id": oid, "object": "text_completion", "created": created, "model": model,
                           "choices": [{"index": 0, "text": delta, "finish_reason": reason, "logprobs": None}]}
                if use is not None:
                    obj["usage"] = use
                return obj

            async def stream() -> AsyncIterator[bytes]:
                role = True
                try:
                    async for ev in token_events():
                        count(ev)
                        reason = finish_reason(ev)
                        yield sse(chunk(ev, role=role, reason=reason, use=usage(ev) if reason else None))
                        role = False
                        if reason:
                            if include_usage:
                                u = chunk(None, use=usage(ev))
                                u["choices"] = []
                                yield sse(u)
                            break
                except LegError as exc:
                    outcome["v"] = "failed"
                    yield sse(error_body(exc.status, f"generation failed after the first token: {exc.message}",
                                         type="server_error", code=exc.code))
                    return
                yield SSE_DONE

            return GuardedStream(stream(), finish)

        completed = False
        try:
            text = ""
            last_ev = first
            async for ev in token_events():
                count(ev)
                text += ev.get("delta", "")
                last_ev = ev
                if finish_reason(ev):
                    break
            completed = True
        except LegError as exc:
            outcome["v"] = "failed"
            raise ApiError(exc.status if exc.status != 499 else 502, f"generation failed: {exc.message}",
                           type="server_error", code=exc.code) from None
        finally:
            await finish(completed)
        reason = finish_reason(last_ev) or "stop"
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": reason}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "finish_reason": reason, "logprobs": None}
            obj = "text_completion"
        return JSONResponse({"id": oid, "object": obj, "created": created, "model": model, "choices": [choice],
                             "usage": usage(last_ev)})

    # ---- observability -----------------------------------------------------------------------------
    async def debug_requests(self) -> dict:
        now = time.monotonic()
        own = [{"id": r.rid, "client": r.client, "conversation": r.conversation, "stage": r.stage, "pair": r.pair,
                "age_s": round(now - r.started, 3), "tokens": r.tokens, "attempts": r.attempts} for r in self.live.values()]

        async def fetch(pair_index: int, role: str, url: str) -> dict:
            try:
                r = await self.client.get(url + "/debug/requests", timeout=DEBUG_FETCH_TIMEOUT_S)
                data = r.json()
            except (httpx.HTTPError, ValueError) as exc:
                return {"pair": pair_index, "role": role, "url": url, "error": f"{type(exc).__name__}: {exc}"}
            return {"pair": pair_index, **data, "role": role, "url": url}

        workers = await asyncio.gather(*(fetch(p.index, role, url) for p in self.topology.pairs
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
        return {"role": "router", "live": len(own), "requests": own, "workers": workers, "live_total": total,
                "verdict": verdict}

    def _inflight_by_pair(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for live in self.live.values():
            if live.pair is not None:
                out[live.pair] = out.get(live.pair, 0) + 1
        return out

    def config(self) -> dict:
        return {"role": "router", "env": self.env.as_config(), "topology": self.topology.as_dict(),
                "topology_version": self.topology.generation, "draining": self.topology.draining(),
                "inflight_by_pair": {str(k): n for k, n in sorted(self._inflight_by_pair().items())},
                "topology_file": self.topology_file, "topology_error": self.topology_error,
                "router": {"request_timeout_s": self.cfg.request_timeout_s, "breaker_threshold": self.cfg.breaker_threshold,
                           "breaker_cooldown_s": self.cfg.breaker_cooldown_s, "max_attempts": MAX_ATTEMPTS},
                "models": sorted(self.models)}

    def build_app(self) -> FastAPI:
        app = lifespan_app("pdrt router", self.start, self.stop)

        @app.post("/v1/chat/completions")
        async def chat_completions(request: Request):
            return await self.completions(request, chat=True)

        @app.post("/v1/completions")
        async def completions(request: Request):
            return await self.completions(request, chat=False)

        @app.get("/v1/models")
        async def models():
            if not self.models:
                await self.refresh_models()
            return {"object": "list", "data": [{"id": m, "object": "model", "created": 0, "owned_by": "pdstack",
                                                "max_model_len": info.get("max_model_len")} for m, info in self.models.items()]}

        @app.get("/health")
        async def health():
            now = time.monotonic()
            ok = bool(self.picker.eligible(now))
            return JSONResponse({"status": "ok" if ok else "no ready pair", "pairs": len(self.topology.pairs),
                                 "revision": self.topology.revision}, status_code=200 if ok else 503)

        @app.get("/metrics")
        async def metrics():
            self.metrics.live.labels("router").set(len(self.live))
            return metrics_response(self.metrics.render())

        @app.get("/config")
        async def config():
            return self.config()

        @app.post("/admin/topology")
        async def push_topology(request: Request):
            try:
                doc = await request.json()
            except ValueError:
                doc = None
            status, body = self.topology_source.push(doc, request.headers.get("authorization"))
            return JSONResponse(body, status_code=status)

        @app.get("/debug/requests")
        async def debug_requests():
            return await self.debug_requests()

        return app
