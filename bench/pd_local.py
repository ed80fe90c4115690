"""PD through the router vs the same engine monolithic, plus KV-transfer throughput on loopback.

Starts a prefill worker, a decode worker and a router as separate processes on 127.0.0.1, then
measures, for each concurrency level:
  * PD:          streamed /v1/chat/completions through the router (prefill -> KV transfer -> decode)
  * monolithic:  the same prompt streamed from the decode worker's /generate without bootstrap fields
                 (prefill and decode in one engine, one process: the undisaggregated baseline)
reporting TTFT (time to the first streamed token, client side) and output tokens/s (aggregate).
Then it times raw KV transfers between two endpoints of the wire protocol over loopback TCP with the
model's KV layout, and reads the in-stack transfer time/bytes from the prefill worker's metrics.

    .venv/bin/python bench/pd_local.py                    # default model (SmolLM2-135M)
    .venv/bin/python bench/pd_local.py --model DIR_OR_GGUF --concurrency 1 4 --requests 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

import httpx

from pdruntime.util.ports import free_port
from pdruntime.util.sse import DONE, aiter_sse

HERE = os.path.dirname(os.path.abspath(__file__))




def spawn(args: list[str], log_dir: str, name: str, env: dict) -> subprocess.Popen:
    fh = open(os.path.join(log_dir, name + ".log"), "wb")
    return subprocess.Popen([sys.executable, "-m", "pdruntime.server", "serve", *args], env=env, stdout=fh,
                            stderr=subprocess.STDOUT)


def wait_healthy(urls: list[str], procs: list[subprocess.Popen], timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    for url in urls:
        while True:
            if any(p.poll() is not None for p in procs):
                raise RuntimeError("a server exited during start-up; see the logs")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url} not healthy after {timeout}s")
            time.sleep(0.5)


def prompt_text(i: int, words: int) -> str:
    base = ("The history of distributed inference starts with simple batching and grows into disaggregated "
            "prefill and decode, where the key value cache moves between machines. ")
    text = f"Request {i}. " + base * (words // len(base.split()) + 1)
    return " ".join(text.split()[:words]) + "\nSummarise the above in one paragraph."


async def stream_one(client: httpx.AsyncClient, url: str, body: dict, chat: bool) -> tuple[float, int, float]:
    """-> (ttft seconds, output tokens, total seconds)."""
    t0 = time.perf_counter()
    ttft = None
    tokens = 0
    async with client.stream("POST", url, json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
        async for ev in aiter_sse(resp.aiter_lines()):
            if ev == DONE:
                continue
            if "error" in ev:
                raise RuntimeError(ev["error"])
            if chat:
                if ev.get("usage"):
                    tokens = ev["usage"]["completion_tokens"]
                got = bool(ev["choices"]) and ev["choices"][0]["delta"].get("content") is not None
            else:
                tokens = ev["meta_info"]["completion_tokens"]
                got = bool(ev.get("token_ids"))
            if got and ttft is None:
                ttft = time.perf_counter() - t0
    return ttft or float("nan"), tokens, time.perf_counter() - t0


async def run_level(router: str, decode: str, model_id: str, conc: int, requests: int, words: int,
                    max_tokens: int, mode: str) -> dict:
    limits = httpx.Limits(max_connections=conc * 2)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        sem = asyncio.Semaphore(conc)

        async def one(i: int):
            msgs = [{"role": "user", "content": prompt_text(i, words)}]
            async with sem:
                if mode == "pd":
                    body = {"model": model_id, "messages": msgs, "max_tokens": max_tokens, "temperature": 0,
                            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
                    return await stream_one(client, router + "/v1/chat/completions", body, True)
                body = {"messages": msgs, "stream": True,
                        "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0, "ignore_eos": True}}
                return await stream_one(client, decode + "/generate", body, False)

        t0 = time.perf_counter()
        res = await asyncio.gather(*(one(i) for i in range(requests)))
        wall = time.perf_counter() - t0
    ttfts = [r[0] for r in res]
    return {"mode": mode, "concurrency": conc, "requests": requests, "ttft_p50_s": statistics.median(ttfts),
            "ttft_max_s": max(ttfts), "tokens": sum(r[1] for r in res), "wall_s": wall,
            "tokens_per_s": sum(r[1] for r in res) / wall}


async def loopback_transfer(layers: int, kv_heads: int, head_dim: int, tokens: int, repeats: int) -> dict:
    """Raw wire-protocol throughput: prefill-side send_kv -> decode-side recv_kv over 127.0.0.1 TCP."""
    import torch

    from pdruntime.disagg import transfer, wire

    bs = 16
    blocks = -(-tokens // bs)
    mk = lambda fill: [(torch.randn if fill else torch.zeros)(blocks, bs, kv_heads, head_dim) for _ in range(layers)]
    src = type("KV", (), {"k": mk(True), "v": mk(True)})()
    dst = type("KV", (), {"k": mk(False), "v": mk(False)})()
    layout = transfer.layout_of(src)
    prompt = list(range(tokens))
    times = []
    nbytes = 0
    served = []

    async def handle(conn):
        att = await transfer.accept_attach(conn, "bench")
        h = transfer.make_header(att.room, att.rid, tokens, 0, wire.prompt_crc(prompt), "", [layout], att.checksums)
        await transfer.send_kv(conn, h, [transfer.ShardSource(src, list(range(blocks)), layout)])
        conn.close()
        served.append(att.room)

    server = await transfer.BootstrapServer.start("127.0.0.1", 0, handle)
    port = server.port
    for r in range(repeats):
        att = wire.Attach(r, f"bench-{r}", tokens, wire.prompt_crc(prompt))
        t0 = time.perf_counter()
        conn = await transfer.open_attach("127.0.0.1", port, "bench", att)
        h = await transfer.recv_header(conn)
        nbytes = (await transfer.recv_kv(conn, h, [transfer.ShardSink(dst, list(range(blocks)), layout)])).bytes
        times.append(time.perf_counter() - t0)
        conn.close()
    while len(served) < repeats:  # let the sender see its last ACK
        await asyncio.sleep(0.01)
    server.close()
    assert torch.equal(src.k[-1], dst.k[-1])
    best = min(times)
    return {"tokens": tokens, "bytes": nbytes, "best_s": best, "median_s": statistics.median(times),
            "gb_per_s": nbytes / best / 1e9, "gb_per_s_median": nbytes / statistics.median(times) / 1e9}


def metric_sum(text: str, name: str) -> float:
    return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, flags=re.M))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF or HF dir (default: SmolLM2 via load_model(None))")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--requests", type=int, default=4, help="requests per concurrency level")
    ap.add_argument("--prompt-words", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--transfer-tokens", type=int, default=2048)
    ap.add_argument("--json", default=None, help="also write results to this file")
    args = ap.parse_args()

    env = {k: v for k, v in os.environ.items() if not k.startswith("PDRT_")}
    env["PDRT_KV_AUTH_TOKEN"] = "bench"
    if args.model:
        env["PDRT_MODEL"] = args.model
    log_dir = tempfile.mkdtemp(prefix="pd-bench-")
    pp, dp, bp, rp = free_port(), free_port(), free_port(), free_port()
    flags = ["--max-num-seqs", "32"]
    procs = [spawn(["--role", "prefill", "--port", str(pp), "--bootstrap-port", str(bp), *flags], log_dir, "prefill", env),
             spawn(["--role", "decode", "--port", str(dp), *flags], log_dir, "decode", env)]
    procs.append(spawn(["--role", "router", "--port", str(rp), "--prefill", f"http://127.0.0.1:{pp}",
                        "--decode", f"http://127.0.0.1:{dp}", "--bootstrap-ports", str(bp)], log_dir, "router", env))
    router, decode, prefill = f"http://127.0.0.1:{rp}", f"http://127.0.0.1:{dp}", f"http://127.0.0.1:{pp}"
    results: dict = {"levels": []}
    try:
        wait_healthy([prefill, decode, router], procs)
        info = httpx.get(decode + "/get_model_info", timeout=10).json()
        cfg = httpx.get(decode + "/config", timeout=10).json()["engine"]["model"]
        model_id = info["model_name"]
        results["model"] = {"name": model_id, "path": info["model_path"], "layers": cfg["num_layers"],
                            "kv_heads": cfg["num_kv_heads"], "head_dim": cfg["head_dim"]}
        print(f"model {model_id} ({info['model_path']}); logs in {log_dir}", flush=True)
        # warm-up both paths once
        asyncio.run(run_level(router, decode, model_id, 1, 1, 20, 4, "pd"))
        asyncio.run(run_level(router, decode, model_id, 1, 1, 20, 4, "mono"))
        def transfer_totals() -> tuple[float, float, float]:
            m = httpx.get(prefill + "/metrics", timeout=10).text
            return (metric_sum(m, "pdrt_kv_transfer_seconds_count"), metric_sum(m, "pdrt_kv_transfer_seconds_sum"),
                    metric_sum(m, "pdrt_kv_transfer_size_bytes_sum"))

        for conc in args.concurrency:
            for mode in ("pd", "mono"):
                before = transfer_totals()
                r = asyncio.run(run_level(router, decode, model_id, conc, max(args.requests, conc), args.prompt_words,
                                          args.max_tokens, mode))
                if mode == "pd":
                    n, secs, nb = (a - b for a, b in zip(transfer_totals(), before))
                    r["transfer_ms_mean"] = secs / n * 1000 if n else None
                    r["transfer_mb_mean"] = nb / n / 1e6 if n else None
                results["levels"].append(r)
                xfer = f"  KV transfer {r['transfer_ms_mean']:.0f} ms for {r['transfer_mb_mean']:.1f} MB" \
                    if r.get("transfer_ms_mean") else ""
                print(f"  {mode:4s} c={conc}: TTFT p50 {r['ttft_p50_s'] * 1000:8.1f} ms  max {r['ttft_max_s'] * 1000:8.1f} ms"
                      f"  {r['tokens_per_s']:7.1f} tok/s{xfer}", flush=True)
        m = httpx.get(prefill + "/metrics", timeout=10).text
        secs, nbytes = metric_sum(m, "pdrt_kv_transfer_seconds_sum"), metric_sum(m, "pdrt_kv_transfer_size_bytes_sum")
        count = metric_sum(m, "pdrt_kv_transfer_seconds_count")
        results["in_stack_transfer"] = {"transfers": count, "bytes": nbytes, "seconds": secs,
                                        "gb_per_s": nbytes / secs / 1e9 if secs else None}
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(30)
    mi = results["model"]
    results["loopback_transfer"] = asyncio.run(loopback_transfer(mi["layers"], mi["kv_heads"], mi["head_dim"],
                                                                 args.transfer_tokens, 5))

    print("\n| mode | concurrency | requests | TTFT p50 (ms) | TTFT max (ms) | output tok/s | KV transfer per request |")
    print("|---|---|---|---|---|---|---|")
    for r in results["levels"]:
        name = "PD via router" if r["mode"] == "pd" else "monolithic"
        xfer = f"{r['transfer_ms_mean']:.0f} ms, {r['transfer_mb_mean']:.1f} MB" if r.get("transfer_ms_mean") else "-"
        print(f"| {name} | {r['concurrency']} | {r['requests']} | {r['ttft_p50_s'] * 1000:.1f} | "
              f"{r['ttft_max_s'] * 1000:.1f} | {r['tokens_per_s']:.1f} | {xfer} |")
    lt = results["loopback_transfer"]
    print(f"\nKV transfer on loopback (wire protocol, {mi['layers']} layers x {mi['kv_heads']} KV heads x {mi['head_dim']}"
          f" fp32, {lt['tokens']} tokens = {lt['bytes'] / 1e6:.1f} MB): best {lt['gb_per_s']:.2f} GB/s, "
          f"median {lt['gb_per_s_median']:.2f} GB/s")
    st = results["in_stack_transfer"]
    if st["gb_per_s"]:
        print(f"In-stack transfers (prefill KV ready -> receipt, includes gather/scatter and the ACK): "
              f"{int(st['transfers'])} transfers, {st['bytes'] / 1e6:.1f} MB in {st['seconds']:.3f} s = {st['gb_per_s']:.2f} GB/s")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
