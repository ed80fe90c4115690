"""The engine process, found under /proc by a substring of its command line."""

from __future__ import annotations

import os


def cmdline(pid: int, proc: str = "/proc") -> str | None:
    try:
        with open(f"{proc}/{pid}/cmdline", "rb") as fh:
            return fh.read().replace(b"\0", b" ").decode("utf-8", "replace").strip()
    except OSError:
        return None


def find_pid(matches: tuple[str, ...], proc: str = "/proc", exclude: int | None = None) -> int | None:
    """The lowest PID whose command line contains one of ``matches`` (not ``exclude``: the agent itself)."""
    try:
        pids = sorted(int(p) for p in os.listdir(proc) if p.isdigit())
    except OSError:
        return None
    for pid in pids:
        if pid == exclude:
            continue
        line = cmdline(pid, proc)
        if line and any(m in line for m in matches):
            return pid
    return None


def read_environ(pid: int, proc: str = "/proc") -> dict[str, str] | None:
    """The process's environment as it started (``/proc/PID/environ``); None when unreadable."""
    try:
        with open(f"{proc}/{pid}/environ", "rb") as fh:
            raw = fh.read()
    except OSError:
        return None
    out = {}
    for item in raw.split(b"\0"):
        k, sep, v = item.decode("utf-8", "replace").partition("=")
        if sep and k:
            out[k] = v
    return out
