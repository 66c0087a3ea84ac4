"""Served names: one rule for every name a request's `model` may give, and a digest form.

A name becomes a served name where it enters: a GGUF the library adds (its file name without
`.gguf`, or a split model's prefix), a vLLM or TensorFold recipe's served names, a tier alias
in the gateway's settings. Each of those refuses a name that breaks the rule, saying why. The
rule is 1 to 256 ASCII letters, digits and `. _ : @ + - /`; the name and each part of it after
a `/` start with a letter or a digit (no leading punctuation, no empty part, no trailing `/`);
and no `..` anywhere.

A name from before the rule (a GGUF a library already held) is still served, and a row of the
record still keeps it: as its digest form, `<shown>~<16 hex>`, where `<shown>` is its first 64
characters with each one outside the rule's characters made `_`, and the hex digits are the
first 16 of the SHA-256 of its UTF-8 bytes. `~` is never in a served name, so a digest form is
never one, and names that differ get different digests (64 bits of the SHA-256).
"""

from __future__ import annotations

import hashlib
import re
from typing import Final

MAX_LENGTH: Final = 256
CHARACTERS: Final = "letters, digits and . _ : @ + - /"
_ALLOWED: Final = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._:@+-/")
MARK: Final = "~"
SHOWN: Final = 64  # characters of the name a digest form shows
DIGITS: Final = 16  # hex digits of the SHA-256 a digest form keeps
DIGEST_FORM: Final = re.compile(rf"[A-Za-z0-9._:@+/-]{{0,{SHOWN}}}{MARK}[0-9a-f]{{{DIGITS}}}")


def _shown(character: str) -> str:
    if character == " ":
        return "a space"
    return f"{character!a} (U+{ord(character):04X})"


def problem(name: object) -> str | None:
    """Pure: why `name` is not a served name (one line that shows one character of it at
    most), or None when it is one."""
    if not isinstance(name, str):
        return "is not a string"
    if not name:
        return "is empty"
    if len(name) > MAX_LENGTH:
        return f"is longer than {MAX_LENGTH} characters"
    for character in name:
        if character not in _ALLOWED:
            return f"has {_shown(character)}: a served name has {CHARACTERS} only"
    if ".." in name:
        return "has '..'"
    for index, part in enumerate(name.split("/")):
        if not part:
            return "has an empty part: a '/' at its start or its end, or '//'"
        if not part[0].isalnum():
            where = "starts" if index == 0 else "has a part after a '/' that starts"
            return (
                f"{where} with {part[0]!a}: the name and each part after a '/' start "
                "with a letter or a digit"
            )
    return None


def is_served_name(name: object) -> bool:
    """Pure: whether `name` keeps the rule."""
    return problem(name) is None


def check(name: str) -> str:
    """`name` when it is a served name; else ValueError showing it (its first 80 characters)
    and saying why not, for a validator of where names enter."""
    found = problem(name)
    if found is not None:
        shown = name[:80] + ("…" if len(name) > 80 else "")
        raise ValueError(f"{shown!r} is not a served name: it {found}")
    return name


def digest_form(name: str) -> str:
    """Pure: the form a name is kept in when it is not a served name (the module's text)."""
    shown = "".join(c if c in _ALLOWED else "_" for c in name[:SHOWN])
    digest = hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:DIGITS]
    return f"{shown}{MARK}{digest}"


def kept(name: str) -> str:
    """Pure: the name as a record keeps it: itself when it is a served name, else its digest
    form (even when it already looks like one: only a digest makes a digest form)."""
    return name if is_served_name(name) else digest_form(name)


def is_kept(value: object) -> bool:
    """Pure: whether `value` is what `kept` gives: a served name or a digest form."""
    return isinstance(value, str) and (is_served_name(value) or bool(DIGEST_FORM.fullmatch(value)))
