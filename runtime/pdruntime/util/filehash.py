"""The sha256 of a model's weights files (torch-free: the sidecar agent imports it as the loader does)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable


def sha256_files(paths: Iterable[str]) -> str:
    """One digest over the files' bytes, in sorted path order (pdrt's model info and the agent's /config)."""
    h = hashlib.sha256()
    for p in sorted(paths):
        with open(p, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 22), b""):
                h.update(chunk)
    return h.hexdigest()
