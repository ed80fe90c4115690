"""Both ends of one KV transfer over the wire format in :mod:`wire`, from and into paged KV memory.

The bulk phase runs on a transfer thread pool with blocking sockets: ``sendmsg`` of memoryviews over
the pages (or a staging buffer) and ``recvmsg_into`` the destination pages (or a pinned slot), so the
event loop never copies KV bytes. Waiting for the peer (decode waiting for prefill's KV, prefill
waiting for the ACK) holds no thread: it awaits socket readability. How pages become bytes, per
device, is :mod:`kv_staging` (re-exported here: ``ShardSource``, ``ShardSink``, ``layout_of``).

Prefill side (bootstrap server)::

    server = await BootstrapServer.start(host, port, handler)        # handler(conn: KVConn) coroutine
    att = await accept_attach(conn, token)                            # WireError: auth / protocol
    # refuse wire.tp_mismatch(my_tp_size, att.tp_size) here, before any prefill work
    skip, why = wire.delta_skip_pages(att, page_size, my_cache_namespace)       # decode's held prefix, or 0
    header = replace(make_header(room, rid, num_tokens, first_token_id, prompt_crc, model_sha256, [layout...]),
                     skip_pages=skip, cached_tokens=...)                # dataclasses.replace
    stats = await send_kv(conn, header, [ShardSource(kv, block_ids[skip:header.num_pages], layout), ...])

Decode side::

    conn = await open_attach(host, port, token, Attach(room, rid, n, prompt_crc, tp_size, tp_ranks, held_tokens=h,
                                                       cache_namespace=ns))
    header = await recv_header(conn)                                  # prefill's KV is ready
    check_header(header, att, [my_layout...], model_sha256)           # WireError('mismatch') naming both values
    # header.skip_pages is h // page_size (the delta) or 0 (a full transfer: give the shared pages up first)
    stats = await recv_kv(conn, header, [ShardSink(kv, block_ids[header.skip_pages:header.num_pages], layout), ...])
    # on any WireError: await send_error(conn, exc.reason, exc.message) (prefill fails with that message)

Every failure is a WireError; ``conn.close()`` from the event loop (a watchdog) wakes any blocked step.
"""

from __future__ import annotations

import asyncio
import secrets
import socket
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Awaitable, Callable, Sequence

from pdruntime.disagg import wire
from pdruntime.disagg.kv_staging import ShardSink, ShardSource, layout_of
from pdruntime.disagg.wire import Attach, ChunkHead, FrameSocket, FrameType, KVHeader, KVLayout, WireError
from pdruntime.util.aio import within

CONNECT_TIMEOUT_S = 5.0  # seconds for TCP connect + each handshake frame (decode side)
HANDSHAKE_DEADLINE_S = 5.0  # seconds, absolute, from accept to a verified ATTACH (prefill side; not per byte)
MAX_PENDING_PER_PEER = 64  # unauthenticated handshakes one address may hold; beyond it its oldest is evicted
MAX_PENDING = 1024  # unauthenticated handshakes of all peers together; beyond it the largest holder's oldest goes
IO_TIMEOUT_S = 30.0  # seconds without progress in one send/recv of the bulk phase (watchdogs cut sooner)
MAX_TRANSFER_THREADS = 32  # concurrent bulk phases per process (waiting for a peer holds no thread)

_EXECUTOR = ThreadPoolExecutor(max_workers=MAX_TRANSFER_THREADS, thread_name_prefix="pdkv")

__all__ = ["Attach", "BootstrapServer", "KVConn", "LogLimiter", "PendingHandshakes", "ShardSink", "ShardSource",
           "TransferStats", "accept_attach", "check_header", "layout_of", "make_header", "open_attach", "recv_header",
           "recv_kv", "send_error", "send_kv", "send_progress"]


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


# ---- header --------------------------------------------------------------------------------------

def make_header(room: int, rid: str, num_tokens: int, first_token_id: int, prompt_crc: int, model_sha256: str,
                shards: Sequence[KVLayout], checksums: Sequence[str] = ("crc32",)) -> KVHeader:
    """The HEADER of a full transfer for a request; ``checksums`` is what decode offered (``Attach.checksums``).
    The delta is ``dataclasses.replace(header, skip_pages=..., cached_tokens=...)``."""
    page = shards[0].page_size
    return KVHeader(room=room, rid=rid, num_tokens=num_tokens, num_pages=-(-num_tokens // page),
                    first_token_id=int(first_token_id), prompt_crc=prompt_crc, model_sha256=model_sha256,
                    chunk_bytes=wire.chunk_pages_for(shards[0].page_bytes) * shards[0].page_bytes, shards=tuple(shards),
                    checksum=wire.pick_checksum(checksums))


# ---- connection ---------------------------------------------------------------------------------

class KVConn:
    """One KV-transfer connection for asyncio callers: blocking I/O runs on the transfer thread pool,
    waiting for the peer awaits readability. ``close()`` (idempotent, loop thread) wakes every waiter."""

    def __init__(self, sock: socket.socket, timeout_s: float = IO_TIMEOUT_S) -> None:
        self.fs = FrameSocket(sock, timeout_s)
        self.stats = TransferStats()
        self.attach: Attach | None = None  # what the peer attached with (prefill side, after accept_attach)
        self.peer = ""  # the peer's address (prefill side): unauthenticated handshakes are capped per peer
        self._handshake: asyncio.Timeout | None = None  # the deadline of a handshake in progress (prefill side)
        self._evicted = ""  # why the handshake was cut short, if it was
        self._io: Future | None = None  # the blocking step running on the transfer pool, if any
        self.kv_sending = False  # prefill side: send_kv began; a PROGRESS report from now on is dropped
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

    @property
    def pending(self) -> bool:
        """Accepted, not yet authenticated, not closed (prefill side)."""
        return self.attach is None and not self.closed

    def evict(self, why: str) -> None:
        """End a pending handshake now (loop thread): accept_attach raises WireError('timeout', why)."""
        if self._handshake is not None and self.pending and not self._evicted:
            self._evicted = why
            self._handshake.reschedule(asyncio.get_running_loop().time())

    async def run(self, fn: Callable, *args):
        """Run blocking ``fn(*args)`` on the transfer pool. Cancelling the caller does not stop the thread:
        ``close()`` does (the blocked socket call fails), and ``after_io()`` runs once it has."""
        if self.closed:
            raise WireError("closed", "connection already closed")
        self._io = _EXECUTOR.submit(fn, *args)
        return await asyncio.wrap_future(self._io)

    def after_io(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` on the event loop once no blocking step of this connection is running (now, if
        none is). Free a request's pages this way: a receive still in flight writes into them."""
        io = self._io
        if io is None or io.done():
            callback()
            return
        loop = asyncio.get_running_loop()
        io.add_done_callback(lambda _f: loop.call_soon_threadsafe(callback))

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
            await within(fut, timeout_s)
        except asyncio.TimeoutError:
            raise WireError("timeout", f"peer sent nothing within {timeout_s}s") from None
        finally:
            with self._lock:
                mine = self._waiter is not None and self._waiter[1] is fut
                if mine:
                    self._waiter = None
            if mine:
                loop.remove_reader(fd)
                self._blocking_again()
        if self.closed:
            raise WireError("closed", "connection closed locally")

    def _blocking_again(self) -> None:
        """Watching the fd may have made it non-blocking behind the socket object's back (uvloop's libuv does, and
        leaves it so): the transfer thread's I/O then failed at once with EAGAIN, read as "peer stalled". The
        bulk phase needs a blocking socket (bounded by SO_RCVTIMEO/SO_SNDTIMEO)."""
        try:
            self.fs.sock.setblocking(True)
        except OSError:  # closed meanwhile: the caller's next step reports it
            pass


def _in_loop(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


class PendingHandshakes:
    """Unauthenticated connections by peer, oldest first, bounded per peer and in total.

    A flood of silent or dripping connections evicts its own oldest members: it never holds a transfer
    thread (the handshake runs on the event loop) and never pushes out a peer that authenticates in time.
    ``admit(conn)`` -> the connections to evict (callers ``evict()`` them). Pure apart from its own queues."""

    def __init__(self, per_peer: int = MAX_PENDING_PER_PEER, total: int = MAX_PENDING) -> None:
        if not 1 <= per_peer <= total:
            raise ValueError(f"accepted: 1 <= per_peer <= total (got {per_peer}, {total})")
        self.per_peer, self.total = per_peer, total
        self._by_peer: dict[str, list[KVConn]] = {}

    def _pending(self, peer: str) -> list[KVConn]:
        live = [c for c in self._by_peer.get(peer, ()) if c.pending]
        if live:
            self._by_peer[peer] = live
        else:
            self._by_peer.pop(peer, None)
        return live

    def count(self) -> int:
        return sum(len(self._pending(p)) for p in list(self._by_peer))

    def admit(self, conn: KVConn) -> list[tuple[KVConn, str]]:
        mine = self._pending(conn.peer)
        mine.append(conn)
        self._by_peer[conn.peer] = mine
        out = [(c, f"peer {conn.peer} holds more than {self.per_peer} unauthenticated KV connections")
               for c in mine[:-self.per_peer]]
        del mine[:-self.per_peer]
        over = self.count() - self.total
        while over > 0:
            peer = max(self._by_peer, key=lambda p: len(self._by_peer[p]))
            out.append((self._by_peer[peer].pop(0), f"more than {self.total} unauthenticated KV connections"))
            over -= 1
        return out


class BootstrapServer:
    """Prefill's bootstrap listener: one ``handler(KVConn)`` task per accepted connection; the handler's
    ``accept_attach`` is bounded by HANDSHAKE_DEADLINE_S and by :class:`PendingHandshakes`."""

    def __init__(self, sock: socket.socket, task: asyncio.Task, pending: PendingHandshakes) -> None:
        self.sock, self._task, self.pending = sock, task, pending
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
        pending = PendingHandshakes()

        async def accept_loop() -> None:
            while True:
                try:
                    sock, addr = await loop.sock_accept(lsock)
                except OSError:
                    if lsock.fileno() < 0:
                        return
                    await asyncio.sleep(0.05)  # EMFILE and friends: back off instead of spinning
                    continue
                conn = KVConn(sock)
                conn.peer = str(addr[0])
                t = loop.create_task(handler(conn))
                tasks.add(t)
                t.add_done_callback(tasks.discard)
                for victim, why in pending.admit(conn):
                    victim.evict(why)

        return cls(lsock, loop.create_task(accept_loop()), pending)

    def close(self) -> None:
        self._task.cancel()
        self.sock.close()


# ---- prefill side -------------------------------------------------------------------------------

async def _recv_exactly(loop: asyncio.AbstractEventLoop, sock: socket.socket, n: int, what: str) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        piece = await loop.sock_recv(sock, n - len(buf))
        if not piece:
            raise WireError("closed", f"peer closed the connection while {what} ({len(buf)} of {n} bytes)")
        buf += piece
    return bytes(buf)


async def _server_handshake(conn: KVConn, token: str | None) -> Attach:
    """CHALLENGE out, PREAMBLE + ATTACH in, MAC verified: on the event loop, so no thread is held for a
    peer that has not authenticated. The caller bounds the whole exchange."""
    loop, sock = asyncio.get_running_loop(), conn.fs.sock
    nonce = secrets.token_hex(16)
    await loop.sock_sendall(sock, wire.PREAMBLE + wire.encode_control(FrameType.CHALLENGE, {"nonce": nonce}))
    wire.check_preamble(await _recv_exactly(loop, sock, len(wire.PREAMBLE), "reading the preamble"))
    ftype, length = wire.decode_frame_head(await _recv_exactly(loop, sock, wire.FRAME_HEAD_SIZE, "reading ATTACH"),
                                           wire.MAX_CONTROL_BYTES)
    msg = wire.expect_control(FrameType.ATTACH, ftype, await _recv_exactly(loop, sock, length, "reading ATTACH"))
    att = Attach.from_json(msg)
    mac = msg.get("mac")
    if token and not mac:
        raise WireError("auth", f"unauthenticated KV pull for room {att.room}: no credentials were presented")
    if not wire.verify_mac(token, nonce, att.room, mac):
        raise WireError("auth", f"bad KV-transfer credentials for room {att.room}")
    return att


async def accept_attach(conn: KVConn, token: str | None, deadline_s: float = HANDSHAKE_DEADLINE_S) -> Attach:
    """Server half of the handshake, within ``deadline_s`` in all (a peer dripping bytes gains nothing), holding
    no thread. WireError on auth/protocol, 'timeout' past the deadline or when evicted by a flood."""
    sock = conn.fs.sock
    sock.setblocking(False)
    try:
        async with asyncio.timeout(deadline_s) as tm:
            conn._handshake = tm
            conn.attach = await _server_handshake(conn, token)
        return conn.attach
    except TimeoutError:
        raise WireError("timeout", conn._evicted or f"no verified ATTACH within the {deadline_s:g}s handshake "
                                                      "deadline") from None
    except OSError as exc:
        raise WireError("closed", f"connection lost during the handshake: {type(exc).__name__}") from None
    finally:
        conn._handshake = None
        if conn.attach is not None and not conn.closed:
            conn.fs.set_timeout(IO_TIMEOUT_S)  # back to blocking, kernel-bounded I/O for the transfer thread


def _send_error(fs: FrameSocket, reason: str, message: str) -> None:
    try:
        fs.set_timeout(1.0)
        fs.send_control(FrameType.ERROR, {"reason": reason, "message": message[:2000]})
        fs.sock.shutdown(socket.SHUT_WR)  # FIN after the ERROR: the peer reads it before seeing EOF
    except (WireError, OSError):
        pass


def _send_error_nowait(conn: KVConn, reason: str, message: str) -> None:
    """To a peer that never authenticated: one non-blocking send (no thread, no wait), then close."""
    try:
        conn.fs.sock.setblocking(False)
        conn.fs.sock.send(wire.encode_control(FrameType.ERROR, {"reason": reason, "message": message[:2000]}))
        conn.fs.sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass


async def send_error(conn: KVConn, reason: str, message: str) -> None:
    """Best effort: tell the peer why (ERROR frame), then close."""
    if conn.attach is None and not conn.closed and conn.peer:
        _send_error_nowait(conn, reason, message)
    elif not conn.closed:
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
        fs.set_timeout(0.5)
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
            per_chunk = wire.chunk_pages_for(src.layout.page_bytes)
            for layer, kind, p0, n, bufs in src.chunks(header.sent_pages, per_chunk):
                # fault injection: one byte flipped "in flight", after the digest saw it
                stats.bytes += fs.send_chunk(wire.chunk_head_bytes(si, layer, kind, p0, n), bufs, header.checksum,
                                             corrupt_first_chunk)
                corrupt_first_chunk = False
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
    conn.kv_sending = True
    if conn._io is not None and not conn._io.done():  # a PROGRESS frame still being written: never interleave
        await asyncio.wrap_future(conn._io)
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
        await within(loop.sock_connect(sock, addr), CONNECT_TIMEOUT_S)
    except (OSError, asyncio.TimeoutError) as exc:
        sock.close()
        raise WireError("closed", f"cannot connect to prefill bootstrap {host}:{port}: {type(exc).__name__}") from None
    conn = KVConn(sock, CONNECT_TIMEOUT_S)
    try:
        await conn.run(_client_handshake, conn.fs, token, att)
    except BaseException:
        conn.close()
        raise
    conn.fs.set_timeout(IO_TIMEOUT_S)
    return conn


async def recv_header(conn: KVConn, timeout_s: float | None = None,
                      on_progress: Callable[[dict], None] | None = None) -> KVHeader:
    """Wait (holding no thread) for prefill's HEADER, i.e. its KV is ready; PROGRESS frames before it go to
    ``on_progress``. A peer ERROR raises its reason."""
    while True:
        await conn.wait_readable(timeout_s)
        ftype, payload = await conn.run(conn.fs.read_frame, wire.MAX_CONTROL_BYTES)
        if ftype is FrameType.PROGRESS:
            if on_progress is not None:
                on_progress(wire.parse_json(payload))
            continue
        return wire.header_from_json(wire.expect_control(FrameType.HEADER, ftype, payload))


async def send_progress(conn: KVConn, tokens: int, steps: int) -> None:
    """Prefill: one PROGRESS frame, before the HEADER only: :func:`send_kv` waits for one in flight, and one that
    comes after it began (a report scheduled as the KV became ready) is dropped, never written between its frames
    (checked and submitted with no ``await`` between)."""
    if conn.kv_sending:
        return
    await conn.run(conn.fs.send_control, FrameType.PROGRESS, {"tokens": int(tokens), "steps": int(steps)})


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
    held_pages = att.held_tokens // h.shards[0].page_size
    if h.skip_pages not in (0, held_pages):  # 0 is the full-transfer fallback; anything else would leave a hole
        raise WireError("mismatch", f"prefill leaves out {h.skip_pages} leading pages, decode holds {held_pages}; "
                                    f"accepted: {held_pages} (the delta) or 0 (a full transfer)")


def _recv_body(fs: FrameSocket, header: KVHeader, sinks: Sequence[ShardSink], stats: TransferStats) -> None:
    try:
        _recv_chunks(fs, header, sinks, stats)
    finally:  # on this thread: nothing receives into a staging buffer once it is back in the pool
        for sink in sinks:
            sink.release()


def _next_chunk_pages(fs: FrameSocket, index: int, page_bytes: int, left: int) -> int:
    """Read the next frame head; it must be CHUNK ``index`` carrying 1..``left`` whole pages. -> its page count.
    A peer ERROR raises its reason."""
    ftype, length = fs.read_frame_head(wire.MAX_FRAME_BYTES)
    if ftype is FrameType.ERROR:
        raise wire.peer_error(fs.recv_exact(min(length, wire.MAX_CONTROL_BYTES)))
    if ftype is not FrameType.CHUNK:
        raise WireError("protocol", f"expected CHUNK {index}, got {ftype.name}")
    n = wire.chunk_pages_in(length, page_bytes)
    if n is None or n > left:
        raise WireError("protocol", f"CHUNK {index} of {length} bytes is not a head, 1 to {left} pages of "
                                    f"{page_bytes} bytes and a digest")
    return n


def _recv_chunks(fs: FrameSocket, header: KVHeader, sinks: Sequence[ShardSink], stats: TransferStats) -> None:
    fs.send_control(FrameType.READY, {"room": header.room})
    stats.start()
    P = header.sent_pages  # the sinks hold exactly the pages sent (after decode's held ones)
    index, total_bytes = 0, header.total_bytes
    for si, (layout, sink) in enumerate(zip(header.shards, sinks)):
        pb = layout.page_bytes
        sink.check_capacity(P)
        total = 2 * layout.num_layers * P  # pages of this shard in wire order: layer, K then V, page
        u = 0
        while u < total:
            lk, p = divmod(u, P)
            layer, kind = lk // 2, lk % 2
            n = _next_chunk_pages(fs, index, pb, total - u)
            # the frame length says how many pages, and wire order where they go: they land in place before the
            # chunk head is checked (a wrong head or digest fails the request, whose pages are its own)
            bufs = sink.buffers(layer, kind, p, n, P)
            more = total_bytes - stats.bytes - n * pb  # page bytes still to come after this chunk
            head, digest, sent = fs.recv_chunk(bufs, header.checksum, f"receiving CHUNK {index}", more)
            if head != wire.chunk_head_bytes(si, layer, kind, p, n):
                got = ChunkHead.unpack(head)
                raise WireError("protocol", f"CHUNK {index} (shard {got.shard} layer {got.layer} kind {got.kind} "
                                f"pages {got.page_start}+{got.page_count}) is not the expected shard {si} layer "
                                f"{layer} kind {kind} pages {p}+{n}")
            if digest != sent:
                raise WireError("checksum", f"CHUNK {index} (shard {si} from layer {layer} {'KV'[kind]} page {p}, "
                                f"{n} pages) {header.checksum} {digest:#x} != sender's {sent:#x}")
            sink.commit(layer, kind, p, n, P)
            stats.bytes += n * pb
            stats.chunks += 1
            index += 1
            u += n
    end = fs.read_control(FrameType.END)
    if end.get("bytes") != stats.bytes or stats.bytes != total_bytes:
        raise WireError("protocol", f"END reports {end.get('bytes')!r} bytes; received {stats.bytes}, header promised "
                                    f"{header.total_bytes}")
    for sink in sinks:
        sink.finish()
    fs.send_control(FrameType.ACK, {"room": header.room})
    stats.finish()


async def recv_kv(conn: KVConn, header: KVHeader, sinks: Sequence[ShardSink]) -> TransferStats:
    """READY, every chunk (order, size and checksum verified, scattered into the sinks' pages), END, ACK."""
    if len(sinks) != len(header.shards):
        raise ValueError(f"{len(sinks)} sinks for a header of {len(header.shards)} shards")
    await conn.run(_recv_body, conn.fs, header, sinks, conn.stats)
    return conn.stats
