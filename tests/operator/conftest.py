"""Operator test fixtures live in pdop_harness.py (importable by tests); this puts it on sys.path."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from pdop_harness import cluster, operator, strict_operator  # noqa: E402,F401  (pytest fixtures)
