"""The KV wire (pdruntime.disagg.wire / transfer) in one process over real loopback TCP.

Pure pieces (layout checks, header validation, MAC, log limiter), round trips that must be bit-exact
for fp32/bf16/fp16 over scattered page tables, refusals (layout mismatch, corruption, bad credentials)
seen by both ends, hypothesis fuzzing of both decoders, and a CUDA bf16 round trip (gpu marker).
The worker-level behaviour (pages freed, client-visible errors, metrics) is in test_wire_stack.py.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import zlib
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from pdruntime.disagg import kv_staging, transfer, wire
from pdruntime.disagg.wire import Attach, ChunkHead, FrameSocket, FrameType, KVLayout, WireError

TOKEN = "s3cret-token"


def _kv(num_blocks=12, page=4, hkv=2, d=3, layers=2, dtype=torch.float32, fill=True, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)

    def mk():
        if not fill:
            return torch.zeros(num_blocks, page, hkv, d, dtype=dtype, device=device)
        return torch.randn(num_blocks, page, hkv, d, generator=g).to(dtype).to(device)

    return SimpleNamespace(k=[mk() for _ in range(layers)], v=[mk() for _ in range(layers)])


def _pages_equal(src, s_ids, dst, d_ids) -> bool:
    return all(torch.equal(a[s_ids].view(torch.uint8), b[d_ids].view(torch.uint8))
               for a, b in zip(src.k + src.v, dst.k + dst.v))


async def _transfer(src, s_ids, dst, d_ids, n, *, token_s=TOKEN, token_c=TOKEN, src_layout=None, dst_layout=None,
                    corrupt=False, via=None, room=7, progress_race=False):
    """One full transfer prefill(src) -> decode(dst). -> {"server": stats | WireError, "client": ...}.
    ``progress_race``: a PROGRESS report is scheduled (a task not yet run) just before the KV is sent, as
    prefill's periodic reporter can."""
    src_layout = src_layout or transfer.layout_of(src)
    dst_layout = dst_layout or transfer.layout_of(dst)
    prompt = list(range(100, 100 + n))
    out: dict = {}
    done = asyncio.Event()

    async def handler(conn):
        try:
            att = await transfer.accept_attach(conn, token_s)
            h = transfer.make_header(att.room, att.rid, n, 5, wire.prompt_crc(prompt), "", [src_layout], att.checksums)
            if progress_race:
                asyncio.get_running_loop().create_task(transfer.send_progress(conn, n, 1))
            out["server"] = await transfer.send_kv(conn, h, [transfer.ShardSource(src, s_ids, src_layout)],
                                                   corrupt_first_chunk=corrupt)
        except WireError as exc:
            out["server"] = exc
            await transfer.send_error(conn, exc.reason, exc.message)
        finally:
            conn.close()
            done.set()

    server = await transfer.BootstrapServer.start("127.0.0.1", 0, handler)
    port = server.port if via is None else await via(server.port)
    att = Attach(room, "rid-1", n, wire.prompt_crc(prompt))
    conn = None
    try:
        conn = await transfer.open_attach("127.0.0.1", port, token_c, att)
        header = await transfer.recv_header(conn)
        try:
            transfer.check_header(header, att, [dst_layout], "")
            out["client"] = await transfer.recv_kv(conn, header, [transfer.ShardSink(dst, d_ids, dst_layout)])
            out["first"] = header.first_token_id
        except WireError as exc:
            if exc.reason not in ("closed", "timeout"):
                await transfer.send_error(conn, exc.reason, exc.message)  # what the decode worker does
            raise
    except WireError as exc:
        out["client"] = exc
    finally:
        if conn is not None:
            conn.close()
    await asyncio.wait_for(done.wait(), 20)
    server.close()
    return out


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


# ---- pure pieces -----------------------------------------------------------------------------------

BASE = KVLayout("float32", 16, 2, 2, 32)


@pytest.mark.parametrize("field,value,text", [
    ("dtype", "bfloat16", "KV dtype: prefill sends bfloat16, decode expects float32"),
    ("page_size", 8, "KV page size (tokens per page): prefill sends 8, decode expects 16"),
    ("num_layers", 3, "layer count: prefill sends 3, decode expects 2"),
    ("num_kv_heads", 1, "KV heads per rank: prefill sends 1, decode expects 2"),
    ("head_dim", 64, "head dim: prefill sends 64, decode expects 32"),
])
def test_layout_mismatch_names_the_field_and_both_values(field, value, text):
    got = KVLayout(**{**BASE.__dict__, field: value})
    assert wire.layout_mismatch(BASE, BASE) is None
    assert text in wire.layout_mismatch(BASE, got)


def test_layout_mismatch_on_tp_rank_and_size():
    r1 = KVLayout("float32", 16, 2, 2, 32, tp_rank=1, tp_size=2)
    r0 = KVLayout("float32", 16, 2, 2, 32, tp_rank=0, tp_size=2)
    assert "tensor-parallel rank: prefill sends 1, decode expects 0" in wire.layout_mismatch(r0, r1)
    assert "tensor-parallel size: prefill sends 2, decode expects 1" in wire.layout_mismatch(BASE, r0)
    assert "prefill runs tp_size=2, decode runs tp_size=1" in wire.tp_mismatch(2, 1)
    assert wire.tp_mismatch(4, 4) is None
    assert "decode asks for TP ranks [1], this prefill endpoint serves [0]" in wire.rank_mismatch((0,), (1,))
    assert wire.rank_mismatch((0, 1), (0, 1)) is None


@pytest.mark.parametrize("kw,needle", [({"dtype": "int7"}, "not supported"), ({"page_size": 0}, "page_size"),
                                       ({"tp_rank": 2, "tp_size": 2}, "tp_rank"), ({"head_dim": True}, "head_dim")])
def test_layout_rejects_bad_values_with_a_typed_error(kw, needle):
    with pytest.raises(WireError, match=needle):
        KVLayout(**{**BASE.__dict__, **kw})


def test_header_round_trip_and_typed_rejection():
    h = transfer.make_header(3, "r", 10, 7, 99, "ab", [BASE, KVLayout("float32", 16, 2, 2, 32, 1, 2)])
    assert h.num_pages == 1 and h.total_bytes == 2 * 2 * 2 * 16 * 2 * 32 * 4
    assert wire.header_from_json(wire.header_to_json(h)) == h
    good = wire.header_to_json(h)
    for bad in ({"room": 1}, {**good, "version": 1}, {**good, "num_pages": 5}, {**good, "shards": []},
                {**good, "shards": [{**good["shards"][0], "dtype": "int7"}]}, {**good, "num_tokens": -1},
                {**good, "chunk_bytes": 0}, {**good, "shards": "x"}):
        with pytest.raises(WireError):
            wire.header_from_json(bad)


def test_mac_authenticates_room_and_token_without_sending_the_token():
    mac = wire.attach_mac("s3cret", "nonce1", 42)
    assert "s3cret" not in mac
    assert wire.verify_mac("s3cret", "nonce1", 42, mac)
    assert not wire.verify_mac("s3cret", "nonce1", 43, mac)  # other room
    assert not wire.verify_mac("s3cret", "nonce2", 42, mac)  # replay under another challenge
    assert not wire.verify_mac("other", "nonce1", 42, mac)
    assert not wire.verify_mac("s3cret", "nonce1", 42, None) and not wire.verify_mac("s3cret", "n", 42, ["x"])
    assert wire.verify_mac(None, "n", 1, "")  # auth off


def test_frame_heads_reject_unknown_types_and_oversize():
    assert wire.decode_frame_head(bytes([8, 0, 0, 0, 2])) == (FrameType.READY, 2)
    with pytest.raises(WireError, match="unknown frame type"):
        wire.decode_frame_head(bytes([99, 0, 0, 0, 0]))
    with pytest.raises(WireError, match="exceeds the limit"):
        wire.decode_frame_head(bytes([4, 0xFF, 0, 0, 0]))
    with pytest.raises(WireError, match="kind 7"):
        ChunkHead.unpack(ChunkHead(0, 0, 7, 0, 1).pack())


def test_log_limiter_allows_one_line_per_interval_and_counts_the_rest():
    lim = transfer.LogLimiter(10.0)
    assert lim.allow(0.0) == (True, 0)
    assert [lim.allow(t)[0] for t in (1, 2, 9.9)] == [False, False, False]
    assert lim.allow(10.0) == (True, 3)  # the next line reports the 3 suppressed ones
    assert lim.allow(10.5) == (False, 1)


# ---- round trips -----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_is_bit_exact_over_scattered_pages_in_several_chunks(dtype, monkeypatch):
    monkeypatch.setattr(wire, "CHUNK_TARGET_BYTES", 2 * 4 * 2 * 3 * 4)  # 2 fp32 pages per chunk: many chunks
    monkeypatch.setattr(kv_staging, "STAGE_TARGET_BYTES", 3 * 4 * 2 * 3 * 4)  # runs of 3 pages: staged in pieces
    src, dst = _kv(dtype=dtype), _kv(dtype=dtype, fill=False)
    s_ids, d_ids = [9, 2, 7, 0, 5, 11, 3], [4, 10, 1, 8, 6, 2, 0]
    n = 26  # 7 pages of 4; the last page half full (sent whole)
    out = run(_transfer(src, s_ids, dst, d_ids, n))
    assert not isinstance(out["client"], Exception), out["client"]
    assert out["first"] == 5
    el = torch.empty((), dtype=dtype).element_size()
    assert out["client"].bytes == out["server"].bytes == 2 * 2 * 7 * 4 * 2 * 3 * el
    per_chunk = wire.chunk_pages_for(4 * 2 * 3 * el)  # 2 pages (fp32) or 4 (16-bit): chunks cross (layer, kind) runs
    assert out["client"].chunks == -(-2 * 2 * 7 // per_chunk) >= 7
    assert _pages_equal(src, s_ids, dst, d_ids)
    untouched = sorted(set(range(12)) - set(d_ids))
    assert all(float(t[untouched].abs().sum()) == 0 for t in dst.k + dst.v)


def test_a_progress_report_scheduled_as_the_kv_is_sent_is_dropped_not_interleaved():
    """Prefill reports progress from a periodic task; one scheduled in the moment its KV became ready used to be
    written after the HEADER (or, from a second pool thread, into the chunks): decode failed the transfer with
    "expected CHUNK 0, got PROGRESS" (seven requests in one round of the router bench at load 3). PROGRESS
    belongs before the HEADER only: once the KV is on its way, a report is dropped."""
    for seed in range(8):  # where the report would land is a race between two pool threads: try it a few times
        src, dst = _kv(seed=seed), _kv(fill=False)
        out = run(_transfer(src, [1, 4, 6], dst, [0, 2, 5], 10, progress_race=True))
        assert not isinstance(out["client"], WireError), out
        assert not isinstance(out["server"], WireError), out
        assert _pages_equal(src, [1, 4, 6], dst, [0, 2, 5])


def test_round_trip_into_contiguous_pages_lands_in_place():
    src, dst = _kv(), _kv(fill=False)
    s_ids, d_ids = [3, 4, 5, 6], [1, 2, 3, 4]  # contiguous on both sides: sent from and received into the cache
    out = run(_transfer(src, s_ids, dst, d_ids, 16))
    assert out["client"].bytes == 2 * 2 * 4 * 4 * 2 * 3 * 4
    assert _pages_equal(src, s_ids, dst, d_ids)


@pytest.mark.parametrize("change,text", [
    ({"dtype": torch.bfloat16}, "KV dtype: prefill sends bfloat16, decode expects float32"),
    ({"page": 8}, "KV page size (tokens per page): prefill sends 8, decode expects 4"),
    ({"layers": 3}, "layer count: prefill sends 3, decode expects 2"),
    ({"hkv": 1}, "KV heads per rank: prefill sends 1, decode expects 2"),
    ({"rank": 1}, "tensor-parallel rank: prefill sends 1, decode expects 0"),
])
def test_decode_refuses_a_layout_mismatch_and_prefill_fails_with_the_same_message(change, text):
    kw = {k: v for k, v in change.items() if k != "rank"}
    src, dst = _kv(**kw), _kv(fill=False)
    src_layout = None
    if "rank" in change:  # a rank-1 shard of a TP=2 prefill offered to a decode expecting rank 0 of TP=2
        src_layout = transfer.layout_of(src, tp_rank=1, tp_size=2)
        dst_layout = transfer.layout_of(dst, tp_rank=0, tp_size=2)
    else:
        dst_layout = None
    out = run(_transfer(src, [1, 2, 3], dst, [4, 5, 6], 9, src_layout=src_layout, dst_layout=dst_layout))
    for side in ("client", "server"):
        assert isinstance(out[side], WireError) and out[side].reason == "mismatch", (side, out[side])
        assert text in out[side].message, (side, out[side].message)
    assert all(float(t.abs().sum()) == 0 for t in dst.k + dst.v)  # refused before a single page was written


def _flipping_proxy(flip_chunk: int):
    """A loopback proxy that flips one payload byte of the ``flip_chunk``-th CHUNK travelling to decode."""

    async def start(target_port: int) -> int:
        async def handle(c_reader, c_writer):
            s_reader, s_writer = await asyncio.open_connection("127.0.0.1", target_port)

            async def up():
                while data := await c_reader.read(65536):
                    s_writer.write(data)
                    await s_writer.drain()
                s_writer.close()

            async def down():
                c_writer.write(await s_reader.readexactly(len(wire.PREAMBLE)))
                seen = 0
                try:
                    while True:
                        head = await s_reader.readexactly(5)
                        payload = bytearray(await s_reader.readexactly(int.from_bytes(head[1:], "big")))
                        if head[0] == FrameType.CHUNK:
                            if seen == flip_chunk:
                                payload[len(payload) // 2] ^= 0x01  # a KV byte, not the digest
                            seen += 1
                        c_writer.write(head + payload)
                        await c_writer.drain()
                except (asyncio.IncompleteReadError, ConnectionError):
                    c_writer.close()

            await asyncio.gather(up(), down(), return_exceptions=True)

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        return server.sockets[0].getsockname()[1]

    return start


def test_a_chunk_corrupted_in_flight_is_caught_by_its_checksum_on_both_sides(monkeypatch):
    monkeypatch.setattr(wire, "CHUNK_TARGET_BYTES", 2 * 4 * 2 * 3 * 4)
    src, dst = _kv(), _kv(fill=False)
    out = run(_transfer(src, [1, 2, 3], dst, [4, 5, 6], 12, via=_flipping_proxy(3)))
    assert isinstance(out["client"], WireError) and out["client"].reason == "checksum"
    assert "CHUNK 3 " in out["client"].message and "!= sender's" in out["client"].message
    # prefill learns why (decode's ERROR frame) or at least that the peer went away; it never sees an ACK
    assert isinstance(out["server"], WireError) and out["server"].reason in ("checksum", "closed")


def test_the_fault_hook_corrupts_one_chunk_after_its_checksum():
    src, dst = _kv(), _kv(fill=False)
    out = run(_transfer(src, [1, 2, 3], dst, [4, 5, 6], 12, corrupt=True))
    assert isinstance(out["client"], WireError) and out["client"].reason == "checksum"
    assert isinstance(out["server"], WireError)


@pytest.mark.parametrize("token_c,needle", [("wrong", "bad KV-transfer credentials"),
                                            (None, "no credentials were presented")])
def test_bad_or_missing_credentials_are_refused_without_echoing_the_token(token_c, needle):
    src, dst = _kv(), _kv(fill=False)
    out = run(_transfer(src, [1], dst, [2], 4, token_c=token_c))
    for side in ("client", "server"):
        assert isinstance(out[side], WireError) and out[side].reason == "auth"
        assert needle in out[side].message and TOKEN not in out[side].message


def test_a_peer_that_vanishes_mid_stream_ends_in_closed_not_a_hang():
    async def main():
        server_sock = socket.socket()
        server_sock.bind(("127.0.0.1", 0))
        server_sock.listen(1)
        port = server_sock.getsockname()[1]

        def fake_prefill():  # handshake, HEADER, half a chunk, then gone
            s, _ = server_sock.accept()
            fs = FrameSocket(s, 5)
            fs.send_all(wire.PREAMBLE + wire.encode_control(FrameType.CHALLENGE, {"nonce": "n"}))
            fs.read_preamble()
            fs.read_control(FrameType.ATTACH)
            h = transfer.make_header(1, "r", 4, 0, wire.prompt_crc([1, 2, 3, 4]), "", [transfer.layout_of(_kv())])
            fs.send_control(FrameType.HEADER, wire.header_to_json(h))
            fs.read_control(FrameType.READY)
            fs.send_all(wire._FRAME.pack(FrameType.CHUNK, ChunkHead.SIZE + 96 + 8) + ChunkHead(0, 0, 0, 0, 1).pack()
                        + b"x" * 40)
            fs.close()

        t = threading.Thread(target=fake_prefill)
        t.start()
        att = Attach(1, "r", 4, wire.prompt_crc([1, 2, 3, 4]))
        conn = await transfer.open_attach("127.0.0.1", port, None, att)
        header = await transfer.recv_header(conn)
        dst = _kv(fill=False)
        with pytest.raises(WireError) as ei:
            await transfer.recv_kv(conn, header, [transfer.ShardSink(dst, [3], transfer.layout_of(dst))])
        conn.close()
        t.join(5)
        server_sock.close()
        return ei.value

    err = run(main())
    assert err.reason == "closed" and "CHUNK 0" in err.message


# ---- fuzz: both decoders, random bytes and truncations -------------------------------------------

_FUZZ_KV = _kv(num_blocks=4, page=2, hkv=1, d=2, layers=1)
_FUZZ_LAYOUT = transfer.layout_of(_FUZZ_KV)
_FUZZ_PROMPT = [1, 2, 3]
_FUZZ_ATT = Attach(5, "r", 3, wire.prompt_crc(_FUZZ_PROMPT))


def _valid_prefill_stream() -> bytes:
    h = transfer.make_header(5, "r", 3, 9, wire.prompt_crc(_FUZZ_PROMPT), "", [_FUZZ_LAYOUT])
    out = [wire.PREAMBLE, wire.encode_control(FrameType.CHALLENGE, {"nonce": "ab"}),
           wire.encode_control(FrameType.HEADER, wire.header_to_json(h))]
    for kind in (0, 1):
        raw = kv_staging.page_rows((_FUZZ_KV.k if kind == 0 else _FUZZ_KV.v)[0])[[0, 1]].numpy().tobytes()
        out.append(wire.encode_frame(FrameType.CHUNK, ChunkHead(0, 0, kind, 0, 2).pack() + raw
                                     + zlib.crc32(raw).to_bytes(8, "big")))
    out.append(wire.encode_control(FrameType.END, {"bytes": 2 * 2 * _FUZZ_LAYOUT.page_bytes, "chunks": 2}))
    return b"".join(out)


VALID = _valid_prefill_stream()


def _feed(data: bytes, run_reader):
    """Write ``data`` then EOF into one end of a socket pair; run the decoder on the other (2 s stall bound)."""
    a, b = socket.socketpair()
    writer = threading.Thread(target=lambda: (a.sendall(data), a.shutdown(socket.SHUT_WR)), daemon=True)
    writer.start()
    fs = FrameSocket(b, 2.0)
    try:
        return run_reader(fs)
    finally:
        fs.close()
        writer.join(5)
        a.close()


def _decode_side(fs: FrameSocket):
    transfer._client_handshake(fs, TOKEN, _FUZZ_ATT)
    header = wire.header_from_json(fs.read_control(FrameType.HEADER))
    transfer.check_header(header, _FUZZ_ATT, [_FUZZ_LAYOUT], "")
    dst = _kv(num_blocks=4, page=2, hkv=1, d=2, layers=1, fill=False)
    transfer._recv_body(fs, header, [transfer.ShardSink(dst, [2, 3], _FUZZ_LAYOUT)], transfer.TransferStats())
    return dst


def test_the_valid_fuzz_seed_stream_decodes():
    dst = _feed(VALID, _decode_side)
    assert _pages_equal(_FUZZ_KV, [0, 1], dst, [2, 3])


FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)


@FUZZ
@given(st.binary(max_size=2048))
def test_fuzz_decode_side_rejects_random_bytes_with_a_wire_error(data):
    with pytest.raises(WireError):
        _feed(data, _decode_side)


@FUZZ
@given(st.integers(0, len(VALID) - 1))
def test_fuzz_decode_side_rejects_every_truncation(cut):
    with pytest.raises(WireError):
        _feed(VALID[:cut], _decode_side)


@FUZZ
@given(st.lists(st.tuples(st.integers(0, len(VALID) - 1), st.integers(1, 255)), min_size=1, max_size=4))
def test_fuzz_decode_side_never_accepts_corrupt_kv_and_never_crashes(flips):
    data = bytearray(VALID)
    for pos, x in flips:
        data[pos] ^= x
    try:
        dst = _feed(bytes(data), _decode_side)
    except WireError:
        return
    # accepted: only flips outside the KV bytes (nonce, rid, first token id...) may pass, never wrong KV
    assert _pages_equal(_FUZZ_KV, [0, 1], dst, [2, 3])


@FUZZ
@given(st.one_of(st.binary(max_size=1024),
                 st.binary(max_size=512).map(lambda b: wire.PREAMBLE + b),
                 st.dictionaries(st.text(max_size=8), st.one_of(st.integers(), st.text(max_size=8), st.none(),
                                                                st.lists(st.integers(), max_size=3)), max_size=8)
                 .map(lambda d: wire.PREAMBLE + wire.encode_control(FrameType.ATTACH, d))))
def test_fuzz_prefill_side_rejects_random_attach_bytes_with_a_wire_error(data):
    with pytest.raises(WireError):
        _feed(data, _prefill_side)


def _prefill_side(fs: FrameSocket):
    """The prefill half of the handshake as the bootstrap server runs it: on an event loop, deadline-bounded."""
    return asyncio.run(transfer.accept_attach(transfer.KVConn(fs.sock), TOKEN, deadline_s=2.0))


# ---- CUDA ------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (moves bf16 pages from and into device memory)")
def test_bf16_pages_move_between_cuda_caches_bit_exactly(monkeypatch):
    monkeypatch.setattr(wire, "CHUNK_TARGET_BYTES", 64 << 10)
    monkeypatch.setattr(kv_staging, "STAGE_TARGET_BYTES", 256 << 10)  # several runs: exercises the double buffer
    src = _kv(num_blocks=64, page=16, hkv=8, d=128, layers=4, dtype=torch.bfloat16, device="cuda")
    dst = _kv(num_blocks=64, page=16, hkv=8, d=128, layers=4, dtype=torch.bfloat16, device="cuda", fill=False)
    s_ids = [int(i) for i in torch.randperm(64, generator=torch.Generator().manual_seed(1))[:40]]
    d_ids = [int(i) for i in torch.randperm(64, generator=torch.Generator().manual_seed(2))[:40]]
    out = run(_transfer(src, s_ids, dst, d_ids, 40 * 16 - 3))
    assert not isinstance(out["client"], Exception), out["client"]
    torch.cuda.synchronize()
    assert _pages_equal(src, s_ids, dst, d_ids)


def test_after_io_waits_for_a_blocked_receive_to_end_before_pages_may_be_freed():
    """Decode frees a failed request's pages through KVConn.after_io: never while a receive thread can
    still write into them."""

    async def main():
        a, b = socket.socketpair()
        conn = transfer.KVConn(b, 10)
        freed = []
        task = asyncio.ensure_future(conn.run(conn.fs.recv_exact, 10))  # blocks: nothing is sent
        for _ in range(500):  # until the receive runs on its thread (blocked: nothing is sent)
            if conn._io is not None and conn._io.running():
                break
            await asyncio.sleep(0.01)
        assert conn._io is not None and conn._io.running()
        task.cancel()  # what decode's _fail does to the transfer task
        conn.after_io(lambda: freed.append("freed"))
        await asyncio.wait({task})  # the cancellation has reached the caller
        await asyncio.sleep(0)  # and what it scheduled on the loop has run
        early = list(freed)
        conn.close()  # wakes the blocked receive; only then the pages go
        for _ in range(100):
            if freed:
                break
            await asyncio.sleep(0.02)
        a.close()
        return early, freed

    early, freed = run(main())
    assert early == [] and freed == ["freed"]
