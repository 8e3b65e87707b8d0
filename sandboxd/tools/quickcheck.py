"""A fast yes to valid arguments of flat schemas, where jsonschema would say the same.

jsonschema walks a schema keyword by keyword and builds a validator per level it descends into: 20 to
40 us for `read_file`'s two-keyword object, which is a tenth of the whole call in the daemon. The
built-in tools' schemas are all one shape (an object of typed scalars with bounds, which keys are
required, no others allowed), and for that shape validity is a few isinstance checks. `compile_check`
turns such a schema into a function that is True exactly when jsonschema finds no error; any schema
with a keyword outside that shape gets None, and jsonschema alone decides. False is not an error
message: the registry then asks jsonschema, whose message the caller gets as before.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Mapping
from typing import Any

Check = Callable[[Any], bool]

_ANNOTATIONS = frozenset({"description", "title", "examples", "default"})
_OBJECT_KEYS = frozenset({"type", "properties", "required", "additionalProperties"}) | _ANNOTATIONS
_SCALAR_KEYS = frozenset({"type", "minLength", "maxLength", "minimum", "maximum", "exclusiveMinimum",
                          "exclusiveMaximum"}) | _ANNOTATIONS


def _is_integer(value: Any) -> bool:
    # JSON Schema's integer: a bool is not one, and a float with no fraction (1.0) is.
    if isinstance(value, bool):
        return False
    return isinstance(value, int) or (isinstance(value, float) and value.is_integer())


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Number) and not isinstance(value, bool)


_TYPES: dict[str, Check] = {"string": lambda v: isinstance(v, str), "boolean": lambda v: isinstance(v, bool),
                            "integer": _is_integer, "number": _is_number}


def _bound(value: Any) -> bool:
    return _is_number(value) and not isinstance(value, complex)


def _scalar(schema: Any) -> Check | None:
    if not isinstance(schema, Mapping) or not set(schema) <= _SCALAR_KEYS:
        return None
    kind = schema.get("type")
    is_type = _TYPES.get(kind) if isinstance(kind, str) else None  # a list of types is jsonschema's to check
    if is_type is None:
        return None
    checks: list[Check] = [is_type]
    lengths = [schema.get(key) for key in ("minLength", "maxLength")]
    if any(n is not None for n in lengths):
        if schema["type"] != "string" or not all(n is None or _is_integer(n) and n >= 0 for n in lengths):
            return None
        low, high = (int(n) if n is not None else None for n in lengths)
        checks.append(lambda v: (low is None or len(v) >= low) and (high is None or len(v) <= high))
    bounds = {key: schema[key] for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
              if key in schema}
    if bounds:
        if schema["type"] not in ("integer", "number") or not all(_bound(b) for b in bounds.values()):
            return None
        # Each as the negation of jsonschema's own failing comparison, so a value no comparison orders (NaN)
        # passes here as there.
        tests: dict[str, Callable[[Any, Any], bool]] = {
            "minimum": lambda v, b: not v < b, "maximum": lambda v, b: not v > b,
            "exclusiveMinimum": lambda v, b: not v <= b, "exclusiveMaximum": lambda v, b: not v >= b}
        pairs = [(tests[key], bound) for key, bound in bounds.items()]
        checks.append(lambda v: all(test(v, bound) for test, bound in pairs))
    return lambda v: all(check(v) for check in checks)


def compile_check(schema: Any) -> Check | None:
    """True-exactly-when-valid for a flat object schema (see the module docstring), or None for any other."""
    if not isinstance(schema, Mapping) or not set(schema) <= _OBJECT_KEYS or schema.get("type") != "object":
        return None
    properties, required = schema.get("properties", {}), schema.get("required", [])
    extra = schema.get("additionalProperties", True)
    if (not isinstance(properties, Mapping) or not isinstance(required, list)
            or not all(isinstance(name, str) for name in required) or not isinstance(extra, bool)):
        return None
    fields: dict[str, Check] = {}
    for name, sub in properties.items():
        check = _scalar(sub)
        if check is None:
            return None
        fields[name] = check
    needed, closed = tuple(required), not extra

    def valid(args: Any) -> bool:
        if not isinstance(args, dict):
            return False
        for name, value in args.items():
            check = fields.get(name)
            if check is None:
                if closed:
                    return False
            elif not check(value):
                return False
        return all(name in args for name in needed)

    return valid
