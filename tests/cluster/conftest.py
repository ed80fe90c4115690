"""The test cluster's modules on sys.path (the emulator lives in tests/operator)."""

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
for p in (HERE, HERE.parent / "operator"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))
