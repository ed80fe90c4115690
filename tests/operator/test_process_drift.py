"""Drift source "process": the env a runtime reports at /config against the declared env."""

from __future__ import annotations

import pytest

from pdoperator.core.drift import PRESENCE_ONLY, process_env_drift as entries


def process_env_drift(*args):
    """The drift entries' text (status.drift holds the entries; lines are made from them at the edges)."""
    return [e.text for e in entries(*args)]

DECLARED = {"PDRT_MAX_KV_SPLITS": "32", "PDRT_KV_AUTH_TOKEN_FILE": "/var/run/pdstack/kv/token",
            "HF_TOKEN": {"secretKeyRef": {"name": "hf", "key": "t"}}, "MY_FLAG": "1"}
SEEN = {"PDRT_MAX_KV_SPLITS": "32", "PDRT_KV_AUTH_TOKEN_FILE": "/var/run/pdstack/kv/token"}


@pytest.mark.parametrize("reported,allow,lines", [
    (SEEN, (), []),                                                           # as declared
    ({**SEEN, "SGLANG_SM120_MMA_TARGET_CTAS": "512"}, (),                    # webhook-injected
     ["SGLANG_SM120_MMA_TARGET_CTAS=512 (not declared)"]),
    ({**SEEN, "PDRT_MAX_KV_SPLITS": "16"}, (), ["PDRT_MAX_KV_SPLITS: declared 32, process sees 16"]),
    ({"PDRT_KV_AUTH_TOKEN_FILE": "/var/run/pdstack/kv/token"}, (),            # a knob the process did not get
     ["PDRT_MAX_KV_SPLITS: declared 32, not in the process"]),
    ({**SEEN, "HOME": "/root"}, (), []),                                      # not a reported family: ignored
    ({**SEEN, "HF_TOKEN": "<redacted>", "MY_FLAG": "2"}, ("HF_*", "MY_FLAG"),  # allow-listed: compared; refs by presence
     ["MY_FLAG: declared 1, process sees 2"]),
    (SEEN, ("HF_TOKEN",), ["HF_TOKEN: declared from a reference, not in the process"]),
    ({**SEEN, "NCCL_PASSWORD": "<redacted>"}, (), ["NCCL_PASSWORD=<redacted> (not declared)"]),
])
def test_process_env_drift(reported, allow, lines):
    assert process_env_drift(DECLARED, reported, allow, PRESENCE_ONLY) == lines


def test_presence_only_names_compare_by_presence_and_others_by_value():
    moved = {**SEEN, "PDRT_KV_AUTH_TOKEN_FILE": "/elsewhere/token"}
    assert process_env_drift(DECLARED, moved, (), PRESENCE_ONLY) == []
    assert process_env_drift(DECLARED, moved, ()) == [
        "PDRT_KV_AUTH_TOKEN_FILE: declared /var/run/pdstack/kv/token, process sees /elsewhere/token"]
    gone = {"PDRT_MAX_KV_SPLITS": "32"}
    assert process_env_drift(DECLARED, gone, (), PRESENCE_ONLY) == [
        "PDRT_KV_AUTH_TOKEN_FILE: declared /var/run/pdstack/kv/token, not in the process"]


def _pod(name, rev, image_id, ctr="worker"):
    return {"metadata": {"name": name, "labels": {"pdstack.io/revision": rev}},
            "status": {"containerStatuses": [{"name": ctr, "imageID": image_id}] if image_id is not None else []}}


A = "ghcr.io/pdstack/runtime@sha256:aaa"
B = "docker-pullable://ghcr.io/pdstack/runtime@sha256:bbb"


@pytest.mark.parametrize("pods,lines", [
    ([_pod("p0", "r1", A), _pod("d0", "r1", A)], []),
    ([_pod("p0", "r1", A), _pod("d0", "r1", None)], []),                    # no imageID yet: no evidence
    ([_pod("p0", "r1", A), _pod("d0", "r2", B)], []),                       # different revisions may differ
    ([_pod("p0", "r1", A), _pod("d0", "r1", A), _pod("p1", "r1", B)],
     ["image: revision r1 container worker runs 2 digests: sha256:aaa (d0, p0), sha256:bbb (p1)"]),
])
def test_image_drift_moved_tag(pods, lines):
    from pdoperator.core.drift import image_drift, message_lines
    assert message_lines(image_drift(pods)) == lines
