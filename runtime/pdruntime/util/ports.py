"""Free local ports for servers started by tests, benchmarks and smoke runs.

:func:`free_port_block` picks from below Linux's ephemeral range (32768-60999), so no outgoing connection on
the machine can take one of the ports between the check and the server's bind. :func:`free_port` is the
single-port form: a port the kernel picks (it does not hand the same one out again at once, so several
calls in a row give distinct ports).
"""

from __future__ import annotations

import random
import socket

BLOCK_RANGE = (20000, 32767)  # [lo, hi]: below the ephemeral range
ATTEMPTS = 200


def _bindable(host: str, ports: range) -> bool:
    socks: list[socket.socket] = []
    try:
        for p in ports:
            s = socket.socket()
            socks.append(s)
            s.bind((host, p))
        return True
    except OSError:
        return False
    finally:
        for s in socks:
            s.close()


def free_port_block(n: int, host: str = "127.0.0.1") -> int:
    """A base port with ``n`` consecutive free ports (``pdrt up`` listens on base .. base + n - 1)."""
    for _ in range(ATTEMPTS):
        base = random.randint(BLOCK_RANGE[0], BLOCK_RANGE[1] - n)
        if _bindable(host, range(base, base + n)):
            return base
    raise RuntimeError(f"no block of {n} free ports in {BLOCK_RANGE}")


def free_port(host: str = "127.0.0.1") -> int:
    """One free port, chosen by the kernel."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
