"""The KV wire's bulk phase at sizes and shapes the small round trips in test_wire.py do not reach.

Page spans by bisection (pure, against one view per page), resuming a partial sendmsg / recvmsg_into, calls
of more than IOV_MAX buffers, chunks capped so that one sendmsg holds them, multi-MiB transfers over two TP
shards whose tail is shorter than the SO_RCVLOWAT threshold (no wake-up may be missed), a chunk whose head or
length does not fit wire order, and the event loop leaving the socket non-blocking (uvloop).
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from pdruntime.disagg import kv_staging, transfer, wire
from pdruntime.disagg.wire import Attach, ChunkHead, FrameSocket, FrameType, WireError
from test_wire import TOKEN, _kv, _pages_equal, run


# ---- pure pieces -----------------------------------------------------------------------------------

@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.data())
def test_span_table_views_are_the_pages_in_table_order_one_view_per_run(data):
    num_blocks = data.draw(st.integers(1, 40))
    ids = np.array(data.draw(st.permutations(range(num_blocks))), dtype=np.int64)
    ids = ids[:data.draw(st.integers(1, num_blocks))]
    pb = 3
    cache = bytes(range(256)) * (num_blocks * pb // 256 + 1)
    mv = memoryview(cache)[:num_blocks * pb]
    p0 = data.draw(st.integers(0, len(ids) - 1))
    p1 = data.draw(st.integers(p0 + 1, len(ids)))
    views = kv_staging.SpanTable(ids, pb).views(mv, p0, p1)
    assert b"".join(views) == b"".join(bytes(mv[i * pb:(i + 1) * pb]) for i in ids[p0:p1])
    runs = 1 + int(np.count_nonzero(np.diff(ids[p0:p1]) != 1))
    assert len(views) == runs  # one buffer per run of consecutive pages, never one per page


def test_after_resumes_a_partial_transfer_inside_a_view_and_past_empty_views():
    views = [memoryview(b"abc"), memoryview(b""), memoryview(b"defgh")]
    assert [bytes(v) for v in wire._after(views, 3)] == [b"defgh"]
    assert [bytes(v) for v in wire._after(views, 1)] == [b"bc", b"", b"defgh"]
    assert [bytes(v) for v in wire._after(views, 5)] == [b"fgh"]


def test_a_chunk_fits_one_sendmsg_however_small_the_pages():
    assert wire.chunk_pages_for(96) == wire.MAX_CHUNK_PAGES  # 1 MiB / 96 B would be 10922 buffers
    assert wire.MAX_CHUNK_PAGES + wire.CHUNK_IOV_EXTRA <= wire.MAX_IOV
    assert wire.chunk_pages_for(8 << 20) == 1  # a page over the chunk target still goes, alone
    assert wire.chunk_pages_in(wire.CHUNK_OVERHEAD + 5 * 96, 96) == 5
    assert wire.chunk_pages_in(wire.CHUNK_OVERHEAD + 5 * 96 + 1, 96) is None
    assert wire.chunk_pages_in(wire.CHUNK_OVERHEAD, 96) is None


def test_more_buffers_than_iov_max_go_out_and_land_in_order():
    a, b = socket.socketpair()
    src = bytes(np.random.default_rng(0).integers(0, 256, 3 * 2500, dtype=np.uint8))
    dst = bytearray(len(src))
    out = [memoryview(src)[i:i + 3] for i in range(0, len(src), 3)]  # 2500 buffers: three sendmsg calls
    into = [memoryview(dst)[i:i + 3] for i in range(0, len(dst), 3)]
    sender = threading.Thread(target=FrameSocket(a, 10).send_views, args=(out,))
    sender.start()
    FrameSocket(b, 10).recv_exact_into_views(into)
    sender.join(10)
    a.close()
    b.close()
    assert bytes(dst) == src


# ---- bulk transfers over loopback ----------------------------------------------------------------

async def _transfer_shards(srcs, s_ids, dsts, d_ids, num_tokens):
    """One transfer of len(srcs) TP shards on one connection (one prefill endpoint serving every rank).
    -> (prefill's stats or WireError, decode's stats or WireError)."""
    layouts = [transfer.layout_of(kv, r, len(srcs)) for r, kv in enumerate(srcs)]
    prompt = list(range(num_tokens))
    served: dict = {}
    done = asyncio.Event()

    async def handler(conn):
        try:
            att = await transfer.accept_attach(conn, TOKEN)
            h = transfer.make_header(att.room, att.rid, num_tokens, 1, wire.prompt_crc(prompt), "", layouts,
                                     att.checksums)
            served["stats"] = await transfer.send_kv(conn, h, [transfer.ShardSource(kv, s_ids, lay)
                                                               for kv, lay in zip(srcs, layouts)])
        except WireError as exc:
            served["stats"] = exc
        finally:
            conn.close()
            done.set()

    server = await transfer.BootstrapServer.start("127.0.0.1", 0, handler)
    att = Attach(3, "bulk", num_tokens, wire.prompt_crc(prompt), tp_size=len(srcs), tp_ranks=tuple(range(len(srcs))))
    conn = await transfer.open_attach("127.0.0.1", server.port, TOKEN, att)
    try:
        header = await transfer.recv_header(conn)
        transfer.check_header(header, att, layouts, "")
        got = await transfer.recv_kv(conn, header, [transfer.ShardSink(kv, d_ids, lay) for kv, lay in zip(dsts, layouts)])
    except WireError as exc:
        got = exc
    finally:
        conn.close()
    await asyncio.wait_for(done.wait(), 20)
    server.close()
    return served["stats"], got


def _bf16_kv(seed: int, fill: bool = True):
    return _kv(num_blocks=48, page=16, hkv=8, d=128, layers=2, dtype=torch.bfloat16, fill=fill, seed=seed)


@pytest.mark.parametrize("pages", [17, 20, 40])
def test_multi_mib_two_shard_transfers_end_without_waiting_on_a_missed_wakeup(pages, monkeypatch):
    """32 KiB pages, 1 MiB chunks, two shards: the tails (4, 16 and 32 pages after the last full chunk of a
    shard) sit below, at and above RCVLOWAT_BYTES. A receive that waited for bytes that never come would only be
    rescued by the I/O timeout, set here far beyond the hang deadline."""
    monkeypatch.setattr(transfer, "IO_TIMEOUT_S", 600.0)
    srcs, dsts = [_bf16_kv(0), _bf16_kv(1)], [_bf16_kv(0, fill=False), _bf16_kv(1, fill=False)]
    s_ids = [int(i) for i in np.random.default_rng(pages).permutation(48)[:pages]]
    d_ids = [int(i) for i in np.random.default_rng(pages + 1).permutation(48)[:pages]]
    served, got = asyncio.run(asyncio.wait_for(_transfer_shards(srcs, s_ids, dsts, d_ids, pages * 16 - 5), 30))
    assert not isinstance(got, Exception), got
    assert not isinstance(served, Exception), served
    assert got.bytes == served.bytes == 2 * 2 * 2 * pages * (32 << 10)
    assert all(_pages_equal(s, s_ids, d, d_ids) for s, d in zip(srcs, dsts))


def test_pages_smaller_than_a_chunk_has_buffers_move_in_capped_chunks():
    """96-byte pages: a chunk would be 10922 pages by bytes; it is MAX_CHUNK_PAGES, one buffer each."""
    src = _kv(num_blocks=2600, page=4, hkv=2, d=3, layers=1)
    dst = _kv(num_blocks=2600, page=4, hkv=2, d=3, layers=1, fill=False)
    s_ids = [int(i) for i in np.random.default_rng(5).permutation(2600)[:2500]]
    d_ids = [int(i) for i in np.random.default_rng(6).permutation(2600)[:2500]]
    served, got = run(_transfer_shards([src], s_ids, [dst], d_ids, 2500 * 4))
    assert not isinstance(got, Exception), got
    assert got.chunks == -(-2 * 2500 // wire.MAX_CHUNK_PAGES)
    assert _pages_equal(src, s_ids, dst, d_ids)


# ---- a chunk that does not fit wire order --------------------------------------------------------

def _decode_against(send_chunk_frames) -> WireError:
    """Decode's side of one transfer against a hand-written prefill that sends ``send_chunk_frames(fs, layout)``
    after READY. -> (the WireError decode raised, decode's cache)."""
    kv = _kv()
    layout = transfer.layout_of(kv)

    async def main():
        lsock = socket.create_server(("127.0.0.1", 0))

        def fake_prefill():
            s, _ = lsock.accept()
            fs = FrameSocket(s, 5)
            fs.send_all(wire.PREAMBLE + wire.encode_control(FrameType.CHALLENGE, {"nonce": "n"}))
            fs.read_preamble()
            fs.read_control(FrameType.ATTACH)
            h = transfer.make_header(1, "r", 8, 0, wire.prompt_crc(list(range(8))), "", [layout])
            fs.send_control(FrameType.HEADER, wire.header_to_json(h))
            fs.read_control(FrameType.READY)
            try:  # decode may already have failed the chunk and closed: then END finds a broken pipe
                send_chunk_frames(fs, layout)
                fs.send_control(FrameType.END, {"bytes": 0, "chunks": 0})
                fs.read_frame()  # until decode has answered or closed
            except WireError:
                pass
            fs.close()

        t = threading.Thread(target=fake_prefill)
        t.start()
        att = Attach(1, "r", 8, wire.prompt_crc(list(range(8))))
        conn = await transfer.open_attach("127.0.0.1", lsock.getsockname()[1], None, att)
        dst = _kv(fill=False)
        try:
            header = await transfer.recv_header(conn)
            with pytest.raises(WireError) as ei:
                await transfer.recv_kv(conn, header, [transfer.ShardSink(dst, [3, 4], layout)])
        finally:
            conn.close()
            t.join(10)
            lsock.close()
        return ei.value, dst

    return run(main())


def _chunk(fs: FrameSocket, head: ChunkHead, payload: bytes, extra: bytes = b"") -> None:
    digest = wire.chunk_digest("crc32", [payload])
    fs.send_frame(FrameType.CHUNK, head.pack() + payload + extra + digest.to_bytes(8, "big"))


def test_a_chunk_whose_head_is_not_the_next_in_wire_order_fails_naming_both():
    err, _ = _decode_against(lambda fs, lay: _chunk(fs, ChunkHead(0, 0, 0, 1, 2), bytes(2 * lay.page_bytes)))
    assert err.reason == "protocol"
    assert "pages 1+2" in err.message and "expected shard 0 layer 0 kind 0 pages 0+2" in err.message


def test_a_chunk_that_is_not_whole_pages_fails_before_any_byte_lands():
    err, dst = _decode_against(lambda fs, lay: _chunk(fs, ChunkHead(0, 0, 0, 0, 1), b"\x01" * lay.page_bytes, b"xyz"))
    assert err.reason == "protocol" and "not a head, 1 to 8 pages of 96 bytes" in err.message
    assert all(float(t.abs().sum()) == 0 for t in dst.k + dst.v)


# ---- the event loop and the socket's blocking mode ---------------------------------------------------

def test_waiting_for_the_peer_hands_the_transfer_thread_a_blocking_socket():
    """uvloop (libuv) makes an fd it watches non-blocking and leaves it so; the blocking reads after the wait
    then failed at once as "peer stalled". Here the fd is made non-blocking behind the socket's back."""

    async def main():
        a, b = socket.socketpair()
        conn = transfer.KVConn(b, 10)
        os.set_blocking(b.fileno(), False)
        a.send(b"x")
        await conn.wait_readable(10)
        blocking = os.get_blocking(b.fileno())
        conn.close()
        a.close()
        return blocking

    assert run(main())


def test_a_transfer_under_uvloop_is_bit_exact():
    uvloop = pytest.importorskip("uvloop", reason="uvloop is not installed (pdrt serve pins asyncio's own loop)")
    srcs, dsts = [_bf16_kv(0)], [_bf16_kv(0, fill=False)]
    ids = list(range(20))
    served, got = uvloop.run(asyncio.wait_for(_transfer_shards(srcs, ids, dsts, ids[::-1], 20 * 16), 30))
    assert not isinstance(got, Exception), got
    assert _pages_equal(srcs[0], ids, dsts[0], ids[::-1])
