"""Both ends of one KV transfer over the wire format in :mod:`wire`.

Prefill side (bootstrap server): :func:`accept_attach` runs the challenge/attach handshake on a
fresh connection; :func:`send_kv` streams HEADER, CHUNKs and END, then awaits the ACK.
Decode side (client): :func:`open_attach` connects and attaches; :func:`recv_kv` reads the KV into
the caller's pages, verifying room, token count, layout and checksum, then sends the ACK.

The paged KV tensors are read/written through slot indices: token ``t`` of a request lives in
slot ``block_ids[t // block_size] * block_size + t % block_size`` of ``kv.k[layer].view(-1, Hkv, D)``.
"""

from __future__ import annotations

import asyncio
import secrets
import zlib
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np
import torch

from pdruntime.disagg import wire
from pdruntime.disagg.wire import FrameType, KVHeader, WireError

CONNECT_TIMEOUT_S = 5.0  # seconds for TCP connect + handshake frames


# ---- KV <-> slots ------------------------------------------------------------------------

def flat_slots(block_ids: list[int], block_size: int, num_tokens: int) -> torch.Tensor:
    """Slot index per token: [num_tokens] int64."""
    if num_tokens > len(block_ids) * block_size:
        raise ValueError(f"{num_tokens} tokens do not fit in {len(block_ids)} blocks of {block_size}")
    blocks = torch.tensor(block_ids, dtype=torch.int64)
    t = torch.arange(num_tokens, dtype=torch.int64)
    return blocks[t // block_size] * block_size + t % block_size


def _flat(cache: torch.Tensor) -> torch.Tensor:
    # cache: [num_blocks, block_size, Hkv, D] -> [num_blocks * block_size, Hkv, D] (a view, never a copy)
    assert cache.is_contiguous(), "KV cache tensors must be contiguous"
    return cache.view(-1, cache.shape[-2], cache.shape[-1])


def _flat_bytes(cache: torch.Tensor) -> np.ndarray:
    """CPU cache as a numpy view of byte rows: [num_blocks * block_size, Hkv * D * elsize] uint8.

    Copies go through numpy on purpose: torch parallelises big copies with OpenMP, which on a busy
    host (prefill or decode steps running in the engine thread) is ~50x slower than one thread."""
    flat = _flat(cache)
    return flat.view(flat.shape[0], -1).view(torch.uint8).numpy()


def gather_chunks(kv, slots: torch.Tensor, chunk_tokens: int) -> Iterator[tuple[int, int, int, int, memoryview]]:
    """Yield (layer, kind, tok_start, tok_count, raw) per chunk of one layer's K or V."""
    n = slots.numel()
    on_cpu = kv.k[0].device.type == "cpu"
    idx_np = slots.numpy() if on_cpu else None
    for layer in range(len(kv.k)):
        for kind, cache in ((0, kv.k[layer]), (1, kv.v[layer])):
            if on_cpu:
                rows = _flat_bytes(cache)
                for start in range(0, n, chunk_tokens):
                    part = np.take(rows, idx_np[start:start + chunk_tokens], axis=0)  # [count, row bytes]
                    yield layer, kind, start, part.shape[0], memoryview(part).cast("B")
            else:
                flat = _flat(cache)
                for start in range(0, n, chunk_tokens):
                    idx = slots[start:start + chunk_tokens].to(flat.device)
                    data = flat.index_select(0, idx).contiguous().cpu()
                    yield layer, kind, start, idx.numel(), memoryview(data.view(torch.uint8).numpy()).cast("B")


def scatter_chunk(kv, slots: torch.Tensor, layer: int, kind: int, start: int, count: int, raw: memoryview,
                  dtype: torch.dtype) -> None:
    """Write ``count`` tokens of one layer's K or V (raw bytes in the cache's own dtype) into their slots."""
    cache = kv.k[layer] if kind == 0 else kv.v[layer]
    assert cache.dtype == dtype, f"KV dtype {dtype} != cache dtype {cache.dtype}"
    if cache.device.type == "cpu":
        rows = _flat_bytes(cache)
        rows[slots.numpy()[start:start + count]] = np.frombuffer(raw, dtype=np.uint8).reshape(count, rows.shape[1])
        return
    flat = _flat(cache)
    src = torch.frombuffer(bytearray(raw), dtype=dtype).view(count, flat.shape[1], flat.shape[2])
    flat.index_copy_(0, slots[start:start + count].to(flat.device), src.to(flat.device))


def layout_of(kv) -> tuple[int, int, int, str]:
    """(num_layers, num_kv_heads, head_dim, dtype name) of a paged KV cache."""
    k0 = kv.k[0]
    return len(kv.k), int(k0.shape[2]), int(k0.shape[3]), str(k0.dtype).removeprefix("torch.")


# ---- prefill side ------------------------------------------------------------------------

@dataclass(frozen=True)
class Attach:
    room: int
    rid: str
    num_tokens: int
    prompt_crc: int


async def accept_attach(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, token: str | None) -> Attach:
    """Run the server half of the handshake. Raises WireError('auth', ...) on a bad MAC."""
    nonce = secrets.token_hex(16)
    writer.write(wire.PREAMBLE + wire.encode_control(FrameType.CHALLENGE, {"nonce": nonce}))
    await writer.drain()
    await asyncio.wait_for(wire.read_preamble(reader), CONNECT_TIMEOUT_S)
    msg = await asyncio.wait_for(wire.read_control(reader, FrameType.ATTACH), CONNECT_TIMEOUT_S)
    try:
        att = Attach(int(msg["room"]), str(msg["rid"]), int(msg["num_tokens"]), int(msg["prompt_crc"]))
    except (KeyError, TypeError, ValueError):
        raise WireError("protocol", "ATTACH needs room, rid, num_tokens, prompt_crc and mac") from None
    if not wire.verify_mac(token, nonce, att.room, msg.get("mac", "")):
        raise WireError("auth", f"bad KV-transfer credentials for room {att.room}")
    return att


async def send_error(writer: asyncio.StreamWriter, reason: str, message: str) -> None:
    try:
        writer.write(wire.encode_control(FrameType.ERROR, {"reason": reason, "message": message}))
        await asyncio.wait_for(writer.drain(), 1.0)
    except (OSError, asyncio.TimeoutError, RuntimeError):
        pass
    finally:
        writer.close()


async def send_kv(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, header: KVHeader,
                  chunks: Iterator[tuple[int, int, int, int, bytes]]) -> int:
    """Send HEADER, every chunk and END; wait for the ACK. Returns the KV bytes sent.

    Each chunk is drained before the next is gathered, so at most one chunk is buffered.
    The caller's watchdog bounds the whole call (it closes ``writer`` when it fires).
    """
    writer.write(wire.encode_control(FrameType.HEADER, wire.header_to_json(header)))
    crc = 0
    nbytes = 0
    for layer, kind, start, count, raw in chunks:
        head = wire.encode_chunk_header(layer, kind, start, count)
        crc = zlib.crc32(raw, crc)
        nbytes += len(raw)
        writer.write(wire._FRAME.pack(int(FrameType.CHUNK), len(head) + len(raw)) + head)
        writer.write(raw)
        await writer.drain()
    writer.write(wire.encode_control(FrameType.END, {"checksum": crc, "bytes": nbytes}))
    await writer.drain()
    ack = await wire.read_control(reader, FrameType.ACK)
    if int(ack.get("room", -1)) != header.room:
        raise WireError("mismatch", f"ACK for room {ack.get('room')} on the connection of room {header.room}")
    return nbytes


# ---- decode side -------------------------------------------------------------------------

async def open_attach(host: str, port: int, token: str | None, att: Attach) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Connect to a prefill bootstrap port and attach to ``att.room``."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), CONNECT_TIMEOUT_S)
    try:
        await asyncio.wait_for(wire.read_preamble(reader), CONNECT_TIMEOUT_S)
        challenge = await asyncio.wait_for(wire.read_control(reader, FrameType.CHALLENGE), CONNECT_TIMEOUT_S)
        mac = wire.attach_mac(token, str(challenge.get("nonce", "")), att.room)
        writer.write(wire.PREAMBLE + wire.encode_control(FrameType.ATTACH, {
            "room": att.room, "rid": att.rid, "num_tokens": att.num_tokens, "prompt_crc": att.prompt_crc, "mac": mac}))
        await writer.drain()
    except BaseException:
        writer.close()
        raise
    return reader, writer


def check_header(h: KVHeader, att: Attach, layout: tuple[int, int, int, str], model_sha256: str) -> None:
    """Decode-side verification of a HEADER against what decode expects; raises WireError('mismatch')."""
    if h.room != att.room:
        raise WireError("mismatch", f"HEADER is for room {h.room}, expected {att.room}")
    if h.num_tokens != att.num_tokens:
        raise WireError("mismatch", f"HEADER carries {h.num_tokens} tokens, decode tokenized {att.num_tokens}")
    if h.prompt_crc != att.prompt_crc:
        raise WireError("mismatch", "prompt token checksum differs between prefill and decode")
    if (h.num_layers, h.num_kv_heads, h.head_dim, h.dtype) != layout:
        raise WireError("mismatch", f"KV layout {(h.num_layers, h.num_kv_heads, h.head_dim, h.dtype)} != decode's {layout}")
    if model_sha256 and h.model_sha256 and h.model_sha256 != model_sha256:
        raise WireError("mismatch", "prefill and decode run different model weights (sha256 differs)")


async def recv_kv(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, att: Attach,
                  on_header: Callable[[KVHeader], "ChunkSink"]) -> tuple[KVHeader, int]:
    """Read HEADER, CHUNKs and END; verify completeness and checksum; send ACK. -> (header, bytes).

    ``on_header`` verifies the header (raise WireError to refuse) and returns the sink that
    writes chunks into the reserved pages.
    """
    header = wire.header_from_json(await wire.read_control(reader, FrameType.HEADER))
    sink = on_header(header)
    crc = 0
    nbytes = 0
    expected_bytes = header.total_bytes
    per_tok = header.bytes_per_token_layer
    while True:
        ftype, payload = await wire.read_frame(reader)
        if ftype is FrameType.CHUNK:
            layer, kind, start, count, raw = wire.decode_chunk(payload)
            if layer >= header.num_layers or start + count > header.num_tokens or len(raw) != count * per_tok:
                raise WireError("protocol", f"CHUNK layer={layer} tokens [{start}, {start + count}) of {len(raw)} bytes "
                                            f"does not fit the header")
            crc = zlib.crc32(raw, crc)
            nbytes += len(raw)
            sink(layer, kind, start, count, raw)
        elif ftype is FrameType.END:
            end = wire.parse_json(payload)
            if nbytes != expected_bytes:
                raise WireError("mismatch", f"received {nbytes} KV bytes, header promised {expected_bytes}")
            if int(end.get("checksum", -1)) != crc:
                raise WireError("checksum", f"KV checksum {crc:#x} != sender's {int(end.get('checksum', -1)):#x}")
            break
        elif ftype is FrameType.ERROR:
            err = wire.parse_json(payload)
            raise WireError(str(err.get("reason", "peer_error")), str(err.get("message", "")))
        else:
            raise WireError("protocol", f"unexpected {ftype.name} during KV transfer")
    writer.write(wire.encode_control(FrameType.ACK, {"room": att.room}))
    await writer.drain()
    return header, nbytes


ChunkSink = Callable[[int, int, int, int, memoryview], None]
