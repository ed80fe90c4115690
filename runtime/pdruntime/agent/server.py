"""The agent's HTTP server (stdlib ``ThreadingHTTPServer``: the sidecar needs no event loop)."""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from pdruntime.env import env_report

from . import proc, tables, weights


@dataclass
class AgentConfig:
    engine: str
    role: str
    engine_url: str
    matches: tuple[str, ...]
    model_path: str | None = None
    report_env: tuple[str, ...] = ()
    proc_root: str = "/proc"


@dataclass
class _Progress:
    """When the generation counter last changed, and since when each stage has held requests."""

    tokens: float | None = None
    changed_at: float = field(default_factory=time.monotonic)
    busy_since: dict[str, float] = field(default_factory=dict)


class Agent:
    def __init__(self, cfg: AgentConfig) -> None:
        self.cfg = cfg
        self.pid: int | None = None
        self.restarts = 0
        self._progress = _Progress()
        self._lock = threading.Lock()

    def engine_pid(self) -> int | None:
        """The engine's PID, found again when the one known is gone or is no longer the engine."""
        pid = self.pid
        if pid is not None:
            line = proc.cmdline(pid, self.cfg.proc_root)
            if line and any(m in line for m in self.cfg.matches):
                return pid
        found = proc.find_pid(self.cfg.matches, self.cfg.proc_root, exclude=os.getpid())
        if found is not None and pid is not None and found != pid:
            self.restarts += 1
        self.pid = found
        return self.pid

    def health(self) -> tuple[int, dict]:
        pid = self.engine_pid()
        body = {"status": "ok" if pid else "engine process not found", "engine": self.cfg.engine, "pid": pid}
        if not pid:
            body["why"] = f"no process under {self.cfg.proc_root} whose command line contains {list(self.cfg.matches)}"
        return (200 if pid else 503), body

    def config(self) -> dict:
        pid = self.engine_pid()
        environ = proc.read_environ(pid, self.cfg.proc_root) if pid else None
        env = {"process_env": env_report(environ, self.cfg.report_env) if environ is not None else None,
               "report_env": list(self.cfg.report_env)}
        return {"engine": self.cfg.engine, "role": self.cfg.role, "pid": pid, "env": env,
                "model": weights.model_info(self.cfg.model_path)}

    def engine_metrics(self) -> dict[str, float | None]:
        try:
            with urllib.request.urlopen(self.cfg.engine_url.rstrip("/") + "/metrics", timeout=3) as resp:
                text = resp.read().decode("utf-8", "replace")
        except (OSError, ValueError):
            text = None
        values = tables.translate(self.cfg.engine, text)
        self._track(values)
        return values

    def _track(self, values: dict[str, float | None]) -> None:
        now = time.monotonic()
        with self._lock:
            p = self._progress
            if values.get("generation_tokens") != p.tokens:
                p.tokens, p.changed_at = values.get("generation_tokens"), now
            for stage in tables.STAGES[self.cfg.role]:
                if (values.get(stage) or 0) > 0:
                    p.busy_since.setdefault(stage, now)
                else:
                    p.busy_since.pop(stage, None)

    def metrics_text(self) -> str:
        v = self.engine_metrics()
        lines = ["# TYPE pdrt_agent_engine_up gauge", f"pdrt_agent_engine_up {1 if self.engine_pid() else 0}",
                 "# TYPE pdrt_agent_engine_restarts_total counter",
                 f"pdrt_agent_engine_restarts_total {self.restarts}"]
        for key, name in (("generation_tokens", "pdrt_generated_tokens_total"),
                          ("prompt_tokens", "pdrt_prompt_tokens_total")):
            if v.get(key) is not None:  # unknown stays absent, never 0
                lines += [f"# TYPE {name.removesuffix('_total')} counter", f'{name}{{role="{self.cfg.role}"}} {v[key]}']
        lines.append("# TYPE pdrt_agent_queue_requests gauge")
        for stage in tables.STAGES[self.cfg.role]:
            if v.get(stage) is not None:
                lines.append(f'pdrt_agent_queue_requests{{role="{self.cfg.role}",stage="{stage}"}} {v[stage]}')
        return "\n".join(lines) + "\n"

    def debug_requests(self) -> dict:
        """The pdrt worker's ``/debug/requests`` shape. The engine lists no requests, so its running batch is one
        aggregate row (``count`` requests) whose ``idle_s`` is the time the generation counter has not moved --
        what stall.py needs to see a frozen engine. The queues are counts only: a queue whose count holds
        steady may hold different requests, so no row claims one of them is stuck."""
        v = self.engine_metrics()
        now = time.monotonic()
        with self._lock:
            p = self._progress
            rows = [{"id": f"{self.cfg.engine}-{self.cfg.role}-{stage}", "stage": stage, "aggregate": True,
                     "count": int(v[stage] or 0), "age_s": round(now - since, 3),
                     "idle_s": None if p.tokens is None else round(now - max(since, p.changed_at), 3),
                     "tokens": None if p.tokens is None else int(p.tokens)}
                    for stage, since in sorted(p.busy_since.items()) if stage == "running"]
            idle = None if p.tokens is None else round(now - p.changed_at, 3)
        queues = {stage: None if v.get(stage) is None else int(v[stage]) for stage in tables.STAGES[self.cfg.role]}
        live = None if v.get("running") is None else int(v["running"] or 0)
        return {"role": self.cfg.role, "url": self.cfg.engine_url, "live": live,
                "requests": rows, "queues": queues, "engine": self.cfg.engine,
                "progress": {"generation_tokens": v.get("generation_tokens"),
                             "prompt_tokens": v.get("prompt_tokens"), "tokens_idle_s": idle}}


def _handler(agent: Agent) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:  # access logs would drown the engine's
            pass

        def _send(self, code: int, body: bytes, ctype: str) -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                return self._send(200, agent.metrics_text().encode(), "text/plain; version=0.0.4")
            routes = {"/health": agent.health, "/config": lambda: (200, agent.config()),
                      "/debug/requests": lambda: (200, agent.debug_requests())}
            if path not in routes:
                body = {"error": f"no route {path}; accepted: {sorted(routes) + ['/metrics']}"}
                return self._send(404, json.dumps(body).encode(), "application/json")
            code, body = routes[path]()
            self._send(code, json.dumps(body).encode(), "application/json")

    return Handler


def make_server(agent: Agent, host: str, port: int) -> ThreadingHTTPServer:
    server = ThreadingHTTPServer((host, port), _handler(agent))
    server.daemon_threads = True
    return server
