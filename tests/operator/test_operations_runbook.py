"""docs/operations.md is a runbook of commands: every command it shows must exist with the flags it uses."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from pdoperator.cli import kubectl_pd as pd_cli
from pdruntime import cli as rt_cli

RUNBOOK = Path(__file__).resolve().parents[2] / "docs" / "operations.md"
SECTIONS = ("Agents hang after a few rounds", "Decode restarted alone", "What changed since noon",
            "Is this load from my harness or someone else's", "Where is this request stuck",
            "The hang is outside the stack: a client-side proxy")


def _commands(prefix: str) -> list[list[str]]:
    out = []
    for line in RUNBOOK.read_text().splitlines():
        m = re.match(r"^\$ " + re.escape(prefix) + r" (.*)$", line.strip())
        if m:
            out.append(shlex.split(m.group(1).replace('"$KEY"', "k")))
    return out


def test_the_runbook_walks_through_every_incident():
    text = RUNBOOK.read_text()
    for title in SECTIONS:
        assert re.search(r"^## \d\. \"" + re.escape(title), text, re.M), title


@pytest.mark.parametrize("argv", _commands("kubectl pd"), ids=" ".join)
def test_every_kubectl_pd_command_in_the_runbook_parses(argv):
    pd_cli.build_parser().parse_args(argv)  # SystemExit(2) on an unknown command or flag fails the test


@pytest.mark.parametrize("argv", _commands("pdrt"), ids=" ".join)
def test_every_pdrt_command_in_the_runbook_parses(argv):
    rt_cli.build_parser().parse_args(argv)


def test_the_runbook_shows_commands():
    assert len(_commands("kubectl pd")) >= 6 and _commands("pdrt")
