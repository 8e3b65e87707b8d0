"""Property tests of strict decoding: whatever bytes arrive, `decode_request` returns a request or raises
`ProtocolError` with one of the four decoding codes, never anything else; valid frames round-trip.

Inputs come in three kinds: random bytes, random MessagePack values (some shaped like requests), and
valid frames of every request type mutated at the byte level or the field level.
"""

from __future__ import annotations

import typing
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, reject, settings
from hypothesis import strategies as st

from sandboxd import protocol as p
from sandboxd.errors import ErrorCode, ProtocolError
from tests.unit.test_protocol import SAMPLES

#: the codes `decode_request` may raise (README "Errors"; protocol.py's docstring)
DECODE_CODES = {ErrorCode.BAD_FRAME, ErrorCode.FRAME_TOO_LARGE, ErrorCode.UNKNOWN_TYPE, ErrorCode.INVALID_FIELD}

VALID_REQUESTS: list[Any] = [m for m in SAMPLES if type(m).__name__ in p.REQUEST_TYPES]
VALID_FRAMES = [p.encode(m) for m in VALID_REQUESTS]
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def check_frame(frame: bytes, max_frame: int = p.DEFAULT_MAX_FRAME) -> Any:
    """Decode `frame`; a success must re-encode to a frame that decodes to the same bytes again."""
    rid = p.request_id_of(frame)  # must never raise: the server calls it on frames that failed
    assert isinstance(rid, str)
    try:
        message = p.decode_request(frame, max_frame)
    except ProtocolError as exc:
        assert exc.code in DECODE_CODES, exc
        assert isinstance(exc.message, str) and exc.message
        msgspec.msgpack.encode(exc.details)  # the details must fit in an ErrorResponse
        return exc
    assert type(message).__name__ in p.REQUEST_TYPES
    again = p.encode(message)
    assert p.encode(p.decode_request(again)) == again
    return message


# Random inputs -------------------------------------------------------------------------------

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats()
    | st.text(max_size=20)
    | st.binary(max_size=20)
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=5)
    | st.dictionaries(st.text(max_size=10) | st.integers(-5, 5), inner, max_size=5),
    max_leaves=25,
)
request_names = st.sampled_from(sorted(p.REQUEST_TYPES))
field_names = st.sampled_from(sorted({f for cls in p.REQUEST_TYPES.values() for f in cls.__struct_fields__}))
request_shaped = st.builds(
    lambda kind, fields: {"type": kind, **fields},
    request_names | st.sampled_from(sorted(p.RESPONSE_TYPES)) | st.text(max_size=12),
    st.dictionaries(field_names | st.text(max_size=8), values, max_size=8),
)


@FUZZ
@given(st.binary(max_size=512))
def test_random_bytes_never_crash_the_decoder(frame: bytes) -> None:
    check_frame(frame)


@FUZZ
@given(values | request_shaped)
def test_random_msgpack_values_never_crash_the_decoder(value: Any) -> None:
    check_frame(msgspec.msgpack.encode(value))


@FUZZ
@given(st.integers(min_value=0, max_value=300).flatmap(
    lambda limit: st.tuples(st.just(limit), st.binary(min_size=limit + 1, max_size=limit + 100))))
def test_frames_over_the_limit_are_refused_before_decoding(case: tuple[int, bytes]) -> None:
    limit, frame = case
    result = check_frame(frame, max_frame=limit)
    assert isinstance(result, ProtocolError) and result.code == ErrorCode.FRAME_TOO_LARGE


@pytest.mark.parametrize("depth", [200, 5_000, 200_000])
def test_deep_nesting_is_a_bad_frame_or_a_request(depth: int) -> None:
    # Found by this suite: 100,000 nested one-element arrays (100 KB) raised RecursionError out of
    # decode_request, which the server does not catch, so one small frame killed the daemon.
    nested = b"\x91" * depth + b"\xc0"
    envelope = msgspec.msgpack.encode({"type": "CallRequest", "request_id": "deep", "session_id": "s",
                                       "tool": "webhook", "args": {"body": None}})
    frame = envelope[:-1] + nested  # the last field's value (None) becomes the nested array
    result = check_frame(frame)
    if depth > 1_000:
        assert isinstance(result, ProtocolError) and result.code == ErrorCode.BAD_FRAME
    assert p.request_id_of(frame) in ("deep", "")


# Mutated valid frames ------------------------------------------------------------------------


def test_every_request_type_has_a_valid_sample() -> None:
    assert {type(m).__name__ for m in VALID_REQUESTS} == set(p.REQUEST_TYPES)
    for message, frame in zip(VALID_REQUESTS, VALID_FRAMES, strict=True):
        assert p.decode_request(frame) == message


@st.composite
def byte_mutations(draw: st.DrawFn) -> bytes:
    frame = bytearray(draw(st.sampled_from(VALID_FRAMES)))
    for _ in range(draw(st.integers(min_value=1, max_value=4))):
        op = draw(st.sampled_from(["flip", "set", "insert", "delete", "truncate", "duplicate"]))
        at = draw(st.integers(min_value=0, max_value=max(len(frame) - 1, 0)))
        if op == "flip" and frame:
            frame[at] ^= 1 << draw(st.integers(0, 7))
        elif op == "set" and frame:
            frame[at] = draw(st.integers(0, 255))
        elif op == "insert":
            frame[at:at] = draw(st.binary(min_size=1, max_size=8))
        elif op == "delete" and frame:
            del frame[at:at + draw(st.integers(1, 8))]
        elif op == "truncate":
            del frame[at:]
        elif op == "duplicate":
            frame[at:at] = frame[at:at + draw(st.integers(1, 16))]
    return bytes(frame)


@FUZZ
@given(byte_mutations())
def test_byte_mutated_frames_decode_or_get_a_code(frame: bytes) -> None:
    check_frame(frame)


def raw_of(message: Any) -> dict[str, Any]:
    raw: dict[str, Any] = msgspec.msgpack.decode(p.encode(message))
    return raw


@FUZZ
@given(st.sampled_from(VALID_REQUESTS), st.data())
def test_dropping_a_required_field_is_invalid_field(message: Any, data: st.DataObject) -> None:
    required = [f.encode_name for f in msgspec.structs.fields(type(message)) if f.required]
    if not required:
        reject()
    raw = raw_of(message)
    del raw[data.draw(st.sampled_from(required))]
    result = check_frame(msgspec.msgpack.encode(raw))
    assert isinstance(result, ProtocolError) and result.code == ErrorCode.INVALID_FIELD
    assert result.details.get("request_id") == raw.get("request_id", "")


@FUZZ
@given(st.sampled_from(VALID_REQUESTS), st.text(min_size=1, max_size=12), values)
def test_an_unknown_field_is_invalid_field(message: Any, name: str, value: Any) -> None:
    raw = raw_of(message)
    if name in raw:
        reject()
    raw[name] = value
    result = check_frame(msgspec.msgpack.encode(raw))
    assert isinstance(result, ProtocolError) and result.code == ErrorCode.INVALID_FIELD


@FUZZ
@given(st.sampled_from(VALID_REQUESTS), st.text(max_size=30) | st.integers(-(2**63), 2**64 - 1) | st.none()
       | st.binary(max_size=5))
def test_an_unknown_type_tag_is_unknown_type(message: Any, tag: Any) -> None:
    if tag in p.REQUEST_TYPES:
        reject()
    raw = raw_of(message)
    raw["type"] = tag
    result = check_frame(msgspec.msgpack.encode(raw))
    assert isinstance(result, ProtocolError) and result.code == ErrorCode.UNKNOWN_TYPE


@st.composite
def field_mutations(draw: st.DrawFn) -> dict[str, Any]:
    raw = raw_of(draw(st.sampled_from(VALID_REQUESTS)))
    for _ in range(draw(st.integers(min_value=1, max_value=3))):
        op = draw(st.sampled_from(["drop", "retype", "add", "retag", "nest"]))
        keys = sorted(raw, key=str)
        if op == "drop" and keys:
            del raw[draw(st.sampled_from(keys))]
        elif op == "retype" and keys:
            raw[draw(st.sampled_from(keys))] = draw(values)
        elif op == "add":
            raw[draw(field_names | st.text(max_size=8))] = draw(values)
        elif op == "retag":
            raw["type"] = draw(request_names)
        elif op == "nest" and keys:
            key = draw(st.sampled_from(keys))
            raw[key] = draw(st.sampled_from([[raw[key]], {"v": raw[key]}, {key: raw[key]}]))
    return raw


@FUZZ
@given(field_mutations())
def test_field_mutated_frames_decode_or_get_a_code(raw: dict[str, Any]) -> None:
    check_frame(msgspec.msgpack.encode(raw))


# Valid frames round-trip ---------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.floats(allow_nan=False) | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
json_objects = st.dictionaries(st.text(max_size=8), json_values, max_size=5)
positive_seconds = st.none() | st.floats(min_value=0, exclude_min=True, allow_infinity=False)

#: fields typed `Any` (which hypothesis cannot build) and constrained ones, per struct
OVERRIDES: dict[str, dict[str, st.SearchStrategy[Any]]] = {
    "CallRequest": {"args": json_objects, "timeout_s": positive_seconds},
    "ResolveCallRequest": {"result": st.none() | json_objects},
    "Artifact": {"meta": json_objects},
}


def struct_of(cls: type[Any]) -> st.SearchStrategy[Any]:
    """Every field of a wire struct drawn from its type (nested structs likewise), defaults included."""
    kwargs: dict[str, st.SearchStrategy[Any]] = {}
    for field in msgspec.structs.fields(cls):
        inner = typing.get_args(field.type)
        if field.name in OVERRIDES.get(cls.__name__, {}):
            kwargs[field.name] = OVERRIDES[cls.__name__][field.name]
        elif isinstance(field.type, type) and issubclass(field.type, msgspec.Struct):
            kwargs[field.name] = struct_of(field.type)
        elif typing.get_origin(field.type) is list and isinstance(inner[0], type) \
                and issubclass(inner[0], msgspec.Struct):
            kwargs[field.name] = st.lists(struct_of(inner[0]), max_size=3)
        else:
            kwargs[field.name] = st.from_type(field.type)
    return st.builds(cls, **kwargs)


valid_requests = st.one_of([struct_of(cls) for _, cls in sorted(p.REQUEST_TYPES.items())])


def test_overrides_cover_every_field_typed_any() -> None:
    structs = [*p.REQUEST_TYPES.values(), p.Artifact]
    for cls in structs:
        untyped = {f.name for f in msgspec.structs.fields(cls) if "Any" in str(f.type)}
        assert untyped <= set(OVERRIDES.get(cls.__name__, {})), (cls.__name__, untyped)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(valid_requests)
def test_valid_requests_round_trip(message: Any) -> None:
    try:
        frame = p.encode(message)
    except OverflowError:  # an integer MessagePack cannot carry; not a frame anyone can send
        reject()
    try:
        decoded = p.decode_request(frame)
    except ProtocolError as exc:
        # Structs built directly skip their field constraints (a negative token offset, a turn past
        # what SQLite stores); the decoder must refuse exactly those, as invalid fields.
        assert exc.code == ErrorCode.INVALID_FIELD and "Expected" in exc.message, exc
        reject()
    assert type(decoded) is type(message)
    assert p.encode(decoded) == frame
    assert decoded.request_id == message.request_id == p.request_id_of(frame)
