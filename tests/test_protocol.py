"""Command schemas and validation: parse_command and check_properties."""

from __future__ import annotations

import pytest

from qflow import protocol as P
from qflow.protocol import COMMANDS, CommandError, check_properties, command_name, parse_command

pytestmark = pytest.mark.native_only  # no accounting here: nothing differs under QFLOW_ACCOUNTING=python

# A valid value, and wrongly typed ones, for each schema type.
VALID = {"str": "name", "bool": True, "int": 7, "map": {"k": 1}, "bytes": b"body", "list": [0, 3],
         "props": {"message_id": "m-1"}}
WRONG = {
    "str": [1, b"name", None, ["a"]],
    "bool": [1, 0, "true", None],
    "int": [True, 1.0, "7", None],  # a bool is not an int
    "map": [[], "m", None],
    "bytes": ["body", bytearray(b"x"), None, 5],
    "list": [{}, (0, 3), "0,3", None],
    "props": ["m", [], 5],
}

CASES = [(code, name, fields) for code, (name, fields) in sorted(COMMANDS.items())]
IDS = [name for _, name, _ in CASES]


def valid_frame(code: int, fields: tuple) -> list:
    return [code, 1, *(VALID[kind] for _, kind in fields)]


def test_every_command_code_is_numbered_from_first_command() -> None:
    assert min(COMMANDS) == P.FIRST_COMMAND
    assert sorted(COMMANDS) == list(range(P.FIRST_COMMAND, P.FIRST_COMMAND + len(COMMANDS)))
    assert len({name for name, _ in COMMANDS.values()}) == len(COMMANDS)


@pytest.mark.parametrize(("code", "name", "fields"), CASES, ids=IDS)
def test_valid_command(code: int, name: str, fields: tuple) -> None:
    frame = valid_frame(code, fields)
    assert parse_command(frame) == frame[2:]
    assert len(parse_command(frame)) == len(fields)
    assert command_name(code) == name


@pytest.mark.parametrize("code", sorted(P.OPTIONAL_FIELDS))
def test_optional_trailing_fields_take_their_defaults(code: int) -> None:
    name, fields = COMMANDS[code]
    defaults = P.OPTIONAL_FIELDS[code]
    required = valid_frame(code, fields)[: 2 + len(fields) - len(defaults)]
    assert parse_command(required) == required[2:] + list(defaults)
    assert parse_command(valid_frame(code, fields)) == valid_frame(code, fields)[2:]


def test_subscribe_start_sequence_defaults_to_zero() -> None:
    assert parse_command([P.SUBSCRIBE, 1, "q", "dest", 0, 1]) == ["q", "dest", 0, 1, 0]
    assert parse_command([P.SUBSCRIBE, 1, "q", "dest", 0, 1, 42]) == ["q", "dest", 0, 1, 42]
    with pytest.raises(CommandError, match="start_sequence"):
        parse_command([P.SUBSCRIBE, 1, "q", "dest", 0, 1, "42"])


def test_transfer_with_nil_properties() -> None:
    assert parse_command([P.TRANSFER, 1, "ex", "key", None, b""]) == ["ex", "key", None, b""]


@pytest.mark.parametrize(("code", "name", "fields"), CASES, ids=IDS)
def test_missing_field(code: int, name: str, fields: tuple) -> None:
    frame = valid_frame(code, fields)
    required = len(fields) - len(P.OPTIONAL_FIELDS.get(code, ()))
    if required:
        frame = frame[:2 + required - 1]  # the last required field left out
    else:  # execution.sync has no field to leave out: give it one too many
        frame = frame + ["extra"]
    with pytest.raises(CommandError) as info:
        parse_command(frame)
    err = info.value
    assert err.code == P.INVALID_ARGUMENT
    assert name in err.text
    assert f"expected {len(fields)} fields" in err.text
    for field, _ in fields:
        assert field in err.text
    assert str(err) == err.text


@pytest.mark.parametrize(("code", "name", "fields"), CASES, ids=IDS)
def test_extra_field(code: int, name: str, fields: tuple) -> None:
    with pytest.raises(CommandError, match=name.replace(".", r"\.")) as info:
        parse_command(valid_frame(code, fields) + [0])
    assert info.value.code == P.INVALID_ARGUMENT


WRONG_CASES = [
    (code, name, fields, index, bad)
    for code, name, fields in CASES
    for index, (_, kind) in enumerate(fields)
    for bad in WRONG[kind]
]


@pytest.mark.parametrize(("code", "name", "fields", "index", "bad"), WRONG_CASES,
                         ids=[f"{c[1]}-{c[2][c[3]][0]}-{type(c[4]).__name__}" for c in WRONG_CASES])
def test_wrongly_typed_field(code: int, name: str, fields: tuple, index: int, bad: object) -> None:
    frame = valid_frame(code, fields)
    frame[2 + index] = bad
    with pytest.raises(CommandError) as info:
        parse_command(frame)
    field = fields[index][0]
    assert info.value.code == P.INVALID_ARGUMENT
    assert name in info.value.text
    assert field in info.value.text


def test_wrong_type_error_text() -> None:
    with pytest.raises(CommandError) as info:
        parse_command([P.QUEUE_DECLARE, 1, "q", "yes", False, False, {}, False])
    assert info.value.text == "queue.declare: field 'durable' must be bool, got str"


@pytest.mark.parametrize("code", [99, 29, P.OPEN, P.COMPLETED, -1, P.FIRST_COMMAND + len(COMMANDS)])
def test_unknown_command_code_is_not_implemented(code: int) -> None:
    with pytest.raises(CommandError) as info:
        parse_command([code, 1, "x"])
    assert info.value.code == P.NOT_IMPLEMENTED == 540
    assert str(code) in info.value.text


def test_command_name_of_unknown_code() -> None:
    assert command_name(99) == "command 99"
    assert command_name(P.SYNC) == "execution.sync"


# -- message properties --------------------------------------------------------------------------------------


def test_check_properties_accepts_every_known_key() -> None:
    props = {"message_id": "m", "correlation_id": "c", "content_type": "text/plain", "durable": True,
             "headers": {"a": 1, "b": [1, 2], "c": None}, "timestamp": 1_790_000_000_123}
    assert check_properties(props) is False  # nothing the broker acts on when the message arrives
    assert check_properties({**props, "ttl": 1000, "expiration": 1_790_000_001_123, "priority": 9}) is True
    assert set(props) | {"ttl", "expiration", "priority"} == P.PROPERTY_KEYS
    assert check_properties({}) is False
    assert check_properties(None) is False
    assert check_properties({"message_id": None, "content_type": None}) is False
    for key, value in (("ttl", 0), ("expiration", 5), ("priority", 0)):
        assert check_properties({"message_id": "m", key: value}) is True


@pytest.mark.parametrize("key", ["Ttl", "Message_Id", "reply_to", "x-message-ttl"])
def test_check_properties_unknown_key(key: str) -> None:
    with pytest.raises(CommandError) as info:
        check_properties({"message_id": "m", key: "x"})
    assert info.value.code == P.INVALID_ARGUMENT
    assert repr(key) in info.value.text
    assert "message.transfer" in info.value.text


@pytest.mark.parametrize(("props", "words"), [
    ({"durable": 1}, "'durable' must be a bool"),
    ({"durable": "true"}, "'durable' must be a bool"),
    ({"durable": None}, "'durable' must be a bool"),
    ({"headers": []}, "'headers' must be a map"),
    ({"headers": {1: "x"}}, "'headers' must be a map with string keys"),
    ({"headers": {b"k": "x"}}, "'headers' must be a map with string keys"),
    ({"message_id": 5}, "'message_id' must be a string"),
    ({"correlation_id": b"c"}, "'correlation_id' must be a string"),
    ({"content_type": True}, "'content_type' must be a string"),
    ({"timestamp": "2026-11-24"}, "'timestamp' must be an integer (milliseconds since the Unix epoch"),
    ({"timestamp": 1.5}, "'timestamp' must be an integer"),
    ({"timestamp": True}, "'timestamp' must be an integer"),
    ({"timestamp": -1}, "'timestamp' must be an integer"),
    ({"timestamp": None}, "'timestamp' must be an integer"),
    ({"ttl": "1000"}, "'ttl' must be an integer of milliseconds"),
    ({"ttl": -1}, "'ttl' must be an integer of milliseconds"),
    ({"ttl": 1.5}, "'ttl' must be an integer of milliseconds"),
    ({"ttl": None}, "'ttl' must be an integer of milliseconds"),
    ({"expiration": True}, "'expiration' must be an integer of milliseconds"),
    ({"priority": 10}, "'priority' must be an integer from 0 to 9"),
    ({"priority": -1}, "'priority' must be an integer from 0 to 9"),
    ({"priority": "high"}, "'priority' must be an integer from 0 to 9"),
    (["message_id", "m"], "properties must be a map or nil"),
    ("m", "properties must be a map or nil"),
])
def test_check_properties_bad_types(props: object, words: str) -> None:
    with pytest.raises(CommandError) as info:
        check_properties(props)
    assert info.value.code == P.INVALID_ARGUMENT
    assert words in info.value.text


def test_transfer_with_bad_properties_fails_through_parse_command() -> None:
    with pytest.raises(CommandError, match="unknown property 'bogus'") as info:
        parse_command([P.TRANSFER, 1, "ex", "k", {"bogus": 1}, b""])
    assert info.value.code == P.INVALID_ARGUMENT
