"""KV wire throughput on loopback: the pdstack KV wire next to a raw Python socket, measured in the same run.

Two processes (this one is decode / the receiving end; a child is prefill / the sending end):

- **raw socket**: the peer sends N bytes with ``sendall`` from one preallocated 4 MiB buffer, we
  ``recv_into`` one preallocated 4 MiB buffer: the ceiling for a Python TCP stream on this host.
- **raw socket, same pages**: the peer ``sendmsg``s the wire's scattered pages (page spans of a
  hundreds-of-MiB cache, as the wire does) and we ``recvmsg_into`` decode's scattered pages, with no
  framing and no checksum: the ceiling for moving KV that lives in DRAM rather than in CPU caches.
  Plain loops, 4 MiB of pages per call, no flags (``plain_sendmsg`` / ``plain_recvmsg_into`` here, not the
  wire's own socket code, so the reference does not move when the wire changes);
- **raw, same pages, MSG_WAITALL**: the same, receiving with MSG_WAITALL (which the wire uses): how much of
  the wire's receive path a raw peer would also gain from that one flag.
- **pdstack wire**: the real API (``open_attach`` -> ``recv_header`` -> ``recv_kv`` against
  ``BootstrapServer`` + ``accept_attach`` + ``send_kv``), moving paged KV from scattered pages of a
  paged cache into scattered pages of another (random page tables), with framing and a per-chunk
  checksum on both ends; and again with contiguous page tables.

The plain raw peer reads and writes one 4 MiB buffer that stays in the CPU caches; the wire reads and
writes pages spread over a cache of hundreds of MiB (DRAM), as a real transfer does.

KV layout: one TP rank of a Llama-3-8B-shaped cache (32 layers, 8 KV heads x 128, bf16, 16-token
pages: 2 MiB of K+V per page across layers). Rounds interleave raw and wire at every size; the table
shows the best and the median of the rounds. Timing covers the bulk phase (raw: request to last
byte; wire: READY to ACK, i.e. ``TransferStats.seconds`` on decode).

    .venv/bin/python bench/kv_wire.py [--sizes-mib 16 64 256] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import torch

from pdruntime.disagg import transfer, wire

LAYERS, KV_HEADS, HEAD_DIM, PAGE, DTYPE = 32, 8, 128, 16, torch.bfloat16
RAW_CHUNK = 4 << 20  # bytes per sendall / recv_into (sendmsg / recvmsg_into of pages) of the raw-socket peer
IOV_MAX = 1024  # Linux: buffers per sendmsg / recvmsg_into
TOKEN = "bench-token"


def make_kv(num_blocks: int, fill: bool):
    shape = (num_blocks, PAGE, KV_HEADS, HEAD_DIM)
    g = torch.Generator().manual_seed(0)
    mk = (lambda: torch.randn(shape, generator=g).to(DTYPE)) if fill else (lambda: torch.zeros(shape, dtype=DTYPE))
    return SimpleNamespace(k=[mk() for _ in range(LAYERS)], v=[mk() for _ in range(LAYERS)])


def page_ids(num_blocks: int, seed: int) -> list[int]:
    return [int(i) for i in torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))]


# ---- the raw peer's plain socket loops (fixed: the wire's own FrameSocket may use other flags) -----------

def plain_sendmsg(s: socket.socket, views: list) -> None:
    """sendmsg over byte memoryviews until all are sent, at most IOV_MAX per call."""
    i = 0
    while i < len(views):
        sent = s.sendmsg(views[i:i + IOV_MAX])
        while i < len(views) and sent >= len(views[i]):
            sent -= len(views[i])
            i += 1
        if sent:
            views[i] = views[i][sent:]


def plain_recvmsg_into(s: socket.socket, views: list, flags: int = 0) -> None:
    """recvmsg_into byte memoryviews until all are full, at most IOV_MAX per call."""
    i = 0
    while i < len(views):
        r = s.recvmsg_into(views[i:i + IOV_MAX], 0, flags)[0]
        if r == 0:
            raise RuntimeError("raw peer closed early")
        while i < len(views) and r >= len(views[i]):
            r -= len(views[i])
            i += 1
        if r:
            views[i] = views[i][r:]


# ---- sending end (child process) ---------------------------------------------------------------

def raw_server(lsock: socket.socket, kv, ids: list[int]) -> None:
    buf = bytearray(os.urandom(1 << 16)) * (RAW_CHUNK >> 16)
    view = memoryview(buf)
    layout = transfer.layout_of(kv)
    while True:
        s, _ = lsock.accept()
        with s:
            mode, n = struct.unpack(">BQ", s.recv(9, socket.MSG_WAITALL))
            if mode == 0:  # one cache-hot 4 MiB buffer
                while n > 0:
                    k = min(n, RAW_CHUNK)
                    s.sendall(view[:k])
                    n -= k
            else:  # the same scattered pages the wire sends: sendmsg of the page spans, no framing, no checksum
                pages = n // (2 * LAYERS * layout.page_bytes)
                for *_, bufs in transfer.ShardSource(kv, ids[:pages], layout).chunks(pages, RAW_CHUNK // layout.page_bytes):
                    plain_sendmsg(s, bufs)
            s.recv(1)  # wait for the peer's close


async def serve(num_blocks: int) -> None:
    kv = make_kv(num_blocks, fill=True)
    layout = transfer.layout_of(kv)
    ids = page_ids(num_blocks, 1)
    contiguous = list(range(num_blocks))

    async def handler(conn: transfer.KVConn) -> None:
        try:
            att = await transfer.accept_attach(conn, TOKEN)
            pages = -(-att.num_tokens // PAGE)
            h = transfer.make_header(att.room, att.rid, att.num_tokens, 0, att.prompt_crc, "", [layout], att.checksums)
            table = contiguous if att.rid.startswith("contig") else ids
            await transfer.send_kv(conn, h, [transfer.ShardSource(kv, table[:pages], layout)])
        except wire.WireError as exc:
            print(f"server: {exc}", file=sys.stderr, flush=True)
        finally:
            conn.close()

    server = await transfer.BootstrapServer.start("127.0.0.1", 0, handler)
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(8)
    threading.Thread(target=raw_server, args=(lsock, kv, ids), daemon=True).start()
    print(f"PORTS {server.port} {lsock.getsockname()[1]}", flush=True)
    await asyncio.Event().wait()


# ---- receiving end (this process) ----------------------------------------------------------------

def raw_once(port: int, nbytes: int) -> float:
    buf = bytearray(RAW_CHUNK)
    view = memoryview(buf)
    with socket.create_connection(("127.0.0.1", port)) as s:
        t0 = time.perf_counter()
        s.sendall(struct.pack(">BQ", 0, nbytes))
        got = 0
        while got < nbytes:
            r = s.recv_into(view, min(RAW_CHUNK, nbytes - got))
            if r == 0:
                raise RuntimeError("raw peer closed early")
            got += r
        return time.perf_counter() - t0


def raw_pages_once(port: int, kv, ids: list[int], nbytes: int, flags: int = 0) -> float:
    """The raw socket moving the wire's scattered DRAM pages: recvmsg_into the page spans (with ``flags``),
    nothing else."""
    layout = transfer.layout_of(kv)
    pages = nbytes // (2 * LAYERS * layout.page_bytes)
    sink = transfer.ShardSink(kv, ids[:pages], layout)
    per = RAW_CHUNK // layout.page_bytes
    with socket.create_connection(("127.0.0.1", port)) as s:
        t0 = time.perf_counter()
        s.sendall(struct.pack(">BQ", 1, nbytes))
        for u in range(0, 2 * LAYERS * pages, per):
            lk, p = divmod(u, pages)
            plain_recvmsg_into(s, sink.buffers(lk // 2, lk % 2, p, min(per, 2 * LAYERS * pages - u), pages), flags)
        return time.perf_counter() - t0


async def wire_once(port: int, kv, ids: list[int], nbytes: int, room: int, contiguous: bool = False) -> float:
    layout = transfer.layout_of(kv)
    pages = nbytes // (2 * LAYERS * layout.page_bytes)
    tokens = pages * PAGE
    if contiguous:
        ids = list(range(len(ids)))
    att = wire.Attach(room, f"{'contig' if contiguous else 'bench'}-{room}", tokens, 0)
    conn = await transfer.open_attach("127.0.0.1", port, TOKEN, att)
    try:
        header = await transfer.recv_header(conn)
        transfer.check_header(header, att, [layout], "")
        stats = await transfer.recv_kv(conn, header, [transfer.ShardSink(kv, ids[:pages], layout)])
    finally:
        conn.close()
    assert stats.bytes == nbytes, (stats.bytes, nbytes)
    return stats.seconds


def cpu_seconds(child_pid: int) -> float:
    """CPU seconds used so far by this process and the peer process (user + system): unlike wall time, this
    barely moves when other jobs share the cores."""
    with open(f"/proc/{child_pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    t = os.times()
    return t.user + t.system + (int(fields[11]) + int(fields[12])) / tick


def checksum_gbps() -> dict[str, float]:
    buf = memoryview(os.urandom(RAW_CHUNK))
    return {name: RAW_CHUNK / min(_timed(lambda: wire.chunk_digest(name, [buf])) for _ in range(20)) / 1e9
            for name in wire.CHECKSUMS}


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes-mib", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--serve-blocks", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    page_all_layers = 2 * LAYERS * PAGE * KV_HEADS * HEAD_DIM * 2  # bytes of one page across layers, K+V
    if args.serve_blocks:
        asyncio.run(serve(args.serve_blocks))
        return 0
    num_blocks = max(args.sizes_mib) * (1 << 20) // page_all_layers + 8
    child = subprocess.Popen([sys.executable, __file__, "--serve-blocks", str(num_blocks)], stdout=subprocess.PIPE,
                             text=True)
    try:
        line = child.stdout.readline()
        if not line.startswith("PORTS"):
            raise RuntimeError(f"server did not start: {line!r}")
        wire_port, raw_port = map(int, line.split()[1:])
        kv = make_kv(num_blocks, fill=False)
        ids = page_ids(num_blocks, 2)
        results: dict[tuple[int, str], list[float]] = {}
        cpu: dict[str, list[float]] = {}  # kind -> [cpu seconds both processes, GB]

        async def measure(kind: str, mib: int, run) -> None:
            c0 = cpu_seconds(child.pid)
            seconds = await run()
            c = cpu_seconds(child.pid) - c0
            results.setdefault((mib, kind), []).append((mib << 20) / seconds / 1e9)
            acc = cpu.setdefault(kind, [0.0, 0.0])
            acc[0] += c
            acc[1] += (mib << 20) / 1e9

        async def rounds() -> None:
            room = 0
            for _ in range(args.rounds):
                for mib in args.sizes_mib:
                    nbytes = mib << 20
                    room += 2

                    async def raw():
                        return raw_once(raw_port, nbytes)

                    async def rawpages():
                        return raw_pages_once(raw_port, kv, ids, nbytes)

                    async def rawwait():
                        return raw_pages_once(raw_port, kv, ids, nbytes, socket.MSG_WAITALL)

                    await measure("raw", mib, raw)
                    await measure("rawpages", mib, rawpages)
                    await measure("rawwait", mib, rawwait)
                    await measure("wire", mib, lambda r=room: wire_once(wire_port, kv, ids, nbytes, r))
                    await measure("contig", mib, lambda r=room + 1: wire_once(wire_port, kv, ids, nbytes, r, True))

        asyncio.run(rounds())
    finally:
        child.kill()
        child.wait()
    load = os.getloadavg()
    print(f"KV wire on loopback: {LAYERS} layers x {KV_HEADS} KV heads x {HEAD_DIM}, {str(DTYPE).removeprefix('torch.')}, "
          f"{PAGE}-token pages, scattered page tables; best / median of {args.rounds} interleaved rounds; "
          f"{os.cpu_count()} CPUs, load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")
    print("| size | raw socket GB/s | pdstack wire GB/s | ratio | raw socket, same scattered pages GB/s | ratio "
          "| raw, same pages, MSG_WAITALL GB/s | ratio | wire, contiguous page tables GB/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    bm = lambda xs: f"{max(xs):.2f} / {statistics.median(xs):.2f}"  # noqa: E731
    ratio = lambda a, b: f"{max(a) / max(b):.2f} / {statistics.median(a) / statistics.median(b):.2f}"  # noqa: E731
    for mib in args.sizes_mib:
        raw, wr, rp, rw, ct = (results[(mib, k)] for k in ("raw", "wire", "rawpages", "rawwait", "contig"))
        print(f"| {mib} MiB | {bm(raw)} | {bm(wr)} | {ratio(wr, raw)} | {bm(rp)} | {ratio(wr, rp)} | {bm(rw)} "
              f"| {ratio(wr, rw)} | {bm(ct)} |")
    print("(each cell: best / median; a ratio is best/best and median/median)")
    names = {"raw": "raw socket", "rawpages": "raw socket, same scattered pages",
             "rawwait": "raw socket, same pages, MSG_WAITALL", "wire": "pdstack wire",
             "contig": "pdstack wire, contiguous page tables"}
    print("CPU seconds per GB moved, both processes together (sum over all rounds and sizes): "
          + "; ".join(f"{names[k]} {c / gb:.2f}" for k, (c, gb) in cpu.items()))
    print(f"chunk checksum: {wire.CHECKSUMS[0]}; alone on one core over 4 MiB: "
          + ", ".join(f"{name} {gbps:.1f} GB/s" for name, gbps in checksum_gbps().items())
          + " (computed once per byte on each end)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
