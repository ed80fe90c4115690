"""A real agent loop: the harness in bench/agent_harness.py (official openai client) runs 8 agents x 5 rounds
of tool use against `pdrt up` (router + one PD pair as real processes) with 0 errors."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "pd"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
from pd_harness import base_env, free_port  # noqa: E402
from pdruntime.util.ports import free_port_block  # noqa: E402

pytestmark = [pytest.mark.timeout(900)]


def test_eight_agents_five_rounds_of_tool_use_against_pdrt_up_with_zero_errors(tiny_model):
    pytest.importorskip("openai")
    import agent_harness

    port, base = free_port(), free_port_block(3)
    proc = subprocess.Popen([sys.executable, "-m", "pdruntime.server", "up", "--model", tiny_model, "--port",
                             str(port), "--base-port", str(base), "--num-blocks", "2048"], env=base_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True).start()
    try:
        deadline = time.monotonic() + 300
        while not any(l.startswith("curl ") for l in lines):
            assert proc.poll() is None and time.monotonic() < deadline, f"pdrt up did not get ready: {lines[-20:]}"
            time.sleep(0.2)
        results = agent_harness.run(f"http://127.0.0.1:{port}", agents=8, rounds=5, max_tokens=200)
        errors = [e for r in results for e in r.errors]
        assert errors == [] and sum(r.rounds for r in results) == 40, errors
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
