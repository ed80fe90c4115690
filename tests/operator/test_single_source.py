"""Single source of truth: the CRD schema and the runtime's env parser agree with the typed spec model.

The frozen dataclasses of ``pdoperator.core.spec`` hold every scalar field's default, range or enum, and the
``PDRT_*`` variable it renders to (``spec_knobs()``). Checkers compare the other holders against it:

- ``crd_disagreements``: each modelled field at its JSON path in ``crds/pddeployment.yaml``'s
  openAPIV3Schema has the model's type, default, minimum, maximum and enum; and no CRD scalar with a
  default is left out of the model (``crd_defaults_not_modelled``).
- ``runtime_disagreements``: for each env-rendered field, ``pdruntime.env.RuntimeEnv.from_environ``
  (the runtime's own parser) reads the operator's rendering (``render.worker_env``) of the default, the
  minimum, the maximum and each choice back as the same value; an unset variable means the model's
  default; and just outside the model's range (or an unknown choice) is rejected.
- smaller holders of the same facts: the runtime's dtype and attention-backend choices, the effective
  config's kernel/watchdog keys, and the defaults written in docs/crd.md's tables.

Each checker is shown to fail, naming the field, on a mutated copy of the CRD, the docs or the model.
"""

from __future__ import annotations

import copy
import math
import re
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import pytest
import yaml

from pdoperator.core.render import worker_env
from pdoperator.core.revisions import effective_config
from pdoperator.core.spec import (OPERATOR_OWNED_ENV, KnobAt, PDSpec, PodTemplate, Section, SpecError, parse_spec,
                              spec_knobs)
from pdruntime import env as runtime_env
from pdruntime.env import ConfigError, RuntimeEnv

ROOT = Path(__file__).resolve().parents[2]
CRD = yaml.safe_load((ROOT / "crds" / "pddeployment.yaml").read_text())
SPEC_SCHEMA = CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
KNOBS = spec_knobs()
# spec.podTemplate: the roles' shared pod fields (parsed into each role, so not a PDSpec attribute of its own)
POD_TEMPLATE_KNOBS = spec_knobs(Section("podTemplate", PodTemplate), "podTemplate")
SCALARS = ("integer", "number", "string", "boolean")


# ---------------------------------------------------------------- CRD checker
def schema_at(schema: Mapping[str, Any], path: str) -> Mapping[str, Any] | None:
    node: Any = schema
    for key in path.split("."):
        node = (node.get("properties") or {}).get(key)
        if node is None:
            return None
    return node


def _same_value(kind: str, crd: Any, model: Any) -> bool:
    if kind == "integer":
        return type(crd) is int and crd == model
    if kind == "number":
        return isinstance(crd, (int, float)) and not isinstance(crd, bool) and float(crd) == model
    if kind == "boolean":
        return type(crd) is bool and crd == model
    return crd == model


def crd_disagreements(schema: Mapping[str, Any], knobs: Iterable[KnobAt]) -> list[str]:
    """One line per modelled field whose CRD schema says something else (or that the CRD lacks)."""
    out = []
    for k in knobs:
        node = schema_at(schema, k.path)
        if node is None:
            out.append(f"{k.path}: in the model, missing from the CRD")
            continue
        if node.get("type") != k.knob.kind:
            out.append(f"{k.path}: type {node.get('type')!r} in the CRD, {k.knob.kind!r} in the model")
        if k.default is None:
            if "default" in node:
                out.append(f"{k.path}: default {node['default']!r} in the CRD, none in the model")
        elif "default" not in node:
            out.append(f"{k.path}: no default in the CRD, {k.default!r} in the model")
        elif not _same_value(k.knob.kind, node["default"], k.default):
            out.append(f"{k.path}: default {node['default']!r} in the CRD, {k.default!r} in the model")
        for word, model in (("minimum", k.knob.lo), ("maximum", k.knob.hi)):
            crd = node.get(word)
            if crd is None and model is None:
                continue
            if crd is None or model is None or not _same_value(k.knob.kind, crd, model):
                out.append(f"{k.path}: {word} {crd!r} in the CRD, {model!r} in the model")
        if list(node.get("enum") or ()) != list(k.knob.choices):
            out.append(f"{k.path}: enum {node.get('enum')!r} in the CRD, {list(k.knob.choices)!r} in the model")
    return out


def crd_scalars_with_defaults(node: Mapping[str, Any], prefix: str = "") -> list[str]:
    out = []
    if "default" in node and node.get("type") in SCALARS:
        out.append(prefix)
    for key, child in (node.get("properties") or {}).items():
        out += crd_scalars_with_defaults(child, f"{prefix}.{key}" if prefix else key)
    if isinstance(node.get("items"), Mapping):
        out += crd_scalars_with_defaults(node["items"], f"{prefix}[]")
    return out


def crd_defaults_not_modelled(schema: Mapping[str, Any], knobs: Iterable[KnobAt]) -> list[str]:
    """CRD scalar fields that carry a default the model does not hold (a third place for a fact)."""
    modelled = {k.path for k in knobs}
    return [p for p in crd_scalars_with_defaults(schema) if p not in modelled]


# ---------------------------------------------------------------- runtime checker
def with_value(obj: Any, attrs: tuple[str, ...], value: Any) -> Any:
    if len(attrs) == 1:
        return replace(obj, **{attrs[0]: value})
    return replace(obj, **{attrs[0]: with_value(getattr(obj, attrs[0]), attrs[1:], value)})


def runtime_attr(var: str) -> str:
    return var.removeprefix("PDRT_").lower()  # PDRT_WATCHDOG_TICK_S -> RuntimeEnv.watchdog_tick_s


def _text(kind: str, v: Any) -> str:
    return str(v) if kind == "integer" else repr(float(v))


def runtime_disagreements(knobs: Iterable[KnobAt], parse: Callable[[Mapping[str, str]], Any] = RuntimeEnv.from_environ,
                          render: Callable[[PDSpec, str], list[dict[str, Any]]] = worker_env) -> list[str]:
    """One line per env-rendered field where the runtime's parser and the model disagree."""
    out = []
    unset_env = parse({})
    for k in knobs:
        var, kind = k.knob.env, k.knob.kind
        if var is None:
            continue
        attr = runtime_attr(var)
        if not hasattr(unset_env, attr):
            out.append(f"{k.path}: renders {var}, which the runtime does not read (no RuntimeEnv.{attr})")
            continue
        unset = getattr(unset_env, attr)
        if unset != k.default:
            out.append(f"{k.path}: the runtime's default with {var} unset is {unset!r}, the model's {k.default!r}")
        samples = [k.default, *k.knob.choices] + [b for b in (k.knob.lo, k.knob.hi) if b is not None]
        if kind == "string" and not k.knob.choices:
            samples.append("/models/model.gguf")
        for value in dict.fromkeys(samples):  # each once, in order
            spec = with_value(PDSpec(image="img"), k.attrs, int(value) if kind == "integer" and value is not None
                              else value)
            rendered = list(dict.fromkeys(e["value"] for role in ("prefill", "decode") for e in render(spec, role)
                                          if e["name"] == var))  # each distinct rendering once
            if not rendered and unset != value:
                out.append(f"{k.path}={value!r}: {var} is not rendered, and unset the runtime reads {unset!r}")
            for text in rendered:
                try:
                    got = getattr(parse({var: text}), attr)
                except ConfigError as exc:
                    out.append(f"{k.path}={value!r}: rendered {var}={text!r}, the runtime rejects it ({exc})")
                    continue
                if got != value:
                    out.append(f"{k.path}={value!r}: rendered {var}={text!r}, the runtime reads {got!r}")
        outside = []
        if kind == "integer" and k.knob.lo is not None:
            outside = [str(int(k.knob.lo) - 1), str(int(k.knob.hi) + 1)]
        elif kind == "number":
            outside = [_text(kind, math.nextafter(k.knob.lo, -math.inf)),
                       _text(kind, math.nextafter(k.knob.hi, math.inf))]
        elif k.knob.choices:
            outside = ["not-a-choice"]
        for text in outside:
            try:
                got = getattr(parse({var: text}), attr)
            except ConfigError:
                continue
            out.append(f"{k.path}: {var}={text!r} is outside the model's {_accepted(k)}, the runtime accepts it "
                       f"as {got!r}")
    return out


def _accepted(k: KnobAt) -> str:
    return f"choices {list(k.knob.choices)}" if k.knob.choices else f"range [{k.knob.lo}, {k.knob.hi}]"


def mutated(path: str, **changes: Any) -> tuple[KnobAt, ...]:
    """The model with one field's knob (or default) changed."""
    out = []
    for k in KNOBS:
        if k.path == path:
            default = changes.pop("default", k.default)
            k = replace(k, knob=replace(k.knob, **changes), default=default)
        out.append(k)
    return tuple(out)


# ---------------------------------------------------------------- the checks
def test_the_model_covers_the_fields_the_issue_names():
    paths = {k.path for k in KNOBS}
    required = {
        "pairs", "revisionHistoryLimit", "engine", "model.dtype",
        "kernel.decodeTargetCTAs", "kernel.maxKVSplits", "kernel.attentionBackend",
        "watchdog.bootstrapTimeoutSeconds", "watchdog.transferTimeoutSeconds",
        "watchdog.decodeTransferTimeoutSeconds", "watchdog.tickSeconds",
        "coRestart.policy", "coRestart.backoff.initialSeconds", "coRestart.backoff.maxSeconds", "drift.policy",
        "rollout.maxUnavailablePairs", "rollout.drainSeconds", "rollout.soakSeconds", "rollout.canary.agents",
        "rollout.canary.rounds", "rollout.canary.roundTimeoutSeconds", "rollout.canary.maxTokens",
        "rollout.autoRollback", "rollout.rollbackWindowSeconds", "stall.seconds",
        "probes.startupSeconds", "probes.readinessTimeoutSeconds", "probes.livenessPeriodSeconds",
        "probes.livenessFailureThreshold", "probes.preStopDrainSeconds",
        "placement.groupPlacement", "sglang.transferBackend",
        *(f"{role}.{f}" for role in ("prefill", "decode", "router") for f in ("replicas", "resources.gpus")),
        "prefill.tensorParallelSize", "decode.tensorParallelSize",
    }
    assert sorted(required - paths) == []


def test_crd_schema_agrees_with_the_model():
    assert [k.path for k in POD_TEMPLATE_KNOBS] == ["podTemplate.imagePullPolicy",
                                                    "podTemplate.automountServiceAccountToken",
                                                    "podTemplate.terminationGracePeriodSeconds"]
    assert crd_disagreements(SPEC_SCHEMA, KNOBS + POD_TEMPLATE_KNOBS) == []


def test_every_crd_default_is_held_by_the_model():
    assert crd_defaults_not_modelled(SPEC_SCHEMA, KNOBS + POD_TEMPLATE_KNOBS) == []


def test_the_chart_ships_the_same_crd():
    assert (ROOT / "charts" / "pdstack" / "crds" / "pddeployment.yaml").read_bytes() == \
        (ROOT / "crds" / "pddeployment.yaml").read_bytes()


def test_runtime_env_parser_agrees_with_the_model():
    assert runtime_disagreements(KNOBS) == []


def test_every_rendered_pdrt_variable_is_operator_owned_and_every_env_knob_is_rendered():
    spec = parse_spec({"image": "img", "model": {"source": "/m/x.gguf"}, "kernel": {"decodeTargetCTAs": 512}})
    rendered = {e["name"] for role in ("prefill", "decode") for e in worker_env(spec, role)}
    assert sorted(n for n in rendered if n.startswith("PDRT_") and n not in OPERATOR_OWNED_ENV) == []
    assert sorted({k.knob.env for k in KNOBS if k.knob.env} - rendered) == []


def test_the_effective_config_names_the_kernel_and_watchdog_knobs_as_the_model_does():
    """Revisions record kernel knobs and watchdog timeouts under the model's JSON names, with the parsed values."""
    spec = parse_spec({"image": "img", "kernel": {"decodeTargetCTAs": 512, "maxKVSplits": 8},
                       "watchdog": {"tickSeconds": 0.25, "transferTimeoutSeconds": 90}})
    config = effective_config(spec)
    for name in ("kernel", "watchdog"):
        from_model = {k.knob.json: getattr(getattr(spec, k.attrs[0]), k.attr) for k in KNOBS if k.attrs[0] == name}
        assert config[name] == from_model


def test_runtime_attention_backends_are_the_models_choices():
    (k,) = [k for k in KNOBS if k.path == "kernel.attentionBackend"]
    assert runtime_env.ATTENTION_BACKENDS == k.knob.choices


def test_runtime_weight_formats_are_the_models_choices():
    """spec.model.weights renders as pdrt's --weights: every choice the model accepts, serve's parser accepts (and
    its default is serve's, so an unset field renders no flag)."""
    import argparse

    from pdruntime.server.commands import register

    parser = argparse.ArgumentParser(prog="pdrt")
    register(parser.add_subparsers(dest="command", required=True))
    (k,) = [k for k in KNOBS if k.path == "model.weights"]
    assert runtime_env.WEIGHT_FORMATS == k.knob.choices
    for choice in k.knob.choices:
        assert parser.parse_args(["serve", "--role", "decode", "--weights", choice]).weights == choice
    assert parser.parse_args(["serve", "--role", "decode"]).weights == k.default


def test_parse_spec_defaults_are_the_models():
    """parse_spec of an empty spec (canary set to {}) yields every modelled default at its place."""
    spec = parse_spec({"image": "img", "rollout": {"canary": {}}})
    for k in KNOBS:
        value: Any = spec
        for a in k.attrs:
            value = getattr(value, a) if value is not None else None
        if k.path.startswith("model.storage."):
            continue  # no storage in this spec
        assert value == k.default, k.path


@pytest.mark.parametrize("k", [k for k in KNOBS if k.knob.lo is not None], ids=lambda k: k.path)
def test_parse_spec_enforces_the_models_range(k):
    """The bounds are accepted, just outside them is refused with the model's range in the message."""
    step = 1 if k.knob.kind == "integer" else 0.0001
    for value, ok in ((k.knob.lo, True), (k.knob.hi, True), (k.knob.lo - step, False), (k.knob.hi + step, False)):
        value = int(value) if k.knob.kind == "integer" else value
        raw: dict[str, Any] = {"image": "img"}
        node = raw
        *parents, key = k.path.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[key] = value
        try:
            parse_spec(raw)
            problems: list[str] = []
        except SpecError as err:
            # only this field's own check; cross-field rules (timeouts > tick, initial <= max) are other tests'
            problems = [p for p in err.problems if p.startswith(f"spec.{k.path}=") and " is invalid; accepted" in p]
        if ok:
            assert problems == [], (k.path, value)
        else:
            assert len(problems) == 1 and f"[{k.knob.lo}, {k.knob.hi}]" in problems[0], (k.path, value, problems)


# ---------------------------------------------------------------- the checkers can fail
def test_crd_checker_names_a_changed_maximum_default_enum_type_and_a_missing_field():
    schema = copy.deepcopy(SPEC_SCHEMA)
    schema["properties"]["kernel"]["properties"]["maxKVSplits"]["maximum"] = 2048
    schema["properties"]["watchdog"]["properties"]["tickSeconds"]["default"] = 1
    schema["properties"]["drift"]["properties"]["policy"]["enum"] = ["Report", "Revert", "Ignore"]
    schema["properties"]["stall"]["properties"]["seconds"]["type"] = "integer"
    del schema["properties"]["rollout"]["properties"]["canary"]["properties"]["maxTokens"]
    del schema["properties"]["pairs"]["minimum"]
    assert crd_disagreements(schema, KNOBS) == [
        "pairs: minimum None in the CRD, 0 in the model",
        "kernel.maxKVSplits: maximum 2048 in the CRD, 1024 in the model",
        "watchdog.tickSeconds: default 1 in the CRD, 0.5 in the model",
        "drift.policy: enum ['Report', 'Revert', 'Ignore'] in the CRD, ['Report', 'Revert'] in the model",
        "rollout.canary.maxTokens: in the model, missing from the CRD",
        "stall.seconds: type 'integer' in the CRD, 'number' in the model",
    ]


def test_crd_checker_names_a_role_field_once_per_role_sharing_the_yaml_anchor():
    """prefill and decode share one schema node (a YAML anchor): a change there shows at both paths."""
    schema = copy.deepcopy(SPEC_SCHEMA)
    schema["properties"]["prefill"]["properties"]["replicas"]["maximum"] = 8
    assert crd_disagreements(schema, KNOBS) == ["prefill.replicas: maximum 8 in the CRD, 16 in the model",
                                                "decode.replicas: maximum 8 in the CRD, 16 in the model"]


def test_crd_checker_names_a_changed_model():
    assert crd_disagreements(SPEC_SCHEMA, mutated("rollout.canary.rounds", hi=50)) == [
        "rollout.canary.rounds: maximum 100 in the CRD, 50 in the model"]
    assert crd_disagreements(SPEC_SCHEMA, mutated("router.replicas", default=2)) == [
        "router.replicas: default 1 in the CRD, 2 in the model"]
    assert crd_disagreements(SPEC_SCHEMA, mutated("probes.readinessTimeoutSeconds", lo=None)) == [
        "probes.readinessTimeoutSeconds: minimum 1 in the CRD, None in the model"]


def test_crd_checker_lists_a_crd_default_the_model_does_not_hold():
    schema = copy.deepcopy(SPEC_SCHEMA)
    schema["properties"]["probes"]["properties"]["readinessTimeoutSeconds"]["default"] = 2
    schema["properties"]["stall"]["properties"]["minLiveRequests"] = {"type": "integer", "default": 1}
    assert crd_defaults_not_modelled(schema, KNOBS) == ["stall.minLiveRequests"]
    assert crd_disagreements(schema, KNOBS) == [
        "probes.readinessTimeoutSeconds: default 2 in the CRD, none in the model"]


def test_runtime_checker_names_a_default_and_a_range_the_runtime_does_not_share():
    assert runtime_disagreements(mutated("kernel.maxKVSplits", default=64)) == [
        "kernel.maxKVSplits: the runtime's default with PDRT_MAX_KV_SPLITS unset is 32, the model's 64"]
    wider = runtime_disagreements(mutated("watchdog.tickSeconds", hi=120.0))
    assert wider == ["watchdog.tickSeconds=120.0: rendered PDRT_WATCHDOG_TICK_S='120', the runtime rejects it "
                     "(PDRT_WATCHDOG_TICK_S=120.0 is out of range; accepted: seconds in [0.001, 60.0])"]
    narrower = runtime_disagreements(mutated("kernel.decodeTargetCTAs", hi=4096))
    assert narrower == ["kernel.decodeTargetCTAs: PDRT_DECODE_TARGET_CTAS='4097' is outside the model's range "
                        "[0, 4096], the runtime accepts it as 4097"]
    fewer = runtime_disagreements(mutated("kernel.attentionBackend", choices=("auto", "triton")))
    assert fewer == []  # a runtime accepting an extra choice is caught by test_runtime_attention_backends_...
    more = runtime_disagreements(mutated("kernel.attentionBackend", choices=("auto", "triton", "cpu", "torch", "flash")))
    assert more == ["kernel.attentionBackend='flash': rendered PDRT_ATTENTION_BACKEND='flash', the runtime rejects "
                    "it (PDRT_ATTENTION_BACKEND='flash' is not accepted; accepted: auto, triton, cpu, torch)"]


def test_runtime_checker_names_a_value_the_render_drops():
    """A knob the operator leaves unset at some value must mean that value to the runtime."""
    def render_without_ctas(spec: PDSpec, role: str) -> list[dict[str, Any]]:
        return [e for e in worker_env(spec, role) if e["name"] != "PDRT_DECODE_TARGET_CTAS"]

    assert runtime_disagreements([k for k in KNOBS if k.path == "kernel.decodeTargetCTAs"],
                                 render=render_without_ctas) == [
        "kernel.decodeTargetCTAs=65536: PDRT_DECODE_TARGET_CTAS is not rendered, and unset the runtime reads 0"]


# ---------------------------------------------------------------- other holders of the same facts
def test_runtime_dtype_choices_are_the_models():
    device = pytest.importorskip("pdruntime.engine.device", reason="pdruntime.engine needs torch")
    (k,) = [k for k in KNOBS if k.path == "model.dtype"]
    assert device.DTYPE_CHOICES == k.knob.choices


def doc_defaults(text: str) -> list[tuple[str, str]]:
    """(JSON path, default as written) from docs/crd.md's tables: a second cell that says "default X"
    ("Type / default" tables), or a second column headed "Default" (one value per named field)."""
    out: list[tuple[str, str]] = []
    header: list[str] | None = None
    for line in text.splitlines():
        if not line.startswith("|"):
            header = None
            continue
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]  # "\|" inside a cell is a literal bar
        if header is None:
            header = cells
            continue
        if len(cells) < 2 or set(cells[0]) <= set("-: "):
            continue
        paths = re.findall(r"`([A-Za-z.]+)`", cells[0])
        if header[1] == "Default":
            values = [v.strip().strip("`") for v in cells[1].split(",")]
            out += zip(paths, values) if len(values) == len(paths) else []
        elif (said := re.search(r"default `?([^`,;\s]+)`?", cells[1])) and len(paths) == 1:
            out.append((paths[0], said[1]))
    return out


def doc_default_disagreements(text: str, knobs: Iterable[KnobAt]) -> list[str]:
    by_path = {k.path: k for k in knobs}
    out = []
    for path, value in doc_defaults(text):
        k = by_path.get(path)
        if k is None:
            continue
        same = str(k.default) == value or (k.knob.kind == "number" and re.fullmatch(r"[0-9.]+", value)
                                           and float(value) == k.default) \
            or (k.knob.kind == "boolean" and value == str(k.default).lower())  # JSON's spelling: true/false
        if not same:
            out.append(f"{k.path}: default {value} in docs/crd.md, {k.default!r} in the model")
    return out


def test_docs_crd_tables_state_the_models_defaults():
    text = (ROOT / "docs" / "crd.md").read_text()
    assert len({p for p, _ in doc_defaults(text)} & {k.path for k in KNOBS}) >= 20  # the tables were read
    assert doc_default_disagreements(text, KNOBS) == []
    changed = text.replace("| number, default 0.5 |", "| number, default 1 |").replace("| 10, 6 |", "| 10, 5 |")
    assert doc_default_disagreements(changed, KNOBS) == [
        "watchdog.tickSeconds: default 1 in docs/crd.md, 0.5 in the model",
        "probes.livenessFailureThreshold: default 5 in docs/crd.md, 6 in the model"]


def test_parse_spec_rejects_a_router_tensor_parallel_size():
    """The CRD has no spec.router.tensorParallelSize (the router has no TP ranks); the parser used to accept it."""
    with pytest.raises(SpecError) as err:
        parse_spec({"image": "img", "router": {"tensorParallelSize": 2}})
    assert err.value.problems == ["spec.router.tensorParallelSize is not a field of spec.router; accepted: "
                                  "tensorParallelSize on spec.prefill and spec.decode"]
    assert schema_at(SPEC_SCHEMA, "router.tensorParallelSize") is None
    assert "router.tensorParallelSize" not in {k.path for k in KNOBS}
