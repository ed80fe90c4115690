"""`pdrt up --prefill 1 --decode 2`: one 1P:2D group as real processes on loopback; the router dispatches
within the group to the least-loaded decode, so 16 concurrent chats use both decodes."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import threading
import time

import httpx

from pd_harness import base_env, free_port, stop_up
from pdruntime.util.ports import free_port_block


def _decode_requests(port: int) -> float:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return sum(float(m.group(1)) for m in re.finditer(r'^pdrt_requests_total\{[^}]*role="decode"[^}]*\} (\S+)$',
                                                         text, re.M))


def test_pdrt_up_1p2d_group_serves_16_concurrent_chats_on_both_decodes(tiny_model):
    port, base = free_port(), free_port_block(4)
    proc = subprocess.Popen([sys.executable, "-m", "pdruntime.server", "up", "--model", tiny_model, "--port", str(port),
                             "--base-port", str(base), "--prefill", "1", "--decode", "2", "--num-blocks", "256",
                             "--max-num-seqs", "16"], env=base_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True).start()
    try:
        deadline = time.monotonic() + 240
        while not any(l.startswith("curl ") for l in lines):
            assert proc.poll() is None and time.monotonic() < deadline, lines
            time.sleep(0.2)
        assert any("1P:2D group" in l for l in lines), lines
        url = f"http://127.0.0.1:{port}"
        model_id = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        decodes = (base + 1, base + 3)  # group_ports: prefill base, decode base+1, bootstrap base+2, decode-1 base+3

        async def chats():
            async with httpx.AsyncClient(timeout=120) as http:
                async def one(i):
                    r = await http.post(url + "/v1/chat/completions", json={
                        "model": model_id, "max_tokens": 8,
                        "messages": [{"role": "user", "content": f"agent {i}: say something"}]})
                    return r.status_code, r.text
                return await asyncio.gather(*(one(i) for i in range(16)))
        results = asyncio.run(chats())
        assert [s for s, _ in results] == [200] * 16, [t for s, t in results if s != 200][:2]
        served = [_decode_requests(p) for p in decodes]
        print(f"decode requests served: {served}")
        assert sum(served) >= 16 and all(n > 0 for n in served), served  # both decodes took requests
        cfg = httpx.get(url + "/config", timeout=10).json()
        assert cfg["topology_version"] is not None
    finally:
        stop_up(proc)
