"""KV-transfer wire format (version 2): binary, chunked, checksummed, authenticated, TP-sharded. No pickle.

One TCP connection per request, opened by decode to the prefill worker's bootstrap port. Everything
here is pure (bytes in, typed values or :class:`WireError` out) except :class:`FrameSocket`, which does
blocking, timeout-bounded I/O on one socket; :mod:`transfer` runs it in worker threads.

Grammar::

    connection := PREAMBLE frame*
    PREAMBLE   := b"PDKV" u16 version                         (both directions, first bytes; version = 2)
    frame      := u8 type, u32 length (big-endian), payload[length]   (length <= MAX_FRAME_BYTES)

    prefill -> decode   CHALLENGE {nonce}                     right after the preamble
    decode  -> prefill  ATTACH {room, rid, num_tokens, prompt_crc, tp_size, tp_ranks, checksums, mac,
                                held_tokens, cache_namespace}
                        mac = HMAC-SHA256(token, nonce ":" room) (hex); the token never crosses the wire.
                        Prefill refuses (ERROR) a bad mac (auth), an unknown room (unknown_room), and a
                        tp_size or prompt that differs from its own (mismatch) - before any prefill work.
                        held_tokens: leading prompt tokens whose KV decode already holds (its prefix cache);
                        cache_namespace: what keys decode's cache (model, weights, dtype, page size, TP).
    prefill -> decode   PROGRESS {tokens, steps}*                while prefill computes: prompt tokens whose KV is
                        computed, prefill engine steps taken (each tick; decode's stall watchdog reads them)
    prefill -> decode   HEADER {version, room, rid, num_tokens, num_pages, first_token_id, prompt_crc,
                                model_sha256, chunk_bytes, checksum, shards: [LAYOUT, ...],
                                skip_pages, cached_tokens}  (KV is ready)
                        skip_pages: leading pages not sent (decode holds them): held_tokens / page_size when
                        prefill accepts the delta (:func:`delta_skip_pages`), else 0 (a full transfer);
                        cached_tokens: prompt tokens prefill did not recompute (its own prefix cache)
                        LAYOUT = {dtype, page_size, num_layers, num_kv_heads, head_dim, tp_rank, tp_size}
                        (num_kv_heads is per TP rank; one LAYOUT per shard carried, in tp_ranks order)
    decode  -> prefill  READY {room}                          decode checked HEADER against its own layout
                      | ERROR {reason: "mismatch", message}   naming the field and both values; both free pages
    prefill -> decode   CHUNK*   binary payload:
                        u8 shard, u16 layer, u8 kind (0=K, 1=V), u32 page_start, u32 page_count, raw, u64 digest
                        raw = page_count whole pages, [page_count, page_size, num_kv_heads, head_dim] in the
                        shard's dtype (bf16/fp16/fp32 bytes as stored); digest (a trailer) = HEADER.checksum
                        over raw: xxh3_64 (preferred) or zlib crc32 (always supported), the first of
                        decode's list prefill supports. page_count = (frame length - 20) / page_bytes, so
                        decode knows where a chunk's pages go before it reads them.
                        Order is fixed: for shard: for layer: K pages then V pages, page_start ascending,
                        contiguous; a chunk may run on into the next (layer, kind) (never the next shard):
                        (layer, kind, page_start) is its first page. Each (layer, kind) run holds the
                        num_pages - skip_pages pages after the skipped ones; page_start counts from the
                        first page sent.
    prefill -> decode   END {bytes, chunks}
    decode  -> prefill  ACK {room}                            receipt verified: closes the transfer phase
    either              ERROR {reason, message}               reason: auth | unknown_room | mismatch | ...

Pages, not tokens, cross the wire: the request's last page is sent whole (its tail is the cache's own
content, masked by attention), so gather and scatter are one index over page ids per run.

Compatibility (the delta is an extension of version 2, not a new version): a peer that does not know it omits
held_tokens / cache_namespace (ATTACH) and skip_pages / cached_tokens (HEADER), read as 0 and "": an old decode
holds nothing and gets a full transfer; an old prefill sends everything, and a decode that reserved shared pages
gives them up first (never writes into a shared page).

Python API (blocking layer here; the asyncio API a worker calls is in :mod:`transfer`)::

    KVLayout(dtype, page_size, num_layers, num_kv_heads, head_dim, tp_rank=0, tp_size=1)
        .page_bytes  .run_bytes(num_pages)  .shard_bytes(num_pages)  .describe()
    layout_mismatch(expected: KVLayout, got: KVLayout) -> str | None      (pure; names field + both values)
    tp_mismatch(prefill_tp_size, decode_tp_size) -> str | None; rank_mismatch(served, asked) -> str | None
    Attach(room, rid, num_tokens, prompt_crc, tp_size=1, tp_ranks=(0,), checksums=CHECKSUMS, held_tokens=0,
           cache_namespace="")
    delta_skip_pages(att, page_size, cache_namespace) -> (pages, fallback reason | None)   (pure)
    KVHeader(room, rid, num_tokens, num_pages, first_token_id, prompt_crc, model_sha256, chunk_bytes, shards,
             checksum="crc32", skip_pages=0, cached_tokens=0)
        .sent_pages  .total_bytes  .saved_bytes;  header_to_json / header_from_json (typed rejection of any bad field)
    ChunkHead(shard, layer, kind, page_start, page_count) .pack() / ChunkHead.unpack(bytes)
    CHECKSUMS; pick_checksum(offered) -> str; chunk_digest(algo, bufs) -> int   (xxh3_64 | crc32)
    chunk_pages_for(page_bytes) -> pages per chunk; chunk_pages_in(frame_length, page_bytes) -> int | None
    FrameSocket(sock, timeout_s): send_frame, send_control, send_chunk(head, bufs, algo) (one sendmsg per chunk,
        no user-space copy), read_frame, read_control(expect), read_frame_head, recv_exact_into(view),
        recv_exact_into_views(views) (recvmsg_into, MSG_WAITALL), recv_chunk(views, algo) (one recvmsg_into per
        chunk: head, pages, digest and the next frame's head), close() (from any thread)
    WireError(reason, message): every malformed, truncated, timed-out or refused input ends in one.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import json
import socket
import struct
import threading
import zlib
from dataclasses import asdict, dataclass, field

MAGIC = b"PDKV"
VERSION = 2
PREAMBLE = MAGIC + struct.pack(">H", VERSION)
MAX_FRAME_BYTES = 64 << 20  # bytes; bounds what one side buffers per frame
MAX_CONTROL_BYTES = 64 << 10  # bytes; JSON control frames are tiny
CHUNK_TARGET_BYTES = 1 << 20  # bytes per KV chunk the sender aims for (whole pages, at least one); one sendmsg
# and one recvmsg_into each, digested on both ends while the chunk is still in L2/L3 (1 MiB: bench/kv_wire.py)
MAX_TP_SIZE = 1024
MAX_DIM = 1 << 20  # bound on any layout integer: a header cannot make the receiver allocate absurd buffers

MAX_IOV = 1024  # buffers per sendmsg/recvmsg_into call: Linux IOV_MAX (UIO_MAXIOV)
RCVLOWAT_BYTES = 256 << 10  # bytes queued before the kernel wakes a chunk receive (SO_RCVLOWAT), not one 64 KiB
# loopback segment; only while at least this much is still to come (bench/kv_wire.py: ~0.03 CPU s/GB on decode)
CHUNK_IOV_EXTRA = 3  # buffers of a chunk's sendmsg / recvmsg_into besides its pages: heads and trailer
MAX_CHUNK_PAGES = MAX_IOV - CHUNK_IOV_EXTRA  # a chunk is at most this many pages (one buffer each when scattered)

_FRAME = struct.Struct(">BI")
FRAME_HEAD_SIZE = _FRAME.size  # bytes: u8 type, u32 length
_CHUNK = struct.Struct(">BHBII")
_DIGEST = struct.Struct(">Q")
DIGEST_SIZE = _DIGEST.size
CHUNK_OVERHEAD = _CHUNK.size + DIGEST_SIZE  # bytes of a CHUNK payload that are not pages: head and digest

try:  # xxh3_64 is ~15x faster than zlib's crc32; crc32 stays the always-available fallback
    import xxhash as _xxhash
except ImportError:  # pragma: no cover - the runtime extra installs it
    _xxhash = None

CHECKSUMS: tuple[str, ...] = (("xxh3_64",) if _xxhash is not None else ()) + ("crc32",)  # preference order

DTYPE_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2}


class FrameType(enum.IntEnum):
    CHALLENGE = 1
    ATTACH = 2
    HEADER = 3
    CHUNK = 4
    END = 5
    ACK = 6
    ERROR = 7
    READY = 8
    PROGRESS = 9


_FRAME_TYPES = {t.value: t for t in FrameType}  # a dict lookup: FrameType(x) costs a microsecond per frame


class WireError(Exception):
    """Protocol violation, refusal or peer-reported error; ``reason`` is a short metric label
    (auth, unknown_room, mismatch, checksum, protocol, closed, timeout, peer_error)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.message = message


def dtype_size(name: str) -> int:
    if name not in DTYPE_SIZES:
        raise WireError("mismatch", f"KV dtype {name!r} is not supported; accepted: {', '.join(DTYPE_SIZES)}")
    return DTYPE_SIZES[name]


def _check_int(owner: str, name: str, value, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise WireError("protocol", f"{owner}.{name}={value!r} is invalid; accepted: an integer in [{lo}, {hi}]")


# ---- layout of one TP shard ----------------------------------------------------------------------

@dataclass(frozen=True)
class KVLayout:
    """Layout of one TP rank's paged KV cache: pages [num_pages, page_size, num_kv_heads, head_dim] per layer
    and per K/V, in ``dtype`` (torch name without "torch.")."""

    dtype: str
    page_size: int  # tokens per page
    num_layers: int
    num_kv_heads: int  # per TP rank
    head_dim: int
    tp_rank: int = 0
    tp_size: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.dtype, str):
            raise WireError("protocol", f"KVLayout.dtype={self.dtype!r} is invalid; accepted: {', '.join(DTYPE_SIZES)}")
        dtype_size(self.dtype)
        for name in ("page_size", "num_layers", "num_kv_heads", "head_dim"):
            _check_int("KVLayout", name, getattr(self, name), 1, MAX_DIM)
        _check_int("KVLayout", "tp_size", self.tp_size, 1, MAX_TP_SIZE)
        _check_int("KVLayout", "tp_rank", self.tp_rank, 0, self.tp_size - 1)
        if self.page_bytes > MAX_FRAME_BYTES:
            raise WireError("protocol", f"one KV page is {self.page_bytes} bytes, over the frame limit {MAX_FRAME_BYTES}")

    @property
    def page_bytes(self) -> int:
        """bytes of one page of one layer's K (or V)."""
        return self.page_size * self.num_kv_heads * self.head_dim * DTYPE_SIZES[self.dtype]

    def run_bytes(self, num_pages: int) -> int:
        """bytes of one (layer, kind) run of ``num_pages`` pages."""
        return num_pages * self.page_bytes

    def shard_bytes(self, num_pages: int) -> int:
        return 2 * self.num_layers * self.run_bytes(num_pages)

    def describe(self) -> str:
        return (f"{self.dtype} page_size={self.page_size} layers={self.num_layers} kv_heads={self.num_kv_heads} "
                f"head_dim={self.head_dim} tp_rank={self.tp_rank}/{self.tp_size}")


_LAYOUT_FIELDS = (("dtype", "KV dtype"), ("page_size", "KV page size (tokens per page)"),
                  ("num_layers", "layer count"), ("num_kv_heads", "KV heads per rank"), ("head_dim", "head dim"),
                  ("tp_size", "tensor-parallel size"), ("tp_rank", "tensor-parallel rank"))


def layout_mismatch(expected: KVLayout, got: KVLayout) -> str | None:
    """Pure. None if decode (``expected``) can take prefill's shard (``got``), else a message naming every
    differing field with both values, e.g. "KV dtype: prefill sends bfloat16, decode expects float32"."""
    diffs = [f"{label}: prefill sends {getattr(got, name)}, decode expects {getattr(expected, name)}"
             for name, label in _LAYOUT_FIELDS if getattr(got, name) != getattr(expected, name)]
    if not diffs:
        return None
    return "KV layout mismatch between prefill and decode; " + "; ".join(diffs)


def tp_mismatch(prefill_tp_size: int, decode_tp_size: int) -> str | None:
    """Pure. Bootstrap-time refusal text when the two sides shard the KV differently."""
    if prefill_tp_size == decode_tp_size:
        return None
    return (f"tensor-parallel size mismatch: prefill runs tp_size={prefill_tp_size}, decode runs "
            f"tp_size={decode_tp_size}; accepted: equal tensor-parallel sizes on both sides of a pair")


def rank_mismatch(served: tuple[int, ...], asked: tuple[int, ...]) -> str | None:
    """Pure. Bootstrap-time refusal text when decode asks for TP shards this prefill endpoint does not
    serve (one endpoint serves either every rank of its group, or one rank)."""
    if tuple(asked) == tuple(served):
        return None
    return (f"tensor-parallel rank mismatch: decode asks for TP ranks {list(asked)}, this prefill endpoint serves "
            f"{list(served)}; accepted: the ranks the endpoint serves, in order")


# ---- handshake and header ------------------------------------------------------------------------

@dataclass(frozen=True)
class Attach:
    """What decode asks for: the room, the prompt it tokenized, and the TP shards it wants."""

    room: int
    rid: str
    num_tokens: int
    prompt_crc: int
    tp_size: int = 1
    tp_ranks: tuple[int, ...] = (0,)
    checksums: tuple[str, ...] = CHECKSUMS  # what decode can verify, preferred first
    held_tokens: int = 0  # leading prompt tokens whose KV decode holds already (page-aligned; 0: send everything)
    cache_namespace: str = ""  # decode's prefix-cache namespace: its held KV is prefill's only if the two agree

    def to_json(self, mac: str) -> dict:
        return {"room": self.room, "rid": self.rid, "num_tokens": self.num_tokens, "prompt_crc": self.prompt_crc,
                "tp_size": self.tp_size, "tp_ranks": list(self.tp_ranks), "checksums": list(self.checksums), "mac": mac,
                "held_tokens": self.held_tokens, "cache_namespace": self.cache_namespace}

    @classmethod
    def from_json(cls, obj: dict) -> "Attach":
        try:
            att = cls(room=obj["room"], rid=obj["rid"], num_tokens=obj["num_tokens"], prompt_crc=obj["prompt_crc"],
                      tp_size=obj.get("tp_size", 1), tp_ranks=tuple(obj.get("tp_ranks", (0,))),
                      checksums=tuple(obj.get("checksums", ("crc32",))), held_tokens=obj.get("held_tokens", 0),
                      cache_namespace=obj.get("cache_namespace", ""))
        except (KeyError, TypeError) as exc:
            raise WireError("protocol", f"ATTACH needs room, rid, num_tokens, prompt_crc, tp_size, tp_ranks and mac: "
                                        f"{exc}") from None
        _check_int("ATTACH", "room", att.room, 0, (1 << 64) - 1)
        _check_int("ATTACH", "num_tokens", att.num_tokens, 0, 1 << 31)
        _check_int("ATTACH", "prompt_crc", att.prompt_crc, 0, (1 << 32) - 1)
        _check_int("ATTACH", "tp_size", att.tp_size, 1, MAX_TP_SIZE)
        if not isinstance(att.rid, str) or len(att.rid) > 512:
            raise WireError("protocol", "ATTACH.rid must be a string of at most 512 characters")
        if not att.tp_ranks or len(set(att.tp_ranks)) != len(att.tp_ranks):
            raise WireError("protocol", f"ATTACH.tp_ranks={list(att.tp_ranks)!r} must list distinct ranks")
        for r in att.tp_ranks:
            _check_int("ATTACH", "tp_ranks[]", r, 0, att.tp_size - 1)
        if len(att.checksums) > 8 or not all(isinstance(c, str) for c in att.checksums):
            raise WireError("protocol", "ATTACH.checksums must be a short list of names")
        _check_int("ATTACH", "held_tokens", att.held_tokens, 0, 1 << 31)
        if not isinstance(att.cache_namespace, str) or len(att.cache_namespace) > 1024:
            raise WireError("protocol", "ATTACH.cache_namespace must be a string of at most 1024 characters")
        return att


def delta_skip_pages(att: Attach, page_size: int, cache_namespace: str) -> tuple[int, str | None]:
    """Pure. Prefill's decision on the delta: (leading pages it may leave out because decode holds them, None),
    or (0, why a full transfer) - decode holds nothing, its cache is keyed differently (another model, weights
    format, KV dtype, page size or TP size: its held KV is not the KV this prefill computes), or the held count
    is not whole pages of this prefill or is longer than the prompt. Never a partial page: decode's held pages
    are full and read-only."""
    held = att.held_tokens
    if held == 0:
        return 0, None
    if not att.cache_namespace or att.cache_namespace != cache_namespace:
        return 0, "namespace"
    if held % page_size:
        return 0, "unaligned"
    if held > att.num_tokens:
        return 0, "too_long"
    return held // page_size, None


@dataclass(frozen=True)
class KVHeader:
    """Request-level header; ``shards`` holds one :class:`KVLayout` per TP shard on this connection."""

    room: int
    rid: str
    num_tokens: int
    num_pages: int  # pages per (layer, kind) run: ceil(num_tokens / page_size)
    first_token_id: int
    prompt_crc: int  # crc32 of the prompt token ids as little-endian int32
    model_sha256: str
    chunk_bytes: int  # sender's chunk target (informational; the receiver bounds by MAX_FRAME_BYTES)
    shards: tuple[KVLayout, ...] = field(default_factory=tuple)
    checksum: str = "crc32"  # chunk digest algorithm, picked by prefill from ATTACH.checksums
    version: int = VERSION
    skip_pages: int = 0  # leading pages of each run not sent: decode holds them (0: a full transfer)
    cached_tokens: int = 0  # prompt tokens whose KV prefill took from its own prefix cache (usage.cached_tokens)

    @property
    def sent_pages(self) -> int:
        """Pages per (layer, kind) run on the wire: the prompt's pages after the skipped ones."""
        return self.num_pages - self.skip_pages

    @property
    def total_bytes(self) -> int:
        return sum(s.shard_bytes(self.sent_pages) for s in self.shards)

    @property
    def saved_bytes(self) -> int:
        """KV bytes the skip left off the wire (what a full transfer would have sent more)."""
        return sum(s.shard_bytes(self.skip_pages) for s in self.shards)


def header_to_json(h: KVHeader) -> dict:
    d = asdict(h)
    d["shards"] = [asdict(s) for s in h.shards]
    return d


def header_from_json(obj: dict) -> KVHeader:
    """Typed HEADER; any missing, extra-typed or out-of-range field raises WireError('protocol')."""
    try:
        shards = obj["shards"]
        if not isinstance(shards, list) or not 1 <= len(shards) <= MAX_TP_SIZE:
            raise WireError("protocol", "HEADER.shards must be a list of 1..1024 layouts")
        layouts = tuple(KVLayout(**{k: s[k] for k in KVLayout.__dataclass_fields__}) for s in shards)
        h = KVHeader(room=obj["room"], rid=obj["rid"], num_tokens=obj["num_tokens"], num_pages=obj["num_pages"],
                     first_token_id=obj["first_token_id"], prompt_crc=obj["prompt_crc"],
                     model_sha256=obj["model_sha256"], chunk_bytes=obj["chunk_bytes"], shards=layouts,
                     checksum=obj["checksum"], version=obj["version"], skip_pages=obj.get("skip_pages", 0),
                     cached_tokens=obj.get("cached_tokens", 0))
    except (KeyError, TypeError) as exc:
        raise WireError("protocol", f"HEADER is missing or has bad fields: {exc!r}") from None
    if h.version != VERSION:
        raise WireError("protocol", f"HEADER version {h.version!r} is not supported; accepted: {VERSION}")
    _check_int("HEADER", "room", h.room, 0, (1 << 64) - 1)
    _check_int("HEADER", "num_tokens", h.num_tokens, 0, 1 << 31)
    _check_int("HEADER", "first_token_id", h.first_token_id, 0, 1 << 31)
    _check_int("HEADER", "prompt_crc", h.prompt_crc, 0, (1 << 32) - 1)
    _check_int("HEADER", "chunk_bytes", h.chunk_bytes, 1, MAX_FRAME_BYTES)
    page = h.shards[0].page_size
    need = -(-h.num_tokens // page)
    if h.num_pages != need:
        raise WireError("protocol", f"HEADER.num_pages={h.num_pages!r} does not cover {h.num_tokens} tokens in "
                                    f"pages of {page}; expected {need}")
    _check_int("HEADER", "skip_pages", h.skip_pages, 0, h.num_pages)
    _check_int("HEADER", "cached_tokens", h.cached_tokens, 0, h.num_tokens)
    if h.checksum not in CHECKSUMS:
        raise WireError("protocol", f"HEADER.checksum={h.checksum!r} is not supported; accepted: {', '.join(CHECKSUMS)}")
    if not isinstance(h.rid, str) or not isinstance(h.model_sha256, str):
        raise WireError("protocol", "HEADER.rid and HEADER.model_sha256 must be strings")
    return h


def chunk_pages_for(page_bytes: int, target: int | None = None) -> int:
    """Whole pages per chunk: as many as fit in ``target`` (default CHUNK_TARGET_BYTES) bytes, at least one and at
    most MAX_CHUNK_PAGES (so a scattered chunk, one buffer per page, fits one sendmsg)."""
    return max(1, min(MAX_CHUNK_PAGES, (CHUNK_TARGET_BYTES if target is None else target) // max(1, page_bytes)))


def chunk_pages_in(frame_length: int, page_bytes: int) -> int | None:
    """Pure: the pages a CHUNK frame of ``frame_length`` payload bytes carries, or None when the length is not a
    head, whole pages and a digest."""
    n, rest = divmod(frame_length - CHUNK_OVERHEAD, page_bytes)
    return n if rest == 0 and n >= 1 else None


def pick_checksum(offered) -> str:
    """Pure: the first of this side's CHECKSUMS that the peer offered (crc32 is always common)."""
    for name in CHECKSUMS:
        if name in offered:
            return name
    return "crc32"


def chunk_digest(algo: str, bufs) -> int:
    """The CHUNK checksum over the payload buffers in order (no concatenation): xxh3_64 or zlib crc32. One C call
    per buffer (a page span), nothing per byte in Python."""
    if algo == "xxh3_64":
        h = _xxhash.xxh3_64()
        for b in bufs:
            h.update(b)
        return h.intdigest()
    crc = 0
    for b in bufs:
        crc = zlib.crc32(b, crc)
    return crc


def prompt_crc(token_ids: list[int]) -> int:
    return zlib.crc32(struct.pack(f"<{len(token_ids)}i", *token_ids))


def attach_mac(token: str | None, nonce: str, room: int) -> str:
    if not token:
        return ""
    return hmac.new(token.encode(), f"{nonce}:{room}".encode(), hashlib.sha256).hexdigest()


def verify_mac(token: str | None, nonce: str, room: int, mac) -> bool:
    """True when no token is configured (auth off) or the MAC matches; compared in constant time."""
    if not token:
        return True
    if not isinstance(mac, str):
        return False
    return hmac.compare_digest(attach_mac(token, nonce, room).encode(), mac.encode("utf-8", "replace"))


# ---- frames ----------------------------------------------------------------------------------------

def chunk_head_bytes(shard: int, layer: int, kind: int, page_start: int, page_count: int) -> bytes:
    """The 12 bytes of a chunk head (what :meth:`ChunkHead.pack` returns, without building one per chunk)."""
    return _CHUNK.pack(shard, layer, kind, page_start, page_count)


@dataclass(frozen=True)
class ChunkHead:
    shard: int
    layer: int
    kind: int  # 0 = K, 1 = V
    page_start: int
    page_count: int

    SIZE = _CHUNK.size

    def pack(self) -> bytes:
        return chunk_head_bytes(self.shard, self.layer, self.kind, self.page_start, self.page_count)

    @classmethod
    def unpack(cls, buf: bytes | memoryview) -> "ChunkHead":
        if len(buf) < _CHUNK.size:
            raise WireError("protocol", f"CHUNK payload of {len(buf)} bytes is shorter than its {_CHUNK.size}-byte head")
        head = cls(*_CHUNK.unpack_from(buf))
        if head.kind not in (0, 1):
            raise WireError("protocol", f"CHUNK kind {head.kind} is not 0 (K) or 1 (V)")
        return head


def encode_frame(ftype: FrameType, payload: bytes) -> bytes:
    return _FRAME.pack(int(ftype), len(payload)) + payload


def encode_control(ftype: FrameType, obj: dict) -> bytes:
    return encode_frame(ftype, json.dumps(obj, separators=(",", ":")).encode())


def decode_frame_head(head: bytes | memoryview, max_bytes: int = MAX_FRAME_BYTES) -> tuple[FrameType, int]:
    """Pure: 5 bytes -> (type, payload length); unknown types and oversized lengths raise WireError."""
    ftype, length = _FRAME.unpack(head)
    ft = _FRAME_TYPES.get(ftype)
    if ft is None:
        raise WireError("protocol", f"unknown frame type {ftype}")
    if length > max_bytes:
        raise WireError("protocol", f"{ft.name} frame of {length} bytes exceeds the limit of {max_bytes}")
    return ft, length


def parse_json(payload: bytes) -> dict:
    try:
        obj = json.loads(payload)
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise WireError("protocol", "control frame is not valid JSON") from None
    if not isinstance(obj, dict):
        raise WireError("protocol", "control frame is not a JSON object")
    return obj


def peer_error(payload: bytes) -> WireError:
    """The WireError a peer's ERROR frame stands for (its reason and message, bounded)."""
    err = parse_json(payload)
    return WireError(str(err.get("reason", "peer_error"))[:64], str(err.get("message", ""))[:2000])


def expect_control(expect: FrameType, ftype: FrameType, payload: bytes) -> dict:
    """Pure: a received control frame as the JSON object of type ``expect``; a peer ERROR raises its
    WireError, any other type 'protocol'."""
    if ftype is FrameType.ERROR:
        raise peer_error(payload)
    if ftype is not expect:
        raise WireError("protocol", f"expected {expect.name}, got {ftype.name}")
    return parse_json(payload)


def check_preamble(got: bytes) -> None:
    if got[:4] != MAGIC:
        raise WireError("protocol", "peer did not send the PDKV preamble")
    (version,) = struct.unpack(">H", got[4:6])
    if version != VERSION:
        raise WireError("protocol", f"wire version {version} is not supported; accepted: {VERSION}")


def _after(views: list, done: int) -> list:
    """The part of byte memoryviews ``views`` left after the first ``done`` bytes (0 <= done < their total), for
    resuming a partial sendmsg / recvmsg_into; views are sliced, never copied."""
    i = 0
    while done >= len(views[i]):
        done -= len(views[i])
        i += 1
    return [views[i][done:], *views[i + 1:]]


class FrameSocket:
    """Blocking frame I/O on one connected TCP socket; every call is bounded by ``timeout_s``.

    Used from one thread at a time, except :meth:`close`, which any thread (a watchdog) may call to
    wake a blocked send or receive. Every failure surfaces as WireError (closed, timeout, protocol, ...).
    """

    def __init__(self, sock: socket.socket, timeout_s: float = 30.0) -> None:
        self.sock = sock
        self._closed = threading.Event()
        self.set_timeout(timeout_s)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass
        self._head = bytearray(_FRAME.size)
        self._chunk_head = memoryview(bytearray(_CHUNK.size))
        self._trailer = memoryview(bytearray(DIGEST_SIZE + _FRAME.size))  # a CHUNK's digest, then the next frame head
        self._head_ready = False  # _trailer holds a frame head not yet returned by read_frame_head
        self._digest_out: list[bytes] = []  # the last CHUNK's digest trailer, sent with the next frame
        self._rcvlowat = 1  # SO_RCVLOWAT now (bytes); 1 (the kernel's default) except inside the bulk phase

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def set_timeout(self, seconds: float) -> None:
        """Bound every send/recv by ``seconds`` without progress, in the kernel (SO_SNDTIMEO/SO_RCVTIMEO on a
        blocking socket): Python's own socket timeout polls before every call, which halves throughput."""
        if self._closed.is_set():
            return
        self.sock.settimeout(None)
        tv = struct.pack("ll", int(seconds), int((seconds - int(seconds)) * 1e6))
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)

    def close(self) -> None:
        """Idempotent; safe from any thread (shutdown wakes a thread blocked in send/recv)."""
        if self._closed.is_set():
            return
        self._closed.set()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()

    def _io_error(self, exc: BaseException, what: str) -> WireError:
        if isinstance(exc, (socket.timeout, BlockingIOError)):  # SO_*TIMEO expired: EAGAIN
            return WireError("timeout", f"peer stalled: no progress while {what}")
        if self._closed.is_set():
            return WireError("closed", f"connection closed locally while {what}")
        return WireError("closed", f"connection lost while {what}: {type(exc).__name__}")

    # ---- send ----
    def send_all(self, *bufs) -> None:
        """Write every buffer in order with sendmsg: the kernel gathers them, nothing is concatenated."""
        self.send_views([memoryview(b).cast("B") for b in bufs])

    def send_views(self, views: list) -> None:
        """sendmsg over byte memoryviews, MAX_IOV per call. A blocking socket takes a whole call's buffers
        unless SO_SNDTIMEO expires part-way; only then are the views walked to find where to resume."""
        try:
            while views:
                batch, views = views[:MAX_IOV], views[MAX_IOV:]
                sent = self.sock.sendmsg(batch)
                if sent < sum(map(len, batch)):
                    views = _after(batch, sent) + views
        except OSError as exc:  # includes socket.timeout
            raise self._io_error(exc, "sending") from None

    def send_frame(self, ftype: FrameType, payload: bytes) -> None:
        """One frame, after the last CHUNK's digest if that is still to go (so a frame never splits a CHUNK)."""
        self.send_views([*self._pending_digest(), memoryview(_FRAME.pack(int(ftype), len(payload))),
                         memoryview(payload).cast("B")])

    def _pending_digest(self) -> list:
        out, self._digest_out = self._digest_out, []
        return out

    def send_control(self, ftype: FrameType, obj: dict) -> None:
        self.send_frame(ftype, json.dumps(obj, separators=(",", ":")).encode())

    def send_chunk(self, head: bytes, bufs: list, algo: str, corrupt: bool = False) -> int:
        """One CHUNK frame, in one sendmsg with the previous chunk's digest: that digest, frame and chunk heads,
        then ``bufs`` (byte memoryviews over the pages) in order. The kernel's copy is the pages' first (DRAM)
        read; they are digested right after, from cache, and the digest goes out first in the next frame's
        sendmsg (:meth:`send_frame`, or the next chunk's). ``corrupt`` (fault injection) sends a copy of the first
        buffer with one byte flipped, the digest being the original's. -> payload bytes sent (pages only)."""
        nbytes = sum(map(len, bufs))
        prefix = [*self._pending_digest(), _FRAME.pack(int(FrameType.CHUNK), CHUNK_OVERHEAD + nbytes) + head]
        if corrupt:
            digest = chunk_digest(algo, bufs)
            bad = bytearray(bufs[0])
            bad[len(bad) // 2] ^= 0xFF
            self.send_views([*prefix, memoryview(bad), *bufs[1:]])
        else:
            self.send_views([*prefix, *bufs])
            digest = chunk_digest(algo, bufs)
        self._digest_out = [_DIGEST.pack(digest)]
        return nbytes

    # ---- receive ----
    def recv_exact_into(self, view: memoryview, what: str = "receiving") -> None:
        """Fill ``view`` completely from the socket (no intermediate copies); woken by any byte that arrives."""
        self._set_rcvlowat(1)
        self.recv_exact_into_views([memoryview(view).cast("B")], what)

    def _set_rcvlowat(self, nbytes: int) -> None:
        if nbytes != self._rcvlowat:
            try:
                self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, nbytes)
            except OSError as exc:
                raise self._io_error(exc, "setting SO_RCVLOWAT") from None
            self._rcvlowat = nbytes

    def recv_exact_into_views(self, views: list, what: str = "receiving") -> None:
        """Fill every byte memoryview in order: recvmsg_into with MSG_WAITALL, so the kernel scatters a whole call's
        buffers before waking us (no intermediate copy, no per-segment wake-up). It returns short only on a
        stall (SO_RCVTIMEO), a signal or EOF; only then are the views walked to find where to resume."""
        got = 0
        try:
            while views:
                batch, views = views[:MAX_IOV], views[MAX_IOV:]
                r = self.sock.recvmsg_into(batch, 0, socket.MSG_WAITALL)[0]
                got += r
                if r < sum(map(len, batch)):
                    if r == 0:
                        total = got + sum(map(len, batch)) + sum(map(len, views))
                        raise WireError("closed", f"peer closed the connection while {what} ({got} of {total} bytes)")
                    views = _after(batch, r) + views
        except OSError as exc:
            raise self._io_error(exc, what) from None

    def recv_chunk(self, views: list, algo: str, what: str, more: int = 0) -> tuple[bytes, int, int]:
        """The rest of a CHUNK frame whose head :meth:`read_frame_head` returned, in one recvmsg_into: its chunk
        head, its pages into ``views`` (byte memoryviews), its digest trailer, and the next frame's head (a CHUNK
        is always followed by a frame: the next CHUNK, END or ERROR; :meth:`read_frame_head` returns it).
        ``more``: page bytes the peer still sends after this chunk; while that is RCVLOWAT_BYTES or more, the
        kernel wakes this receive only once RCVLOWAT_BYTES are queued (everything still to come is at least
        that much, so the wake-up always comes). -> (chunk head bytes, digest computed here over ``views``,
        digest the sender sent)."""
        self._set_rcvlowat(RCVLOWAT_BYTES if more >= RCVLOWAT_BYTES else 1)
        self.recv_exact_into_views([self._chunk_head, *views, self._trailer], what)
        self._head_ready = True
        (sent,) = _DIGEST.unpack_from(self._trailer)
        return bytes(self._chunk_head), chunk_digest(algo, views), sent

    def recv_exact(self, n: int, what: str = "receiving") -> bytes:
        buf = bytearray(n)
        self.recv_exact_into(memoryview(buf), what)
        return bytes(buf)

    def read_preamble(self) -> None:
        check_preamble(self.recv_exact(len(PREAMBLE), "reading the preamble"))

    def read_frame_head(self, max_bytes: int = MAX_FRAME_BYTES) -> tuple[FrameType, int]:
        if self._head_ready:  # read with the previous CHUNK
            self._head_ready = False
            return decode_frame_head(self._trailer[DIGEST_SIZE:], max_bytes)
        self.recv_exact_into(memoryview(self._head), "reading a frame head")
        return decode_frame_head(self._head, max_bytes)

    def read_frame(self, max_bytes: int = MAX_CONTROL_BYTES) -> tuple[FrameType, bytes]:
        ftype, length = self.read_frame_head(max_bytes)
        return ftype, self.recv_exact(length, f"reading a {ftype.name} frame")

    def read_control(self, expect: FrameType) -> dict:
        """One control frame of type ``expect``; a peer ERROR raises its WireError, anything else 'protocol'."""
        return expect_control(expect, *self.read_frame(MAX_CONTROL_BYTES))
