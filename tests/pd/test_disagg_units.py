"""Unit tests of the PD protocol pieces: transfer states, wire format + auth, KV chunk round trip, watchdog."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch

from pdruntime.disagg import transfer, wire
from pdruntime.disagg.prefill_queues import PrefillQueues, PrefillRequest
from pdruntime.disagg.states import IllegalTransition, TransferState as S, TransferStatus, can_transition
from pdruntime.disagg.watchdog import OffsetClock, Watchdog
from pdruntime.disagg.wire import KVHeader, WireError


# ---- states --------------------------------------------------------------------------------------

def test_transfer_states_are_forward_only_except_failed():
    order = [S.BOOTSTRAPPING, S.WAITING_FOR_INPUT, S.TRANSFERRING, S.SUCCESS]
    for i, a in enumerate(order):
        for j, b in enumerate(order):
            assert can_transition(a, b) == (j > i and a is not S.SUCCESS), (a, b)
        assert can_transition(a, S.FAILED) == (a is not S.SUCCESS)
    assert not any(can_transition(S.FAILED, b) for b in S)


def test_transfer_status_records_times_and_refuses_backwards_moves():
    st = TransferStatus(now=1.0)
    st.advance(S.WAITING_FOR_INPUT, 2.0)
    st.advance(S.TRANSFERRING, 3.5)
    assert st.since() == 3.5 and st.entered[S.BOOTSTRAPPING] == 1.0
    with pytest.raises(IllegalTransition):
        st.advance(S.WAITING_FOR_INPUT, 4.0)
    assert st.fail(5.0, "peer lost") and st.state is S.FAILED and st.reason == "peer lost"
    assert not st.fail(6.0, "again")  # terminal: no change
    assert st.reason == "peer lost"


# ---- wire ----------------------------------------------------------------------------------------

def test_mac_authenticates_room_and_token_without_sending_the_token():
    mac = wire.attach_mac("s3cret", "nonce1", 42)
    assert "s3cret" not in mac
    assert wire.verify_mac("s3cret", "nonce1", 42, mac)
    assert not wire.verify_mac("s3cret", "nonce1", 43, mac)  # other room
    assert not wire.verify_mac("s3cret", "nonce2", 42, mac)  # replay under another challenge
    assert not wire.verify_mac("other", "nonce1", 42, mac)
    assert wire.verify_mac(None, "n", 1, "")  # auth off


def test_header_round_trip_and_validation():
    h = KVHeader(room=7, rid="r", num_tokens=5, first_token_id=3, num_layers=2, num_kv_heads=2, head_dim=4,
                 dtype="float32", chunk_tokens=2, prompt_crc=wire.prompt_crc([1, 2, 3, 4, 5]), model_sha256="ab")
    assert wire.header_from_json(wire.header_to_json(h)) == h
    assert h.total_bytes == 2 * 2 * 5 * 2 * 4 * 4
    with pytest.raises(WireError) as e:
        wire.header_from_json({"room": 1})
    assert e.value.reason == "protocol"
    with pytest.raises(WireError):
        wire.header_from_json({**wire.header_to_json(h), "dtype": "int7"})


def test_frames_reject_oversized_and_unknown_types():
    async def run(data: bytes, max_bytes: int = 100):
        r = asyncio.StreamReader()
        r.feed_data(data)
        r.feed_eof()
        return await wire.read_frame(r, max_bytes)

    assert asyncio.run(run(wire.encode_frame(wire.FrameType.ACK, b"{}"))) == (wire.FrameType.ACK, b"{}")
    with pytest.raises(WireError, match="exceeds"):
        asyncio.run(run(wire.encode_frame(wire.FrameType.CHUNK, b"x" * 200)))
    with pytest.raises(WireError, match="unknown frame type"):
        asyncio.run(run(bytes([99, 0, 0, 0, 0])))


def _kv(num_blocks=6, bs=4, hkv=2, d=3, layers=2, fill=True):
    g = torch.Generator().manual_seed(0)
    mk = (lambda: torch.randn(num_blocks, bs, hkv, d, generator=g)) if fill else (lambda: torch.zeros(num_blocks, bs, hkv, d))
    return SimpleNamespace(k=[mk() for _ in range(layers)], v=[mk() for _ in range(layers)])


def test_gather_scatter_moves_kv_between_different_page_layouts():
    src, dst = _kv(), _kv(fill=False)
    n = 10  # tokens, across 3 pages of 4
    s_slots = transfer.flat_slots([5, 1, 3], 4, n)
    d_slots = transfer.flat_slots([0, 4, 2], 4, n)
    for layer, kind, start, count, raw in transfer.gather_chunks(src, s_slots, chunk_tokens=3):
        assert count <= 3
        transfer.scatter_chunk(dst, d_slots, layer, kind, start, count, memoryview(raw), torch.float32)
    for layer in range(2):
        for a, b in ((src.k[layer], dst.k[layer]), (src.v[layer], dst.v[layer])):
            assert torch.equal(a.view(-1, 2, 3)[s_slots], b.view(-1, 2, 3)[d_slots])
    assert dst.k[0][0].abs().sum() > 0 and dst.k[0][1].abs().sum() == 0  # untouched page stays zero


async def _corrupting_proxy(target_port: int):
    """A TCP proxy that flips one byte in the payload of the first CHUNK frame travelling to the client."""

    async def handle(c_reader, c_writer):
        s_reader, s_writer = await asyncio.open_connection("127.0.0.1", target_port)

        async def up():
            while data := await c_reader.read(65536):
                s_writer.write(data)
                await s_writer.drain()
            s_writer.close()

        async def down():
            c_writer.write(await s_reader.readexactly(len(wire.PREAMBLE)))
            flipped = False
            try:
                while True:
                    head = await s_reader.readexactly(5)
                    payload = bytearray(await s_reader.readexactly(int.from_bytes(head[1:], "big")))
                    if head[0] == wire.FrameType.CHUNK and not flipped:
                        payload[-1] ^= 0xFF
                        flipped = True
                    c_writer.write(head + payload)
                    await c_writer.drain()
            except asyncio.IncompleteReadError:
                c_writer.close()

        await asyncio.gather(up(), down(), return_exceptions=True)

    return await asyncio.start_server(handle, "127.0.0.1", 0)


async def _loopback(token_server, token_client, room_client=9, corrupt=False, n=10):
    """Run one full transfer over a real loopback socket. -> (server outcome, client outcome, dst kv)."""
    src, dst = _kv(), _kv(fill=False)
    prompt = list(range(100, 100 + n))
    s_slots = transfer.flat_slots([5, 1, 3], 4, n)
    d_slots = transfer.flat_slots([0, 4, 2], 4, n)
    result = {}

    async def handle(reader, writer):
        try:
            att = await transfer.accept_attach(reader, writer, token_server)
            h = KVHeader(room=att.room, rid=att.rid, num_tokens=n, first_token_id=7, num_layers=2, num_kv_heads=2,
                         head_dim=3, dtype="float32", chunk_tokens=4, prompt_crc=wire.prompt_crc(prompt), model_sha256="")
            chunks = transfer.gather_chunks(src, s_slots, 4)
            result["server"] = await transfer.send_kv(reader, writer, h, chunks)
        except WireError as exc:
            result["server"] = exc.reason
            await transfer.send_error(writer, exc.reason, exc.message)
        except (asyncio.IncompleteReadError, ConnectionError):
            result["server"] = "eof"

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    if corrupt:
        proxy = await _corrupting_proxy(port)
        port = proxy.sockets[0].getsockname()[1]
    att = transfer.Attach(room_client, "rid-1", n, wire.prompt_crc(prompt))
    try:
        reader, writer = await transfer.open_attach("127.0.0.1", port, token_client, att)

        def on_header(h):
            transfer.check_header(h, att, (2, 2, 3, "float32"), "")
            return lambda layer, kind, start, count, raw: transfer.scatter_chunk(dst, d_slots, layer, kind, start, count, raw, torch.float32)

        header, nbytes = await transfer.recv_kv(reader, writer, att, on_header)
        result["client"] = (header.first_token_id, nbytes)
        writer.close()
    except WireError as exc:
        result["client"] = exc.reason
        if "writer" in locals():
            writer.close()  # what the decode worker does on failure
    for _ in range(200):
        if "server" in result:
            break
        await asyncio.sleep(0.01)
    server.close()
    return result, src, dst, s_slots, d_slots


def test_loopback_transfer_delivers_verified_kv_and_acks():
    res, src, dst, s_slots, d_slots = asyncio.run(_loopback("tok", "tok"))
    assert res["client"] == (7, 2 * 2 * 10 * 2 * 3 * 4)
    assert res["server"] == res["client"][1]  # server saw the ACK
    assert torch.equal(src.v[1].view(-1, 2, 3)[s_slots], dst.v[1].view(-1, 2, 3)[d_slots])


def test_loopback_transfer_rejects_a_wrong_token():
    res, *_ = asyncio.run(_loopback("tok", "wrong"))
    assert res["server"] == "auth" and res["client"] == "auth"


def test_loopback_transfer_detects_corruption_by_checksum():
    res, *_ = asyncio.run(_loopback("tok", "tok", corrupt=True))
    assert res["client"] == "checksum"
    assert res["server"] == "eof"  # no ACK ever came


def test_decode_refuses_a_header_for_another_room_or_prompt():
    att = transfer.Attach(1, "r", 10, 123)
    h = KVHeader(room=2, rid="r", num_tokens=10, first_token_id=0, num_layers=2, num_kv_heads=2, head_dim=3,
                 dtype="float32", chunk_tokens=4, prompt_crc=123, model_sha256="")
    with pytest.raises(WireError, match="room"):
        transfer.check_header(h, att, (2, 2, 3, "float32"), "")
    with pytest.raises(WireError, match="checksum"):
        transfer.check_header(KVHeader(**{**h.__dict__, "room": 1, "prompt_crc": 5}), att, (2, 2, 3, "float32"), "")
    with pytest.raises(WireError, match="layout"):
        transfer.check_header(KVHeader(**{**h.__dict__, "room": 1}), att, (3, 2, 3, "float32"), "")


# ---- watchdog ------------------------------------------------------------------------------------

def test_watchdog_fires_once_after_timeout_on_the_injected_clock():
    clock = OffsetClock()
    fired_metric = []
    wd = Watchdog("prefill", clock, tick_s=0.01, on_fired=lambda r, p: fired_metric.append((r, p)))
    hits = []
    wd.arm("a", "transfer", 10.0, lambda d: hits.append(d.key))
    assert wd.check() == [] and hits == []
    clock.advance(10.5)
    assert [d.key for d in wd.check()] == ["a"]
    assert hits == ["a"] and fired_metric == [("prefill", "transfer")]
    assert wd.check() == []  # fired deadlines are gone


def test_watchdog_disarm_covers_only_the_guarded_phase():
    clock = OffsetClock()
    wd = Watchdog("prefill", clock, tick_s=0.01)
    hits = []
    wd.arm("r", "transfer", 1.0, lambda d: hits.append(d.phase))
    clock.advance(0.5)
    wd.disarm("r", "transfer")  # receipt confirmed: the decode phase that follows is not watched
    clock.advance(1000.0)
    wd.check()
    assert hits == []


def test_watchdog_ticks_on_its_own_without_traffic():
    async def main():
        wd = Watchdog("decode", OffsetClock(), tick_s=0.01)
        hits = []
        wd.arm("lonely", "decode_transfer", 0.05, lambda d: hits.append(d.key))
        wd.start()
        await asyncio.sleep(0.3)  # nothing else happens on this loop
        await wd.stop()
        return hits, wd.ticks

    hits, ticks = asyncio.run(main())
    assert hits == ["lonely"] and ticks >= 5


def test_watchdog_survives_a_failing_handler():
    wd = Watchdog("p", OffsetClock(), 0.01)
    wd.arm("x", "bootstrap", 0.0, lambda d: 1 / 0)
    wd.arm("y", "bootstrap", 0.0, lambda d: None)
    wd.clock.advance(1)
    assert {d.key for d in wd.check()} == {"x", "y"}


# ---- queues --------------------------------------------------------------------------------------

def test_prefill_queues_move_and_room_wait():
    async def main():
        q = PrefillQueues()
        loop = asyncio.get_running_loop()
        mk = lambda rid, room: PrefillRequest(rid, room, "c", [1], None, 0.0, TransferStatus(0.0), loop.create_future())
        waiter = asyncio.create_task(q.wait_room(5, 1.0))
        await asyncio.sleep(0)
        r = mk("a", 5)
        q.register(r)
        assert await waiter is r
        with pytest.raises(KeyError):
            q.register(mk("b", 5))  # room in use
        q.move("a", "inflight")
        assert q.counts() == {"bootstrap": 0, "waiting": 0, "inflight": 1}
        q.finish(r)
        assert len(q) == 0 and 5 not in q.by_room
        assert await q.wait_room(6, 0.05) is None
        assert not q._room_waiters

    asyncio.run(main())
