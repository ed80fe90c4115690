from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.fixture(autouse=True)
def _helm_home(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> None:
    """helm keeps cache/config/data under HOME: give it a private one per session."""
    base = tmp_path_factory.getbasetemp() / "helm"
    for var in ("HELM_CACHE_HOME", "HELM_CONFIG_HOME", "HELM_DATA_HOME"):
        monkeypatch.setenv(var, str(base / var.lower()))
