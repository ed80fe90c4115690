"""The weights' sha256, the way pdrt's model info computes it (pdruntime/util/filehash.py, as the loader: the
weights files in sorted order, one digest), with a size cap and a cached result."""

from __future__ import annotations

import os
from functools import lru_cache

from pdruntime.util.filehash import sha256_files

WEIGHT_SUFFIXES = (".safetensors", ".gguf")
DEFAULT_CAP_BYTES = 64 << 30


def weight_files(path: str) -> list[str]:
    if os.path.isfile(path):
        return [path] if path.endswith(WEIGHT_SUFFIXES) else []
    return sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(WEIGHT_SUFFIXES))


@lru_cache(maxsize=8)
def _hash(files: tuple[str, ...], stamp: tuple[tuple[int, int], ...]) -> str:
    """``stamp`` (each file's size and mtime) is only the cache key: a changed file is hashed again."""
    return sha256_files(files)


def model_info(path: str | None, cap_bytes: int = DEFAULT_CAP_BYTES) -> dict[str, str | None]:
    """``{"path", "sha256", "why_not"}``: the digest, or why there is none."""
    if not path:
        return {"path": None, "sha256": None, "why_not": "no --model-path given"}
    try:
        files = weight_files(path)
        stats = [os.stat(f) for f in files]
    except OSError as exc:
        return {"path": path, "sha256": None, "why_not": f"cannot read {path}: {exc.strerror}"}
    if not files:
        return {"path": path, "sha256": None, "why_not": f"no *.safetensors or *.gguf file at {path}"}
    size = sum(s.st_size for s in stats)
    if size > cap_bytes:
        return {"path": path, "sha256": None,
                "why_not": f"weights are {size} bytes, over the hashing cap of {cap_bytes} bytes"}
    try:
        digest = _hash(tuple(files), tuple((s.st_size, s.st_mtime_ns) for s in stats))
    except OSError as exc:
        return {"path": path, "sha256": None, "why_not": f"cannot read the weights: {exc.strerror}"}
    return {"path": path, "sha256": digest, "why_not": None}
