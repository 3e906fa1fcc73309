"""What a request asks of the served version, read from its headers or query string.

Clients that can set headers use ``X-Bulletin-Min-Version``, ``X-Bulletin-Version``
and ``X-Bulletin-Max-Wait-Ms``; clients that cannot (some OpenAI SDK setups) use the
query parameters ``bulletin_min_version``, ``bulletin_version`` and
``bulletin_max_wait_ms``. The query parameters are removed before the request is
proxied so that the engine never sees them. Values are plain decimal integers; anything
else (signs, spaces, underscores, exponents, more than 18 digits, a header given twice
with different values) is refused with ``InvalidInput`` rather than guessed at.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from multidict import CIMultiDictProxy, MultiDict, MultiDictProxy

from bulletin.errors import InvalidInput

__all__ = [
    "HEADER_EXACT",
    "HEADER_HEAD",
    "HEADER_MAX_WAIT",
    "HEADER_MIN",
    "HEADER_SERVED",
    "PARAM_EXACT",
    "PARAM_MAX_WAIT",
    "PARAM_MIN",
    "VersionRequirement",
    "parse_requirement",
]

HEADER_MIN: Final = "X-Bulletin-Min-Version"
HEADER_EXACT: Final = "X-Bulletin-Version"
HEADER_MAX_WAIT: Final = "X-Bulletin-Max-Wait-Ms"
#: Response headers: the version that served the response, and the head last seen.
HEADER_SERVED: Final = "X-Bulletin-Version"
HEADER_HEAD: Final = "X-Bulletin-Head-Version"

PARAM_MIN: Final = "bulletin_min_version"
PARAM_EXACT: Final = "bulletin_version"
PARAM_MAX_WAIT: Final = "bulletin_max_wait_ms"

#: 18 digits always fit an int64; versions and waits never need more.
_MAX_DIGITS: Final = 18


@dataclass(frozen=True, slots=True)
class VersionRequirement:
    """A minimum or an exact version (never both), and the wait the client allows.

    ``max_wait`` is in seconds, ``None`` when the client did not say; the sidecar caps
    it by its own configuration either way.
    """

    minimum: int | None = None
    exact: int | None = None
    max_wait: float | None = None

    @property
    def wanted(self) -> int | None:
        """The lowest version that could satisfy the request, if it names one."""
        return self.exact if self.exact is not None else self.minimum

    def satisfied_by(self, version: int | None) -> bool:
        """Whether serving ``version`` (``None``: nothing active yet) meets the request."""
        if version is None:
            return False
        if self.exact is not None:
            return version == self.exact
        return self.minimum is None or version >= self.minimum

    def unreachable_from(self, version: int | None) -> bool:
        """An exact version older than ``version``: versions only move forward."""
        return self.exact is not None and version is not None and version > self.exact


def _parse_int(raw: str, what: str) -> int:
    text = raw.strip(" \t")  # optional whitespace around a header value is RFC 9110's
    if not text or len(text) > _MAX_DIGITS or not text.isascii() or not text.isdigit():
        raise InvalidInput(f"{what} must be a non-negative decimal integer, got {raw[:40]!r}")
    return int(text)


def _one(
    headers: CIMultiDictProxy[str] | Mapping[str, str],
    query: MultiDictProxy[str] | Mapping[str, str],
    header: str,
    param: str,
) -> int | None:
    values: list[tuple[str, str]] = []
    if isinstance(headers, CIMultiDictProxy):
        values += [(header, v) for v in headers.getall(header, [])]
    elif header in headers:
        values.append((header, headers[header]))
    if isinstance(query, MultiDictProxy):
        values += [(param, v) for v in query.getall(param, [])]
    elif param in query:
        values.append((param, query[param]))
    parsed = {_parse_int(v, name) for name, v in values}
    if len(parsed) > 1:
        raise InvalidInput(f"{header} / {param} given more than once with different values")
    return parsed.pop() if parsed else None


def parse_requirement(
    headers: CIMultiDictProxy[str] | Mapping[str, str],
    query: MultiDictProxy[str] | Mapping[str, str],
) -> tuple[VersionRequirement, MultiDict[str]]:
    """The request's requirement, and its query string without the Bulletin parameters.

    Raises ``InvalidInput`` (answered 400) for malformed or contradictory values.
    """
    minimum = _one(headers, query, HEADER_MIN, PARAM_MIN)
    exact = _one(headers, query, HEADER_EXACT, PARAM_EXACT)
    wait_ms = _one(headers, query, HEADER_MAX_WAIT, PARAM_MAX_WAIT)
    if minimum is not None and exact is not None:
        raise InvalidInput(f"give either a minimum ({HEADER_MIN}) or an exact version ({HEADER_EXACT}), not both")
    stripped: MultiDict[str] = MultiDict(
        (k, v) for k, v in query.items() if k not in (PARAM_MIN, PARAM_EXACT, PARAM_MAX_WAIT)
    )
    requirement = VersionRequirement(
        minimum=minimum,
        exact=exact,
        max_wait=None if wait_ms is None else wait_ms / 1000.0,
    )
    return requirement, stripped
