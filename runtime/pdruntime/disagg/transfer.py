"""Both ends of one KV transfer over the wire format in :mod:`wire`, from and into paged KV memory.

The bulk phase runs in worker threads on blocking sockets (``sendmsg`` of memoryviews over staging
buffers, ``recv_into`` preallocated buffers or straight into destination pages), so the event loop
never copies KV bytes and there are no per-page Python objects. Waiting for the peer (decode waiting
for prefill's KV, prefill waiting for the ACK) holds no thread: it awaits socket readability.

Prefill side (bootstrap server)::

    server = await BootstrapServer.start(host, port, handler)        # handler(conn: KVConn) coroutine
    att = await accept_attach(conn, token)                            # WireError: auth / protocol
    header = make_header(room, rid, num_tokens, first_token_id, prompt_crc, model_sha256, [layout...])
    stats = await send_kv(conn, header, [ShardSource(kv, block_ids, layout), ...])   # -> TransferStats

Decode side::

    conn = await open_attach(host, port, token, att)
    header = await recv_header(conn)                                  # prefill's KV is ready
    check_header(header, att, [my_layout...], model_sha256)           # WireError('mismatch') naming both values
    stats = await recv_kv(conn, header, [ShardSink(kv, block_ids, layout), ...])
    # on any WireError: await send_error(conn, exc.reason, exc.message) (prefill fails with that message)

Staging, by the cache's own device (never the host's): CPU pages are gathered with one ``np.take`` per
(layer, K/V) run into a reusable host buffer and scattered with one fancy assignment per chunk (or
received straight into the pages when the destination run is contiguous); CUDA pages are gathered on
the device with one ``index_select`` per run into a device buffer, copied to pinned host memory on a
side stream, and the copy of run i+1 overlaps the send of run i (double buffer, one event per slot);
decode copies each received chunk host-to-device on a stream and ``index_copy_``s it into its pages.
"""

from __future__ import annotations

import asyncio
import secrets
import socket
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Awaitable, Callable, Iterator, Sequence

import numpy as np
import torch

from pdruntime.disagg import wire
from pdruntime.disagg.wire import Attach, ChunkHead, FrameSocket, FrameType, KVHeader, KVLayout, WireError

CONNECT_TIMEOUT_S = 5.0  # seconds for TCP connect + each handshake frame
IO_TIMEOUT_S = 30.0  # seconds without progress in one send/recv of the bulk phase (watchdogs cut sooner)
STAGE_TARGET_BYTES = 16 << 20  # bytes per staged (layer, kind) run; bounds staging memory per transfer
MAX_TRANSFER_THREADS = 32  # concurrent bulk phases per process (waiting for a peer holds no thread)

_EXECUTOR = ThreadPoolExecutor(max_workers=MAX_TRANSFER_THREADS, thread_name_prefix="pdkv")

__all__ = ["Attach", "BootstrapServer", "KVConn", "LogLimiter", "ShardSink", "ShardSource", "TransferStats",
           "accept_attach", "check_header", "layout_of", "make_header", "open_attach", "recv_header", "recv_kv",
           "send_error", "send_kv"]


# ---- per-transfer figures and rate-limited logging -----------------------------------------------

@dataclass
class TransferStats:
    """Bytes and time of one transfer's bulk phase (READY .. ACK); updated live, chunk by chunk."""

    bytes: int = 0
    chunks: int = 0
    started: float | None = None  # time.perf_counter() seconds
    finished: float | None = None

    def start(self) -> None:
        self.started = time.perf_counter()

    def finish(self) -> None:
        self.finished = time.perf_counter()

    @property
    def seconds(self) -> float:
        if self.started is None:
            return 0.0
        return (self.finished or time.perf_counter()) - self.started

    @property
    def gbps(self) -> float:
        s = self.seconds
        return self.bytes / s / 1e9 if s > 0 else 0.0

    def row(self) -> dict:
        """The /debug/requests fields."""
        return {"kv_bytes": self.bytes, "kv_seconds": round(self.seconds, 6), "kv_gbps": round(self.gbps, 3)}


class LogLimiter:
    """At most one log line per ``interval_s``; the next allowed line reports how many were suppressed.

    ``allow(now)`` -> (emit, suppressed_since_last_emit). Pure apart from its own counters."""

    def __init__(self, interval_s: float = 10.0) -> None:
        self.interval_s = interval_s
        self._last: float | None = None
        self._suppressed = 0

    def allow(self, now: float) -> tuple[bool, int]:
        if self._last is None or now - self._last >= self.interval_s:
            n, self._suppressed, self._last = self._suppressed, 0, now
            return True, n
        self._suppressed += 1
        return False, self._suppressed


# ---- KV memory <-> staging ----------------------------------------------------------------------

def layout_of(kv, tp_rank: int = 0, tp_size: int = 1) -> KVLayout:
    """The wire layout of a paged KV cache (``kv.k[layer]``: [num_blocks, page_size, Hkv, D]) on this rank."""
    k0 = kv.k[0]
    return KVLayout(dtype=str(k0.dtype).removeprefix("torch."), page_size=int(k0.shape[1]), num_layers=len(kv.k),
                    num_kv_heads=int(k0.shape[2]), head_dim=int(k0.shape[3]), tp_rank=tp_rank, tp_size=tp_size)


def make_header(room: int, rid: str, num_tokens: int, first_token_id: int, prompt_crc: int, model_sha256: str,
                shards: Sequence[KVLayout]) -> KVHeader:
    page = shards[0].page_size
    return KVHeader(room=room, rid=rid, num_tokens=num_tokens, num_pages=-(-num_tokens // page),
                    first_token_id=int(first_token_id), prompt_crc=prompt_crc, model_sha256=model_sha256,
                    chunk_bytes=wire.chunk_pages_for(shards[0].page_bytes) * shards[0].page_bytes, shards=tuple(shards))


def _page_rows(cache: torch.Tensor) -> torch.Tensor:
    # cache: [num_blocks, page_size, Hkv, D] -> [num_blocks, page_bytes] uint8 (a view, never a copy)
    assert cache.is_contiguous(), "KV cache tensors must be contiguous"
    return cache.view(cache.shape[0], -1).view(torch.uint8)


def _as_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.numpy()).cast("B")


def _is_consecutive(ids: np.ndarray) -> bool:
    return ids.size > 0 and int(ids[-1]) - int(ids[0]) == ids.size - 1 and bool(np.all(np.diff(ids) == 1))


class ShardSource:
    """One TP rank's pages of one request, staged run by run: (layer, kind, page_start, page_count, bytes)."""

    def __init__(self, kv, block_ids: Sequence[int], layout: KVLayout) -> None:
        assert layout_of(kv, layout.tp_rank, layout.tp_size) == layout, "layout does not describe this cache"
        self.kv, self.layout = kv, layout
        self.block_ids = torch.tensor(list(block_ids), dtype=torch.int64)
        self.device = kv.k[0].device

    def runs(self, num_pages: int) -> list[tuple[int, int, int, int]]:
        per = max(1, min(num_pages, STAGE_TARGET_BYTES // self.layout.page_bytes))
        return [(layer, kind, p0, min(per, num_pages - p0))
                for layer in range(self.layout.num_layers) for kind in (0, 1) for p0 in range(0, num_pages, per)]

    def staged(self, num_pages: int) -> Iterator[tuple[int, int, int, int, memoryview]]:
        """Yield each run's bytes; a yielded view is valid until the next one is requested."""
        if num_pages > self.block_ids.numel():
            raise ValueError(f"{num_pages} pages requested, the request holds {self.block_ids.numel()}")
        runs = self.runs(num_pages)
        if self.device.type == "cuda":
            yield from self._staged_cuda(runs)
        else:
            yield from self._staged_host(runs)

    def _cache(self, layer: int, kind: int) -> torch.Tensor:
        return self.kv.k[layer] if kind == 0 else self.kv.v[layer]

    def _staged_host(self, runs):
        # numpy on purpose: one thread, no OpenMP team contending with the engine's torch threads
        pb = self.layout.page_bytes
        ids = self.block_ids.numpy()
        cap = max(r[3] for r in runs) if runs else 0
        stage = np.empty((cap, pb), dtype=np.uint8)
        for layer, kind, p0, n in runs:
            rows = _page_rows(self._cache(layer, kind)).numpy()
            sel = ids[p0:p0 + n]
            if _is_consecutive(sel):  # contiguous pages: send straight from the cache, no gather
                yield layer, kind, p0, n, memoryview(rows[sel[0]:sel[0] + n]).cast("B")
            else:
                np.take(rows, sel, axis=0, out=stage[:n])
                yield layer, kind, p0, n, memoryview(stage[:n]).cast("B")

    def _staged_cuda(self, runs):
        dev = self.device
        pb = self.layout.page_bytes
        cap = max(r[3] for r in runs) if runs else 0
        idx = self.block_ids.to(dev, non_blocking=True)
        stream = torch.cuda.Stream(device=dev)
        stream.wait_stream(torch.cuda.current_stream(dev))  # KV written by the engine's stream is complete
        dev_stage = [torch.empty((cap, pb), dtype=torch.uint8, device=dev) for _ in range(2)]
        host_stage = [torch.empty((cap, pb), dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        done = [torch.cuda.Event() for _ in range(2)]

        def launch(i: int) -> None:
            layer, kind, p0, n = runs[i]
            s = i % 2
            with torch.cuda.stream(stream):
                torch.index_select(_page_rows(self._cache(layer, kind)), 0, idx[p0:p0 + n], out=dev_stage[s][:n])
                host_stage[s][:n].copy_(dev_stage[s][:n], non_blocking=True)
                done[s].record(stream)

        if runs:
            launch(0)
        for i, (layer, kind, p0, n) in enumerate(runs):
            if i + 1 < len(runs):
                launch(i + 1)  # device gather + D2H of the next run overlaps the send of this one
            done[i % 2].synchronize()
            yield layer, kind, p0, n, _as_bytes(host_stage[i % 2][:n])
        # launch(i + 2) reuses slot i % 2 only after the consumer asked for run i + 1: the view is no longer read


class ShardSink:
    """One TP rank's reserved pages on decode; chunks land in ``buffer()`` and go to the pages in ``commit()``."""

    def __init__(self, kv, block_ids: Sequence[int], layout: KVLayout) -> None:
        assert layout_of(kv, layout.tp_rank, layout.tp_size) == layout, "layout does not describe this cache"
        self.kv, self.layout = kv, layout
        self.block_ids = torch.tensor(list(block_ids), dtype=torch.int64)
        self.device = kv.k[0].device
        self._direct = False
        self._slot = 0
        self._host: list[torch.Tensor] = []
        self._stage = None
        if self.device.type == "cuda":
            self._stream = torch.cuda.Stream(device=self.device)
            self._idx = self.block_ids.to(self.device)
            self._dev: list[torch.Tensor] = []
            self._events = [torch.cuda.Event(), torch.cuda.Event()]
            self._used = [False, False]

    def _cache(self, layer: int, kind: int) -> torch.Tensor:
        return self.kv.k[layer] if kind == 0 else self.kv.v[layer]

    def check_capacity(self, num_pages: int) -> None:
        if num_pages > self.block_ids.numel():
            raise WireError("mismatch", f"prefill sends {num_pages} pages, decode reserved {self.block_ids.numel()}")

    def buffer(self, layer: int, kind: int, p0: int, n: int) -> memoryview:
        """Where the next chunk's ``n`` pages are received (valid until the next call)."""
        pb = self.layout.page_bytes
        if self.device.type == "cuda":
            return self._cuda_buffer(n, pb)
        rows = _page_rows(self._cache(layer, kind)).numpy()
        sel = self.block_ids.numpy()[p0:p0 + n]
        self._direct = _is_consecutive(sel)
        if self._direct:  # contiguous destination pages: receive straight into the cache
            return memoryview(rows[sel[0]:sel[0] + n]).cast("B")
        if self._stage is None or self._stage.shape[0] < n:
            self._stage = np.empty((max(n, wire.chunk_pages_for(pb)), pb), dtype=np.uint8)
        return memoryview(self._stage[:n]).cast("B")

    def commit(self, layer: int, kind: int, p0: int, n: int) -> None:
        """The chunk received into the last ``buffer()`` is verified: scatter it into its pages."""
        if self.device.type == "cuda":
            self._cuda_commit(layer, kind, p0, n)
        elif not self._direct:
            rows = _page_rows(self._cache(layer, kind)).numpy()
            rows[self.block_ids.numpy()[p0:p0 + n]] = self._stage[:n]

    def finish(self) -> None:
        if self.device.type == "cuda":
            self._stream.synchronize()

    # CUDA: pinned slot s -> device slot s (H2D) -> index_copy_ into the pages, on a side stream
    def _cuda_buffer(self, n: int, pb: int) -> memoryview:
        if not self._host or self._host[0].shape[0] < n:
            cap = max(n, wire.chunk_pages_for(pb))
            self._stream.synchronize()
            self._host = [torch.empty((cap, pb), dtype=torch.uint8, pin_memory=True) for _ in range(2)]
            self._dev = [torch.empty((cap, pb), dtype=torch.uint8, device=self.device) for _ in range(2)]
            self._used = [False, False]
        s = self._slot
        if self._used[s]:
            self._events[s].synchronize()  # the H2D copy out of this pinned slot has finished
        return _as_bytes(self._host[s][:n])

    def _cuda_commit(self, layer: int, kind: int, p0: int, n: int) -> None:
        s = self._slot
        with torch.cuda.stream(self._stream):
            self._dev[s][:n].copy_(self._host[s][:n], non_blocking=True)
            _page_rows(self._cache(layer, kind)).index_copy_(0, self._idx[p0:p0 + n], self._dev[s][:n])
            self._events[s].record(self._stream)
        self._used[s] = True
        self._slot = 1 - s


# ---- connection ---------------------------------------------------------------------------------

class KVConn:
    """One KV-transfer connection for asyncio callers: blocking I/O runs on the transfer thread pool,
    waiting for the peer awaits readability. ``close()`` (idempotent, loop thread) wakes every waiter."""

    def __init__(self, sock: socket.socket, timeout_s: float = IO_TIMEOUT_S) -> None:
        self.fs = FrameSocket(sock, timeout_s)
        self.stats = TransferStats()
        self._waiter: tuple[asyncio.AbstractEventLoop, asyncio.Future, int] | None = None
        self._lock = threading.Lock()

    @property
    def closed(self) -> bool:
        return self.fs.closed

    def close(self) -> None:
        with self._lock:
            waiter, self._waiter = self._waiter, None
        if waiter is not None:
            loop, fut, fd = waiter
            if _in_loop(loop):
                loop.remove_reader(fd)
                if not fut.done():
                    fut.set_result(None)
            else:
                loop.call_soon_threadsafe(self.close)
                return
        self.fs.close()

    async def run(self, fn: Callable, *args):
        """Run blocking ``fn(*args)`` on the transfer pool."""
        if self.closed:
            raise WireError("closed", "connection already closed")
        return await asyncio.get_running_loop().run_in_executor(_EXECUTOR, fn, *args)

    async def wait_readable(self, timeout_s: float | None = None) -> None:
        """Until the peer sent something (or closed); holds no thread. WireError('closed'/'timeout')."""
        if self.closed:
            raise WireError("closed", "connection already closed")
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        fd = self.fs.sock.fileno()

        def ready() -> None:
            if not fut.done():
                fut.set_result(None)

        loop.add_reader(fd, ready)
        with self._lock:
            self._waiter = (loop, fut, fd)
        try:
            await asyncio.wait_for(fut, timeout_s)
        except asyncio.TimeoutError:
            raise WireError("timeout", f"peer sent nothing within {timeout_s}s") from None
        finally:
            with self._lock:
                mine = self._waiter is not None and self._waiter[1] is fut
                if mine:
                    self._waiter = None
            if mine:
                loop.remove_reader(fd)
        if self.closed:
            raise WireError("closed", "connection closed locally")


def _in_loop(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


class BootstrapServer:
    """Prefill's bootstrap listener: one ``handler(KVConn)`` task per accepted connection."""

    def __init__(self, sock: socket.socket, task: asyncio.Task) -> None:
        self.sock, self._task = sock, task
        self.port = sock.getsockname()[1]

    @classmethod
    async def start(cls, host: str, port: int, handler: Callable[[KVConn], Awaitable[None]]) -> "BootstrapServer":
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        lsock = socket.socket(family, socket.SOCK_STREAM)
        lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        lsock.bind((host, port))
        lsock.listen(512)
        lsock.setblocking(False)
        loop = asyncio.get_running_loop()
        tasks: set[asyncio.Task] = set()

        async def accept_loop() -> None:
            while True:
                try:
                    sock, _ = await loop.sock_accept(lsock)
                except OSError:
                    if lsock.fileno() < 0:
                        return
                    await asyncio.sleep(0.05)  # EMFILE and friends: back off instead of spinning
                    continue
                conn = KVConn(sock)
                t = loop.create_task(handler(conn))
                tasks.add(t)
                t.add_done_callback(tasks.discard)

        return cls(lsock, loop.create_task(accept_loop()))

    def close(self) -> None:
        self._task.cancel()
        self.sock.close()


# ---- prefill side -------------------------------------------------------------------------------

def _server_handshake(fs: FrameSocket, token: str | None) -> Attach:
    nonce = secrets.token_hex(16)
    fs.send_all(wire.PREAMBLE + wire.encode_control(FrameType.CHALLENGE, {"nonce": nonce}))
    fs.read_preamble()
    msg = fs.read_control(FrameType.ATTACH)
    att = Attach.from_json(msg)
    mac = msg.get("mac")
    if token and not mac:
        raise WireError("auth", f"unauthenticated KV pull for room {att.room}: no credentials were presented")
    if not wire.verify_mac(token, nonce, att.room, mac):
        raise WireError("auth", f"bad KV-transfer credentials for room {att.room}")
    return att


async def accept_attach(conn: KVConn, token: str | None) -> Attach:
    """Server half of the handshake (bounded by CONNECT_TIMEOUT_S per frame). WireError on auth/protocol."""
    conn.fs.sock.settimeout(CONNECT_TIMEOUT_S)
    try:
        return await conn.run(_server_handshake, conn.fs, token)
    finally:
        if not conn.closed:
            conn.fs.sock.settimeout(IO_TIMEOUT_S)


def _send_error(fs: FrameSocket, reason: str, message: str) -> None:
    try:
        fs.sock.settimeout(1.0)
        fs.send_control(FrameType.ERROR, {"reason": reason, "message": message[:2000]})
        fs.sock.shutdown(socket.SHUT_WR)  # FIN after the ERROR: the peer reads it before seeing EOF
    except (WireError, OSError):
        pass


async def send_error(conn: KVConn, reason: str, message: str) -> None:
    """Best effort: tell the peer why (ERROR frame), then close."""
    if not conn.closed:
        try:
            await conn.run(_send_error, conn.fs, reason, message)
        except WireError:
            pass
    conn.close()


def _peer_reason(fs: FrameSocket, exc: WireError) -> WireError:
    """After a send failed, the peer may have said why (ERROR frame) before closing: prefer its reason."""
    if fs.closed:
        return exc
    try:
        fs.sock.settimeout(0.5)
        while True:
            ftype, length = fs.read_frame_head(wire.MAX_FRAME_BYTES)
            payload = fs.recv_exact(min(length, wire.MAX_CONTROL_BYTES)) if ftype is FrameType.ERROR else None
            if ftype is FrameType.ERROR:
                return wire.peer_error(payload)
            fs.recv_exact(length)
    except (WireError, OSError):
        return exc


def _send_body(fs: FrameSocket, header: KVHeader, sources: Sequence[ShardSource], stats: TransferStats,
               corrupt_first_chunk: bool) -> None:
    fs.send_control(FrameType.HEADER, wire.header_to_json(header))
    fs.read_control(FrameType.READY)  # decode refuses a layout it cannot take with ERROR (mismatch)
    stats.start()
    try:
        for si, src in enumerate(sources):
            pb = src.layout.page_bytes
            per_chunk = wire.chunk_pages_for(pb)
            for layer, kind, p0, n, view in src.staged(header.num_pages):
                for off in range(0, n, per_chunk):
                    cnt = min(per_chunk, n - off)
                    part = view[off * pb:(off + cnt) * pb]
                    head = ChunkHead(si, layer, kind, p0 + off, cnt, zlib.crc32(part))
                    if corrupt_first_chunk:  # fault injection: one flipped byte "in flight", after the checksum
                        bad = bytearray(part)
                        bad[len(bad) // 2] ^= 0xFF
                        part, corrupt_first_chunk = memoryview(bad), False
                    fs.send_chunk(head, part)
                    stats.bytes += len(part)
                    stats.chunks += 1
        fs.send_control(FrameType.END, {"bytes": stats.bytes, "chunks": stats.chunks})
    except WireError as exc:
        raise _peer_reason(fs, exc) from None


async def send_kv(conn: KVConn, header: KVHeader, sources: Sequence[ShardSource], *,
                  corrupt_first_chunk: bool = False) -> TransferStats:
    """HEADER, wait for READY, every chunk, END, then the ACK. Returns ``conn.stats`` (live during the call).

    Raises WireError: the peer's own reason when it refused (mismatch, checksum, ...), else closed/timeout.
    The caller's watchdog bounds the whole call (it closes ``conn``)."""
    if len(header.shards) != len(sources):
        raise ValueError(f"{len(sources)} shard sources for a header of {len(header.shards)} shards")
    stats = conn.stats
    await conn.run(_send_body, conn.fs, header, sources, stats, corrupt_first_chunk)
    await conn.wait_readable()  # decode verifies; no thread held meanwhile
    ack = await conn.run(conn.fs.read_control, FrameType.ACK)
    stats.finish()
    if ack.get("room") != header.room:
        raise WireError("mismatch", f"ACK for room {ack.get('room')!r} on the connection of room {header.room}")
    return stats


# ---- decode side --------------------------------------------------------------------------------

def _client_handshake(fs: FrameSocket, token: str | None, att: Attach) -> None:
    fs.read_preamble()
    challenge = fs.read_control(FrameType.CHALLENGE)
    mac = wire.attach_mac(token, str(challenge.get("nonce", "")), att.room)
    fs.send_all(wire.PREAMBLE + wire.encode_control(FrameType.ATTACH, att.to_json(mac)))


async def open_attach(host: str, port: int, token: str | None, att: Attach) -> KVConn:
    """Connect to a prefill bootstrap port and attach to ``att.room`` (bounded by CONNECT_TIMEOUT_S)."""
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        family, _, _, _, addr = infos[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
    except OSError as exc:
        raise WireError("closed", f"cannot resolve prefill bootstrap address {host}:{port}: {exc}") from None
    sock.setblocking(False)
    try:
        await asyncio.wait_for(loop.sock_connect(sock, addr), CONNECT_TIMEOUT_S)
    except (OSError, asyncio.TimeoutError) as exc:
        sock.close()
        raise WireError("closed", f"cannot connect to prefill bootstrap {host}:{port}: {type(exc).__name__}") from None
    conn = KVConn(sock, CONNECT_TIMEOUT_S)
    try:
        await conn.run(_client_handshake, conn.fs, token, att)
    except BaseException:
        conn.close()
        raise
    conn.fs.sock.settimeout(IO_TIMEOUT_S)
    return conn


async def recv_header(conn: KVConn, timeout_s: float | None = None) -> KVHeader:
    """Wait (holding no thread) for prefill's HEADER, i.e. its KV is ready. A peer ERROR raises its reason."""
    await conn.wait_readable(timeout_s)
    return await conn.run(lambda: wire.header_from_json(conn.fs.read_control(FrameType.HEADER)))


def check_header(h: KVHeader, att: Attach, expected: Sequence[KVLayout], model_sha256: str) -> None:
    """Decode-side verification of a HEADER; raises WireError('mismatch') naming the field and both values."""
    if h.room != att.room:
        raise WireError("mismatch", f"HEADER is for room {h.room}, decode attached to room {att.room}")
    if h.num_tokens != att.num_tokens:
        raise WireError("mismatch", f"prefill sends KV for {h.num_tokens} tokens, decode tokenized {att.num_tokens}")
    if h.prompt_crc != att.prompt_crc:
        raise WireError("mismatch", "prompt token checksum differs between prefill and decode")
    if len(h.shards) != len(expected):
        raise WireError("mismatch", f"prefill sends {len(h.shards)} TP shards, decode expects {len(expected)}")
    for got, want in zip(h.shards, expected):
        msg = wire.layout_mismatch(want, got)
        if msg:
            raise WireError("mismatch", msg)
    if model_sha256 and h.model_sha256 and h.model_sha256 != model_sha256:
        raise WireError("mismatch", f"prefill and decode run different model weights (sha256 "
                                    f"{h.model_sha256[:12]} vs {model_sha256[:12]})")


def _recv_body(fs: FrameSocket, header: KVHeader, sinks: Sequence[ShardSink], stats: TransferStats) -> None:
    fs.send_control(FrameType.READY, {"room": header.room})
    stats.start()
    P = header.num_pages
    index = 0
    for si, (layout, sink) in enumerate(zip(header.shards, sinks)):
        pb = layout.page_bytes
        sink.check_capacity(P)
        for layer in range(layout.num_layers):
            for kind in (0, 1):
                p = 0
                while p < P:
                    ftype, length = fs.read_frame_head(wire.MAX_FRAME_BYTES)
                    if ftype is FrameType.ERROR:
                        raise wire.peer_error(fs.recv_exact(min(length, wire.MAX_CONTROL_BYTES)))
                    if ftype is not FrameType.CHUNK:
                        raise WireError("protocol", f"expected CHUNK {index}, got {ftype.name}")
                    if length < ChunkHead.SIZE:
                        raise WireError("protocol", f"CHUNK {index} of {length} bytes is shorter than its head")
                    head = ChunkHead.unpack(fs.recv_exact(ChunkHead.SIZE, "reading a chunk head"))
                    where = (head.shard, head.layer, head.kind, head.page_start)
                    if where != (si, layer, kind, p) or not 1 <= head.page_count <= P - p \
                            or length - ChunkHead.SIZE != head.page_count * pb:
                        raise WireError("protocol", f"CHUNK {index} (shard {head.shard} layer {head.layer} kind "
                                        f"{head.kind} pages {head.page_start}+{head.page_count}, {length} bytes) is not "
                                        f"the expected shard {si} layer {layer} kind {kind} from page {p}")
                    buf = sink.buffer(layer, kind, p, head.page_count)
                    fs.recv_exact_into(buf, f"receiving CHUNK {index}")
                    crc = zlib.crc32(buf)
                    if crc != head.crc:
                        raise WireError("checksum", f"CHUNK {index} (shard {si} layer {layer} {'KV'[kind]} pages "
                                        f"{p}..{p + head.page_count - 1}) checksum {crc:#010x} != sender's {head.crc:#010x}")
                    sink.commit(layer, kind, p, head.page_count)
                    stats.bytes += len(buf)
                    stats.chunks += 1
                    index += 1
                    p += head.page_count
    end = fs.read_control(FrameType.END)
    if end.get("bytes") != stats.bytes or stats.bytes != header.total_bytes:
        raise WireError("protocol", f"END reports {end.get('bytes')!r} bytes; received {stats.bytes}, header promised "
                                    f"{header.total_bytes}")
    for sink in sinks:
        sink.finish()
    fs.send_control(FrameType.ACK, {"room": header.room})
    stats.finish()


async def recv_kv(conn: KVConn, header: KVHeader, sinks: Sequence[ShardSink]) -> TransferStats:
    """READY, every chunk (order, size and crc32 verified, scattered into the sinks' pages), END, ACK."""
    if len(sinks) != len(header.shards):
        raise ValueError(f"{len(sinks)} sinks for a header of {len(header.shards)} shards")
    await conn.run(_recv_body, conn.fs, header, sinks, conn.stats)
    return conn.stats
