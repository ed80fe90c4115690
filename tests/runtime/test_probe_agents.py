"""The multi-round agent probe (``pdruntime.probe_agents``, ``pdrt probe agents``) against real processes: a router
in front of a healthy pair 0 and a canary pair 1 whose decode worker runs the test-only fault knob
``PDRT_FAULT_DECODE_STALL_AFTER=1`` (the incident's shape: one-shot requests pass, agents hang from round 2).

Also: the stall signals a stall detector reads (``tokens``/``idle_s`` in every /debug/requests row,
``pdrt_oldest_live_request_age_seconds``) change while a request lives, and go away with it.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time

import httpx
import pytest

from pdruntime import cli
from pdruntime.env import ConfigError, RuntimeEnv
from pdruntime.model.testing import write_tiny_checkpoint
from pdruntime.probe_agents import ProbeReport, format_table, run_agents_probe
from pdruntime.server.worker.faults import ConnectionStall, connection_of

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "pd"))
from pd_harness import start_pairs, wait_for  # noqa: E402

FAULT = {"PDRT_FAULT_DECODE_STALL_AFTER": "1"}
ROUND_TIMEOUT_S = 10.0  # a hang is declared after this; a healthy round on the tiny model takes well under a second
PIN_CANARY = {"X-PDStack-Pair": "1"}  # loopback client, router without admin token: pinning is allowed


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("probe-stack")
    model = str(write_tiny_checkpoint(str(tmp / "model")))
    s = start_pairs(str(tmp), model, [{}, {"canary": True, "decode_env": FAULT}])
    yield s
    s.stop()


def live_total(stack) -> int:
    return stack.debug(stack.router)["live_total"]


def wait_nothing_live(stack) -> None:
    """Router and every worker idle, every KV page free again: the probe left nothing behind."""
    def idle() -> bool:
        pools = [stack.debug(w)["pool"] for pair in stack.pairs for w in pair]
        return live_total(stack) == 0 and all(p["free"] == p["total"] for p in pools)

    wait_for(idle, 30, "no live request and every KV pool free")


# ---------------------------------------------------------------- pure parts
def test_the_fault_counter_stalls_every_request_after_the_nth_on_one_connection_only():
    f = ConnectionStall(2)
    assert [f.admit("10.0.0.1:5000") for _ in range(4)] == [False, False, True, True]
    assert f.admit("10.0.0.1:5001") is False  # another connection starts from zero
    assert f.stalled == 2
    with pytest.raises(ValueError, match="accepted: an integer >= 1"):
        ConnectionStall(0)


def test_the_counted_connection_is_the_routers_forwarded_one_else_the_workers_own_peer():
    scope = {"client": ("127.0.0.1", 40000)}
    assert connection_of({"x-pdstack-client-connection": "10.1.2.3:5555"}, scope) == "10.1.2.3:5555"
    assert connection_of({}, scope) == "127.0.0.1:40000"


def test_the_fault_knob_is_read_in_the_typed_env_and_rejects_bad_values():
    assert RuntimeEnv.from_environ({}).fault_decode_stall_after == 0  # unset: off
    assert RuntimeEnv.from_environ(FAULT).fault_decode_stall_after == 1
    for bad in ("0", "-1", "two"):
        with pytest.raises(ConfigError, match="PDRT_FAULT_DECODE_STALL_AFTER.*accepted: an integer in \\[1,"):
            RuntimeEnv.from_environ({"PDRT_FAULT_DECODE_STALL_AFTER": bad})


def test_cli_bad_usage_exits_2_with_a_message_naming_what_is_accepted(capsys):
    for argv, words in ((["probe", "agents", "http://127.0.0.1:1", "--agents", "0"], "--agents: 0 is out of range"),
                        (["probe", "agents", "127.0.0.1:8000"], "accepted: the router's http(s) URL"),
                        (["probe", "agents", "http://127.0.0.1:1", "--round-timeout", "-3"], "accepted: seconds > 0"),
                        (["probe", "agents", "http://127.0.0.1:1", "-o", "xml"], "invalid choice: 'xml'"),
                        (["probe"], "required")):
        with pytest.raises(SystemExit) as exc:
            cli.main(argv)
        assert exc.value.code == 2, argv
        assert words in capsys.readouterr().err, argv


def test_cli_an_unreadable_admin_token_file_is_bad_usage(tmp_path, capsys):
    assert cli.main(["probe", "agents", "http://127.0.0.1:1", "--admin-token-file", str(tmp_path / "nope")]) == 2
    assert "--admin-token-file" in capsys.readouterr().err


def test_the_probe_module_needs_neither_torch_nor_fastapi():
    code = ("import sys; import pdruntime.probe_agents, pdruntime.cli; pdruntime.cli.build_parser(); "
            "heavy = [m for m in ('torch', 'numpy', 'fastapi', 'starlette') if m in sys.modules]; "
            "assert not heavy, heavy")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


# ---------------------------------------------------------------- against the stack
def test_the_probe_passes_against_a_healthy_pair_and_normal_traffic_skips_the_canary(stack):
    canary_decode = stack.pairs[1][1]
    before = stack.metric(canary_decode, "pdrt_requests_total")
    report = asyncio.run(run_agents_probe(stack.router.url, agents=3, rounds=3, round_timeout_s=60, max_tokens=6))
    assert report.ok and report.failure is None, format_table(report, 3)
    assert [(r.round, r.completed, r.failed, r.hung) for r in report.rounds] == [(1, 3, 0, 0), (2, 3, 0, 0), (3, 3, 0, 0)]
    assert all(r.latency_p50_s is not None and r.latency_max_s >= r.latency_p50_s for r in report.rounds)
    assert stack.metric(stack.decode, "pdrt_requests_total", {"outcome": "ok"}) >= 9
    assert stack.metric(canary_decode, "pdrt_requests_total") == before  # the canary pair got none of it
    assert json.loads(json.dumps(report.to_dict()))["rounds"][2]["completed"] == 3


def test_a_decode_stall_from_round_2_is_caught_with_round_stage_and_age_and_nothing_leaks(stack):
    canary_decode = stack.pairs[1][1]
    t0 = time.monotonic()
    report = asyncio.run(run_agents_probe(stack.router.url, agents=2, rounds=3, round_timeout_s=ROUND_TIMEOUT_S,
                                          max_tokens=6, headers=PIN_CANARY))
    assert time.monotonic() - t0 < 120  # a generous hang deadline: the probe itself never hangs
    text = format_table(report, 2)
    assert not report.ok, text
    assert [(r.round, r.completed, r.hung) for r in report.rounds] == [(1, 2, 0), (2, 0, 2)], text
    f = report.failure
    assert (f.round, f.kind, f.stage) == (2, "hang", "decode:running"), text
    assert f.age_s >= ROUND_TIMEOUT_S - 1, text  # how old: at least the round's deadline
    assert "decode running (0 tokens" in f.detail and "pair 1" in f.detail, f.detail
    assert "FAILED: round 2, agent 0: hang in stage decode:running" in text
    # no watchdog fired (the stall is after the transfer), and the probe let go: nothing stays live or held
    assert stack.metric(canary_decode, "pdrt_watchdog_fired_total") == 0
    wait_nothing_live(stack)
    assert stack.metric(canary_decode, "pdrt_aborted_requests_total") >= 2
    # a one-shot request on a fresh connection passes on the same pair: why synthetic probes looked healthy
    model = httpx.get(stack.router.url + "/v1/models", timeout=10).json()["data"][0]["id"]
    r = httpx.post(stack.router.url + "/v1/chat/completions", headers=PIN_CANARY, timeout=60,
                   json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1
    # the knob is visible where drift detection looks, and it announced itself
    env = httpx.get(canary_decode.url + "/config", timeout=10).json()["env"]
    assert env["fault_decode_stall_after"] == 1 and env["process_env"]["PDRT_FAULT_DECODE_STALL_AFTER"] == "1"
    assert "TEST-ONLY FAULT KNOB ON: PDRT_FAULT_DECODE_STALL_AFTER=1" in canary_decode.log_text()
    assert "FAULT KNOB" not in stack.decode.log_text()


def test_the_cli_exits_1_on_a_hang_and_prints_the_evidence(stack):
    out = subprocess.run([sys.executable, "-m", "pdruntime.cli", "probe", "agents", stack.router.url, "--agents", "2",
                          "--rounds", "3", "--round-timeout", "8", "--max-tokens", "4", "--pair", "1", "-o", "json"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stdout + out.stderr
    doc = json.loads(out.stdout)
    assert doc["ok"] is False and doc["failure"]["kind"] == "hang"
    # new client connections: round 1 passes again (the knob counts per client connection), round 2 hangs
    assert [r["completed"] for r in doc["rounds"]] == [2, 0]
    assert doc["failure"]["round"] == 2 and doc["failure"]["stage"] == "decode:running"
    assert doc["failure"]["age_s"] >= 7
    wait_nothing_live(stack)


def test_the_cli_exits_0_and_prints_one_line_per_round_when_healthy(stack):
    out = subprocess.run([sys.executable, "-m", "pdruntime.cli", "probe", "agents", stack.router.url, "--agents", "2",
                          "--rounds", "2", "--max-tokens", "4"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split() == ["round", "completed", "p50_s", "max_s", "notes"]
    assert [ln.split()[:2] for ln in lines[1:3]] == [["1", "2/2"], ["2", "2/2"]]
    assert lines[3] == "OK: 2 rounds x 2 agents completed"


def test_debug_rows_and_the_oldest_age_gauge_follow_a_live_request(stack):
    """A slow request (decode steps slowed by the test hook): its rows carry id, stage, age_s, tokens, idle_s on the
    router and on decode; tokens grow while idle_s stays below age_s; the gauge shows its age per stage while it
    lives and has no series once it is gone."""
    model = httpx.get(stack.router.url + "/v1/models", timeout=10).json()["data"][0]["id"]
    tokens_before = {p.name: stack.metric(p, "pdrt_generated_tokens_total") for p in (stack.router, stack.decode)}
    stack.hooks(stack.decode, step_delay_s=0.25)
    done: dict = {}

    def send() -> None:
        done["r"] = httpx.post(stack.router.url + "/v1/chat/completions", timeout=120, headers={"X-Request-Id": "slow-1"},
                               json={"model": model, "messages": [{"role": "user", "content": "count"}],
                                     "max_tokens": 24, "ignore_eos": True, "stream": True})

    t = threading.Thread(target=send)
    t.start()
    try:
        def rows() -> tuple[dict, dict] | None:
            doc = stack.debug(stack.router)
            mine = [r for r in doc["requests"] if r["client_request_id"] == "slow-1"]
            dec = [r for w in doc["workers"] if w["role"] == "decode" for r in w.get("requests", ())
                   if mine and r["id"] == mine[0]["id"]]
            # the router's row turns "streaming" when its loop has handled the first event, which on a loaded host
            # may come after decode made its second token: wait for both
            return (mine[0], dec[0]) if mine and dec and dec[0]["tokens"] >= 2 and mine[0]["stage"] == "streaming" \
                else None

        router_row, decode_row = wait_for(rows, 60, "the slow request streaming")
        for row in (router_row, decode_row):
            assert {"id", "stage", "age_s", "tokens", "idle_s"} <= set(row), row
            assert 0 <= row["idle_s"] <= row["age_s"], row
        assert router_row["stage"] == "streaming" and decode_row["stage"] == "running"
        gauge = "pdrt_oldest_live_request_age_seconds"
        assert stack.metric(stack.decode, gauge, {"role": "decode", "stage": "running"}) > 0
        assert stack.metric(stack.router, gauge, {"role": "router", "stage": "streaming"}) > 0
        later = wait_for(lambda: (r := rows()) and r[1]["tokens"] > decode_row["tokens"] and r, 60, "more tokens")
        assert later[1]["age_s"] > decode_row["age_s"]
        assert later[1]["idle_s"] < later[1]["age_s"]  # tokens are progress: idle restarts with each one
    finally:
        t.join(120)
        stack.hooks(stack.decode, step_delay_s=0)
    assert done["r"].status_code == 200
    wait_nothing_live(stack)
    for proc in (stack.router, stack.decode):
        assert stack.metric(proc, "pdrt_oldest_live_request_age_seconds") == 0  # no series: nothing is live
        assert "pdrt_oldest_live_request_age_seconds{" not in httpx.get(proc.url + "/metrics", timeout=10).text
    for proc in (stack.router, stack.decode):  # 24 tokens (ignore_eos), counted once by each
        assert stack.metric(proc, "pdrt_generated_tokens_total") - tokens_before[proc.name] == 24


def test_a_hung_request_the_router_never_saw_points_outside_the_stack(stack):
    """Evidence lookup for a request the router does not hold: the probe says to look outside pdstack."""
    from pdruntime.probe_agents import _hang_evidence

    stage, age, seen = asyncio.run(_hang_evidence(stack.router.url, {}, "never-sent"))
    assert stage is None and age is None
    assert "nothing is live inside the stack" in seen


def test_probe_report_round_trips_as_json():
    r = ProbeReport(True, [], None)
    assert r.to_dict() == {"ok": True, "rounds": [], "failure": None}


def test_the_oldest_age_gauge_passes_promtool_and_drops_stages_with_nothing_live():
    import shutil
    from pathlib import Path

    from pdruntime.server.metrics import Metrics

    m = Metrics("decode")
    m.set_oldest_age({"running": 3.25, "transfer": 0.5})
    text = m.render().decode()
    assert 'pdrt_oldest_live_request_age_seconds{role="decode",stage="running"} 3.25' in text
    m.set_oldest_age({"running": 4.0})
    text = m.render().decode()
    assert 'stage="transfer"' not in text and 'stage="running"} 4.0' in text
    local = Path(__file__).resolve().parents[2] / ".tools" / "bin" / "promtool"
    promtool = str(local) if local.exists() else shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed: `make tools` installs it into .tools/bin")
    out = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "pdrt_oldest_live_request_age_seconds" not in out.stdout + out.stderr  # no lint about the new gauge
