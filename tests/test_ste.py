"""SteKind: names, string values, construction from strings, JSON round trip."""
from __future__ import annotations

import json

import pytest

import qatlab as ql
from qatlab.quant.ste import STE_NAMES, SteKind

VALUES = {
    "IDENTITY": "identity",
    "CLIPPED_IDENTITY": "clipped_identity",
    "TANH": "tanh",
    "HARD_TANH": "hard_tanh",
}


def test_members_and_string_values():
    assert [k.name for k in SteKind] == list(VALUES)
    for name, value in VALUES.items():
        kind = getattr(ql.SteKind, name)
        assert kind.value == value
        assert str(kind) == value
        assert kind == value  # a str enum compares equal to its value
    assert STE_NAMES == list(VALUES.values())


@pytest.mark.parametrize("value", list(VALUES.values()))
def test_construct_from_string(value):
    kind = SteKind(value)
    assert kind.value == value
    assert SteKind(kind) is kind


def test_construct_from_name_and_case_insensitive():
    assert SteKind("hard_tanh") is SteKind.HARD_TANH
    assert SteKind("HARD_TANH") is SteKind.HARD_TANH
    assert SteKind("Tanh") is SteKind.TANH


@pytest.mark.parametrize("bad", ["relu", "", "clipped", "hardtanh"])
def test_unknown_name_lists_valid_kinds(bad):
    with pytest.raises(ValueError) as err:
        SteKind(bad)
    msg = str(err.value)
    assert repr(bad) in msg
    for value in VALUES.values():
        assert value in msg


@pytest.mark.parametrize("bad", [3, None, 1.5])
def test_non_string_is_rejected(bad):
    with pytest.raises(ValueError, match="identity"):
        SteKind(bad)


@pytest.mark.parametrize("kind", list(SteKind))
def test_json_round_trip(kind):
    text = kind.to_json()
    assert text == f'"{kind.value}"'
    assert SteKind.from_json(text) is kind
    # plain json works too, because SteKind is a str enum
    assert json.dumps(kind) == text
    assert SteKind(json.loads(json.dumps({"ste": kind}))["ste"]) is kind


def test_from_json_rejects_unknown():
    with pytest.raises(ValueError):
        SteKind.from_json('"bogus"')


def test_kernel_codes_are_declaration_order():
    assert [k.code for k in SteKind] == [0, 1, 2, 3]
