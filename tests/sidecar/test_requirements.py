"""Parsing what a request asks of the served version (headers and query parameters)."""

from __future__ import annotations

import pytest
from multidict import CIMultiDict, CIMultiDictProxy, MultiDict, MultiDictProxy

from bulletin.errors import InvalidInput
from bulletin.sidecar.requirements import VersionRequirement, parse_requirement


def _parse(
    headers: list[tuple[str, str]] | None = None, query: list[tuple[str, str]] | None = None
) -> tuple[VersionRequirement, MultiDict[str]]:
    return parse_requirement(CIMultiDictProxy(CIMultiDict(headers or [])), MultiDictProxy(MultiDict(query or [])))


def test_nothing_asked_is_no_requirement() -> None:
    req, query = _parse(query=[("a", "1")])
    assert req == VersionRequirement()
    assert list(query.items()) == [("a", "1")]


def test_headers_any_case() -> None:
    req, _ = _parse([("x-bulletin-min-version", "7"), ("X-BULLETIN-MAX-WAIT-MS", "1500")])
    assert req == VersionRequirement(minimum=7, max_wait=1.5)
    req, _ = _parse([("X-Bulletin-Version", "12")])
    assert req.exact == 12 and req.minimum is None


def test_query_parameters_are_read_and_stripped_keeping_the_rest() -> None:
    req, query = _parse(query=[("x", "1"), ("bulletin_version", "3"), ("x", "2"), ("bulletin_max_wait_ms", "0")])
    assert req == VersionRequirement(exact=3, max_wait=0.0)
    assert list(query.items()) == [("x", "1"), ("x", "2")]


def test_header_and_query_may_repeat_the_same_value() -> None:
    req, _ = _parse([("X-Bulletin-Min-Version", "4")], [("bulletin_min_version", "4")])
    assert req.minimum == 4


@pytest.mark.parametrize(
    ("headers", "query"),
    [
        ([("X-Bulletin-Min-Version", "4")], [("bulletin_min_version", "5")]),
        ([("X-Bulletin-Min-Version", "4"), ("X-Bulletin-Min-Version", "5")], []),
        ([("X-Bulletin-Min-Version", "4"), ("X-Bulletin-Version", "4")], []),
    ],
)
def test_contradictions_are_refused(headers: list[tuple[str, str]], query: list[tuple[str, str]]) -> None:
    with pytest.raises(InvalidInput):
        _parse(headers, query)


@pytest.mark.parametrize(
    "value",
    ["", " ", "-1", "+1", "1.0", "1e3", "1_000", "0x10", "seven", "١٢", "1 2", "9" * 19, "\t\n"],
)
def test_malformed_values_are_refused(value: str) -> None:
    with pytest.raises(InvalidInput):
        _parse([("X-Bulletin-Version", value)])
    with pytest.raises(InvalidInput):
        _parse(query=[("bulletin_max_wait_ms", value)])


def test_surrounding_header_whitespace_is_allowed() -> None:
    req, _ = _parse([("X-Bulletin-Version", " 42\t")])
    assert req.exact == 42


def test_satisfaction_rules() -> None:
    assert not VersionRequirement().satisfied_by(None)
    assert VersionRequirement().satisfied_by(1)
    assert VersionRequirement(minimum=3).satisfied_by(3)
    assert VersionRequirement(minimum=3).satisfied_by(9)
    assert not VersionRequirement(minimum=3).satisfied_by(2)
    assert VersionRequirement(exact=3).satisfied_by(3)
    assert not VersionRequirement(exact=3).satisfied_by(4)
    assert VersionRequirement(exact=3).unreachable_from(4)
    assert not VersionRequirement(exact=3).unreachable_from(2)
    assert not VersionRequirement(minimum=3).unreachable_from(9)
    assert VersionRequirement(exact=5).wanted == 5
    assert VersionRequirement(minimum=6).wanted == 6
    assert VersionRequirement().wanted is None
