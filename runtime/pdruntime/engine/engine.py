"""The serving engine: paged KV cache + continuous-batching scheduler + sampler around a LlamaModel.

Not thread-safe: one thread owns an Engine and calls ``step()`` in a loop while ``has_work()``.
PD hooks: ``add_request(prefill_only=True)`` / ``pages`` / ``release`` on the prefill side,
``reserve`` / ``add_prefilled`` on the decode side, ``abort`` everywhere.
Prefix cache (engine/prefix_cache.py, ``EngineConfig.prefix_cache``): admission shares the longest cached prefix,
pages are indexed as they fill (prefill chunks, decode, transferred KV), so a finished request's prompt and
output stay cached; ``reserve(..., prompt_token_ids=...)`` shares what the decode side already holds.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import asdict
from typing import Any

import torch

from ..model import LoadedModel
from ..model.llama import PrefillChunk
from .block_pool import BlockPool
from .config import EngineConfig, InvalidRequest, OutOfBlocks, SamplingParams, StepOutput
from .device import cuda_graph_buckets, kv_cache_blocks
from .kv_cache import KVCache
from .grammar import GrammarError, Grammars
from .prefix_cache import PrefixCache
from .sampler import sample_batch
from .scheduler import Scheduler
from .sequence import Sequence, Status

log = logging.getLogger("pdruntime.engine")


def _kernel_config(model: Any) -> dict[str, Any] | None:
    """The kernel configuration the model's decode attention is bound to (else the process-wide one)."""
    cfg = getattr(getattr(model, "decode_attention", None), "keywords", {}).get("config")
    if cfg is not None:
        return cfg.as_dict()
    try:
        from pdruntime.kernels.decode_attention import kernel_config
    except ImportError:
        return None
    return kernel_config()


def _weight_bytes(model: Any) -> int:
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def load_for(source: str | None, config: EngineConfig, *, weights: str = "fp32", threads: int | None = None,
             env=None) -> LoadedModel:
    """Load the model the way ``config`` says: its device and dtype, and with tensor_parallel_size > 1 the
    follower ranks started and rank 0's shard loaded here (``Engine(loaded, config)`` then drives them)."""
    if config.tensor_parallel_size > 1:
        from .tp import start as start_tp

        return start_tp(source, config, weights=weights, threads=threads, env=env)
    from ..model import load_model

    return load_model(source, dtype=config.torch_dtype, device=config.device, weights=weights, env=env)


CANARY_PREFIX = "__canary-"  # engine ids of failure-isolation canaries (owned by the engine, never a client)

class Engine:
    def __init__(self, loaded: LoadedModel, config: EngineConfig | None = None) -> None:
        self.config = config or EngineConfig()
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.info = loaded.info
        self.device = self.config.torch_device
        model_dev = torch.device(getattr(self.model, "device", "cpu"))
        if self.model.dtype != self.config.torch_dtype or model_dev.type != self.device.type \
                or (self.device.index is not None and model_dev.index not in (None, self.device.index)):
            raise ValueError(f"the model was loaded as {self.model.dtype} on {model_dev} but the engine is configured "
                             f"for {self.config.torch_dtype} on {self.config.device}; load it with "
                             "load_model(..., dtype=config.torch_dtype, device=config.device)")
        cfg = self.model.config  # per-rank shape under tensor parallelism
        self.max_model_len = min(self.config.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        bs = self.config.block_size
        per_block = KVCache.bytes_per_block(cfg.num_layers, bs, cfg.num_kv_heads, cfg.head_dim, self.model.dtype)
        useful = self.config.max_num_seqs * -(-self.max_model_len // bs)
        free = torch.cuda.mem_get_info(self.device)[0] if self.device.type == "cuda" else None
        num_blocks, self.kv_budget_source = kv_cache_blocks(
            per_block, useful_blocks=useful, num_blocks=self.config.num_blocks, kv_cache_mib=self.config.kv_cache_mib,
            memory_fraction=self.config.kv_cache_memory_fraction, free_bytes=free)
        self.tp_size = int(getattr(self.model, "tp_size", 1))
        if self.tp_size > 1:
            num_blocks = self.model.agree_num_blocks(num_blocks)  # the smallest any rank can hold
        self.pool = BlockPool(num_blocks)
        graphs = self.config.cuda_graphs and self.device.type == "cuda"
        # CUDA graphs: one extra page past the pool, written by the padding rows of a captured batch
        self.kv = KVCache(cfg.num_layers, num_blocks + (1 if graphs else 0), bs, cfg.num_kv_heads, cfg.head_dim,
                          dtype=self.model.dtype, device=self.device)
        if self.tp_size > 1:
            self.model.setup_kv(self.kv)
        self.graphs = None
        self.graphs_status = "off" if not self.config.cuda_graphs else "not captured"
        if graphs:
            self._capture_graphs(num_blocks)
        self.prefix_cache = PrefixCache(self.pool, bs, self._cache_namespace(), self.config.prefix_cache_max_pages) \
            if self.config.prefix_cache else None
        self.scheduler = Scheduler(self.config, self.pool, self.prefix_cache)
        self._seqs: dict[str, Sequence] = {}  # every live request (any status but FINISHED)
        self._arrivals = itertools.count()
        self._pending: list[StepOutput] = []  # outputs produced outside step() (abort, add_prefilled)
        self._rng = torch.Generator().manual_seed(0)
        self._stop_holdback = 0
        self._eos = self.tokenizer.eos_token_ids
        self.grammars = Grammars(self.tokenizer, self.model.config.vocab_size)  # compiled lazily, on first use
        self.num_preemptions = 0
        self.num_generated_tokens = 0
        self.num_prefill_tokens = 0  # prompt tokens computed by prefill forwards (cache hits excluded)
        log.info("engine: device=%s dtype=%s tp=%d attention=%s cuda_graphs=%s weights=%s (%.1f MiB); KV cache %d "
                 "pages x %d tokens = %d tokens (%.1f MiB, %s): max context %d tokens x %d sequences%s",
                 self.config.device, self.config.dtype, self.tp_size, self.model.attention_backend, self.graphs_status,
                 self.model.weight_format, _weight_bytes(self.model) / 2**20, num_blocks, bs, num_blocks * bs,
                 self.kv.nbytes / 2**20, self.kv_budget_source, self.max_model_len, self.max_full_context_seqs,
                 f"; {torch.cuda.memory_allocated(self.device) / 2**20:.0f} MiB allocated on {self.device}"
                 if self.device.type == "cuda" else "")

    def _capture_graphs(self, num_blocks: int) -> None:
        """Capture decode CUDA graphs per batch bucket; on any failure run eagerly, with one log line."""
        from .cuda_graphs import DecodeGraphs

        buckets = cuda_graph_buckets(self.config.max_num_seqs)
        try:
            if self.tp_size > 1:  # every rank captures its shard's graphs in lockstep (NCCL all-reduces inside)
                self.graphs = self.model.capture_graphs(buckets, self.max_model_len, num_blocks)
            else:
                self.graphs = DecodeGraphs(self.model, self.kv, buckets=buckets, max_model_len=self.max_model_len,
                                           scratch_page=num_blocks)
                self.graphs.capture()
            self.graphs_status = f"on (buckets {list(self.graphs.buckets)})"
            log.info("CUDA graphs: captured decode for batch sizes %s", list(self.graphs.buckets))
        except Exception as exc:  # noqa: BLE001 - any capture failure means eager mode, never a crash
            self.graphs = None
            self.graphs_status = f"eager fallback (capture failed: {type(exc).__name__}: {exc})"
            log.warning("CUDA graphs: capture failed, decoding eagerly: %s: %s", type(exc).__name__, exc)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)

    def _cache_namespace(self) -> str:
        """What makes the KV of the same tokens differ between engines: two engines whose namespaces agree can
        exchange cached pages by key (the PD delta transfer compares them)."""
        i = self.info
        return (f"pdrt-kv/1 model={getattr(i, 'sha256', i.name)} weights={getattr(i, 'weights', '?')} "
                f"dtype={self.model.dtype} block={self.config.block_size} tp={self.tp_size}")

    @property
    def max_full_context_seqs(self) -> int:
        """Sequences of max_model_len tokens that the KV pool holds at once (at most max_num_seqs)."""
        per_seq = -(-self.max_model_len // self.config.block_size)
        return min(self.config.max_num_seqs, self.pool.num_total // per_seq)

    # -- requests --------------------------------------------------------------------------------
    def _validate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> list[int]:
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequest(f"request_id={request_id!r} is invalid; accepted: a non-empty string")
        if request_id in self._seqs:
            raise InvalidRequest(f"request_id {request_id!r} is already live; accepted: a unique id")
        if not isinstance(params, SamplingParams):
            raise InvalidRequest(f"params must be SamplingParams, got {type(params).__name__}")
        try:
            ids = [int(t) for t in prompt_token_ids]
        except (TypeError, ValueError):
            raise InvalidRequest("prompt_token_ids must be a list of integer token ids") from None
        if not ids:
            raise InvalidRequest("prompt is empty; accepted: at least one token")
        vocab = self.model.config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequest(f"prompt holds token ids outside the vocabulary: {bad[:5]}; accepted: 0..{vocab - 1}")
        total = len(ids) + params.max_tokens
        if total > self.max_model_len:
            raise InvalidRequest(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) = {total} exceeds the context "
                f"limit of {self.max_model_len} tokens; accepted: prompt + max_tokens <= {self.max_model_len}")
        capacity = self.pool.num_total * self.config.block_size
        if total > capacity:
            raise InvalidRequest(
                f"prompt + max_tokens = {total} tokens exceeds the KV cache capacity of {capacity} tokens "
                f"({self.pool.num_total} blocks of {self.config.block_size}); accepted: at most {capacity}")
        return ids

    def _new_seq(self, request_id: str, ids: list[int], params: SamplingParams, prefill_only: bool) -> Sequence:
        seed = params.seed if params.seed is not None else int(torch.randint(0, 1 << 62, (1,), generator=self._rng))
        seq = Sequence(request_id=request_id, prompt_ids=ids, params=params, prefill_only=prefill_only,
                       arrival=next(self._arrivals), seed=seed)
        if params.grammar is not None:
            seq.matcher = self.grammars.matcher(params.grammar)  # InvalidRequest for a grammar it cannot compile
        return seq

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                    prefill_only: bool = False, forks: list[tuple[str, SamplingParams]] = ()) -> None:
        """Queue a request; it joins the running batch at the next step(). Raises InvalidRequest.

        ``forks`` (parallel sampling, OpenAI ``n``): more sequences of the same prompt, each with its own id and
        params. The prompt is prefilled once; when it completes, each fork samples its own first token from
        the same logits and decodes on its own, sharing the prompt's full KV pages (reference-counted) and
        owning a copy of the partly filled last page, the only prompt page a decode step writes (copy-on-write,
        done at the fork)."""
        ids = self._validate(request_id, prompt_token_ids, params)
        fork_ids = [rid for rid, _ in forks]
        if forks and (prefill_only or self.tp_size > 1):
            raise InvalidRequest("forks (n > 1) need a monolithic, single-rank engine; accepted: n = 1 here")
        if len(set(fork_ids)) != len(fork_ids) or request_id in fork_ids or any(r in self._seqs for r in fork_ids):
            raise InvalidRequest(f"fork ids {fork_ids} must be unique and not live; accepted: unique ids")
        children = []
        for rid, p in forks:
            self._validate(rid, ids, p)
            children.append(self._new_seq(rid, ids, p, False))
        seq = self._new_seq(request_id, ids, params, prefill_only)
        seq.forks = children
        self._seqs[request_id] = seq
        for c in children:
            c.status = Status.WAITING
            self._seqs[c.request_id] = c  # live (abort() finds them), scheduled once forked
        self.scheduler.waiting.append(seq)

    def pages(self, request_id: str) -> tuple[list[int], int]:
        """(page ids in order, number of tokens whose KV they hold)."""
        seq = self._get(request_id)
        return list(seq.blocks), seq.num_cached

    def release(self, request_id: str) -> None:
        """Free the pages of a prefill_done request. Idempotent; unknown ids are ignored."""
        seq = self._seqs.get(request_id)
        if seq is None:
            return
        if seq.status is not Status.PREFILL_HELD:
            raise InvalidRequest(f"request {request_id!r} is {seq.status.value}, not prefill_done; use abort() instead")
        self.scheduler.free_pages(seq)
        seq.status = Status.FINISHED
        del self._seqs[request_id]

    def reserve(self, request_id: str, num_tokens: int, fork_ids: tuple[str, ...] | list[str] = (), *,
                prompt_token_ids: list[int] | None = None) -> list[int]:
        """Decode side of PD: allocate pages for `num_tokens` tokens of incoming KV plus one decode slot.

        ``fork_ids`` (n > 1): ids of the forks add_prefilled will start off this prompt; each is reserved too,
        holding the one page it copies (the page with the last prompt position), so that the forks cannot run
        out of pages after the KV arrived. All pages or none (OutOfBlocks). Returns the prompt's pages.

        ``prompt_token_ids`` (the prompt's ``num_tokens`` ids, prefix cache on): the longest cached page-aligned
        prefix of the prompt is shared instead of allocated; ``pages(request_id)`` then says how many leading
        tokens the reservation already holds (``held``). The KV transfer must write only pages[held // block_size:]
        (the first ones are shared, read-only), and add_prefilled must get a prompt that starts with the same
        ``held`` tokens."""
        for rid in (request_id, *fork_ids):
            if not isinstance(rid, str) or not rid:
                raise InvalidRequest(f"request_id={rid!r} is invalid; accepted: a non-empty string")
            if rid in self._seqs:
                raise InvalidRequest(f"request_id {rid!r} is already live; accepted: a unique id")
        if len(set(fork_ids)) != len(fork_ids) or request_id in fork_ids:
            raise InvalidRequest(f"fork ids {list(fork_ids)} must be unique; accepted: unique ids")
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens <= 0:
            raise InvalidRequest(f"num_tokens={num_tokens!r} is invalid; accepted: an integer >= 1")
        if num_tokens + 1 > self.max_model_len:
            raise InvalidRequest(f"{num_tokens} tokens leave no room to decode within the context limit of "
                                 f"{self.max_model_len} tokens")
        if fork_ids and self.tp_size > 1:
            raise InvalidRequest("forks (n > 1) need a single-rank engine; accepted: n = 1 here")
        n = -(-(num_tokens + 1) // self.config.block_size)
        probe = Sequence(request_id=request_id, prompt_ids=[], params=SamplingParams(max_tokens=1))
        hit = []
        if prompt_token_ids is not None:
            try:
                probe.prompt_ids = [int(t) for t in prompt_token_ids]
            except (TypeError, ValueError):
                raise InvalidRequest("prompt_token_ids must be a list of integer token ids") from None
            if len(probe.prompt_ids) != num_tokens:
                raise InvalidRequest(f"prompt_token_ids holds {len(probe.prompt_ids)} ids but num_tokens={num_tokens}; "
                                     "accepted: the prompt's num_tokens ids")
            if self.prefix_cache is not None:  # decode needs KV for every prompt position: the whole prompt may hit
                hit = self.prefix_cache.match(probe, num_tokens)
        if not self.pool.can_allocate(n - len(hit) + len(fork_ids), reusing=hit):
            raise OutOfBlocks(f"need {n - len(hit) + len(fork_ids)} KV blocks, {self.pool.num_free} of "
                              f"{self.pool.num_total} free")
        blocks = self.pool.reuse(hit) + self.pool.allocate(n - len(hit) + len(fork_ids))
        held = len(hit) * self.config.block_size
        if self.prefix_cache is not None and prompt_token_ids is not None:
            self.prefix_cache.count(held, num_tokens - held)
        for i, rid in enumerate((request_id, *fork_ids)):
            own = blocks[:n] if i == 0 else [blocks[n + i - 1]]
            self._seqs[rid] = Sequence(request_id=rid, prompt_ids=[], params=SamplingParams(max_tokens=1),
                                       arrival=next(self._arrivals), status=Status.RESERVED, blocks=own)
        res = self._seqs[request_id]
        # keys only of the held pages: add_prefilled checks its prompt against these tokens alone
        res.prompt_ids, res.page_keys = probe.prompt_ids, probe.page_keys[:len(hit)]
        res.num_cached, res.num_published, res.cached_tokens = held, len(hit), held
        return list(blocks[:n])

    def unshare(self, request_id: str) -> list[int]:
        """Decode side of PD, when prefill sends the whole prompt after all (its delta check fell back): the
        reservation gives up the cached pages reserve() shared and holds fresh ones in their place, which the
        transfer then writes (a shared page is never written). All or nothing (OutOfBlocks). -> the prompt's pages."""
        seq = self._seqs.get(request_id)
        if seq is None or seq.status is not Status.RESERVED:
            state = "unknown" if seq is None else seq.status.value
            raise InvalidRequest(f"request {request_id!r} is {state}; unshare needs a reserve()d request")
        k = seq.num_published  # the held pages: reserve() shared exactly these
        if k:
            if not self.pool.can_allocate(k):
                raise OutOfBlocks(f"need {k} KV blocks to receive the whole prompt, {self.pool.num_free} of "
                                  f"{self.pool.num_total} free")
            fresh = self.pool.allocate(k)
            self.pool.free(seq.blocks[:k])
            seq.blocks[:k] = fresh
            seq.num_cached = seq.num_published = seq.cached_tokens = 0
            seq.page_keys = []
        return list(seq.blocks)

    @property
    def kv_namespace(self) -> str:
        """What keys this engine's KV pages (see _cache_namespace); the PD delta compares it across workers."""
        return self._cache_namespace()

    def add_prefilled(self, request_id: str, prompt_token_ids: list[int], first_token_id: int,
                      params: SamplingParams, first_logprobs: Any = None,
                      forks: list[tuple[str, SamplingParams]] = ()) -> None:
        """Decode side of PD: the reserved pages hold KV for the prompt; decode continues from first_token_id.

        ``forks`` (n > 1 over PD): more sequences of the same prompt that share its transferred KV pages; each
        re-runs only the last prompt position (into its own copy of that page) for the logits of its own first
        token, then decodes on its own."""
        seq = self._seqs.get(request_id)
        if seq is None or seq.status is not Status.RESERVED:
            state = "unknown" if seq is None else seq.status.value
            raise InvalidRequest(f"request {request_id!r} is {state}; add_prefilled needs a reserve()d request")
        del self._seqs[request_id]
        try:
            ids = self._validate(request_id, prompt_token_ids, params)
            if not 0 <= int(first_token_id) < self.model.config.vocab_size:
                raise InvalidRequest(f"first_token_id={first_token_id} is outside the vocabulary")
            if -(-len(ids) // self.config.block_size) > len(seq.blocks):
                raise InvalidRequest(f"prompt of {len(ids)} tokens does not fit the {len(seq.blocks)} reserved pages")
            if ids[:seq.num_cached] != seq.prompt_ids[:seq.num_cached]:
                raise InvalidRequest(f"the prompt differs from the one reserve() matched in its first {seq.num_cached} "
                                     "tokens, whose KV the reservation shares from the prefix cache; accepted: the "
                                     "same prompt")
            if forks:
                self._check_forks(ids, forks)  # before anything changes: forks start all together or not at all
        except (InvalidRequest, OutOfBlocks):
            self._seqs[request_id] = seq  # still reserved; caller may abort()
            raise
        new = self._new_seq(request_id, ids, params, False)
        new.blocks, new.num_cached = seq.blocks, len(ids)
        new.page_keys, new.num_published, new.cached_tokens = seq.page_keys, seq.num_published, seq.num_cached
        new.status = Status.RUNNING
        self._seqs[request_id] = new
        if new.matcher is not None:  # constrained decoding continues from prefill's first token
            try:
                self.grammars.advance(new.matcher, int(first_token_id))
            except RuntimeError as exc:
                del self._seqs[request_id]
                self._seqs[request_id] = seq  # still reserved; caller may abort()
                raise InvalidRequest(f"the first token does not fit the request's grammar: {exc}") from None
        if params.logprobs is not None:
            new.logprobs.append(first_logprobs)  # prefill's (None when the caller did not carry them)
        self._append_token(new, int(first_token_id))
        self._publish(new)  # the transferred prompt's full pages
        children = self._fork_prefilled(new, ids, forks) if forks else []
        if new.finish_reason is not None:
            self._pending.append(self._finish(new))
        else:
            self.scheduler.active.append(new)
        self.scheduler.active.extend(children)

    def abort(self, request_id: str) -> bool:
        """Stop a request wherever it is and free its pages. False if the id is unknown."""
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return False
        if seq in self.scheduler.active:
            self.scheduler.active.remove(seq)
        if seq in self.scheduler.waiting:
            self.scheduler.waiting.remove(seq)
        self.scheduler.free_pages(seq)
        self._orphan_forks(seq)
        was_reported = seq.status is Status.PREFILL_HELD
        seq.status = Status.FINISHED
        if not was_reported:
            self._pending.append(StepOutput(request_id, [], "", True, "abort"))
        return True

    def _orphan_forks(self, seq: Sequence) -> None:
        """A parent that ends before its prompt completed: its forks prefill on their own instead."""
        for c in seq.forks:
            if c.request_id in self._seqs:
                self.scheduler.waiting.append(c)
        seq.forks = []

    def has_work(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.active or self._pending)

    # -- the loop --------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self, only: set[str] | None = None) -> list[StepOutput]:
        """One scheduler iteration: decode every running sequence by one token, prefill within budget.

        If it raises, no request is left half-advanced and nothing reported is lost, so the caller may retry with
        ``only`` a subset of :meth:`step_request_ids` (failure isolation). A request whose own sampling
        fails is finished alone with ``finish_reason="error"``; the rest of the step goes on."""
        outputs, self._pending = self._pending, []
        try:
            plan = self.scheduler.schedule(only)
            self.num_preemptions += len(plan.preempted)
            for seq in plan.preempted:
                log.info("preempted %s (KV pages exhausted); it will be recomputed", seq.request_id)
            if plan.decode:
                outputs.extend(self._run_decode(plan.decode))
            if plan.prefill:
                outputs.extend(self._run_prefill(plan.prefill))
        except BaseException:
            self._pending = outputs + self._pending  # reported with the next step that succeeds
            raise
        return outputs

    def step_request_ids(self) -> list[str]:
        """Ids of the requests a step may run (prefilling or decoding, then waiting for admission), oldest first."""
        return [s.request_id for s in self.scheduler.active] + [s.request_id for s in self.scheduler.waiting]

    def fail_request(self, request_id: str, reason: str, code: str | None = None) -> bool:
        """Finish a request with ``finish_reason="error"`` and free its pages (failure isolation); ``code``: the
        API code of a cause that is the request's own (its grammar), None for an engine failure."""
        seq = self._seqs.get(request_id)
        if seq is None:
            return False
        for q in (self.scheduler.active, self.scheduler.waiting):
            if seq in q:
                q.remove(seq)
        self.scheduler.free_pages(seq)
        self._orphan_forks(seq)
        seq.status = Status.FINISHED
        del self._seqs[request_id]
        self._pending.append(StepOutput(request_id, [], "", True, "error", error=reason, error_code=code))
        return True

    def add_canary(self) -> str:
        """Queue a one-token greedy request (failure isolation: can the engine step without the suspect?)."""
        rid = f"{CANARY_PREFIX}{next(self._arrivals)}"
        self.add_request(rid, [0], SamplingParams(max_tokens=1, temperature=0))
        return rid

    def drop_canary(self, rid: str, outputs: list[StepOutput]) -> list[StepOutput]:
        """Remove a canary without a trace; returns ``outputs`` minus the canary's own."""
        seq = self._seqs.pop(rid, None)
        if seq is not None:
            for q in (self.scheduler.active, self.scheduler.waiting):
                if seq in q:
                    q.remove(seq)
            self.scheduler.free_pages(seq)
            seq.status = Status.FINISHED
        self._pending = [o for o in self._pending if o.request_id != rid]
        return [o for o in outputs if o.request_id != rid]

    def _sample_each(self, seqs: list[Sequence], rows: torch.Tensor) -> list[int | None]:
        """One token per row (one batched call); a row whose sampling raises fails its own request (None) and
        no other. Grammar rows get their token mask first and advance their matcher after (once, per row)."""
        got = None
        try:
            for s in seqs:
                if s.matcher is not None:
                    s.token_mask = self.grammars.mask(s.matcher)
            got = sample_batch(rows, seqs)
        except Exception:
            pass
        out: list[int | None] = []
        for i, s in enumerate(seqs):
            try:
                if got is None:  # the batch raised: row by row, so that only the failing request fails
                    if s.matcher is not None:
                        s.token_mask = self.grammars.mask(s.matcher)
                    one = sample_batch(rows[i: i + 1], [s])
                    tok, lp = one.tokens[0], one.logprobs[0]
                else:
                    tok, lp = got.tokens[i], got.logprobs[i]
                if s.matcher is not None:
                    self.grammars.advance(s.matcher, tok)
                if lp is not None:
                    s.logprobs.append(lp)
                out.append(tok)
            except GrammarError as exc:  # the request's grammar, not the engine: its own error and code
                self.fail_request(s.request_id, str(exc), exc.code)
                out.append(None)
            except Exception as exc:
                log.warning("sampling failed for rid=%s alone (%s: %s); failing that request", s.request_id,
                            type(exc).__name__, exc)
                self.fail_request(s.request_id, f"sampling failed: {type(exc).__name__}: {exc}")
                out.append(None)
        return out

    def _check_forks(self, ids: list[int], forks: list[tuple[str, SamplingParams]]) -> None:
        """Raise InvalidRequest / OutOfBlocks unless every fork of a transferred prompt can start now: unique ids,
        each either not live or reserve()d with its parent (then holding its page), and pages for the rest."""
        if self.tp_size > 1:
            raise InvalidRequest("forks (n > 1) need a single-rank engine; accepted: n = 1 here")
        fork_ids = [rid for rid, _ in forks]
        if len(set(fork_ids)) != len(fork_ids):
            raise InvalidRequest(f"fork ids {fork_ids} must be unique; accepted: unique ids")
        missing = 0
        for rid, p in forks:
            held = self._seqs.get(rid)
            if held is not None and held.status is not Status.RESERVED:
                raise InvalidRequest(f"fork id {rid!r} is already live; accepted: unique ids")
            if not isinstance(p, SamplingParams):
                raise InvalidRequest(f"fork {rid!r}: params must be SamplingParams, got {type(p).__name__}")
            if len(ids) + p.max_tokens > self.max_model_len:
                raise InvalidRequest(f"fork {rid!r}: prompt + max_tokens exceeds {self.max_model_len} tokens")
            missing += 1 if held is None else 0
        if not self.pool.can_allocate(missing):
            raise OutOfBlocks(f"forks need {missing} KV blocks, {self.pool.num_free} of {self.pool.num_total} free")

    def _fork_prefilled(self, parent: Sequence, ids: list[int], forks: list[tuple[str, SamplingParams]]) -> list[Sequence]:
        """Children of a transferred prompt (checked by _check_forks): pages before the one holding the last
        prompt position shared, that page copied (into the page reserve()d for the fork, else a new one);
        each child prefills that one last position for the logits of its own first token."""
        bs = self.config.block_size
        k, end = (len(ids) - 1) // bs, -(-len(ids) // bs)  # end - k == 1: only the last prompt page is copied
        children = []
        for rid, p in forks:
            held = self._seqs.pop(rid, None)  # RESERVED with the parent: its page is the copy's
            c = self._new_seq(rid, ids, p, False)
            own = held.blocks if held is not None else self.pool.allocate(end - k)
            c.blocks = self.pool.share(parent.blocks[:k]) + own
            for src, dst in zip(parent.blocks[k:end], own):
                for layer in range(len(self.kv.k)):
                    self.kv.k[layer][dst].copy_(self.kv.k[layer][src])
                    self.kv.v[layer][dst].copy_(self.kv.v[layer][src])
            c.num_cached = len(ids) - 1
            c.page_keys, c.cached_tokens = parent.page_keys[:len(ids) // bs], parent.cached_tokens  # prompt pages
            c.status = Status.PREFILLING
            self._seqs[rid] = c
            children.append(c)
        return children

    def _record_prompt_logprobs(self, seq: Sequence, start: int, end: int, rows: torch.Tensor) -> None:
        """rows: [end - start, V] logits; row j predicts token start + j + 1 (entries for prompt tokens only)."""
        n = seq.params.prompt_logprobs
        stop = min(end, len(seq.prompt_ids) - 1)  # the last prompt row predicts the first output token
        if stop <= start:
            return
        lsm = torch.log_softmax(rows[: stop - start].float(), dim=-1)
        nxt = torch.tensor(seq.prompt_ids[start + 1: stop + 1], device=lsm.device)
        chosen = lsm.gather(1, nxt[:, None]).squeeze(1).tolist()
        tv, ti = torch.topk(lsm, n, dim=-1) if n else (lsm[:, :0], lsm[:, :0].long())
        if start == 0:
            seq.prompt_logprobs = []  # a recompute after preemption starts over
        seq.prompt_logprobs += [(c, list(zip(i, v))) for c, i, v in zip(chosen, ti.tolist(), tv.tolist())]

    def _fork(self, parents: list[Sequence]) -> list[tuple[Sequence, int]]:
        """Children of the parents whose prompt just completed, holding the prompt's KV: full pages shared, the
        partly filled last page copied. A child the pool cannot give its copy to is queued to prefill alone."""
        out = []
        bs = self.config.block_size
        for j, parent in enumerate(parents):
            children, parent.forks = [c for c in parent.forks if c.request_id in self._seqs], []
            full = len(parent.prompt_ids) // bs
            for c in children:
                partial = len(parent.blocks) > full
                if partial and not self.pool.can_allocate(1):
                    self.scheduler.waiting.append(c)  # prefills itself later (correct, just not shared)
                    continue
                c.blocks = self.pool.share(parent.blocks[:full])
                if partial:
                    page = self.pool.allocate(1)[0]
                    for layer in range(len(self.kv.k)):
                        self.kv.k[layer][page].copy_(self.kv.k[layer][parent.blocks[full]])
                        self.kv.v[layer][page].copy_(self.kv.v[layer][parent.blocks[full]])
                    c.blocks.append(page)
                c.num_cached = len(c.prompt_ids)
                c.page_keys, c.cached_tokens = parent.page_keys[:full], parent.cached_tokens  # prompt pages only
                out.append((c, j))
        return out

    def _run_decode(self, seqs: list[Sequence]) -> list[StepOutput]:
        n = len(seqs)
        tokens = torch.tensor([s.output_ids[-1] for s in seqs], dtype=torch.int64)
        positions = torch.tensor([s.num_tokens - 1 for s in seqs], dtype=torch.int64)
        width = max(len(s.blocks) for s in seqs)
        table = torch.zeros((n, width), dtype=torch.int32)
        for i, s in enumerate(seqs):
            table[i, : len(s.blocks)] = torch.tensor(s.blocks, dtype=torch.int32)
        seq_lens = (positions + 1).to(torch.int32)
        logits = self.graphs.run(tokens, positions, table, seq_lens) if self.graphs is not None else None
        if logits is None:
            dev = self.device  # .to() of a cpu tensor to cpu is a no-op: nothing added to the CPU path
            logits = self.model.decode(tokens.to(dev), positions.to(dev), self.kv.k, self.kv.v, table.to(dev),
                                       seq_lens.to(dev))
        new = self._sample_each(seqs, logits)
        out = self.take_pending()
        for s, tok in zip(seqs, new):
            if tok is None:
                continue
            s.num_cached = s.num_tokens
            if self.prefix_cache is not None and s.num_cached >= (s.num_published + 1) * self.config.block_size:
                self.prefix_cache.publish(s)  # a page just filled: decode keeps what it made
            out.append(self._emit(s, tok))
        return out

    def _run_prefill(self, chunks: list[tuple[Sequence, int, int]]) -> list[StepOutput]:
        """All scheduled prompt chunks in one forward; sequences whose prompt is complete sample a token."""
        batch = [PrefillChunk(torch.tensor(seq.tokens[start:end], dtype=torch.int64), start,
                              torch.tensor(seq.blocks, dtype=torch.int64)) for seq, start, end in chunks]
        want = [seq.params.prompt_logprobs is not None and start < len(seq.prompt_ids) for seq, start, _ in chunks]
        if any(want):  # prompt logprobs: every position's logits (only in steps that carry such a chunk)
            full = self.model.prefill_batch(batch, self.kv.k, self.kv.v, all_logits=True)
            for (seq, start, end), rows, w in zip(chunks, full, want):
                if w:
                    self._record_prompt_logprobs(seq, start, end, rows)
            logits = [rows[-1] for rows in full]
        else:
            logits = self.model.prefill_batch(batch, self.kv.k, self.kv.v)
        done = [i for i, (seq, _s, end) in enumerate(chunks) if end >= seq.num_tokens]
        forked = self._fork([chunks[i][0] for i in done])  # [(child, row index in done)]
        rows = torch.stack([logits[i] for i in done] + [logits[done[j]] for _, j in forked]) if done else None
        sampled = self._sample_each([chunks[i][0] for i in done] + [c for c, _ in forked], rows) if done else []
        toks = dict(zip(done, sampled))
        out = self.take_pending()
        for (child, _), tok in zip(forked, sampled[len(done):]):
            if tok is not None:
                child.status = Status.RUNNING
                self.scheduler.active.append(child)
                out.append(self._emit(child, tok))
        for i, ((seq, start, end), row) in enumerate(zip(chunks, logits)):
            if i in toks and toks[i] is None:
                continue  # failed alone by _sample_each
            seq.num_cached = end
            self.num_prefill_tokens += end - start
            self._publish(seq)
            if end < seq.num_tokens:
                continue  # more chunks to go
            tok = toks[i]
            if seq.prefill_only:
                seq.output_ids.append(tok)
                seq.num_emitted = 1
                self.scheduler.active.remove(seq)
                seq.status = Status.PREFILL_HELD
                self.num_generated_tokens += 1
                text = "" if tok in self._eos else self.tokenizer.decode([tok])
                out.append(StepOutput(seq.request_id, [tok], text, True, "prefill_done",
                                      logprobs=seq.logprobs[:1] if seq.params.logprobs is not None else None,
                                      prompt_logprobs=seq.prompt_logprobs if seq.params.prompt_logprobs is not None
                                      else None, cached_tokens=seq.cached_tokens or 0))
            else:
                seq.status = Status.RUNNING
                out.append(self._emit(seq, tok))
        return out

    def _publish(self, seq: Sequence) -> None:
        if self.prefix_cache is not None:
            self.prefix_cache.publish(seq)

    # -- outputs ---------------------------------------------------------------------------------
    def take_pending(self) -> list[StepOutput]:
        """Outputs produced outside a step (abort, fail_request), to deliver now rather than with the next step."""
        out, self._pending = self._pending, []
        return out

    def _append_token(self, seq: Sequence, tok: int) -> None:
        """Record a sampled token and decide whether the request finished (EOS, stop string, length)."""
        seq.output_ids.append(tok)
        self.num_generated_tokens += 1
        p = seq.params
        if (tok in self._eos and not p.ignore_eos) or tok in p.stop_token_ids:
            seq.finish_reason = "stop"  # the EOS / stop token itself adds no text
        elif seq.matcher is not None and self.grammars.finished(seq.matcher):
            self._detokenize(seq, flush=True)
            seq.finish_reason = "stop"  # the grammar admits nothing more (e.g. the closing brace of a JSON value)
        else:
            self._detokenize(seq, flush=len(seq.output_ids) >= p.max_tokens)
        if seq.finish_reason is None and len(seq.output_ids) >= p.max_tokens:
            seq.finish_reason = "length"

    def _detokenize(self, seq: Sequence, *, flush: bool) -> None:
        """Extend seq.text by the new token(s), decoding only a short window (O(1) per token).

        The window starts at the previous emission point so multi-byte characters split across tokens
        decode whole; text ending in an incomplete character waits for the next token unless `flush`."""
        ids = seq.output_ids
        prefix = self.tokenizer.decode(ids[seq.detok_prefix: seq.detok_read])
        full = self.tokenizer.decode(ids[seq.detok_prefix:])
        if len(full) <= len(prefix) or (full.endswith("\ufffd") and not flush):
            return
        start = len(seq.text)
        seq.text += full[len(prefix):]
        seq.detok_prefix, seq.detok_read = seq.detok_read, len(ids)
        if seq.params.stop:
            longest = max(len(s) for s in seq.params.stop)
            horizon = max(0, start - longest + 1)
            hits = [i for i in (seq.text.find(s, horizon) for s in seq.params.stop) if i >= 0]
            if hits:
                seq.text = seq.text[: min(hits)]
                seq.finish_reason = "stop"

    def _emit(self, seq: Sequence, tok: int) -> StepOutput:
        self._append_token(seq, tok)
        if seq.finish_reason is not None:
            return self._finish(seq)
        # hold back text that may be the start of a stop string or an incomplete UTF-8 character
        visible = len(seq.text)
        if seq.params.stop:
            visible -= max(len(s) for s in seq.params.stop) - 1
        while visible > seq.text_emitted and seq.text[visible - 1] == "\ufffd":
            visible -= 1
        return self._report(seq, visible, finished=False)

    def _report(self, seq: Sequence, visible: int, *, finished: bool) -> StepOutput:
        delta = seq.text[seq.text_emitted: visible] if visible > seq.text_emitted else ""
        seq.text_emitted = max(seq.text_emitted, visible)
        new_ids = seq.output_ids[seq.num_emitted:]
        lps = seq.logprobs[seq.num_emitted:] if seq.params.logprobs is not None else None
        plps = seq.prompt_logprobs if seq.params.prompt_logprobs is not None and seq.num_emitted == 0 \
            and seq.prompt_logprobs else None  # a PD decode sequence has none (prefill reports them)
        cached = (seq.cached_tokens or 0) if seq.num_emitted == 0 else None
        seq.num_emitted = len(seq.output_ids)
        return StepOutput(seq.request_id, new_ids, delta, finished, seq.finish_reason if finished else None,
                          logprobs=lps, prompt_logprobs=plps, cached_tokens=cached)

    def _finish(self, seq: Sequence) -> StepOutput:
        if seq in self.scheduler.active:
            self.scheduler.active.remove(seq)
        self.scheduler.free_pages(seq)
        seq.status = Status.FINISHED
        self._seqs.pop(seq.request_id, None)
        return self._report(seq, len(seq.text), finished=True)

    # -- tensor parallelism: KV pages of every rank (engine thread only: these are collectives) ----
    def gather_pages(self, block_ids: list[int]) -> list:
        """Every TP rank's KV pages ``block_ids`` on this host, one KV-like object per rank (k/v lists of
        [n, page, Hkv_rank, D], pages renumbered 0..n-1), for a KV transfer to send rank by rank."""
        if self.tp_size == 1:
            raise RuntimeError("gather_pages is for tensor-parallel engines; send from engine.kv directly")
        return self.model.gather_pages(list(block_ids))

    def empty_pages(self, num_pages: int) -> list:
        """Host staging for ``num_pages`` incoming pages per TP rank (like gather_pages' result)."""
        if self.tp_size == 1:
            raise RuntimeError("empty_pages is for tensor-parallel engines; receive into engine.kv directly")
        return self.model.empty_pages(num_pages)

    def scatter_pages(self, block_ids: list[int], staged: list) -> None:
        """Write each TP rank's staged pages into that rank's KV cache at ``block_ids``."""
        if self.tp_size == 1:
            raise RuntimeError("scatter_pages is for tensor-parallel engines")
        self.model.scatter_pages(list(block_ids), staged)

    def shutdown(self) -> None:
        """Stop the tensor-parallel followers (no-op for a single-process engine). Idempotent."""
        if self.tp_size > 1:
            self.model.shutdown()

    # -- introspection ---------------------------------------------------------------------------
    def cached_tokens(self, request_id: str) -> int:
        """Prompt tokens of a live request whose KV came from the prefix cache (0 before admission)."""
        return self._get(request_id).cached_tokens or 0

    def page_refs(self, request_id: str) -> list[int]:
        """How many sequences hold each of a request's KV pages, in page order (a page shared by n forks: n)."""
        return [self.pool.refs(b) for b in self._get(request_id).blocks]

    def _get(self, request_id: str) -> Sequence:
        seq = self._seqs.get(request_id)
        if seq is None:
            raise KeyError(f"unknown request id {request_id!r}")
        return seq

    def check_accounting(self) -> None:
        """Pages held by live requests must equal the pool's used pages, with no page held twice."""
        held = [b for s in self._seqs.values() for b in s.blocks]
        holders: dict[int, int] = {}
        for b in held:
            holders[b] = holders.get(b, 0) + 1
        wrong = {b: (n, self.pool.refs(b)) for b, n in holders.items() if self.pool.refs(b) != n}
        if wrong:
            raise AssertionError(f"KV pages whose holders differ from their reference counts: {wrong}")
        if self.prefix_cache is not None:
            self.prefix_cache.check()
        self.pool.assert_no_leaks(held=len(holders), cached=len(self.prefix_cache or ()))

    def stats(self) -> dict[str, Any]:
        by = {st: 0 for st in Status}
        for s in self._seqs.values():
            by[s.status] += 1
        return {
            "num_running": by[Status.RUNNING], "num_prefilling": by[Status.PREFILLING],
            "num_waiting": by[Status.WAITING], "num_prefill_held": by[Status.PREFILL_HELD],
            "num_reserved": by[Status.RESERVED], "blocks_free": self.pool.num_free,
            "blocks_used": self.pool.num_used, "blocks_total": self.pool.num_total,
            "num_preemptions": self.num_preemptions, "num_generated_tokens": self.num_generated_tokens,
            "num_prefill_tokens": self.num_prefill_tokens,
            # prefix cache: blocks_cached (held or evictable) and blocks_evictable (part of blocks_free) are pages;
            # hit/miss are prompt tokens looked up at admission and reserve(prompt_token_ids=...)
            "prefix_cache": self.prefix_cache is not None, "blocks_cached": self.pool.num_cached,
            "blocks_evictable": self.pool.num_evictable, "cache_evictions": self.pool.num_evictions,
            "cache_hit_tokens": self.prefix_cache.hit_tokens if self.prefix_cache is not None else 0,
            "cache_miss_tokens": self.prefix_cache.miss_tokens if self.prefix_cache is not None else 0,
            # prompt tokens computed so far, per request still before its first token (PD progress reports)
            "prefill_progress": {rid: s.num_cached for rid, s in self._seqs.items()
                                 if s.status in (Status.WAITING, Status.PREFILLING)},
        }

    def page_owners(self) -> tuple[dict[str, int], int]:
        """({request id: pages it holds}, pages in use that no sequence holds). O(pages held): for views (the
        leak check, /debug/requests, a scrape), never the step loop. The second number is 0 unless pages leak."""
        owners = {rid: len(s.blocks) for rid, s in self._seqs.items()}
        held = set().union(*(s.blocks for s in self._seqs.values())) if self._seqs else set()
        return owners, self.pool.num_used - len(held)

    def describe(self) -> dict[str, Any]:
        """Effective configuration for /config."""
        out = {
            "model": asdict(self.info),
            "engine": asdict(self.config),
            "device": self.config.device,
            "tensor_parallel_size": self.tp_size,
            "tp_follower_pids": list(getattr(self.model, "follower_pids", [])),
            "num_blocks": self.pool.num_total,
            "kv_pages": self.pool.num_total,
            "kv_budget": self.kv_budget_source,
            "max_model_len": self.max_model_len,
            "max_full_context_seqs": self.max_full_context_seqs,
            "kv_cache_bytes": self.kv.nbytes,
            "weight_bytes": _weight_bytes(self.model),
            "dtype": str(self.model.dtype).replace("torch.", ""),
            "weights": self.model.weight_format,
            "attention_backend": self.model.attention_backend,
            "attention_kernel": _kernel_config(self.model),
            "cuda_graphs": self.graphs_status,
            "torch_threads": torch.get_num_threads(),
        }
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            out["device_memory"] = {"allocated_bytes": torch.cuda.memory_allocated(self.device),
                                    "reserved_bytes": torch.cuda.memory_reserved(self.device),
                                    "free_bytes": free, "total_bytes": total,
                                    "name": torch.cuda.get_device_name(self.device)}
        return out

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
        """Blocking: run the prompts to completion, return each one's output token ids."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        base = f"gen-{next(self._arrivals)}-"
        ids = [base + str(i) for i in range(len(prompts))]
        for rid, prompt, p in zip(ids, prompts, plist):
            self.add_request(rid, prompt, p)
        results: dict[str, list[int]] = {rid: [] for rid in ids}
        done: set[str] = set()
        while len(done) < len(ids):
            for out in self.step():
                if out.request_id in results:
                    results[out.request_id].extend(out.new_token_ids)
                    if out.finished:
                        done.add(out.request_id)
        return [results[rid] for rid in ids]
