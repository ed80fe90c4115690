"""Prometheus metrics of every pdrt server (prefix ``pdrt_``). docs/metrics.md lists each one.

One :class:`Metrics` per process, on its own registry (tests run several apps in one process).
Client labels have bounded cardinality (:class:`ClientLabels`).
"""

from __future__ import annotations

from bisect import bisect_left

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

disable_created_metrics()  # no *_created series: they double the scrape and nothing here reads them

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
BYTES_BUCKETS = tuple(float(1 << p) for p in range(10, 34, 2))  # 1 KiB .. 8 GiB
BATCH_BUCKETS = (1, 2, 4, 8, 12, 15, 16, 24, 32, 48, 64, 128, 256)

MAX_CLIENT_LABELS = 32  # distinct client label values before new clients map to "other"


class ClientLabels:
    """Map client ids to metric label values with bounded cardinality."""

    def __init__(self, limit: int = MAX_CLIENT_LABELS) -> None:
        self.limit = limit
        self._seen: set[str] = set()

    def label(self, client: str | None) -> str:
        client = (client or "anonymous")[:64]
        if client in self._seen:
            return client
        if len(self._seen) < self.limit:
            self._seen.add(client)
            return client
        return "other"


class LoopCounter:
    """A counter child's increments made on the event loop's thread, kept as a plain number and added to the child
    when the registry is rendered (:meth:`Metrics.render`): ``inc`` is an addition, where prometheus_client's takes
    its child's lock (the router updates a few children on every request, and nothing else writes them)."""

    __slots__ = ("child", "n")

    def __init__(self, child) -> None:
        self.child, self.n = child, 0

    def inc(self, amount: float = 1) -> None:
        self.n += amount

    def flush(self) -> None:
        if self.n:
            self.child.inc(self.n)
            self.n = 0


class LoopHistogram:
    """A histogram child's observations made on the event loop's thread, counted into its buckets here (one
    ``bisect`` in C) and added to the child when the registry is rendered: the same buckets and sum as the child's
    own ``observe``, without its lock and checks per observation."""

    __slots__ = ("child", "bounds", "counts", "sum")

    def __init__(self, child) -> None:
        self.child = child
        self.bounds = tuple(child._upper_bounds)  # ends with +Inf: every number has a bucket
        self.counts = [0] * len(self.bounds)
        self.sum = 0.0

    def observe(self, amount: float) -> None:
        self.counts[bisect_left(self.bounds, amount)] += 1  # the first bound >= amount: prometheus' "le"
        self.sum += amount

    def flush(self) -> None:
        counts = self.counts
        if not any(counts):
            return
        for bucket, n in zip(self.child._buckets, counts):
            if n:
                bucket.inc(n)
        self.child._sum.inc(self.sum)
        self.counts, self.sum = [0] * len(counts), 0.0


class Metrics:
    def __init__(self, role: str) -> None:
        self.role = role
        self._on_loop: list[LoopCounter | LoopHistogram] = []  # children updated on the loop's thread (on_loop)
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.clients = ClientLabels()
        # all roles
        self.requests = Counter("pdrt_requests_total", "Requests finished, by role, client and outcome "
                                "(ok, client_error, failed, aborted)", ["role", "client", "outcome"], registry=r)
        self.e2e = Histogram("pdrt_e2e_latency_seconds", "Request arrival to last byte, seconds", ["role"],
                             buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("pdrt_ttft_seconds", "Request arrival to first generated token, seconds", ["role"],
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("pdrt_inter_token_latency_seconds", "Time between consecutive streamed tokens, seconds",
                             ["role"], buckets=ITL_BUCKETS, registry=r)
        self.queue_time = Histogram("pdrt_queue_time_seconds", "Arrival to start of work (prefill: to engine "
                                    "admission; decode: to joining the batch), seconds", ["role"],
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.tokens = Counter("pdrt_generated_tokens_total", "Tokens generated, by role and client",
                              ["role", "client"], registry=r)
        self.live = Gauge("pdrt_live_requests", "Requests live in this server (any stage)", ["role"], registry=r)
        self.connections_open = Gauge("pdrt_http_connections_open", "HTTP connections open on this server",
                                      registry=r)
        self.connections_closed = Counter("pdrt_http_connections_closed_total", "HTTP connections closed or refused "
                                          "by the connection guard (header_timeout, client_cap, server_cap, refused)",
                                          ["reason"], registry=r)
        self.oldest_age = Gauge("pdrt_oldest_live_request_age_seconds", "Age of the oldest live request per stage, "
                                "seconds, computed at scrape time (no series for a stage with none)", ["role", "stage"],
                                registry=r)
        # workers
        self.refused = Counter("pdrt_requests_refused_total", "Requests refused with 429/503 and Retry-After, by "
                               "reason (kv_pages: decode's pool; pairs_busy: every pair busy, at the router; queue_full: the "
                               "router's queue is full)",
                               ["role", "reason"], registry=r)
        self.pages_orphaned = Gauge("pdrt_kv_pages_orphaned", "KV pages in use that no live request holds (a leak; "
                                    "0 at every scrape in a healthy worker)", ["role"], registry=r)
        self.pool_blocks = Gauge("pdrt_kv_pool_blocks", "KV pool blocks by state (free, used, total)",
                                 ["role", "state"], registry=r)
        self.prefill_queue = Gauge("pdrt_prefill_queue_requests", "Prefill requests per queue "
                                   "(bootstrap, waiting, inflight)", ["queue"], registry=r)
        self.decode_queue = Gauge("pdrt_decode_queue_requests", "Decode requests per queue "
                                  "(prealloc, transfer, running)", ["queue"], registry=r)
        self.running_batch = Gauge("pdrt_running_batch_requests", "Requests in the engine's running batch",
                                   ["role"], registry=r)
        self.batch_size = Histogram("pdrt_batch_size", "Running-batch size per engine step", ["role"],
                                    buckets=BATCH_BUCKETS, registry=r)
        self.transfers = Counter("pdrt_kv_transfers_total", "KV transfers finished, by role and outcome "
                                 "(success, failed)", ["role", "outcome"], registry=r)
        self.transfer_failures = Counter("pdrt_kv_transfer_failures_total", "Failed KV transfers by reason",
                                         ["role", "reason"], registry=r)
        self.transfer_seconds = Histogram("pdrt_kv_transfer_seconds", "KV transfer phase duration (prefill: KV "
                                          "ready to receipt confirmed; decode: attach to KV verified), seconds",
                                          ["role"], buckets=LATENCY_BUCKETS, registry=r)
        self.transfer_bytes = Histogram("pdrt_kv_transfer_size_bytes", "KV bytes per successful transfer", ["role"],
                                        buckets=BYTES_BUCKETS, registry=r)
        self.transfer_bytes_total = Counter("pdrt_kv_transfer_bytes_total", "KV bytes moved by successful "
                                            "transfers (prefill: sent; decode: received and verified)", ["role"],
                                            registry=r)
        self.transfer_wire_seconds = Histogram("pdrt_kv_transfer_wire_seconds", "Bulk phase of a successful KV "
                                               "transfer (first chunk to ACK: the wire's own speed), seconds",
                                               ["role"], buckets=ITL_BUCKETS + LATENCY_BUCKETS[9:], registry=r)
        self.transfer_rejected = Counter("pdrt_kv_transfer_rejected_total", "KV-transfer connections rejected, "
                                         "by reason (auth, unknown_room, mismatch, protocol)", ["reason"], registry=r)
        self.watchdog_fired = Counter("pdrt_watchdog_fired_total", "Watchdog fires, by role and phase "
                                      "(bootstrap, transfer, decode_transfer)", ["role", "phase"], registry=r)
        self.aborts = Counter("pdrt_aborted_requests_total", "Requests aborted, by role and cause "
                              "(client_disconnect, abort_request, watchdog, peer_failure)", ["role", "cause"], registry=r)
        self.engine_step_errors = Counter("pdrt_engine_step_errors_total", "Engine steps that raised, by verdict "
                                          "of their retry in parts (request, transient, step, oom)",
                                          ["role", "verdict"], registry=r)
        self.engine_healthy = Gauge("pdrt_engine_healthy", "1 while the engine runs; 0 once too many consecutive "
                                    "steps failed (the process then exits)", ["role"], registry=r)
        # router
        self.pair_outstanding = Gauge("pdrt_router_pair_outstanding_requests", "Requests outstanding per pair",
                                      ["pair"], registry=r)
        self.pair_failures = Counter("pdrt_router_leg_failures_total", "Failed legs, by pair and leg",
                                     ["pair", "leg"], registry=r)
        self.circuit_open = Gauge("pdrt_router_circuit_open", "1 while a pair's circuit breaker is open", ["pair"],
                                  registry=r)
        self.pair_stale = Gauge("pdrt_router_pair_stale", "1 while a pair is skipped because a worker's /health "
                                "went unanswered (frozen) or unhealthy for the stale period", ["pair"], registry=r)
        self.worker_stale = Counter("pdrt_router_worker_stale_total", "Times a worker's /health went stale "
                                    "(frozen, unhealthy or gone after answering)", registry=r)
        self.router_queue = Gauge("pdrt_router_queued_requests", "Requests waiting in the router for a pair with "
                                  "room (admission: --max-pending-per-pair, a pair's learned capacity)", registry=r)
        self.retries = Counter("pdrt_router_retries_total", "Requests retried on another pair before the first "
                               "token", registry=r)
        self.disconnects = Counter("pdrt_router_client_disconnects_total", "Clients that went away mid-request",
                                   registry=r)
        self.topology_reloads = Counter("pdrt_router_topology_reloads_total", "Topology file reloads by outcome "
                                        "(ok, error)", ["outcome"], registry=r)
        self.topology_pairs = Gauge("pdrt_router_pairs", "Pairs in the topology, by readiness", ["ready"],
                                    registry=r)
        self._init_prefix_cache()

    def _init_prefix_cache(self) -> None:
        """The prefix cache's and the PD delta's metrics."""
        r = self.registry
        self.transfer_saved_bytes = Counter("pdrt_kv_transfer_saved_bytes_total", "KV bytes successful transfers "
                                            "left off the wire because decode held those leading pages already (the "
                                            "prefix-cache delta; a full transfer would have moved them too)", ["role"],
                                            registry=r)
        self.kv_delta_fallbacks = Counter("pdrt_kv_delta_fallbacks_total", "Transfers sent whole although decode held "
                                          "a prefix, by reason (prefill: namespace, unaligned, too_long; decode: "
                                          "prefill_sent_all)", ["role", "reason"], registry=r)
        self.prefix_hit_tokens = Counter("pdrt_prefix_cache_hit_tokens_total", "Prompt tokens whose KV the prefix "
                                         "cache held at admission (prefill, monolithic) or reserve (decode)", ["role"],
                                         registry=r)
        self.prefix_miss_tokens = Counter("pdrt_prefix_cache_miss_tokens_total", "Prompt tokens the prefix cache did "
                                          "not hold (computed, or transferred to decode)", ["role"], registry=r)
        self.prefix_pages = Gauge("pdrt_prefix_cache_pages", "KV pages the prefix cache indexes (held by a request "
                                  "or evictable)", ["role"], registry=r)
        self.prefix_evictions = Counter("pdrt_prefix_cache_evictions_total", "Cached KV pages evicted (LRU, under "
                                        "memory pressure or the page limit)", ["role"], registry=r)
        self._engine_totals: dict[str, int] = {}  # the engine's cumulative counts at the last update

    def on_loop(self, child):
        """``child`` (a counter's or a histogram's, from ``labels()``) updated from now on only on the event loop's
        thread, through the :class:`LoopCounter` or :class:`LoopHistogram` returned, which :meth:`render` folds in."""
        local = LoopHistogram(child) if hasattr(child, "_upper_bounds") else LoopCounter(child)
        self._on_loop.append(local)
        return local

    def flush(self) -> None:
        """Fold the loop's counts (:meth:`on_loop`) into their children."""
        for local in self._on_loop:
            local.flush()

    def render(self) -> bytes:
        self.flush()
        return generate_latest(self.registry)

    def set_oldest_age(self, by_stage: dict[str, float]) -> None:
        """Scrape time: the oldest live request's age per stage; stages with none have no series."""
        self.oldest_age.clear()
        for stage, age in by_stage.items():
            self.oldest_age.labels(self.role, stage).set(round(age, 3))

    def update_pool(self, stats: dict) -> None:
        total = stats.get("blocks_total")
        free = stats.get("blocks_free")
        if total is not None and free is not None:
            self.pool_blocks.labels(self.role, "total").set(total)
            self.pool_blocks.labels(self.role, "free").set(free)
            self.pool_blocks.labels(self.role, "used").set(total - free)
        self._update_prefix_cache(stats)

    def _update_prefix_cache(self, stats: dict) -> None:
        """The engine's cumulative prefix-cache counts -> the counters (by what they grew since the last update)."""
        if not stats.get("prefix_cache"):
            return
        self.prefix_pages.labels(self.role).set(stats.get("blocks_cached", 0))
        for key, counter in (("cache_hit_tokens", self.prefix_hit_tokens), ("cache_miss_tokens", self.prefix_miss_tokens),
                             ("cache_evictions", self.prefix_evictions)):
            now = int(stats.get(key, 0))
            grew = now - self._engine_totals.get(key, 0)
            if grew > 0:
                counter.labels(self.role).inc(grew)
            self._engine_totals[key] = now
