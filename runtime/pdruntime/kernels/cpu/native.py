"""Build and load ``pdrt_cpu.c``: pdstack's CPU kernels, compiled for this host on first use.

The library is compiled with the system C compiler (``cc``, as Triton's own launcher stubs are) for the CPU it
runs on (``-march=native``) and cached under ``~/.cache/pdstack/kernels`` (or the temp directory when the home
is not writable), keyed by the source, the compiler, its flags and the CPU's feature flags: a cache shared
between hosts never hands one CPU another's build. Concurrent first uses (test workers, the two workers of
``pdrt up``) each compile to a private name and rename it into place, so nobody loads a half-written file.

``native()`` returns the loaded library, or raises :class:`NativeUnavailable` saying why (no compiler, a
compile error), once per process: callers fall back to torch and report the reason at ``/config``.

OpenMP: the library links ``libgomp.so.1`` by soname; torch is imported first, so the dynamic loader binds it
to the runtime torch already loaded and both share one thread pool (two pools spin against each other on a
small host).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch  # noqa: F401 - loaded before the library, so its OpenMP runtime is the one libgomp resolves to

SOURCE = Path(__file__).with_name("pdrt_cpu.c")
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=c11", "-Wall", "-Werror")


class NativeUnavailable(RuntimeError):
    """The CPU kernels cannot be built or loaded here; the message says why."""


def _compiler() -> str:
    for cc in ("cc", "gcc", "clang"):
        path = shutil.which(cc)
        if path:
            return path
    raise NativeUnavailable("no C compiler (cc, gcc or clang) on PATH; install one (e.g. Debian's gcc) to build "
                            "pdstack's CPU kernels")


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return os.uname().machine


def _cache_dir() -> Path:
    for base in (Path.home() / ".cache" / "pdstack" / "kernels",
                 Path(tempfile.gettempdir()) / f"pdstack-kernels-{os.getuid()}"):
        try:
            base.mkdir(parents=True, exist_ok=True)
            if os.access(base, os.W_OK):
                return base
        except OSError:
            continue
    raise NativeUnavailable("no writable cache directory for the CPU kernels (tried ~/.cache/pdstack/kernels and "
                            "the temp directory)")


def library_path() -> Path:
    """Where this host's build lives (built if missing)."""
    cc = _compiler()
    src = SOURCE.read_bytes()
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise NativeUnavailable(f"C compiler {cc} does not run: {exc}") from None
    key = hashlib.sha256(b"\0".join([src, version.encode(), " ".join(CFLAGS).encode(), _cpu_flags().encode()]))
    out = _cache_dir() / f"pdrt_cpu-{key.hexdigest()[:16]}.so"
    if out.exists():
        return out
    fd, tmp = tempfile.mkstemp(prefix=out.stem + ".", suffix=".so.tmp", dir=out.parent)
    os.close(fd)
    try:
        proc = subprocess.run([cc, *CFLAGS, str(SOURCE), "-o", tmp, "-lm"], capture_output=True, text=True,
                              timeout=300)
        if proc.returncode != 0:
            raise NativeUnavailable(f"compiling {SOURCE.name} with {cc} failed:\n{proc.stderr.strip()[-2000:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


_P, _I64, _I32, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
_SIGNATURES = {
    "pdrt_simd_level": (_I32, []),
    "pdrt_quant_linear": (_I32, [_P, _I64, _I64, _I64, _I32, _P, _F32, _P, _P, _P, _I64, _I32, _P, _I64, _I32, _I32]),
    "pdrt_dequantize": (None, [_P, _P, _P, _I64, _I64, _I32, _P, _I32]),
    "pdrt_rope_store_kv": (None, [_P, _I64, _I64, _I64, _I64, _P, _P, _P, _P, _P, _P]),
    "pdrt_paged_attention": (_I32, [_P, _I64, _I64, _I64, _I64, _I64, _P, _P, _I64, _P, _I64, _P, _F32, _P, _I32,
                                    _I64]),
}


@functools.lru_cache(maxsize=1)
def _load() -> ctypes.CDLL | NativeUnavailable:
    if sys.platform != "linux":
        return NativeUnavailable(f"pdstack's CPU kernels are built on Linux only (this is {sys.platform})")
    try:
        lib = ctypes.CDLL(str(library_path()))
    except NativeUnavailable as exc:
        return exc
    except OSError as exc:
        return NativeUnavailable(f"the CPU kernel library does not load: {exc}")
    for name, (res, args) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = res, args
    return lib


def native() -> ctypes.CDLL:
    """The loaded kernel library; raises NativeUnavailable (with the reason) where it cannot be had."""
    lib = _load()
    if isinstance(lib, NativeUnavailable):
        raise lib
    return lib


def tried() -> bool:
    """Whether this process has built or loaded the kernels yet (or found it could not): reading that builds
    nothing."""
    return _load.cache_info().currsize > 0


def unavailable_reason() -> str | None:
    """None when the kernels load here, else why not (for /config and log lines)."""
    lib = _load()
    return str(lib) if isinstance(lib, NativeUnavailable) else None


VNNI = "avx512-vnni"


def simd_level() -> str:
    """The instruction set the kernels were built for: ``avx512-vnni`` or ``portable``."""
    return VNNI if native().pdrt_simd_level() == 2 else "portable"


def int4_is_fast() -> bool:
    """Whether int4 weights beat fp32 here: on the AVX-512 VNNI build only; the portable build (a CPU without it)
    decodes int4 about 3x slower than fp32 (docs/benchmarks.md, "int4 on a CPU without AVX-512 VNNI")."""
    return simd_level() == VNNI
