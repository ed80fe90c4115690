"""The short form of bench/agents_soak.py: agents with growing multi-round contexts over keep-alive
connections through the router in front of 2 pairs (`pdrt up`), 5% client aborts, and pair 0's decode
killed mid-run and co-restarted by `pdrt up`, an overload burst and a 95%-of-context prompt beside them.
Zero hangs, zero leaked pages, no 502 in the burst, the long prompt served."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

HERE = os.path.dirname(os.path.abspath(__file__))


def _soak_module():
    spec = importlib.util.spec_from_file_location("agents_soak", os.path.join(HERE, "..", "..", "bench", "agents_soak.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_agents_soak_short_form_has_no_hang_no_leak_and_survives_a_decode_kill(tmp_path):
    soak = _soak_module()
    r = soak.main(["--agents", "8", "--rounds", "10", "--log-dir", str(tmp_path),
                   "--kill-at", "0.4", "--abort-rate", "0.05", "--deadline-s", "60", "--max-run-s", "600",
                   "--burst", "60", "--burst-at", "0.6", "--long-prompt"])
    assert r["hangs"] == 0
    assert r["leaked_pages"] == 0 and r["leaked_live_requests"] == 0, r["workers"]
    assert r["rounds_completed"] == r["rounds_expected"] == 80  # every agent finished its conversation
    assert r["decode_killed"] and r["decode_co_restarted"], r["decode_killed"]
    assert r["max_context_chars"] > 1500  # the contexts grew round by round
    # every failure the kill caused reached its agent as an error (and was retried), none was silent
    assert all(not k.startswith("stream ended") for k in r["errors"]), r["errors"]
    # the overload row: a burst beside the agents gets 200s or 429/503 with Retry-After, never a 502
    assert set(r["burst"]["codes"]) <= {"200", "429", "503"} and r["burst"]["refusals_without_retry_after"] == 0, \
        r["burst"]
    assert r["long_prompt"]["status"] == 200, r["long_prompt"]  # the long-prompt row: 95% of the context succeeds
