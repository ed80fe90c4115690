"""Fuzzed PDDeployment specs get a validation message, never a crash (issue 13, build item 5).

``pdoperator.core.spec.parse_spec`` either returns a PDSpec or raises SpecError whose problems each name a
field under ``spec`` (or ``metadata.name``) — for arbitrary JSON, and for the shipped examples with one to
three fields replaced by arbitrary values (the shape a user's typo has). Any other exception is a crash
that would become a reconcile loop. Test only; the operator code is not changed here.

Run against the unfixed code (main at 1c0b2fc's operator): passed there (a guard: the spec parser already
held; this pins it under fuzzing).
"""

from __future__ import annotations

import copy
import glob
import os

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdoperator.core.spec import PDSpec, SpecError, parse_spec

EXAMPLES = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "..", "..", "examples", "*.yaml")))
SPECS = [doc["spec"] for path in EXAMPLES for doc in yaml.safe_load_all(open(path)) if doc and "spec" in doc]

_CHAR = st.one_of(st.characters(), st.sampled_from(["\ud800", "\x00", "-", ".", "/"]))
TEXT = st.lists(_CHAR, max_size=16).map("".join)
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2 ** 70), max_value=2 ** 70),
                    st.floats(allow_nan=True, allow_infinity=True), TEXT)
JSON = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                      st.dictionaries(TEXT, inner, max_size=3)), max_leaves=10)
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True,
                database=None)


def _paths(obj, prefix=()):
    """Every path into a nested dict/list (for replacing one value)."""
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, prefix + (i,))


def _set(obj, path, value):
    for k in path[:-1]:
        obj = obj[k]
    obj[path[-1]] = value


def check(raw, name="demo") -> None:
    try:
        out = parse_spec(raw, name=name)
    except SpecError as exc:
        assert exc.problems and all(isinstance(p, str) and p for p in exc.problems), exc.problems
        assert all(p.startswith(("spec", "metadata.name")) for p in exc.problems), exc.problems
        return
    assert isinstance(out, PDSpec)


def test_examples_parse():
    assert SPECS, "no example specs found"
    for spec in SPECS:
        assert isinstance(parse_spec(spec, name="demo"), PDSpec)


@FUZZ
@given(raw=JSON, name=st.one_of(st.just("demo"), TEXT))
def test_arbitrary_json_specs_get_a_validation_message_not_a_crash(raw, name):
    check(raw, name)


@FUZZ
@given(data=st.data())
def test_example_specs_with_fields_replaced_get_a_validation_message_not_a_crash(data):
    spec = copy.deepcopy(data.draw(st.sampled_from(SPECS)))
    paths = [p for p in _paths(spec) if p]
    for path in data.draw(st.lists(st.sampled_from(paths), min_size=1, max_size=3, unique=True)):
        try:
            _set(spec, path, data.draw(JSON))
        except (KeyError, IndexError, TypeError):
            pass  # an earlier replacement removed this path
    check(spec)
