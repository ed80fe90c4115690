"""spec.prefixCache (issue 21: "a per-process flag and the CRD size or disable it"): the field reaches the
workers' own argument parsers, bad values are refused with what is accepted, and the CRD's CEL rule agrees with
the operator."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

import emu_apiext as apiext
from pdoperator.core.render import Owner, worker_command
from pdoperator.core.spec import SpecError, parse_spec

CRD = yaml.safe_load((Path(__file__).resolve().parents[2] / "crds" / "pddeployment.yaml").read_text())
SCHEMA = CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
OWNER = Owner("llm", "ns", "uid")


def _pdrt_args(raw: dict, role: str):
    """spec -> the operator's worker command line -> pdrt's own argparse -> the engine config it builds."""
    from pdruntime.cli import build_parser
    from pdruntime.server.commands import _engine_config

    cmd = worker_command(parse_spec({"image": "img", **raw}), OWNER, role)
    assert cmd[:2] == ["pdrt", "serve"], cmd
    return cmd, _engine_config(build_parser().parse_args(cmd[1:]))


@pytest.mark.parametrize("role", ["prefill", "decode"])
@pytest.mark.parametrize("field,flag,enabled,max_pages", [
    ({}, None, True, None),  # default: nothing rendered, the runtime's own default (on, any free page)
    ({"enabled": True}, None, True, None),
    ({"enabled": False}, "--no-prefix-cache", False, None),
    ({"maxPages": 4096}, "--prefix-cache-max-pages", True, 4096),
])
def test_the_field_reaches_both_workers_engine_config(role, field, flag, enabled, max_pages):
    cmd, cfg = _pdrt_args({"prefixCache": field} if field else {}, role)
    assert (flag in cmd) if flag else not any("prefix-cache" in a for a in cmd), cmd
    assert (cfg.prefix_cache, cfg.prefix_cache_max_pages) == (enabled, max_pages)


@pytest.mark.parametrize("field,says", [
    ({"maxPages": 0}, "spec.prefixCache.maxPages"),
    ({"enabled": "yes"}, "spec.prefixCache.enabled"),
])
def test_bad_values_are_refused_naming_the_field_and_what_is_accepted(field, says):
    with pytest.raises(SpecError) as e:
        parse_spec({"image": "img", "prefixCache": field})
    assert says in str(e.value) and "accepted" in str(e.value), str(e.value)


def test_max_pages_is_refused_with_engine_sglang_and_enabled_false_renders_sglangs_flag():
    base = {"image": "img", "engine": "sglang", "model": {"source": "/models/m"}, "runtimeImage": "pdrt:1"}
    with pytest.raises(SpecError, match="accepted with engine 'sglang': enabled only"):
        parse_spec({**base, "prefixCache": {"maxPages": 8}})
    cmd = worker_command(parse_spec({**base, "prefixCache": {"enabled": False}}), OWNER, "decode")
    assert "--disable-radix-cache" in cmd  # SGLang's own flag (parsed by SGLang's parser: test_sglang_render.py)


@pytest.mark.parametrize("field,ok", [({"enabled": False}, True), ({"maxPages": 8}, True),
                                      ({"enabled": True, "maxPages": 8}, True),
                                      ({"enabled": False, "maxPages": 8}, False)])
def test_the_crds_cel_rule_refuses_max_pages_on_a_disabled_cache(field, ok):
    obj = {"spec": {"image": "i", "prefixCache": copy.deepcopy(field)}}
    apiext.apply_defaults(obj, SCHEMA, {})
    cel = [c for c in apiext.validate(obj, SCHEMA, {}) if "prefixCache" in c.message]
    assert (not cel) is ok, cel
