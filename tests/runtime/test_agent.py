"""``pdrt agent`` against real processes on loopback: a fake engine (tests/support/fake_engine.py: a python HTTP
server whose command line contains the engine's launch string, serving an engine-shaped /metrics with the names
of pdruntime/agent/tables.py) and the agent as ``python -m pdruntime.cli agent``."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from fake_engine import FakeEngine
from pd_harness import wait_for
from pdoperator.core import drift, stall
from pdoperator.core.render import worker_env
from pdoperator.core.spec import parse_spec
from pdruntime.util.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": f"{ROOT / 'runtime'}:{ROOT / 'operator'}"}


def get(url: str):
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            body = r.read().decode()
            return r.status, body
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


class Engine(FakeEngine):
    """The fake engine on 127.0.0.1 with the test's extra env, started once it serves /metrics."""

    def __init__(self, tmp: Path, engine: str, extra_env: dict[str, str]):
        super().__init__(tmp, engine, "127.0.0.1", free_port(), env={**ENV, **extra_env})

    def start(self) -> None:
        super().start()
        wait_for(lambda: _ok(f"http://127.0.0.1:{self.port}/metrics"), 20, "the fake engine")


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
    """The env _process_drift compares against: render.worker_env of an ``engine: sglang|vllm`` spec (the vLLM one
    declares NCCL_DEBUG=WARN on decode, which the process sees as INFO)."""
    raw = {"engine": engine, "image": f"{engine}:v1", "runtimeImage": "pdrt:1", "model": {"source": "/models/m"}}
    if engine == "vllm":
        raw["decode"] = {"env": [{"name": "NCCL_DEBUG", "value": "WARN"}]}
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
