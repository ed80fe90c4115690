"""`pdrt up` owns its children: the pure parts (backoff, reset, /proc parsing), the port check against a real
socket, the instance check against a real HTTP server, and restart backoff of the supervision loop (fake
processes, fake clock)."""

from __future__ import annotations

import http.server
import json
import os
import socket
import threading

import pytest

from pdruntime.server.local import supervisor
from pdruntime.server.local.supervisor import LocalStack, backoff_for, busy_ports, listening_inodes, restarts_after


@pytest.mark.parametrize("n,want", [(0, 0.0), (1, 1.0), (2, 2.0), (3, 4.0), (5, 16.0), (6, 30.0), (99, 30.0)])
def test_restart_backoff_doubles_up_to_the_cap(n, want):
    assert backoff_for(n) == want


@pytest.mark.parametrize("restarts,healthy_since,now,want", [
    (3, None, 1000.0, 3),   # never became healthy: keeps counting
    (3, 950.0, 1000.0, 3),  # healthy for 50 s < 60 s
    (3, 940.0, 1000.0, 0),  # healthy for 60 s: starts over
])
def test_restart_count_resets_after_a_healthy_period(restarts, healthy_since, now, want):
    assert restarts_after(restarts, healthy_since, now, 60.0) == want


def test_listening_inodes_reads_proc_net_tcp():
    tcp = ("  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
           "   0: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000  0  0 111 1 0 100 0 0 10 0\n"
           "   1: 0100007F:1F90 0100007F:D431 01 00000000:00000000 00:00000000 00000000  0  0 222 1 0 100 0 0 10 0\n"
           "   2: 0100007F:1F91 00000000:0000 0A 00000000:00000000 00:00000000 00000000  0  0 333 1 0 100 0 0 10 0\n")
    assert listening_inodes(8080, {"tcp": tcp}) == {"111"}  # the established connection (st 01) is not a listener
    assert listening_inodes(8081, {"tcp": tcp}) == {"333"}
    assert listening_inodes(9999, {"tcp": tcp}) == set()


def test_busy_ports_names_the_port_its_use_and_the_process_holding_it():
    with socket.socket() as held, socket.socket() as free:
        held.bind(("127.0.0.1", 0))
        held.listen()
        free.bind(("127.0.0.1", 0))
        port, free_port = held.getsockname()[1], free.getsockname()[1]
        free.close()
        msgs = busy_ports("127.0.0.1", {port: "router HTTP", free_port: "pair 0 decode HTTP"})
    assert len(msgs) == 1
    assert f"port {port} (router HTTP)" in msgs[0] and f"pid {os.getpid()} (" in msgs[0]


class _Health(http.server.BaseHTTPRequestHandler):
    instance = "someone-else"

    def do_GET(self):  # noqa: N802 - http.server API
        body = json.dumps({"status": "ok", "instance": self.instance}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *a):
        pass


def test_health_check_counts_only_the_instance_this_stack_started(tmp_path):
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        stack = LocalStack(log_dir=str(tmp_path))
        port = srv.server_address[1]
        assert stack._healthy(port) is True  # answers 200 ...
        assert stack._healthy(port, "up-mine-router-1") is False  # ... but it is not ours (an orphan, a stranger)
        assert stack._healthy(port, "someone-else") is True
    finally:
        srv.shutdown()
        srv.server_close()


class FakeProc:
    def __init__(self) -> None:
        self.code = None
        self.pid = 1

    def poll(self):
        return self.code

    @property
    def returncode(self):
        return self.code

    def terminate(self):
        self.code = -15

    def wait(self, timeout=None):
        return self.code

    def kill(self):
        self.code = -9


def test_every_restart_backs_off_exponentially_and_the_count_resets_after_a_healthy_period(tmp_path, monkeypatch):
    stack = LocalStack(log_dir=str(tmp_path), backoff_base_s=1.0, backoff_cap_s=4.0, reset_after_s=60.0)
    spawned: list[str] = []
    monkeypatch.setattr(stack, "_spawn", lambda name, args: (spawned.append(name) or FakeProc(), f"id-{name}"))
    monkeypatch.setattr(stack, "_healthy", lambda port, instance=None: True)
    monkeypatch.setattr(stack, "write_topology", lambda: None)
    stack.start()
    pp = stack.pairs[0]
    t = 0.0
    stack.tick(t)
    assert pp.ready and pp.healthy_since == 0.0
    delays = []
    for _ in range(4):  # the decode dies each time right after it came back
        t += 1.0
        pp.decode.code = 1
        stack.tick(t)
        delays.append(pp.not_before - t)
        assert not pp.ready and pp.phase == "backoff"
        assert pp.prefill.code == -15  # the survivor stopped at once, not kept with stale transfer state
        stack.tick(t + delays[-1] - 0.01)
        assert pp.phase == "backoff"  # not before its time
        t += delays[-1]
        n = len(spawned)
        stack.tick(t)  # restarted, and ready again (its health checks pass)
        assert len(spawned) == n + 2 and pp.ready
    assert delays == [1.0, 2.0, 4.0, 4.0]  # exponential, capped
    t += 60.0  # healthy for the reset period
    pp.prefill.code = 70
    stack.tick(t)
    assert pp.not_before - t == 1.0 and pp.restarts == 1  # the count started over
    # the router backs off too (it used to restart in a loop: 32 times in 55 s)
    router_delays = []
    for _ in range(3):
        stack.router.code = 1
        stack.tick_router(t)
        router_delays.append(stack.router_not_before - t)
        assert not stack.tick_router(t + router_delays[-1] - 0.01)
        t += router_delays[-1]
        assert stack.tick_router(t)
    assert router_delays == [1.0, 2.0, 4.0]


def test_pdeathsig_preexec_exits_when_the_parent_is_already_gone():
    import subprocess
    import sys

    # the child checks its parent pid after prctl: a wrong expected parent means "parent already died"
    p = subprocess.Popen([sys.executable, "-c", "print('should not run')"], stdout=subprocess.PIPE,
                         preexec_fn=supervisor.die_with_parent(-1))
    out, _ = p.communicate(timeout=30)
    assert p.returncode == 1 and out == b""


def test_engine_max_step_failures_flag_reaches_the_workers_pdrt_up_starts():
    import argparse

    from pdruntime.server.commands import _worker_args, register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["up", "--engine-max-step-failures", "7"])
    out = _worker_args(args)
    assert out[out.index("--engine-max-step-failures") + 1] == "7"
    serve = parser.parse_args(["serve", "--role", "decode", "--engine-max-step-failures", "7"])
    assert serve.engine_max_step_failures == 7


def test_weights_default_to_auto_for_pdrt_up_and_fp32_for_serve():
    """`pdrt up` (make run) serves the fastest format that keeps SmolLM2's next-token choices (auto: int4 on the CPU);
    `pdrt serve`, which the operator renders, stays exact unless told otherwise."""
    import argparse

    from pdruntime.server.commands import _worker_args, register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    up = _worker_args(parser.parse_args(["up"]))
    assert up[up.index("--weights") + 1] == "auto"
    pinned = _worker_args(parser.parse_args(["up", "--weights", "fp32"]))
    assert pinned[pinned.index("--weights") + 1] == "fp32"
    assert parser.parse_args(["serve", "--role", "decode"]).weights == "fp32"
    assert parser.parse_args(["serve", "--role", "decode", "--weights", "int4"]).weights == "int4"


def test_pdrt_up_starts_its_router_with_the_worker_protocol_it_was_given(tmp_path, monkeypatch):
    """`pdrt up --worker-protocol vllm`: the router it starts runs `pdrt serve --role router --worker-protocol vllm`
    (that router's vLLM exchange with pdrt workers, live: test_worker_protocol_vllm.py's vllm_router tests)."""
    import argparse

    from pdruntime.server import commands

    made: dict = {}

    class Made(Exception):
        pass

    def capture(**kw):
        made.update(kw)
        raise Made

    monkeypatch.setattr(supervisor, "LocalStack", capture)
    parser = argparse.ArgumentParser()
    commands.register(parser.add_subparsers(dest="command"))
    with pytest.raises(Made):
        commands.cmd_up(parser.parse_args(["up", "--worker-protocol", "vllm"]))
    stack = LocalStack(**{**made, "log_dir": str(tmp_path)})
    spawned: list[tuple[str, list[str]]] = []
    monkeypatch.setattr(stack, "_spawn", lambda name, args: (spawned.append((name, args)) or FakeProc(), "id"))
    stack._start_router()
    (name, argv), = spawned
    assert name == "router" and argv[:2] == ["--role", "router"]
    assert argv[argv.index("--worker-protocol") + 1] == "vllm"
