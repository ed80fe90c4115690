"""``python -m pdoperator`` as the README gives it (issue 19, defect 5): one replica, no peering object anywhere.

kopf's named peering is mandatory: with ``peering_name`` set and no such object it pauses every handler, silently,
until the object appears (the chart creates it only for ``operator.replicas > 1``). One replica must therefore run
standalone unless HA is asked for (``--priority`` or ``--peering``)."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from unittest import mock

import pytest

from pdop_harness import KUBECONFIG, NS, PEERINGS, eventually, manifest


def _kopf_kwargs(argv: list[str], env: dict[str, str] | None = None) -> dict:
    import pdoperator.__main__ as entry

    with mock.patch("kopf.run") as kopf_run, mock.patch("logging.basicConfig"), \
            mock.patch.dict("os.environ", env or {}):
        entry.main(argv)
    return kopf_run.call_args.kwargs


def test_one_replica_runs_standalone_unless_ha_is_asked_for():
    kw = _kopf_kwargs([])
    assert kw["standalone"] is True and "peering_name" not in kw
    assert _kopf_kwargs(["--standalone", "-n", "a"])["standalone"] is True
    kw = _kopf_kwargs(["--priority", "7"])
    assert kw["standalone"] is False and kw["peering_name"] == "pdstack-operator" and kw["priority"] == 7
    kw = _kopf_kwargs(["--peering", "mine"])
    assert kw["standalone"] is False and kw["peering_name"] == "mine" and kw["priority"] == 0
    with pytest.raises(SystemExit):
        _kopf_kwargs(["--standalone", "--priority", "1"])  # argparse: they exclude each other


async def test_readme_command_reconciles_without_a_peering_object(cluster):
    """The README's `python -m pdoperator -n NS` (no --standalone) against a cluster where no KopfPeering exists."""
    assert cluster.api.select(PEERINGS, NS) == []
    env = dict(os.environ, KUBECONFIG=KUBECONFIG, PDSTACK_OPERATOR_METRICS_PORT="0")
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "pdoperator", "-n", NS, "--liveness", "",
                                                env=env, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.STDOUT)

    def acted():  # a paused kopf creates nothing at all
        return len(cluster.pods("readme")) == 2 or proc.returncode is not None

    def ready():
        return cluster.condition("readme", "Ready").get("status") == "True" or proc.returncode is not None

    try:
        cluster.apply(manifest("readme", pairs=1))
        await eventually(acted, timeout=30, what="the README's python -m pdoperator to create the pair's pods")
        await eventually(ready, timeout=30, what="Ready via the README's python -m pdoperator")
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
        out, _ = await asyncio.wait_for(proc.communicate(), timeout=30)
    assert cluster.condition("readme", "Ready").get("status") == "True", out.decode()[-3000:]
    assert "standalone: one replica, no peering" in out.decode()
