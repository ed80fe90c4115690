"""``pdrt agent`` against real processes on loopback: a fake engine (a python HTTP server whose command line
contains the engine's launch string, serving an engine-shaped /metrics with the names of
pdruntime/agent/tables.py) and the agent as ``python -m pdruntime.cli agent``."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from pd_harness import wait_for
from pdoperator.core import drift, stall
from pdoperator.core.render import worker_env
from pdoperator.core.spec import parse_spec
from pdruntime.util.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": f"{ROOT / 'runtime'}:{ROOT / 'operator'}"}

FAKE_ENGINE = textwrap.dedent('''
    import json, sys
    from http.server import BaseHTTPRequestHandler, HTTPServer
    port, state = int(sys.argv[-2]), sys.argv[-1]
    class H(BaseHTTPRequestHandler):
        def log_message(self, *a): pass
        def do_GET(self):
            s = json.load(open(state))
            body = s["text"].encode()
            self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
            self.wfile.write(body)
    HTTPServer(("127.0.0.1", port), H).serve_forever()
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


def get(url: str):
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            body = r.read().decode()
            return r.status, body
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


class Engine:
    """The fake engine: ``python <script> <launch words> PORT STATE``; /metrics from the STATE file."""

    def __init__(self, tmp: Path, engine: str, extra_env: dict[str, str]):
        self.engine, self.port, self.extra_env = engine, free_port(), extra_env
        self.script, self.state = tmp / "fake_engine.py", tmp / "state.json"
        self.script.write_text(FAKE_ENGINE)
        self.set(running=2, gen=10)
        self.proc: subprocess.Popen | None = None

    def set(self, running: int, gen: int) -> None:
        self.state.write_text(json.dumps({"text": TEXTS[self.engine].format(running=running, gen=gen)}))

    def start(self) -> None:
        # the engine's launch words in the command line, as the real one has ("-m sglang.launch_server", "vllm serve")
        cmd = [sys.executable, str(self.script), *LAUNCH[self.engine], str(self.port), str(self.state)]
        self.proc = subprocess.Popen(cmd, env={**ENV, **self.extra_env})
        wait_for(lambda: _ok(f"http://127.0.0.1:{self.port}/metrics"), 20, "the fake engine")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(10)


def _ok(url: str) -> bool:
    try:
        return get(url)[0] == 200
    except OSError:
        return False


@pytest.fixture
def stack(tmp_path, request):
    engine_name = request.param
    extra = {"SGLANG_INJECTED_BY_WEBHOOK": "1", "NCCL_DEBUG": "INFO", "SGLANG_API_KEY": "s3cret",
             "HF_TOKEN": "hf_s3cret", "PDRT_DECODE_TARGET_CTAS": "999"}
    eng = Engine(tmp_path, engine_name, extra)
    eng.start()
    weights = tmp_path / "model"
    weights.mkdir()
    (weights / "model.safetensors").write_bytes(b"weights" * 100)
    port = free_port()
    agent = subprocess.Popen(
        [sys.executable, "-m", "pdruntime.cli", "agent", "--engine", engine_name, "--role", "decode",
         "--port", str(port), "--host", "127.0.0.1", "--engine-url", f"http://127.0.0.1:{eng.port}",
         "--model-path", str(weights), "--report-env", "HF_TOKEN"], env=ENV)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: _ok(url + "/health"), 20, "the agent to find the engine")
        yield eng, url, weights
    finally:
        agent.kill()
        agent.wait(10)
        eng.stop()


def declared_env(engine: str, role: str) -> dict:
    """The env _process_drift compares against: render.worker_env of an ``engine: sglang`` spec; for vLLM
    (``engine: vllm`` is added to spec.py in parallel) a hand-built declared env."""
    if engine == "vllm":
        return {"NCCL_DEBUG": "WARN"}
    raw = {"engine": "sglang", "image": "lmsysorg/sglang:v0.5.0", "model": {"source": "/models/m"}}
    spec = parse_spec(raw, name="t")
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in worker_env(spec, role)}


@pytest.mark.parametrize("stack", ["sglang", "vllm"], indirect=True)
def test_config_feeds_process_drift_and_redacts(stack):
    eng, url, weights = stack
    code, body = get(url + "/config")
    cfg = json.loads(body)
    assert code == 200 and cfg["engine"] == eng.engine and cfg["pid"] == eng.proc.pid
    env = cfg["env"]
    assert env["process_env"]["SGLANG_API_KEY"] == "<redacted>"
    assert env["process_env"]["HF_TOKEN"] == "<redacted>" and env["report_env"] == ["HF_TOKEN"]
    declared = declared_env(eng.engine, "decode")
    entries = drift.process_env_drift(declared, env["process_env"], tuple(env["report_env"]),
                                      drift.PRESENCE_ONLY, pod="w-0")
    texts = " | ".join(e.text for e in entries)
    assert all(e.source == "process" for e in entries)
    assert "SGLANG_INJECTED_BY_WEBHOOK=1 (not declared)" in texts, texts
    nccl = "NCCL_DEBUG: declared WARN, process sees INFO" if eng.engine == "vllm" else "NCCL_DEBUG=INFO (not declared)"
    assert nccl in texts, texts
    assert "s3cret" not in texts
    assert "s3cret" not in body
    # the digest pdrt's loader gives the same files (pdruntime/model/loader.py _sha256)
    assert cfg["model"]["sha256"] == hashlib.sha256((weights / "model.safetensors").read_bytes()).hexdigest()
    assert cfg["model"]["why_not"] is None


@pytest.mark.parametrize("stack", ["sglang", "vllm"], indirect=True)
def test_stall_fires_while_frozen_and_clears(stack):
    eng, url, _ = stack
    prev = None

    def look(at: float) -> stall.Evidence:
        nonlocal prev
        doc = json.loads(get(url + "/debug/requests")[1])
        rows = [r for r in (stall.parse_row("decode", raw) for raw in doc["requests"]) if r is not None]
        text = get(url + "/metrics")[1]
        obs = stall.observe(0, time.monotonic(), rows, [text], [text])
        ev = stall.evaluate(prev, obs, stall_s=1.0)
        prev = ev.observation
        return ev

    assert not look(time.monotonic()).stalled
    time.sleep(1.3)
    ev = look(time.monotonic())
    assert ev.stalled and ev.stage == "decode/running" and ev.tokens_per_s == 0.0, ev.reason
    eng.set(running=2, gen=50)
    ev = look(time.monotonic())
    assert not ev.stalled and ev.tokens_per_s and ev.tokens_per_s > 0, ev.reason


@pytest.mark.parametrize("stack", ["sglang"], indirect=True)
def test_engine_restart_is_found_again(stack):
    eng, url, _ = stack
    old = eng.proc.pid
    eng.stop()
    wait_for(lambda: get(url + "/health")[0] == 503, 20, "the agent to see the engine gone")
    eng.start()
    assert eng.proc.pid != old
    health = wait_for(lambda: (lambda r: r[0] == 200 and json.loads(r[1]))(get(url + "/health")), 20, "re-find")
    assert health["pid"] == eng.proc.pid
    assert "pdrt_agent_engine_restarts_total" in get(url + "/metrics")[1]


def test_model_why_not(tmp_path):
    from pdruntime.agent import weights

    assert "no *.safetensors or *.gguf" in weights.model_info(str(tmp_path))["why_not"]
    (tmp_path / "m.gguf").write_bytes(b"x" * 64)
    capped = weights.model_info(str(tmp_path), cap_bytes=10)
    assert capped["sha256"] is None and "over the hashing cap" in capped["why_not"]
    assert weights.model_info(str(tmp_path))["sha256"] == hashlib.sha256(b"x" * 64).hexdigest()


def test_missing_metrics_are_unknown_not_zero():
    from pdruntime.agent import tables

    out = tables.translate("vllm", "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 3\n")
    assert out["running"] == 3 and out["waiting"] is None and out["generation_tokens"] is None
    assert all(v is None for v in tables.translate("sglang", None).values())


@pytest.mark.parametrize("argv, accepted", [
    (["--engine", "tgi", "--role", "decode"], "choose from 'sglang', 'vllm'"),
    (["--engine", "vllm", "--role", "decode", "--engine-url", "localhost:8000"], "accepted: the engine's http(s) URL"),
    (["--engine", "vllm", "--role", "decode", "--port", "70000"], "accepted: a port 1..65535"),
    (["--engine", "vllm", "--role", "router"], "choose from 'prefill', 'decode'"),
])
def test_bad_flags_say_what_is_accepted(argv, accepted):
    r = subprocess.run([sys.executable, "-m", "pdruntime.cli", "agent", *argv], env=ENV, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and accepted in r.stderr, r.stderr
