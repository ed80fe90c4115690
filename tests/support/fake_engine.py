"""A fake SGLang or vLLM engine for the pdstack agent's tests: a python HTTP server whose command line carries
the engine's launch words (``-m sglang.launch_server ...`` / ``vllm serve ...``, as the agent finds the real one
under /proc) and that serves an engine-shaped ``/metrics`` from a state file: the metric names and types of
pdruntime/agent/tables.py, taken from the engines' source."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Mapping, Sequence

SCRIPT = textwrap.dedent('''
    import json, sys
    from http.server import BaseHTTPRequestHandler, HTTPServer
    host, port, state = sys.argv[-3], int(sys.argv[-2]), sys.argv[-1]
    class H(BaseHTTPRequestHandler):
        def log_message(self, *a): pass
        def do_GET(self):
            s = json.load(open(state))
            body = s["text"].encode()
            self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
            self.wfile.write(body)
    HTTPServer((host, port), H).serve_forever()
''')

# names and types from the engines' source (see pdruntime/agent/tables.py)
SGLANG_TEXT = """# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{{model_name="m"}} {running}
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{{model_name="m"}} 1
# TYPE sglang:num_decode_prealloc_queue_reqs gauge
sglang:num_decode_prealloc_queue_reqs{{model_name="m"}} 0
# TYPE sglang:num_decode_transfer_queue_reqs gauge
sglang:num_decode_transfer_queue_reqs{{model_name="m"}} 2
# TYPE sglang:prompt_tokens counter
sglang:prompt_tokens_total{{model_name="m"}} 100
# TYPE sglang:generation_tokens counter
sglang:generation_tokens_total{{model_name="m"}} {gen}
"""
VLLM_TEXT = """# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",model_name="m"}} {running}
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{engine="0",model_name="m"}} 0
# TYPE vllm:prompt_tokens counter
vllm:prompt_tokens_total{{engine="0",model_name="m"}} 50
# TYPE vllm:generation_tokens counter
vllm:generation_tokens_total{{engine="0",model_name="m"}} {gen}
"""
TEXTS = {"sglang": SGLANG_TEXT, "vllm": VLLM_TEXT}
LAUNCH = {"sglang": ["-m", "sglang.launch_server"], "vllm": ["vllm", "serve"]}


class FakeEngine:
    """``python <script> <launch words> HOST PORT STATE``; ``set`` rewrites what its /metrics says."""

    def __init__(self, workdir: Path, engine: str, host: str, port: int, *, words: Sequence[str] | None = None,
                 env: Mapping[str, str] | None = None, tag: str = "engine"):
        self.engine, self.host, self.port = engine, host, port
        self.words = list(words if words is not None else LAUNCH[engine])
        self.env = dict(env or {})
        self.script, self.state = workdir / "fake_engine.py", workdir / f"{tag}-state.json"
        self.script.write_text(SCRIPT)
        self.set(running=2, gen=10)
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def set(self, running: int, gen: int) -> None:
        self.state.write_text(json.dumps({"text": TEXTS[self.engine].format(running=running, gen=gen)}))

    def start(self) -> subprocess.Popen:
        cmd = [sys.executable, str(self.script), *self.words, self.host, str(self.port), str(self.state)]
        self.proc = subprocess.Popen(cmd, env=self.env)
        return self.proc

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
