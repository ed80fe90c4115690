"""Paged KV memory <-> the byte runs of the KV wire, for one TP shard of one request.

A chunk is ``n`` whole pages of one layer's K or V, in page-table order. How its bytes reach the
socket depends on where the cache lives (the cache's own device decides, never the host):

- **CPU**: no staging copy at all. A chunk is a list of memoryviews over runs of consecutive page ids
  in the cache itself (one view when the page table is contiguous), found by bisection in a
  :class:`SpanTable` built once per transfer; ``sendmsg`` gathers them and ``recvmsg_into`` scatters
  straight into decode's pages. Measured on the 2-core host: a numpy
  gather + scatter through a staging buffer cost more than the socket itself (bench/kv_wire.py).
- **CUDA**: pages are gathered on the device with one ``index_select`` per (layer, kind) run into a
  device buffer, copied to pinned host memory on a side stream, and the copy of run i+1 overlaps
  the send of run i (three slots, one event each). Decode receives each chunk into a pinned slot,
  copies it host-to-device on a stream and ``index_copy_``s it into its pages (two slots).
"""

from __future__ import annotations

import threading
from bisect import bisect_left, bisect_right
from typing import Iterator, Sequence

import numpy as np
import torch

from pdruntime.disagg.wire import KVLayout, WireError

STAGE_TARGET_BYTES = 16 << 20  # bytes per staged device run (CUDA); bounds pinned memory per transfer

Chunk = tuple[int, int, int, int, list]  # (layer, kind, page_start, page_count, [memoryview, ...])


def layout_of(kv, tp_rank: int = 0, tp_size: int = 1) -> KVLayout:
    """The wire layout of a paged KV cache (``kv.k[layer]``: [num_blocks, page_size, Hkv, D]) on this rank."""
    k0 = kv.k[0]
    return KVLayout(dtype=str(k0.dtype).removeprefix("torch."), page_size=int(k0.shape[1]), num_layers=len(kv.k),
                    num_kv_heads=int(k0.shape[2]), head_dim=int(k0.shape[3]), tp_rank=tp_rank, tp_size=tp_size)


def page_rows(cache: torch.Tensor) -> torch.Tensor:
    # cache: [num_blocks, page_size, Hkv, D] -> [num_blocks, page_bytes] uint8 (a view, never a copy)
    assert cache.is_contiguous(), "KV cache tensors must be contiguous"
    return cache.view(cache.shape[0], -1).view(torch.uint8)


def chunk_bounds(num_pages: int, per_chunk: int) -> list[tuple[int, int]]:
    """Pure: (page_start, page_count) of each chunk of one (layer, kind) run."""
    return [(p0, min(per_chunk, num_pages - p0)) for p0 in range(0, num_pages, per_chunk)]


def segments(layer: int, kind: int, p0: int, n: int, num_pages: int) -> list[tuple[int, int, int, int]]:
    """Pure: a chunk of ``n`` pages starting at (layer, kind, p0) in wire order (layer, then K before V,
    pages ascending) split into its per-(layer, kind) pieces (layer, kind, page_start, count)."""
    out = []
    u = (2 * layer + kind) * num_pages + p0
    end = u + n
    while u < end:
        lk, p = divmod(u, num_pages)
        c = min(end - u, num_pages - p)
        out.append((lk // 2, lk % 2, p, c))
        u += c
    return out


def _cache_bytes(cache: torch.Tensor) -> memoryview:
    return memoryview(page_rows(cache).numpy()).cast("B")


class SpanTable:
    """A page table's runs of consecutive page ids ([3,4,5,9,2]: 3-5, 9, 2) as byte ranges, computed once per
    transfer (numpy): every
    (layer, kind) run shares the table, so a chunk's buffers are one slice per run of pages, found by bisection,
    with no per-page Python.

    ``views(mv, p0, p1)``: memoryviews over table positions [p0, p1) of the cache tensor whose bytes are ``mv``."""

    def __init__(self, ids: np.ndarray, page_bytes: int) -> None:
        self.page_bytes = page_bytes
        if ids.size == 0:
            self.pos, self.byte0, self.byte1 = [], [], []
            return
        starts = np.concatenate(([0], np.flatnonzero(np.diff(ids) != 1) + 1))
        counts = np.diff(np.append(starts, ids.size))
        self.pos = starts.tolist()  # table position of each run's first page, ascending
        self.byte0 = (ids[starts] * page_bytes).tolist()  # byte offset of each run in the cache tensor
        self.byte1 = ((ids[starts] + counts) * page_bytes).tolist()  # ... and of its end

    def views(self, mv: memoryview, p0: int, p1: int) -> list[memoryview]:
        pb, pos = self.page_bytes, self.pos
        j0 = bisect_right(pos, p0) - 1  # runs j0 .. j1-1 hold positions [p0, p1)
        j1 = bisect_left(pos, p1, j0 + 1)
        first = self.byte0[j0] + (p0 - pos[j0]) * pb
        last = self.byte0[j1 - 1] + (p1 - pos[j1 - 1]) * pb  # end of the last run's part in [p0, p1)
        if j1 - j0 == 1:
            return [mv[first:last]]
        middle = [mv[a:b] for a, b in zip(self.byte0[j0 + 1:j1 - 1], self.byte1[j0 + 1:j1 - 1])]
        return [mv[first:self.byte1[j0]], *middle, mv[self.byte0[j1 - 1]:last]]


def _layer_bytes(kv) -> list[list[memoryview]]:
    """[layer][kind] -> the whole cache tensor as bytes (CPU)."""
    return [[_cache_bytes(kv.k[layer]), _cache_bytes(kv.v[layer])] for layer in range(len(kv.k))]


def _chunk_views(mvs: list[list[memoryview]], spans: SpanTable, layer: int, kind: int, p0: int, n: int,
                 num_pages: int) -> list[memoryview]:
    """The cache bytes of a chunk of ``n`` pages from (layer, kind, p0) in wire order, one view per run of pages."""
    if p0 + n <= num_pages:  # within one (layer, kind) run: the common case for long prompts
        return spans.views(mvs[layer][kind], p0, p0 + n)
    bufs = []
    for lay, kd, ps, c in segments(layer, kind, p0, n, num_pages):
        bufs += spans.views(mvs[lay][kd], ps, ps + c)
    return bufs


class _PinnedPool:
    """Pinned host staging buffers kept between transfers: cudaHostAlloc of tens of MiB costs milliseconds,
    as much as moving the bytes. At most MAX_KEPT buffers are kept."""

    MAX_KEPT = 16

    def __init__(self) -> None:
        self._free: dict[tuple[int, int], list[torch.Tensor]] = {}
        self._lock = threading.Lock()

    def get(self, rows: int, row_bytes: int) -> torch.Tensor:
        with self._lock:
            kept = self._free.get((rows, row_bytes))
            if kept:
                return kept.pop()
        return torch.empty((rows, row_bytes), dtype=torch.uint8, pin_memory=True)

    def put(self, bufs: list[torch.Tensor]) -> None:
        with self._lock:
            for b in bufs:
                if sum(len(v) for v in self._free.values()) < self.MAX_KEPT:
                    self._free.setdefault(tuple(b.shape), []).append(b)


_PINNED = _PinnedPool()


def _check_ids(block_ids: Sequence[int], kv) -> np.ndarray:
    ids = np.asarray(list(block_ids), dtype=np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= kv.k[0].shape[0]):
        raise ValueError(f"page ids outside the cache's {kv.k[0].shape[0]} pages")
    return ids


class ShardSource:
    """One TP rank's pages of one request, read chunk by chunk for the wire (prefill side)."""

    def __init__(self, kv, block_ids: Sequence[int], layout: KVLayout) -> None:
        assert layout_of(kv, layout.tp_rank, layout.tp_size) == layout, "layout does not describe this cache"
        self.kv, self.layout = kv, layout
        self.ids = _check_ids(block_ids, kv)
        self.device = kv.k[0].device

    def _cache(self, layer: int, kind: int) -> torch.Tensor:
        return self.kv.k[layer] if kind == 0 else self.kv.v[layer]

    def chunks(self, num_pages: int, per_chunk: int) -> Iterator[Chunk]:
        """Every chunk in wire order (layer, then K before V, pages ascending). A chunk's buffers stay
        valid until the next chunk is requested."""
        if num_pages > self.ids.size:
            raise ValueError(f"{num_pages} pages requested, the request holds {self.ids.size}")
        if num_pages == 0:
            return
        if self.device.type == "cuda":
            yield from self._chunks_cuda(num_pages, per_chunk)
            return
        # CPU: chunks run across (layer, kind) boundaries, so every chunk is per_chunk pages however short
        # the prompt; its buffers are views of the cache pages themselves
        mvs = _layer_bytes(self.kv)
        spans = SpanTable(self.ids[:num_pages], self.layout.page_bytes)
        total = 2 * self.layout.num_layers * num_pages
        for u in range(0, total, per_chunk):
            lk, p = divmod(u, num_pages)
            n = min(per_chunk, total - u)
            yield lk // 2, lk % 2, p, n, _chunk_views(mvs, spans, lk // 2, lk % 2, p, n, num_pages)

    def _chunks_cuda(self, num_pages: int, per_chunk: int) -> Iterator[Chunk]:
        dev = self.device
        pb = self.layout.page_bytes
        per_run = max(1, min(num_pages, STAGE_TARGET_BYTES // pb))
        runs = [(layer, kind, r0, min(per_run, num_pages - r0))
                for layer in range(self.layout.num_layers) for kind in (0, 1) for r0 in range(0, num_pages, per_run)]
        idx = torch.as_tensor(self.ids).to(dev, non_blocking=True)
        stream = torch.cuda.Stream(device=dev)
        stream.wait_stream(torch.cuda.current_stream(dev))  # KV written on the engine's stream is complete
        # slot i % 3: run i is being sent, run i+1 is being gathered and copied; the third is spare
        dev_stage = [torch.empty((per_run, pb), dtype=torch.uint8, device=dev) for _ in range(3)]
        host_stage = [_PINNED.get(per_run, pb) for _ in range(3)]
        done = [torch.cuda.Event() for _ in range(3)]

        def launch(i: int) -> None:
            layer, kind, r0, n = runs[i]
            s = i % 3
            with torch.cuda.stream(stream):
                torch.index_select(page_rows(self._cache(layer, kind)), 0, idx[r0:r0 + n], out=dev_stage[s][:n])
                host_stage[s][:n].copy_(dev_stage[s][:n], non_blocking=True)
                done[s].record(stream)

        try:
            launch(0)
            for i, (layer, kind, r0, n) in enumerate(runs):
                if i + 1 < len(runs):
                    launch(i + 1)  # device gather + D2H of the next run overlaps the send of this one
                done[i % 3].synchronize()
                mv = memoryview(host_stage[i % 3].numpy()).cast("B")
                for p0, cnt in chunk_bounds(n, per_chunk):
                    yield layer, kind, r0 + p0, cnt, [mv[p0 * pb:(p0 + cnt) * pb]]
        finally:
            stream.synchronize()  # no copy in flight into a buffer handed back to the pool
            _PINNED.put(host_stage)


class ShardSink:
    """One TP rank's reserved pages on decode: ``buffers()`` says where a chunk is received, ``commit()``
    makes a verified chunk part of the pages, ``finish()`` waits for the last one."""

    def __init__(self, kv, block_ids: Sequence[int], layout: KVLayout) -> None:
        assert layout_of(kv, layout.tp_rank, layout.tp_size) == layout, "layout does not describe this cache"
        self.kv, self.layout = kv, layout
        self.ids = _check_ids(block_ids, kv)
        self.device = kv.k[0].device
        self._cuda = self.device.type == "cuda"  # per chunk: torch.device attributes are slow to read
        self._slot = 0
        if not self._cuda:
            self._mvs = _layer_bytes(kv)
            self._spans = SpanTable(self.ids, layout.page_bytes)
        else:
            self._stream = torch.cuda.Stream(device=self.device)
            self._idx = torch.as_tensor(self.ids).to(self.device)
            self._host: list[torch.Tensor] = []
            self._dev: list[torch.Tensor] = []
            self._events = [torch.cuda.Event(), torch.cuda.Event()]
            self._used = [False, False]

    def _cache(self, layer: int, kind: int) -> torch.Tensor:
        return self.kv.k[layer] if kind == 0 else self.kv.v[layer]

    def check_capacity(self, num_pages: int) -> None:
        if num_pages > self.ids.size:
            raise WireError("mismatch", f"prefill sends {num_pages} pages, decode reserved {self.ids.size}")

    def buffers(self, layer: int, kind: int, p0: int, n: int, num_pages: int) -> list[memoryview]:
        """Where the next chunk (``n`` pages from (layer, kind, p0) in wire order, possibly running into the
        next layers) is received: views of the destination pages themselves (CPU), or a pinned host slot
        (CUDA). A chunk that fails its checksum leaves garbage in this request's own pages only, which the
        failed request frees."""
        if not self._cuda:
            return _chunk_views(self._mvs, self._spans, layer, kind, p0, n, num_pages)
        pb = self.layout.page_bytes
        if not self._host or self._host[0].shape[0] < n:
            self.release()
            self._host = [_PINNED.get(n, pb) for _ in range(2)]
            self._dev = [torch.empty((n, pb), dtype=torch.uint8, device=self.device) for _ in range(2)]
            self._used = [False, False]
        s = self._slot
        if self._used[s]:
            self._events[s].synchronize()  # the H2D copy out of this pinned slot has finished
        return [memoryview(self._host[s][:n].numpy()).cast("B")]

    def commit(self, layer: int, kind: int, p0: int, n: int, num_pages: int) -> None:
        """The chunk received into the last ``buffers()`` is verified (CPU: already in place)."""
        if not self._cuda:
            return
        s = self._slot
        with torch.cuda.stream(self._stream):
            self._dev[s][:n].copy_(self._host[s][:n], non_blocking=True)
            off = 0
            for lay, kd, ps, c in segments(layer, kind, p0, n, num_pages):
                page_rows(self._cache(lay, kd)).index_copy_(0, self._idx[ps:ps + c], self._dev[s][off:off + c])
                off += c
            self._events[s].record(self._stream)
        self._used[s] = True
        self._slot = 1 - s

    def finish(self) -> None:
        if self.device.type == "cuda":
            self._stream.synchronize()

    def release(self) -> None:
        """Hand staging buffers back (after the transfer, failed or not). Idempotent."""
        if self.device.type == "cuda" and self._host:
            self._stream.synchronize()
            _PINNED.put(self._host)
            self._host = []
