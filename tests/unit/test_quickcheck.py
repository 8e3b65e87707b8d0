"""The quick check says valid exactly when jsonschema does, over generated flat schemas and arguments."""

from __future__ import annotations

from typing import Any

import jsonschema
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from sandboxd.errors import InvalidArguments
from sandboxd.tools.builtin import BUILTIN_TOOLS
from sandboxd.tools.quickcheck import compile_check
from sandboxd.tools.registry import ToolRegistry

NAMES = ["path", "content", "n", "flag", "x"]
numbers = st.one_of(st.integers(-3, 3), st.floats(-3, 3), st.sampled_from([0.0, 1.0, -0.0, 2.5]))
scalars = st.one_of(st.none(), st.booleans(), st.integers(-5, 5), st.floats(allow_nan=True, allow_infinity=True),
                    st.text(max_size=5), st.sampled_from([1.0, 2.0, -1.0, 0.5, True, False, 0, 1]))
edges = st.sampled_from([float("nan"), 0.5, -1.5, 3.0, "", "abcd"])
values = st.one_of(scalars, scalars, edges, st.lists(scalars, max_size=2),
                   st.dictionaries(st.sampled_from(NAMES), scalars, max_size=2))


@st.composite
def scalar_schemas(draw: st.DrawFn) -> dict[str, Any]:
    """Mostly of the flat shape; one in ten not (a keyword it lacks, or one on a type it does not bound)."""
    kind = draw(st.sampled_from(["string", "boolean", "integer", "number"]))
    schema: dict[str, Any] = {"type": kind}
    if kind == "string":
        for key in ("minLength", "maxLength"):
            if draw(st.booleans()):
                schema[key] = draw(st.sampled_from([0, 1, 2, 4, 2.0]))
    if kind in ("integer", "number"):
        for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
            if draw(st.integers(0, 2)) == 0:
                schema[key] = draw(numbers)
    if draw(st.booleans()):
        schema["description"] = "what it is"
    if draw(st.integers(0, 9)) == 0:
        key, value = draw(st.sampled_from([("enum", ["a"]), ("pattern", "^a"), ("const", 1), ("format", "date"),
                                           ("type", "null"), ("minLength", 1), ("minimum", 0)]))
        schema[key] = value
    return schema


@st.composite
def object_schemas(draw: st.DrawFn) -> dict[str, Any]:
    properties = draw(st.dictionaries(st.sampled_from(NAMES[:4]), scalar_schemas(), max_size=4))
    schema: dict[str, Any] = {"type": "object", "properties": properties,
                              "required": draw(st.lists(st.sampled_from(NAMES), max_size=3, unique=True))}
    if draw(st.booleans()):
        schema["additionalProperties"] = draw(st.booleans())
    if draw(st.integers(0, 9)) == 0:
        schema["minProperties"] = 1
    return schema


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schema=object_schemas(), args=st.one_of(st.dictionaries(st.sampled_from(NAMES), values, max_size=4),
                                               st.dictionaries(st.integers(0, 2), values, max_size=1), values))
def test_the_quick_check_agrees_with_jsonschema(schema: dict[str, Any], args: Any) -> None:
    cls = jsonschema.validators.validator_for(schema)
    try:
        cls.check_schema(schema)
    except jsonschema.SchemaError:
        assume(False)
    quick = compile_check(schema)
    if quick is None:  # outside the shape: jsonschema alone decides, so nothing to agree on
        assert any(key not in ("type", "properties", "required", "additionalProperties") for key in schema) or any(
            set(sub) - {"type", "minLength", "maxLength", "minimum", "maximum", "exclusiveMinimum",
                        "exclusiveMaximum", "description"} or sub["type"] == "null"
            or (sub["type"] != "string" and ({"minLength", "maxLength"} & set(sub)))
            or (sub["type"] not in ("integer", "number")
                and ({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"} & set(sub)))
            for sub in schema["properties"].values())
        return
    assert quick(args) == cls(schema).is_valid(args), (schema, args)


def test_every_builtin_schema_has_a_quick_check_and_it_decides_both_ways() -> None:
    for manifest in BUILTIN_TOOLS:
        assert compile_check(manifest.parameters) is not None, manifest.name
    read = compile_check(next(m for m in BUILTIN_TOOLS if m.name == "read_file").parameters)
    assert read is not None
    assert read({"path": "a"})
    assert not read({"path": ""}) and not read({"path": "a", "other": 1}) and not read({}) and not read({"path": 1})
    assert not read({"path": "x" * 4097})


@pytest.mark.parametrize("args", [{"path": ""}, {"path": "a", "extra": True}, {}, {"path": 3}])
def test_a_no_is_still_worded_by_jsonschema(args: dict[str, Any]) -> None:
    registry = ToolRegistry(BUILTIN_TOOLS)
    with pytest.raises(InvalidArguments) as raised:
        registry.validate("read_file", args)
    expected = jsonschema.exceptions.best_match(
        jsonschema.validators.validator_for({})(next(m for m in BUILTIN_TOOLS if m.name == "read_file").parameters)
        .iter_errors(args))
    assert expected is not None and expected.message in str(raised.value)


@pytest.mark.parametrize("kind", ["integer", "number"])
@pytest.mark.parametrize("bound", ["minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"])
def test_values_no_comparison_orders_pass_or_fail_a_bound_as_in_jsonschema(kind: str, bound: str) -> None:
    schema = {"type": "object", "properties": {"n": {"type": kind, bound: 1}}}
    quick = compile_check(schema)
    assert quick is not None
    validator = jsonschema.validators.validator_for(schema)(schema)
    for value in (float("nan"), float("inf"), float("-inf"), 0, 1, 1.0, 2, 0.5, True, -0.0, 10**30):
        assert quick({"n": value}) == validator.is_valid({"n": value}), (schema, value)


def test_a_schema_this_check_does_not_know_is_left_to_jsonschema_not_an_error() -> None:
    for odd in ({"type": ["string", "null"]}, {"type": {"not": "a type"}}, {"type": None}):
        assert compile_check({"type": "object", "properties": {"x": odd}}) is None
