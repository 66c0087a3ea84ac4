"""The served-name rule (protocol.names), in tables, and the digest form a name outside it is
kept in by the record: stable, distinct, and never a served name."""

from __future__ import annotations

import hashlib

import pytest

from supervisor.protocol.names import (
    MAX_LENGTH,
    check,
    digest_form,
    is_kept,
    is_served_name,
    kept,
    problem,
)

LEGAL = [
    "tiny",
    "Qwen3-0.6B-Q4_K_M",
    "qwen2.5-0.5b",
    "Qwen/Qwen2.5-0.5B-Instruct",  # a vLLM served name: the hub's id
    "org/family/model",
    "qwen2.5:7b",
    "model@rev+build",
    "a",
    "7",
    "x" * MAX_LENGTH,
    "a.b",
    "model.",
    "model-",
    "sha256:" + "ab" * 32,
]

ILLEGAL = [
    ("Qwen 7B (Q4)", "has a space"),
    ("model(Q4)", "has '(' (U+0028)"),
    ("Llama 3.1 8B (instruct)+v2@x", "has a space"),
    ("modèle", r"has '\xe8' (U+00E8)"),
    ("模型", r"has '\u6a21' (U+6A21)"),
    ("", "is empty"),
    ("x" * (MAX_LENGTH + 1), f"is longer than {MAX_LENGTH} characters"),
    (".hidden", "starts with '.'"),
    ("-flag", "starts with '-'"),
    ("_private", "starts with '_'"),
    (":7b", "starts with ':'"),
    ("@x", "starts with '@'"),
    ("..", "has '..'"),
    ("a..b", "has '..'"),
    ("org/../x", "has '..'"),
    ("/abs", "has an empty part"),
    ("trailing/", "has an empty part"),
    ("a//b", "has an empty part"),
    ("org/.hidden", "has a part after a '/' that starts with '.'"),
    ("org/-x", "has a part after a '/' that starts with '-'"),
    ("a\\b", r"has '\\' (U+005C)"),
    ("[x]", "has '[' (U+005B)"),
    ("semi;colon", "has ';' (U+003B)"),
    ("hash#tag", "has '#' (U+0023)"),
    ("new\nline", r"has '\n' (U+000A)"),
    ("escape\x1b[31m", r"has '\x1b' (U+001B)"),
    ("tilde~0123456789abcdef", "has '~' (U+007E)"),  # a digest form is never a served name
    ("pct%20", "has '%' (U+0025)"),
]


@pytest.mark.parametrize("name", LEGAL)
def test_a_served_name(name: str) -> None:
    assert problem(name) is None and is_served_name(name)
    assert check(name) == name
    assert kept(name) == name  # a record keeps it as it is
    assert is_kept(name)


@pytest.mark.parametrize(("name", "why"), ILLEGAL)
def test_not_a_served_name_and_why(name: str, why: str) -> None:
    found = problem(name)
    assert found is not None and found.startswith(why), found
    assert not is_served_name(name)
    with pytest.raises(ValueError, match="is not a served name: it ") as caught:
        check(name)
    assert "\n" not in str(caught.value) and "\x1b" not in str(caught.value)


@pytest.mark.parametrize("value", [None, 7, b"tiny", ["tiny"]])
def test_what_is_no_string_is_no_name(value: object) -> None:
    assert problem(value) == "is not a string"
    assert not is_served_name(value) and not is_kept(value)


# -- the digest form ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "form"),
    [
        ("Qwen 7B (Q4)", "Qwen_7B__Q4_~"),
        ("模型", "__~"),
        ("", "~"),
        ("a..b", "a..b~"),
        ("x" * 300, "x" * 64 + "~"),
        ("tilde~0123456789abcdef", "tilde_0123456789abcdef~"),
    ],
)
def test_the_digest_form_shows_the_name_and_its_sha256(name: str, form: str) -> None:
    digest = hashlib.sha256(name.encode()).hexdigest()[:16]
    assert digest_form(name) == kept(name) == form + digest


@pytest.mark.parametrize(("name", "_why"), ILLEGAL)
def test_the_digest_form_is_stable_kept_and_never_a_served_name(name: str, _why: str) -> None:
    form = kept(name)
    assert form == kept(name) == digest_form(name)  # the same every time
    assert not is_served_name(form) and problem(form) is not None
    assert is_kept(form) and len(form) <= 64 + 1 + 16


def test_digest_forms_are_distinct() -> None:
    """Names that read alike (each shown as the same characters) still differ by the digest;
    and a name that looks like a digest form is digested, not kept: it never takes another's."""
    alike = ["a b", "a(b", "a)b", "a_b~", "a\tb", "aéb", "a b" + " " * 200, "a b" + "x" * 200]
    forms = [kept(name) for name in alike + [name for name, _ in ILLEGAL]]
    assert len(set(forms)) == len(forms)
    other = kept("Qwen 7B (Q4)")
    assert kept(other) != other and kept(other) != kept("Qwen 7B (Q4)")


def test_a_lone_surrogate_has_a_digest_form() -> None:
    """A name from JSON may hold one; it is digested, never a reason to fail."""
    name = "bad\ud800name"
    assert kept(name).startswith("bad_name~") and is_kept(kept(name))


@pytest.mark.parametrize(
    "value",
    [
        "tell me a story",
        "Qwen_7B__Q4_~0123",
        "Qwen_7B__Q4_~" + "G" * 16,
        "x" * 65 + "~" + "0" * 16,
        "a b~" + "0" * 16,
        "~" + "0" * 17,
    ],
)
def test_is_kept_takes_nothing_else(value: str) -> None:
    assert not is_kept(value)
