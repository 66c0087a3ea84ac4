"""Image references as Docker parses them: `[host[:port]/]path[:tag][@digest]`.

The grammar is the one of Docker's reference library (distribution's `reference/regexp.go`):
path components are lower-case alphanumerics joined by `.`, `_`, `__` or dashes; the registry
host is a domain name (any case), an IPv4 address or a bracketed IPv6 address, with an optional
port; a tag is at most 128 word characters, dots and dashes, not starting with either; a digest
is `algorithm:hex` (at least 32 hex digits). A name is at most 255 characters.
"""

from __future__ import annotations

import re
from typing import Final

_ALNUM = r"[a-z0-9]+"
_COMPONENT = rf"{_ALNUM}(?:(?:[._]|__|-+){_ALNUM})*"
_HOST_PART = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_HOST = rf"(?:{_HOST_PART}(?:\.{_HOST_PART})*|\[[a-fA-F0-9:]+\])"
_DOMAIN = rf"{_HOST}(?::(?P<port>[0-9]{{1,5}}))?"
_NAME = rf"(?P<name>(?:{_DOMAIN}/)?{_COMPONENT}(?:/{_COMPONENT})*)"
_TAG = r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}"
_DIGEST = r"[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,}"

_REFERENCE: Final = re.compile(rf"{_NAME}(?::{_TAG})?(?:@{_DIGEST})?")
_TAGGED: Final = re.compile(rf"{_NAME}(?::{_TAG})?")
_REPOSITORY: Final = re.compile(_NAME)
NAME_MAX: Final = 255
GRAMMAR: Final = "[host[:port]/]path[:tag][@digest], lower-case path"


def _check(value: str, pattern: re.Pattern[str], what: str, form: str) -> str:
    found = pattern.fullmatch(value)
    if found is None:
        raise ValueError(f"{value!r} is not a valid {what} ({form})")
    if len(found["name"]) > NAME_MAX:
        raise ValueError(f"{value!r} is not a valid {what}: its name is longer than {NAME_MAX}")
    port = found["port"]
    if port is not None and not 1 <= int(port) <= 65535:
        raise ValueError(f"{value!r} is not a valid {what}: port {port} is out of range")
    return value


def image_reference(value: str) -> str:
    """An image to pull: any reference Docker accepts."""
    return _check(value, _REFERENCE, "image reference", GRAMMAR)


def image_tag(value: str) -> str:
    """A name to build an image under: a reference without a digest (Docker tags no digests)."""
    return _check(value, _TAGGED, "image reference", "[host[:port]/]path[:tag], lower-case path")


def repository(value: str) -> str:
    """A repository, without tag or digest: where the tags to be chosen are looked for."""
    return _check(
        value, _REPOSITORY, "image repository", "[host[:port]/]path, lower-case, no tag or digest"
    )
