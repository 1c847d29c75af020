"""The sim engine's made-up JSON of a schema (shared/synthetic_json.py: pure): every value it
makes is one the schema admits, checked with a JSON Schema validator."""

from __future__ import annotations

import math
from typing import Any

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.synthetic_json import TooLarge, example

# what agents send: OpenAI strict structured outputs, pydantic's model_json_schema(), tool parameters
SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "properties": {"verdict": {"type": "string", "enum": ["fix", "skip"]}, "done": {"type": "boolean"}},
     "required": ["verdict", "done"], "additionalProperties": False},
    {"type": "object"},  # json_object
    {"$defs": {"Step": {"type": "object", "properties": {"file": {"type": "string"}, "line": {"type": "integer", "minimum": 1}},
                        "required": ["file", "line"], "title": "Step"}},
     "properties": {"steps": {"items": {"$ref": "#/$defs/Step"}, "type": "array", "minItems": 2},
                    "note": {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None}},
     "required": ["steps", "note"], "title": "Plan", "type": "object"},
    {"type": "object", "properties": {"id": {"type": "string", "format": "uuid"}, "at": {"type": "string", "format": "date-time"},
                                      "mail": {"type": "string", "format": "email"},
                                      "code": {"type": "string", "minLength": 12, "maxLength": 12}},
     "required": ["id", "at", "mail", "code"]},
    {"type": "object", "properties": {"n": {"type": "integer", "exclusiveMinimum": 200, "maximum": 205, "multipleOf": 2},
                                      "p": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
                                      "t": {"type": ["null", "integer"], "maximum": -3}},
     "required": ["n", "p", "t"]},
    {"type": "array", "prefixItems": [{"const": "v1"}, {"type": "integer"}], "minItems": 2},
    {"allOf": [{"$ref": "#/definitions/Base"}, {"properties": {"extra": {"type": "boolean"}}, "required": ["extra"]}],
     "definitions": {"Base": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}}},
    {"oneOf": [{"type": "null"}, {"type": "object", "properties": {"k": {"const": 3}}, "required": ["k"]}]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"}, "maxItems": 0}},
     "required": ["tags"]},
    {"type": "object", "properties": {"meta": {"type": "object", "additionalProperties": {"type": "integer"}}},
     "required": ["meta"]},
    # a recursive schema: it stops at the depth bound with the least value there
    {"$defs": {"Node": {"type": "object", "properties": {"children": {"type": "array", "items": {"$ref": "#/$defs/Node"}}},
                        "required": ["children"]}}, "$ref": "#/$defs/Node"},
]


@pytest.mark.parametrize("schema", SCHEMAS, ids=range(len(SCHEMAS)))
def test_the_value_is_one_the_schema_admits(schema: dict[str, Any]) -> None:
    value = example(schema, "call-1")
    jsonschema.validate(value, schema)
    assert example(schema, "call-1") == value  # the same for the same seed


def test_every_required_property_is_filled_and_informative() -> None:
    value = example(SCHEMAS[2], "c")
    assert len(value["steps"]) == 2 and value["note"] is not None  # anyOf: the branch that is not null
    assert all(step["line"] >= 1 and step["file"].startswith("synthetic-") for step in value["steps"])
    # every property where none is listed as required, as the tool calls always had it
    assert set(example({"properties": {"a": {"type": "string"}, "b": {"type": "integer"}}}, "c")) == {"a", "b"}


_SCALARS = st.sampled_from([
    {"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"}, {"type": "null"},
    {"type": "string", "minLength": 3, "maxLength": 5}, {"type": "integer", "minimum": -7, "maximum": -2},
    {"type": "number", "exclusiveMinimum": 10}, {"enum": ["a", 1, None]}, {"const": {"x": [1]}},
    {"type": "string", "format": "date"}, {"type": ["string", "null"]},
])


def _schemas() -> st.SearchStrategy[dict[str, Any]]:
    return st.recursive(_SCALARS, lambda inner: st.one_of(
        st.dictionaries(st.text("abcxyz", min_size=1, max_size=3), inner, max_size=4).flatmap(
            lambda props: st.lists(st.sampled_from(sorted(props)) if props else st.nothing(), unique=True).map(
                lambda req: {"type": "object", "properties": props, "required": req, "additionalProperties": False})),
        st.builds(lambda items, lo: {"type": "array", "items": items, "minItems": lo}, inner, st.integers(0, 3)),
        st.lists(inner, min_size=1, max_size=3).map(lambda branches: {"anyOf": branches}),
    ), max_leaves=12)


@settings(max_examples=300, deadline=None)
@given(_schemas(), st.text(max_size=8))
def test_any_schema_of_the_covered_keywords_admits_its_value(schema: dict[str, Any], seed: str) -> None:
    jsonschema.validate(example(schema, seed), schema)


@pytest.mark.parametrize("schema", [
    {"type": "array", "items": {"type": "integer"}, "minItems": 10**9},  # would not fit in memory
    {"type": "string", "minLength": 10**12},
    {"type": "object", "properties": {"a": {"type": "array", "items": {"$ref": "#/properties/a"}, "minItems": 4}},
     "required": ["a"]},  # 4^depth values
    {"$defs": {"N": {"type": "object", "properties": {"n": {"$ref": "#/$defs/N"}}, "required": ["n"]}},
     "$ref": "#/$defs/N"},  # a required chain with no end: no value exists
    {"allOf": [{"$ref": "#"}]},
    {"anyOf": [{"$ref": "#"}]},
])
def test_a_schema_whose_value_is_too_large_or_endless_is_refused(schema: dict[str, Any]) -> None:
    with pytest.raises(TooLarge):
        example(schema, "c")


_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5),
                     lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
                         st.sampled_from(["type", "properties", "required", "items", "prefixItems", "anyOf", "oneOf",
                                          "allOf", "enum", "const", "$ref", "minItems", "maxItems", "minLength",
                                          "maxLength", "minimum", "maximum", "multipleOf", "format", "x"]),
                         inner, max_size=5), max_leaves=20)


@settings(max_examples=500, deadline=None)
@given(_JSON)
def test_any_json_as_a_schema_gives_a_value_or_a_value_error(schema: Any) -> None:
    # a request's schema is the client's: whatever it holds, the sim engine gets a value or a
    # ValueError (and answers free text), never another exception
    try:
        example(schema, "c")
    except ValueError:
        pass


def test_a_number_is_whole_where_a_whole_number_fits() -> None:
    # Codex declares some arguments `number` and reads them as i32: 0.5 failed its parse
    assert example({"type": "number"}, "c") == 1 and isinstance(example({"type": "number"}, "c"), int)
    assert example({"type": "number", "minimum": 0, "maximum": 30000}, "c") == 15000
    assert example({"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1}, "c") == 0.5  # none fits
    assert example({"type": "number", "minimum": 2.2, "maximum": 2.9}, "c") == 2.55
    assert example({"type": "number", "minimum": 1, "maximum": 9, "multipleOf": 4}, "c") == 4


@settings(max_examples=300, deadline=None)
@given(st.fixed_dictionaries({}, optional={
    k: st.integers(-50, 50) | st.floats(-50, 50, allow_nan=False)
    for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")}))
def test_a_number_meets_any_bounds_that_admit_one(bounds: dict[str, float]) -> None:
    schema = {"type": "number", **bounds}
    # the least and the greatest float the bounds admit (an exclusive bound admits the next float
    # past it: no float lies strictly between 0 and 5e-324, which hypothesis found)
    lo = max([bounds.get("minimum", -1e9), math.nextafter(bounds.get("exclusiveMinimum", -1e9), math.inf)])
    hi = min([bounds.get("maximum", 1e9), math.nextafter(bounds.get("exclusiveMaximum", 1e9), -math.inf)])
    if lo >= hi:
        return  # (no value, or a single one the synthetic value need not find)
    jsonschema.validate(example(schema, "c"), schema)


def test_bounds_written_into_the_description_are_kept() -> None:
    # Anthropic's SDK sends the constraints its structured outputs do not take as text in the
    # description (`messages.parse` then validates the reply against the full model)
    full = {"type": "object", "properties": {
        "line": {"type": "integer", "minimum": 1, "maximum": 3},
        "tags": {"type": "array", "items": {"type": "string"}, "minItems": 2, "maxItems": 3},
        "code": {"type": "string", "minLength": 30}}, "required": ["line", "tags", "code"]}
    sent = {"type": "object", "properties": {
        "line": {"type": "integer", "description": "{minimum: 1, maximum: 3}"},
        "tags": {"type": "array", "items": {"type": "string"}, "description": "Tags to add\n\n{maxItems: 3, minItems: 2}"},
        "code": {"type": "string", "description": "{minLength: 30, pattern: ^[a-z, ]+$}"}},
        "required": ["line", "tags", "code"], "additionalProperties": False}
    for i in range(200):
        jsonschema.validate(example(sent, f"call-{i}"), full)
