"""KV-transfer wire format: binary, chunked, memory-bounded, authenticated. No pickle.

One TCP connection per request, opened by decode to the prefill worker's bootstrap port.

    connection := PREAMBLE frame*
    PREAMBLE   := b"PDKV" u16 version                      (both directions, first bytes)
    frame      := u8 type, u32 length (big-endian), payload[length]   (length <= MAX_FRAME_BYTES)

    prefill -> decode   CHALLENGE {nonce}                  right after the preamble
    decode  -> prefill  ATTACH {room, rid, num_tokens, prompt_crc, mac}
                        mac = HMAC-SHA256(token, nonce || room)  (hex); the token never crosses the wire
    prefill -> decode   HEADER {room, rid, num_tokens, first_token_id, layout..., model_sha256}
                        (sent when the KV is ready: this opens the prefill transfer phase)
    prefill -> decode   CHUNK*   binary: u16 layer, u8 kind (0=K, 1=V), u32 tok_start, u32 tok_count, raw
                        raw = tensor bytes [tok_count, num_kv_heads, head_dim] in the header's dtype
    prefill -> decode   END {checksum}                     crc32 over every CHUNK payload, in order
    decode  -> prefill  ACK {room}                         receipt confirmed: closes the transfer phase
    either              ERROR {reason, message}            reason: auth | unknown_room | mismatch | ...

Control payloads are small JSON objects; KV payloads are raw bytes. A chunk holds at most
``chunk_tokens`` tokens of one layer's K or V, so either side buffers at most one frame.
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
import hmac
import json
import struct
import zlib
from dataclasses import asdict, dataclass

MAGIC = b"PDKV"
VERSION = 1
PREAMBLE = MAGIC + struct.pack(">H", VERSION)
MAX_FRAME_BYTES = 32 << 20  # bytes; bounds what one side buffers per frame
MAX_CONTROL_BYTES = 64 << 10  # bytes; JSON control frames are tiny
CHUNK_TARGET_BYTES = 4 << 20  # bytes per KV chunk the sender aims for

_FRAME = struct.Struct(">BI")
_CHUNK = struct.Struct(">HBII")


class FrameType(enum.IntEnum):
    CHALLENGE = 1
    ATTACH = 2
    HEADER = 3
    CHUNK = 4
    END = 5
    ACK = 6
    ERROR = 7


class WireError(Exception):
    """Protocol violation or a peer-reported error; ``reason`` is a short metric label."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.message = message


@dataclass(frozen=True)
class KVHeader:
    room: int
    rid: str
    num_tokens: int
    first_token_id: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "float32"
    chunk_tokens: int
    prompt_crc: int  # crc32 of the prompt token ids as little-endian int32
    model_sha256: str

    @property
    def bytes_per_token_layer(self) -> int:
        return self.num_kv_heads * self.head_dim * dtype_size(self.dtype)

    @property
    def total_bytes(self) -> int:
        return 2 * self.num_layers * self.num_tokens * self.bytes_per_token_layer


def dtype_size(name: str) -> int:
    sizes = {"float32": 4, "float16": 2, "bfloat16": 2}
    if name not in sizes:
        raise WireError("mismatch", f"KV dtype {name!r} is not supported; accepted: {', '.join(sizes)}")
    return sizes[name]


def chunk_tokens_for(bytes_per_token_layer: int) -> int:
    return max(1, CHUNK_TARGET_BYTES // max(1, bytes_per_token_layer))


def prompt_crc(token_ids: list[int]) -> int:
    return zlib.crc32(struct.pack(f"<{len(token_ids)}i", *token_ids))


def attach_mac(token: str | None, nonce: str, room: int) -> str:
    if not token:
        return ""
    return hmac.new(token.encode(), f"{nonce}:{room}".encode(), hashlib.sha256).hexdigest()


def verify_mac(token: str | None, nonce: str, room: int, mac: str) -> bool:
    """True when no token is configured (auth off) or the MAC matches."""
    if not token:
        return True
    return hmac.compare_digest(attach_mac(token, nonce, room), str(mac))


# ---- framing ---------------------------------------------------------------------------

def encode_frame(ftype: FrameType, payload: bytes) -> bytes:
    return _FRAME.pack(int(ftype), len(payload)) + payload


def encode_control(ftype: FrameType, obj: dict) -> bytes:
    return encode_frame(ftype, json.dumps(obj, separators=(",", ":")).encode())


def encode_chunk_header(layer: int, kind: int, tok_start: int, tok_count: int) -> bytes:
    return _CHUNK.pack(layer, kind, tok_start, tok_count)


def decode_chunk(payload: bytes | memoryview) -> tuple[int, int, int, int, memoryview]:
    """-> (layer, kind, tok_start, tok_count, raw bytes)."""
    if len(payload) < _CHUNK.size:
        raise WireError("protocol", f"CHUNK payload of {len(payload)} bytes is shorter than its header")
    layer, kind, start, count = _CHUNK.unpack_from(payload)
    if kind not in (0, 1):
        raise WireError("protocol", f"CHUNK kind {kind} is not 0 (K) or 1 (V)")
    return layer, kind, start, count, memoryview(payload)[_CHUNK.size:]


async def read_preamble(reader: asyncio.StreamReader) -> None:
    got = await reader.readexactly(len(PREAMBLE))
    if got[:4] != MAGIC:
        raise WireError("protocol", "peer did not send the PDKV preamble")
    (version,) = struct.unpack(">H", got[4:])
    if version != VERSION:
        raise WireError("protocol", f"wire version {version} is not supported; accepted: {VERSION}")


async def read_frame(reader: asyncio.StreamReader, max_bytes: int = MAX_FRAME_BYTES) -> tuple[FrameType, bytes]:
    head = await reader.readexactly(_FRAME.size)
    ftype, length = _FRAME.unpack(head)
    if length > max_bytes:
        raise WireError("protocol", f"frame of {length} bytes exceeds the limit of {max_bytes}")
    try:
        ft = FrameType(ftype)
    except ValueError:
        raise WireError("protocol", f"unknown frame type {ftype}") from None
    payload = await reader.readexactly(length)
    return ft, payload


async def read_control(reader: asyncio.StreamReader, expect: FrameType) -> dict:
    """Read one control frame of type ``expect``; a peer ERROR frame raises WireError with its reason."""
    ftype, payload = await read_frame(reader, MAX_CONTROL_BYTES if expect is not FrameType.CHUNK else MAX_FRAME_BYTES)
    if ftype is FrameType.ERROR:
        err = parse_json(payload)
        raise WireError(str(err.get("reason", "peer_error")), str(err.get("message", "")))
    if ftype is not expect:
        raise WireError("protocol", f"expected {expect.name}, got {ftype.name}")
    return parse_json(payload)


def parse_json(payload: bytes) -> dict:
    try:
        obj = json.loads(payload)
    except (UnicodeDecodeError, ValueError):
        raise WireError("protocol", "control frame is not valid JSON") from None
    if not isinstance(obj, dict):
        raise WireError("protocol", "control frame is not a JSON object")
    return obj


def header_to_json(h: KVHeader) -> dict:
    return asdict(h)


def header_from_json(obj: dict) -> KVHeader:
    try:
        h = KVHeader(**{k: obj[k] for k in KVHeader.__dataclass_fields__})
    except (KeyError, TypeError) as exc:
        raise WireError("protocol", f"HEADER is missing or has bad fields: {exc}") from None
    dtype_size(h.dtype)
    return h
