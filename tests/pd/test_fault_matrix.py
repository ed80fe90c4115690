"""The fault matrix (issue 13, "Build" 4): real processes on loopback (router + one PD pair, tiny model).

Every case shows the same five things:
  1. no hang past the deadline: the client's call returns (error or not) within DEADLINE_S + a margin;
  2. freed pages: every live worker ends with no live request and its whole KV pool free;
  3. a clear error to the client: a status and a message naming the failure;
  4. a metric plus a log line recording it;
  5. the next normal request succeeds within RECOVERY_S of the fault being over.

Faults during a KV transfer are held open with the workers' test hooks (PDRT_TEST_HOOKS=1) or with
:class:`KVProxy`, a TCP proxy between decode and prefill's bootstrap port that corrupts or cuts the stream.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import threading
import time
from dataclasses import dataclass

import httpx
import pytest
import yaml

from pdruntime.util.sse import iter_sse
from pd_harness import WORKER_FLAGS, Proc, Stack, base_env, free_port, spawn, wait_for, wait_healthy

pytestmark = pytest.mark.timeout(180)

DEADLINE_S = 12.0  # X-Request-Timeout of the faulted request, seconds
HANG_MARGIN_S = 8.0  # a generous margin over a deadline on a loaded 2-core machine
RECOVERY_S = 45.0  # the next normal request succeeds within this many seconds of the fault ending
STALE_AFTER_S = 5.0  # router: a worker without a healthy /health answer for this long is skipped


# ---- the stack, restartable process by process -----------------------------------------------------------

@dataclass
class FaultStack(Stack):
    args: dict = None
    env: dict = None
    tmp: str = ""

    def respawn(self, name: str) -> Proc:
        """Start a stopped or killed process again on its port (what a pod restart does)."""
        old = getattr(self, name)
        old.kill()
        port = int(old.url.rsplit(":", 1)[1])
        new = spawn(f"{name}-2", self.args[name], self.env, self.tmp, port)
        setattr(self, name, new)
        self.procs.append(new)
        wait_healthy([new])
        return new


def start_fault_stack(tmp: str, model: str, *, bootstrap_port_for_router: int | None = None,
                      topology_file: bool = False) -> FaultStack:
    env = base_env()
    pp, dp, bp, rp = free_port(), free_port(), free_port(), free_port()
    args = {"prefill": ["--role", "prefill", "--port", str(pp), "--bootstrap-port", str(bp), "--model", model, *WORKER_FLAGS],
            "decode": ["--role", "decode", "--port", str(dp), "--model", model, *WORKER_FLAGS]}
    rbp = bootstrap_port_for_router or bp
    if topology_file:
        path = os.path.join(tmp, "topology.yaml")
        write_topology(path, "r1", [(0, pp, dp, rbp, True)])
        args["router"] = ["--role", "router", "--port", str(rp), "--topology-file", path]
    else:
        args["router"] = ["--role", "router", "--port", str(rp), "--prefill", f"http://127.0.0.1:{pp}",
                          "--decode", f"http://127.0.0.1:{dp}", "--bootstrap-ports", str(rbp)]
    procs = {n: spawn(n, a, env, tmp, {"prefill": pp, "decode": dp, "router": rp}[n]) for n, a in args.items()}
    s = FaultStack(procs["router"], procs["prefill"], procs["decode"], bp, model, list(procs.values()), args=args,
                   env=env, tmp=tmp)
    try:
        wait_healthy([s.prefill, s.decode, s.router])
    except BaseException:
        s.stop()
        raise
    return s


def write_topology(path: str, revision: str, pairs: list[tuple[int, int, int, int, bool]]) -> None:
    doc = {"version": 1, "revision": revision, "pairs": [
        {"index": i, "ready": ready, "prefill": {"url": f"http://127.0.0.1:{p}", "bootstrap_host": "127.0.0.1",
                                                 "bootstrap_port": b},
         "decode": {"url": f"http://127.0.0.1:{d}"}} for i, p, d, b, ready in pairs]}
    with open(path + ".tmp", "w") as fh:
        yaml.safe_dump(doc, fh)
    os.replace(path + ".tmp", path)


@pytest.fixture
def fs(tiny_model, tmp_path):
    s = start_fault_stack(str(tmp_path), tiny_model)
    yield s
    for p in s.procs:
        if p.popen.poll() is None:
            try:
                os.kill(p.popen.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
    s.stop()


# ---- client side --------------------------------------------------------------------------------------

def model_of(s) -> str:
    return httpx.get(s.router.url + "/v1/models", timeout=10).json()["data"][0]["id"]


def chat(model: str, content: str = "hello", **kw) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 8, **kw}


class Call:
    """One client request in a thread: its status, body (or SSE events) and how long it took."""

    def __init__(self, s, body: dict, *, deadline_s: float = DEADLINE_S) -> None:
        self.status: int | None = None
        self.body: dict | None = None
        self.events: list = []
        self.exc: BaseException | None = None
        self.elapsed: float | None = None
        self._t = threading.Thread(target=self._run, args=(s.router.url, body, deadline_s), daemon=True)
        self._t.start()

    def _run(self, url: str, body: dict, deadline_s: float) -> None:
        t0 = time.monotonic()
        try:
            headers = {"X-Request-Timeout": str(deadline_s)}
            if body.get("stream"):
                with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers=headers,
                                  timeout=deadline_s + 60) as r:
                    self.status = r.status_code
                    self.events.extend(iter_sse(r.iter_lines()))
                    if r.status_code != 200:
                        self.body = json.loads(r.read() or b"{}")
            else:
                r = httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=deadline_s + 60)
                self.status, self.body = r.status_code, r.json()
        except BaseException as exc:  # noqa: BLE001 - recorded for the assertions
            self.exc = exc
        self.elapsed = time.monotonic() - t0

    def join(self, timeout: float = DEADLINE_S + HANG_MARGIN_S) -> "Call":
        self._t.join(timeout)
        assert not self._t.is_alive(), f"the client hung past its deadline ({DEADLINE_S}s + {HANG_MARGIN_S}s margin)"
        return self

    def error_message(self) -> str:
        """The error the client saw: an HTTP error body, an SSE error event, or a dropped connection."""
        if self.body and "error" in self.body:
            return self.body["error"]["message"]
        errs = [e for e in self.events if isinstance(e, dict) and "error" in e]
        if errs:
            return errs[0]["error"]["message"]
        if self.exc is not None:
            return f"{type(self.exc).__name__}: {self.exc}"
        return ""


def assert_pages_free(s, *procs: Proc, timeout: float = 30.0) -> None:
    for p in procs or (s.prefill, s.decode):
        d = wait_for(lambda p=p: (lambda d: d if d["live"] == 0 and d["pool"]["free"] == d["pool"]["total"] else None)(
            s.debug(p)), timeout, f"{p.name} to hold no request and free every page")
        assert d["pool"]["free"] == d["pool"]["total"]


def next_request_succeeds(s, bound_s: float = RECOVERY_S) -> float:
    """Normal requests until one is answered 200; returns the seconds it took (asserted <= bound_s)."""
    t0 = time.monotonic()
    model = model_of(s)
    last = None
    while time.monotonic() - t0 < bound_s:
        try:
            r = httpx.post(s.router.url + "/v1/chat/completions", json=chat(model), timeout=30)
            if r.status_code == 200:
                return time.monotonic() - t0
            last = r.text
        except httpx.HTTPError as exc:
            last = repr(exc)
        time.sleep(0.5)
    raise AssertionError(f"no normal request succeeded within {bound_s}s of the fault ending; last: {last}")


def in_flight(s, proc: Proc, pred, what: str, timeout: float = 30.0) -> dict:
    return wait_for(lambda: next((r for r in s.debug(proc)["requests"] if pred(r)), None), timeout, what)


def log_has(proc: Proc, *words: str) -> bool:
    return any(all(w in line for w in words) for line in proc.log_text().splitlines())


# ---- the KV proxy ---------------------------------------------------------------------------------------

class KVProxy:
    """TCP proxy decode -> prefill bootstrap port. mode "corrupt": flips one byte in the middle of the first
    CHUNK payload (prefill -> decode); mode "drop": cuts both connections (RST) halfway through that payload."""

    PREAMBLE = 6  # b"PDKV" + u16 version
    FRAME = struct.Struct(">BI")  # u8 type, u32 length
    CHUNK_TYPE = 4

    def __init__(self, target_port: int, mode: str) -> None:
        self.target, self.mode = target_port, mode
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.port = self.sock.getsockname()[1]
        self.faulted = 0
        self.armed = True
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self.sock.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target))
            threading.Thread(target=self._pipe, args=(client, upstream), daemon=True).start()
            threading.Thread(target=self._p2d, args=(upstream, client), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        for x in (src, dst):
            try:
                x.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    @staticmethod
    def _exact(src: socket.socket, n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            data = src.recv(n - len(buf))
            if not data:
                raise ConnectionError("closed")
            buf += data
        return buf

    def _p2d(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            dst.sendall(self._exact(src, self.PREAMBLE))
            while True:
                head = self._exact(src, self.FRAME.size)
                ftype, length = self.FRAME.unpack(head)
                payload = bytearray(self._exact(src, length))
                if ftype == self.CHUNK_TYPE and self.armed:
                    self.armed = False
                    self.faulted += 1
                    mid = 11 + (length - 11) // 2  # past the chunk's own header (u16 u8 u32 u32)
                    if self.mode == "corrupt":
                        payload[mid] ^= 0xFF
                    else:  # drop: half the payload, then a reset on both sides
                        dst.sendall(head + bytes(payload[:mid]))
                        for x in (src, dst):
                            x.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                            x.close()
                        return
                dst.sendall(head + bytes(payload))
        except OSError:
            pass
        self._pipe(src, dst)


# ---- the cases --------------------------------------------------------------------------------------------

@pytest.mark.slow  # the same fault, in make test: tests/pd/test_pd_failures.py
def test_kill_decode_during_transfer(fs):
    s = fs
    s.hooks(s.decode, stall_transfers=1)  # decode reads the HEADER, then stops reading: a transfer in flight
    call = Call(s, chat(model_of(s), stream=True))
    row = in_flight(s, s.prefill, lambda r: r["stage"] == "inflight", "the KV in flight")
    s.decode.kill()
    call.join()
    assert call.status in (200, 502, 503, 504) and call.error_message(), (call.status, call.events, call.exc)
    assert_pages_free(s, s.prefill)  # prefill's transfer watchdog / lost connection freed the held KV
    assert s.metric(s.prefill, "pdrt_kv_transfers_total", {"outcome": "failed"}) == 1
    assert log_has(s.prefill, "prefill request failed", row["id"])
    s.respawn("decode")
    next_request_succeeds(s)
    assert_pages_free(s)


@pytest.mark.slow
def test_sigstop_decode_during_transfer(fs):
    s = fs
    s.hooks(s.decode, stall_transfers=1)
    call = Call(s, chat(model_of(s)))
    row = in_flight(s, s.prefill, lambda r: r["stage"] == "inflight", "the KV in flight")
    os.kill(s.decode.popen.pid, signal.SIGSTOP)
    try:
        call.join()
        assert call.status in (502, 504), (call.status, call.body)
        assert "transfer timeout" in call.error_message() or "failed" in call.error_message()
        assert_pages_free(s, s.prefill)
        assert s.metric(s.prefill, "pdrt_watchdog_fired_total", {"phase": "transfer"}) == 1
        assert log_has(s.prefill, "prefill request failed", row["id"], "transfer timeout")
        # the frozen decode is noticed: the router's /health turns 503 and it stops dispatching there
        wait_for(lambda: httpx.get(s.router.url + "/health", timeout=5).status_code == 503, STALE_AFTER_S + 10,
                 "the router to notice the frozen decode")
        t0 = time.monotonic()
        r = httpx.post(s.router.url + "/v1/chat/completions", json=chat(model_of(s)), timeout=30)
        assert r.status_code == 503 and time.monotonic() - t0 < 5, r.text  # refused at once, not sent to hang
        wait_for(lambda: log_has(s.router, "is stale", s.decode.url), 10, "the router's log line")
        assert s.metric(s.router, "pdrt_router_worker_stale_total") >= 1
        assert s.metric(s.router, "pdrt_router_pair_stale") == 1
    finally:
        os.kill(s.decode.popen.pid, signal.SIGCONT)
    next_request_succeeds(s)
    assert_pages_free(s)  # decode, once thawed, dropped its stale transfer and freed its reservation


@pytest.mark.slow
def test_sigstop_decode_during_decode(fs):
    s = fs
    s.hooks(s.decode, step_delay_s=0.2)  # slow decode: the generation is still running when decode freezes
    call = Call(s, chat(model_of(s), max_tokens=200, ignore_eos=True, stream=True), deadline_s=DEADLINE_S)
    wait_for(lambda: len(call.events) >= 2, 30, "the first tokens to stream")
    os.kill(s.decode.popen.pid, signal.SIGSTOP)
    try:
        call.join()
        assert call.status == 200 and "deadline" in call.error_message(), (call.events[-2:], call.exc)
        assert call.elapsed < DEADLINE_S + HANG_MARGIN_S
        wait_for(lambda: s.metric(s.router, "pdrt_requests_total", {"outcome": "failed"}) == 1, 10,
                 "the router to count the failed request (after its best-effort aborts time out)")
        wait_for(lambda: httpx.get(s.router.url + "/health", timeout=5).status_code == 503, STALE_AFTER_S + 10,
                 "the router to notice the frozen decode")
        wait_for(lambda: log_has(s.router, "is stale", s.decode.url), 10, "the router's log line")
        assert s.metric(s.router, "pdrt_router_worker_stale_total") >= 1
        assert s.metric(s.router, "pdrt_router_pair_stale") == 1
    finally:
        os.kill(s.decode.popen.pid, signal.SIGCONT)
    s.hooks(s.decode, step_delay_s=0)
    assert_pages_free(s)  # thawed decode saw its client gone and freed the pages
    assert s.metric(s.decode, "pdrt_aborted_requests_total") >= 1
    assert log_has(s.decode, "decode request failed")
    next_request_succeeds(s)


@pytest.mark.slow  # the same fault, in make test: tests/pd/test_pd_failures.py
def test_kill_prefill(fs):
    s = fs
    s.hooks(s.prefill, stall_prefill=1)  # held before the engine; decode attached and waiting for the KV
    call = Call(s, chat(model_of(s)))
    row = in_flight(s, s.decode, lambda r: r["state"] == "WaitingForInput", "decode waiting for the KV")
    s.prefill.kill()
    call.join()
    assert call.status in (502, 503) and call.error_message(), (call.status, call.body)
    assert_pages_free(s, s.decode)
    assert s.metric(s.decode, "pdrt_kv_transfers_total", {"outcome": "failed"}) == 1
    assert log_has(s.decode, "decode request failed", row["id"])
    s.respawn("prefill")
    next_request_succeeds(s)
    assert_pages_free(s)


@pytest.mark.slow
def test_sigstop_prefill(fs):
    s = fs
    s.hooks(s.prefill, stall_prefill=1)
    call = Call(s, chat(model_of(s)))
    row = in_flight(s, s.decode, lambda r: r["state"] == "WaitingForInput", "decode waiting for the KV")
    os.kill(s.prefill.popen.pid, signal.SIGSTOP)
    try:
        call.join()
        assert call.status in (502, 504) and call.error_message(), (call.status, call.body)
        assert_pages_free(s, s.decode)  # decode's prefill-stall watchdog freed its reservation
        assert s.metric(s.decode, "pdrt_watchdog_fired_total", {"phase": "prefill_stall"}) == 1
        assert log_has(s.decode, "decode request failed", row["id"], "prefill stalled")
        wait_for(lambda: httpx.get(s.router.url + "/health", timeout=5).status_code == 503, STALE_AFTER_S + 10,
                 "the router to notice the frozen prefill")
        wait_for(lambda: log_has(s.router, "is stale", s.prefill.url), 10, "the router's log line")
        assert s.metric(s.router, "pdrt_router_worker_stale_total") >= 1
        assert s.metric(s.router, "pdrt_router_pair_stale") == 1
    finally:
        os.kill(s.prefill.popen.pid, signal.SIGCONT)
    next_request_succeeds(s)
    assert_pages_free(s)


@pytest.mark.slow
def test_overload_burst_gets_a_200_or_a_429_with_retry_after_never_a_502(fs):
    """The overload row (issue 20): 80 concurrent 600-token completions on one pair whose decode holds ~26."""
    s = fs
    model = model_of(s)
    health: list[int] = []
    calls = [Call(s, {**chat(model, f"burst {i}: tell a long story"), "max_tokens": 600, "ignore_eos": True},
                  deadline_s=120) for i in range(80)]
    t_end = time.monotonic() + 120 + HANG_MARGIN_S
    while any(c._t.is_alive() for c in calls) and time.monotonic() < t_end:
        health.append(httpx.get(s.router.url + "/health", timeout=10).status_code)
        time.sleep(0.5)
    for c in calls:
        c.join(max(0.0, t_end - time.monotonic()))
    codes = sorted(c.status for c in calls)
    refused = [c for c in calls if c.status in (429, 503)]
    odd = [(c.status, c.error_message()[:200]) for c in calls if c.status not in (200, 429)]
    assert set(codes) <= {200, 429, 503} and refused and codes.count(200) >= 20, (codes, odd)
    for c in refused:  # a clear answer: the OpenAI error shape, a code naming why, how long to wait
        assert c.body["error"]["code"] in ("pairs_busy", "router_queue_full") and c.error_message(), c.body
    assert set(health) == {200}, health  # busy, not unhealthy: a load balancer keeps the stack
    assert s.metric(s.router, "pdrt_router_circuit_open") == 0
    assert s.metric(s.router, "pdrt_requests_refused_total", {"reason": "pairs_busy"}) >= 1
    assert_pages_free(s)
    next_request_succeeds(s)


@pytest.mark.slow
def test_a_long_prompt_that_keeps_advancing_is_served_however_long_its_prefill(fs):
    """The long-prompt row (issue 20): 95% of the context with every prefill step slowed to 2.5 s (~10 s of
    prefill, past decode's 6-s transfer timeout here, which once covered prefill's work and failed it)."""
    s = fs
    model = model_of(s)
    s.hooks(s.prefill, step_delay_s=2.5)
    try:
        call = Call(s, {**chat(model, "pd " * 900), "max_tokens": 4}, deadline_s=90).join(90 + HANG_MARGIN_S)
    finally:
        s.hooks(s.prefill, step_delay_s=0)
    assert call.status == 200, (call.status, call.body)
    assert call.body["usage"]["prompt_tokens"] > 0.85 * 2048 and call.elapsed > 6, (call.body["usage"], call.elapsed)
    assert s.metric(s.decode, "pdrt_watchdog_fired_total", {"phase": "prefill_stall"}) == 0
    assert s.metric(s.decode, "pdrt_watchdog_fired_total", {"phase": "decode_transfer"}) == 0
    assert_pages_free(s)
    next_request_succeeds(s)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["drop", "corrupt"])
def test_kv_connection_dropped_or_corrupted_mid_stream(tiny_model, tmp_path, mode):
    # the router sends decode to the proxy's port; the proxy forwards to prefill's real bootstrap port
    s = None
    proxy = KVProxy(0, mode)  # its target is set once prefill's bootstrap port is known (connections come later)
    try:
        s = start_fault_stack(str(tmp_path), tiny_model, bootstrap_port_for_router=proxy.port)
        proxy.target = s.bootstrap_port
        call = Call(s, chat(model_of(s))).join()
        assert proxy.faulted == 1
        assert call.status == 502, (call.status, call.body)
        msg = call.error_message()
        if mode == "corrupt":
            assert "checksum" in msg, msg  # the END frame's crc32 over the chunks caught the flipped byte
            assert s.metric(s.decode, "pdrt_kv_transfer_failures_total") == 1
            assert log_has(s.decode, "decode request failed", "checksum")
        else:
            assert "lost" in msg or "unreachable" in msg or "failed" in msg, msg
            assert s.metric(s.prefill, "pdrt_kv_transfers_total", {"outcome": "failed"}) == 1
            assert log_has(s.prefill, "prefill request failed")
        assert call.elapsed < DEADLINE_S + HANG_MARGIN_S
        assert_pages_free(s)
        next_request_succeeds(s)  # the proxy is disarmed: the next transfer goes through intact
        assert_pages_free(s)
    finally:
        proxy.close()
        if s is not None:
            s.stop()


def test_slow_client_reading_sse_does_not_hold_back_others_and_frees_its_pages(fs):
    s = fs
    model = model_of(s)
    port = int(s.router.url.rsplit(":", 1)[1])
    body = json.dumps(chat(model, "a long story please", max_tokens=400, ignore_eos=True, stream=True)).encode()
    slow = socket.socket()
    slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window: the router must wait on us
    slow.connect(("127.0.0.1", port))
    slow.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"X-Request-Timeout: {DEADLINE_S}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    got = slow.recv(200)  # the headers and a first event, then the client reads 64 bytes every 0.1 s
    assert b"200" in got.split(b"\r\n")[0]
    t0 = time.monotonic()
    clean = Call(s, chat(model, "meanwhile", temperature=0), deadline_s=30)
    read_slowly = len(got)

    def decode_idle() -> bool:
        d = s.debug(s.decode)
        return d["live"] == 0 and d["pool"]["free"] == d["pool"]["total"]

    while (clean._t.is_alive() or not decode_idle()) and time.monotonic() - t0 < 40:
        read_slowly += len(slow.recv(64))
        time.sleep(0.1)
    clean.join(1)
    assert clean.status == 200, clean.body  # others are served while the slow reader crawls
    # the generation finished and its KV pages are free although the client has read only a sliver of it:
    # a slow reader holds socket buffers, never KV pages
    assert decode_idle() and read_slowly < 20_000, read_slowly
    # the slow request ends by its deadline (completed into the socket buffers, or cut with an error event)
    slow.settimeout(DEADLINE_S + HANG_MARGIN_S)
    rest = b""
    try:
        while chunk := slow.recv(65536):
            rest += chunk
            if b"[DONE]" in rest or b'"error"' in rest:
                break
    except socket.timeout:
        pytest.fail("the slow client's stream neither finished nor failed by its deadline")
    slow.close()
    assert b"[DONE]" in rest or b"deadline" in rest
    assert_pages_free(s)
    assert s.metric(s.router, "pdrt_requests_total") >= 2
    next_request_succeeds(s)


def test_router_restart_with_live_requests(fs):
    s = fs
    s.hooks(s.decode, step_delay_s=0.1)
    calls = [Call(s, chat(model_of(s), f"live {i}", max_tokens=200, ignore_eos=True, stream=True)) for i in range(3)]
    wait_for(lambda: all(len(c.events) >= 1 for c in calls), 40, "three live streams")
    s.router.kill()
    for c in calls:
        c.join()
        assert c.exc is not None or not c.events or c.events[-1] != "[DONE]"  # the client sees the cut
        assert c.error_message() or c.exc is not None
    s.hooks(s.decode, step_delay_s=0)
    assert_pages_free(s)  # both workers saw the router's connections close and freed everything
    assert s.metric(s.decode, "pdrt_aborted_requests_total", {"cause": "client_disconnect"}) == 3
    assert log_has(s.decode, "decode request failed", "client disconnected")
    s.respawn("router")
    next_request_succeeds(s)


@pytest.mark.slow
def test_topology_reload_during_traffic(tiny_model, tmp_path):
    s = start_fault_stack(str(tmp_path), tiny_model, topology_file=True)
    try:
        path = os.path.join(str(tmp_path), "topology.yaml")
        pp, dp = (int(p.url.rsplit(":", 1)[1]) for p in (s.prefill, s.decode))
        s.hooks(s.decode, step_delay_s=0.05)
        calls = [Call(s, chat(model_of(s), f"during reload {i}", max_tokens=40, ignore_eos=True, stream=True))
                 for i in range(3)]
        wait_for(lambda: all(len(c.events) >= 1 for c in calls), 40, "three live streams")
        # a new revision: the pair kept, plus a second pair that is not ready (e.g. still starting)
        write_topology(path, "r2", [(0, pp, dp, s.bootstrap_port, True), (1, free_port(), free_port(), free_port(), False)])
        wait_for(lambda: httpx.get(s.router.url + "/config", timeout=5).json()["topology"]["revision"] == "r2", 20,
                 "the router to load revision r2")
        for c in calls:
            c.join()
            assert c.status == 200 and c.events[-1] == "[DONE]", (c.events[-2:], c.exc)  # in-flight work unharmed
        s.hooks(s.decode, step_delay_s=0)
        assert s.metric(s.router, "pdrt_router_topology_reloads_total", {"outcome": "ok"}) >= 1
        assert log_has(s.router, "topology revision='r2'")
        # a broken file is refused: the last good revision keeps serving, the error is visible
        with open(path, "w") as fh:
            fh.write("pairs: [not a pair\n")
        wait_for(lambda: httpx.get(s.router.url + "/config", timeout=5).json()["topology_error"], 20,
                 "the bad topology to be reported")
        assert s.metric(s.router, "pdrt_router_topology_reloads_total", {"outcome": "error"}) == 1
        next_request_succeeds(s)
        assert_pages_free(s)
    finally:
        s.stop()


@pytest.mark.slow
def test_breaker_recovers_within_its_window_plus_one_trial_after_a_neutral_trial(fs):
    # Defect 1 of issue 13 (the breaker fix is rel13a's; this case covers it end to end). A decode dies, the
    # breaker opens; after the cooldown the trial request's client leaves before the first token (neutral).
    s = fs
    model = model_of(s)
    s.decode.kill()
    for _ in range(3):  # three pair failures open the breaker
        httpx.post(s.router.url + "/v1/chat/completions", json=chat(model), timeout=30)
    assert httpx.post(s.router.url + "/v1/chat/completions", json=chat(model), timeout=30).status_code == 503
    s.respawn("decode")
    s.hooks(s.decode, stall_transfers=1)  # the trial will not reach its first token before its client leaves
    time.sleep(5.5)  # breaker cooldown (RouterConfig.breaker_cooldown_s = 5 s)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(s.router.url + "/v1/chat/completions", json=chat(model), timeout=2)  # the impatient trial
    assert_pages_free(s)
    # the pair must come back: within the breaker window plus one trial
    next_request_succeeds(s, bound_s=5.0 + 30.0)
    assert httpx.get(s.router.url + "/health", timeout=5).status_code == 200
