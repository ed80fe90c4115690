"""Operator test fixtures live in harness.py (importable by tests); this puts it on sys.path."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import cluster, operator  # noqa: E402,F401  (pytest fixtures)
