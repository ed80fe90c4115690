"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket.

A decode step of B sequences runs the graph of the smallest captured bucket >= B. The graph reads its
inputs from static device buffers (tokens, positions, block table, lengths) and writes static logits.
Rows past B are padding: token 0 at position 0, one token of context, every page the scratch page
(one page past the pool that no request owns), so their K/V writes never touch a live page.

The Triton decode kernel runs in the graph with a split plan built at capture time for the bucket's
longest possible context; it reads the real lengths from the device, so shorter sequences leave the
extra splits empty (their LSE is -inf and the merge ignores them). The torch attention path reads
lengths on the host and cannot be captured: with it, capture fails and the engine decodes eagerly.

Tensor parallelism: every rank captures its own shard's graphs (their NCCL all-reduces are recorded in
them) in the same bucket order, agreeing after each plan and capture, so either every rank has graphs or
none does; rank 0 broadcasts each replay with its inputs (``tp.TPGraphs``).
"""

from __future__ import annotations

from typing import Callable

import torch

from .device import bucket_for


class CaptureRefused(RuntimeError):
    """Some tensor-parallel rank could not plan or capture a bucket; every rank raises this together."""


class DecodeGraphs:
    def __init__(self, model, kv, *, buckets: tuple[int, ...], max_model_len: int, scratch_page: int) -> None:
        self.model, self.kv = model, kv
        self.buckets = tuple(sorted(buckets))
        self.block_size = kv.block_size
        self.max_pages = -(-max_model_len // self.block_size)
        self.max_model_len = max_model_len
        self.scratch = scratch_page
        dev = kv.k[0].device
        bmax = self.buckets[-1]
        # static inputs: [Bmax] int64 tokens/positions, [Bmax, max_pages] int32 table, [Bmax] int32 lengths
        self.tokens = torch.zeros(bmax, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(bmax, dtype=torch.int64, device=dev)
        self.table = torch.full((bmax, self.max_pages), scratch_page, dtype=torch.int32, device=dev)
        self.seq_lens = torch.ones(bmax, dtype=torch.int32, device=dev)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.replays = 0  # steps served from a graph (tests check graphs were really used)

    def _plan(self, batch: int):
        """Split plan for ``batch`` sequences of up to max_model_len tokens (None: the backend needs none)."""
        from pdruntime.kernels.decode_attention import TRITON
        from pdruntime.kernels.split_heuristic import num_kv_splits
        from pdruntime.kernels.triton_decode_attention import make_split_plan

        cfg = getattr(self.model.decode_attention, "keywords", {}).get("config")
        if cfg is None or cfg.backend != TRITON:
            raise RuntimeError(f"decode attention backend {getattr(cfg, 'backend', 'torch')!r} reads lengths on the "
                               "host and cannot be captured; CUDA graphs need the Triton backend")
        lens = [self.max_model_len] * batch
        splits = num_kv_splits(lens, cfg.num_sms, cfg.target_ctas, cfg.max_splits,
                               num_kv_heads=self.kv.num_kv_heads, block_n=cfg.block_n)
        return make_split_plan(lens, splits, cfg.block_n, self.tokens.device)

    def _decode(self, b: int, plan) -> torch.Tensor:
        return self.model.decode(self.tokens[:b], self.positions[:b], self.kv.k, self.kv.v, self.table[:b],
                                 self.seq_lens[:b], attn_plan=plan)

    @torch.inference_mode()
    def capture(self, agree: Callable[[bool], bool] | None = None) -> None:
        """Capture every bucket, largest first, sharing one memory pool. Raises on any failure.

        agree: tensor parallelism: ``agree(ok_here) -> ok_everywhere`` (a collective). Every rank calls it
        after building a bucket's plan and after capturing it, so a rank that fails stops every rank before
        the next real collective (the warm-up's all-reduces): no rank is left waiting on another."""
        pool = torch.cuda.graph_pool_handle()
        current = torch.cuda.current_stream(self.tokens.device)
        for b in reversed(self.buckets):
            plan = self._agreed(agree, lambda: self._plan(b), f"split plan for batch {b}")
            side = torch.cuda.Stream(self.tokens.device)
            side.wait_stream(current)
            with torch.cuda.stream(side):
                for _ in range(2):  # warm-up: Triton compiles, cuBLAS picks its kernels, outside the capture
                    self._decode(b, plan)
            current.wait_stream(side)

            def record():
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    logits = self._decode(b, plan)
                return graph, logits

            graph, logits = self._agreed(agree, record, f"capture of batch {b}")
            self.graphs[b] = (graph, logits, plan)
        torch.cuda.synchronize(self.tokens.device)

    @staticmethod
    def _agreed(agree, fn, what: str):
        """fn(); with ``agree``, also every other rank's verdict (RuntimeError if any rank failed)."""
        if agree is None:
            return fn()
        try:
            out, err = fn(), None
        except Exception as exc:  # noqa: BLE001 - reported to the other ranks first, raised below
            out, err = None, exc
        if not agree(err is None):
            raise CaptureRefused(f"CUDA graph {what} failed on "
                               + (f"this rank: {type(err).__name__}: {err}" if err else "another tensor-parallel rank"))
        return out

    def fits(self, batch: int, width: int) -> bool:
        """A captured bucket holds ``batch`` rows with page tables ``width`` pages wide."""
        return bucket_for(batch, self.buckets) is not None and width <= self.max_pages

    def run(self, tokens: torch.Tensor, positions: torch.Tensor, table: torch.Tensor,
            seq_lens: torch.Tensor) -> torch.Tensor | None:
        """Host tensors of one step -> fp32 logits [B, V] from a graph, or None (no bucket fits: run eagerly)."""
        n = tokens.shape[0]
        if not self.fits(n, table.shape[1]):
            return None
        b = bucket_for(n, self.buckets)
        graph, logits, _plan = self.graphs[b]
        self.tokens[:n].copy_(tokens, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.seq_lens[:n].copy_(seq_lens, non_blocking=True)
        self.table[:n].fill_(self.scratch)
        self.table[:n, : table.shape[1]].copy_(table, non_blocking=True)
        if b > n:  # padding rows: scratch page, one token at position 0
            self.tokens[n:b].zero_()
            self.positions[n:b].zero_()
            self.seq_lens[n:b].fill_(1)
            self.table[n:b].fill_(self.scratch)
        graph.replay()
        self.replays += 1
        return logits[:n]
