"""The key check: the fixed keys' rules, who a presented key is, and keys.json reloaded."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from supervisor import paths, redaction
from supervisor.host import keycheck, keys
from supervisor.host.keycheck import (
    INFERENCE,
    MAX_SECRET,
    OWNER,
    UNKNOWN_RECHECK_S,
    Identity,
    KeyRing,
    SecretRefused,
    Verifier,
    check_secret,
    read_secret,
)
from supervisor.host.keys import KeyConfigError

OWNER_KEY = "o" * 31 + "!"
INFERENCE_KEY = "i" * 40
NOW = datetime(2025, 6, 1, 12, 0, tzinfo=UTC)
T = NOW.timestamp()


class Clock:
    """Wall and monotonic time, moved by the test."""

    def __init__(self) -> None:
        self.wall = T
        self.mono = 100.0

    def time(self) -> float:
        return self.wall

    def monotonic(self) -> float:
        return self.mono


# --- the fixed keys' rules ----------------------------------------------------------------------

SECRETS = [
    ("empty", "", "length"),
    ("31", "a" * 31, "length"),
    ("31 and a newline", "a" * 31 + "\n", "length"),
    ("32", "a" * 32, None),
    ("32 and a newline", "a" * 32 + "\n", None),
    ("32 padded", "  " + "a" * 32 + "\r\n", None),
    ("the longest", "a" * MAX_SECRET, None),
    ("too long", "a" * (MAX_SECRET + 1), "length"),
    ("a space inside", "a" * 20 + " " + "a" * 20, "characters"),
    ("a tab inside", "a" * 20 + "\t" + "a" * 20, "characters"),
    ("not ASCII", "ä" * 40, "characters"),
    ("a control character", "a" * 40 + "\x7f", "characters"),
]


@pytest.mark.parametrize(("text", "rule"), [s[1:] for s in SECRETS], ids=[s[0] for s in SECRETS])
def test_a_fixed_key_rule(text: str, rule: str | None) -> None:
    if rule is None:
        assert check_secret(text, Path("k")) == text.strip()
        return
    with pytest.raises(SecretRefused) as caught:
        check_secret(text, Path("/etc/lucia/owner-key"))
    assert caught.value.rule == rule
    assert isinstance(caught.value, KeyConfigError)  # the gateway's exit 78
    assert str(caught.value).startswith("/etc/lucia/owner-key: ")
    if text.strip():
        assert text.strip() not in str(caught.value)


def test_a_missing_or_odd_secret_file_is_unreadable(tmp_path: Path) -> None:
    (tmp_path / "real").write_text(OWNER_KEY)
    (tmp_path / "link").symlink_to(tmp_path / "real")
    for path, detail in [
        (tmp_path / "none", "does not exist"),
        (tmp_path, "a directory"),
        (tmp_path / "link", "symlink"),
    ]:
        with pytest.raises(SecretRefused, match=detail) as caught:
            read_secret(path)
        assert caught.value.rule == "readable"


EQUAL = [
    ("same", OWNER_KEY, OWNER_KEY),
    ("same but a newline", OWNER_KEY + "\n", OWNER_KEY),
]


@pytest.mark.parametrize(("owner", "inference"), [e[1:] for e in EQUAL], ids=[e[0] for e in EQUAL])
def test_equal_owner_and_inference_keys_are_refused(
    tmp_path: Path, owner: str, inference: str
) -> None:
    (tmp_path / "owner").write_text(owner)
    (tmp_path / "inference").write_text(inference)
    with pytest.raises(SecretRefused, match="must differ") as caught:
        Verifier.open(tmp_path / "keys.json", tmp_path / "owner", tmp_path / "inference")
    assert caught.value.rule == "distinct" and OWNER_KEY not in str(caught.value)


@pytest.mark.parametrize("which", ["owner", "inference"])
def test_a_short_key_file_stops_the_verifier(tmp_path: Path, which: str) -> None:
    (tmp_path / "owner").write_text(OWNER_KEY)
    (tmp_path / "inference").write_text(INFERENCE_KEY)
    (tmp_path / which).write_text("short")
    with pytest.raises(SecretRefused, match=f"{tmp_path / which}: a key has at least 32"):
        Verifier.open(tmp_path / "keys.json", tmp_path / "owner", tmp_path / "inference")


def test_an_invalid_keys_file_stops_the_verifier(tmp_path: Path) -> None:
    (tmp_path / "owner").write_text(OWNER_KEY)
    (tmp_path / "inference").write_text(INFERENCE_KEY)
    (tmp_path / "keys.json").write_text("[]")
    with pytest.raises(keys.KeysFileInvalid):
        Verifier.open(tmp_path / "keys.json", tmp_path / "owner", tmp_path / "inference")


# --- who a key is -------------------------------------------------------------------------------


def issued(n: int, secret: str, **changes: object) -> keys.IssuedKey:
    fields: dict[str, object] = {
        "id": f"key_{n:012x}",
        "name": f"k{n}",
        "sha256": keys.digest(secret).hex(),
        "created": NOW - timedelta(days=1),
    }
    return keys.IssuedKey(**(fields | changes))  # type: ignore[arg-type]


RING = KeyRing.build(
    OWNER_KEY,
    INFERENCE_KEY,
    [
        issued(1, "lucia_inf_active"),
        issued(2, "lucia_inf_later", expires=NOW + timedelta(seconds=1)),
        issued(3, "lucia_inf_now", expires=NOW),
        issued(4, "lucia_inf_expired", expires=NOW - timedelta(days=1)),
        issued(5, "lucia_inf_revoked", revoked=NOW - timedelta(hours=1)),
        issued(6, "lucia_inf_revoked_later", revoked=NOW, expires=NOW + timedelta(days=1)),
    ],
)

VERIFY = [
    ("owner", OWNER_KEY, OWNER),
    ("inference", INFERENCE_KEY, INFERENCE),
    ("issued", "lucia_inf_active", Identity("key_000000000001", "inference", "k1")),
    ("expires in a second", "lucia_inf_later", Identity("key_000000000002", "inference", "k2")),
    ("expires now", "lucia_inf_now", None),
    ("expired", "lucia_inf_expired", None),
    ("revoked", "lucia_inf_revoked", None),
    ("revoked, not expired", "lucia_inf_revoked_later", None),
    ("unknown", "lucia_inf_other", None),
    ("empty", "", None),
    ("the owner key and more", OWNER_KEY + "x", None),
    ("the owner key less one", OWNER_KEY[:-1], None),
    ("the owner key padded", OWNER_KEY + " ", None),
    ("a digest, not a key", keys.digest("lucia_inf_active").hex(), None),
    ("too long", "a" * (MAX_SECRET + 1), None),
    ("not UTF-8", "lucia_inf_\udcff", None),
]


@pytest.mark.parametrize(("presented", "who"), [v[1:] for v in VERIFY], ids=[v[0] for v in VERIFY])
def test_who_a_key_is(presented: str, who: Identity | None) -> None:
    assert RING.verify(presented, T) == who


def test_the_fixed_secrets_are_masked_in_logs(tmp_path: Path) -> None:
    (tmp_path / "owner").write_text(OWNER_KEY)
    (tmp_path / "inference").write_text(INFERENCE_KEY)
    Verifier.open(tmp_path / "keys.json", tmp_path / "owner", tmp_path / "inference")
    assert redaction.redact(f"a {OWNER_KEY} b {INFERENCE_KEY}") == "a *** b ***"


# --- reloading keys.json ------------------------------------------------------------------------


@pytest.fixture
def setup(tmp_path: Path) -> tuple[Verifier, Path, Clock]:
    (tmp_path / "owner").write_text(OWNER_KEY + "\n")
    (tmp_path / "inference").write_text(INFERENCE_KEY + "\n")
    path = paths.keys_file(tmp_path)
    clock = Clock()
    verifier = Verifier.open(
        path,
        tmp_path / "owner",
        tmp_path / "inference",
        clock=clock.time,
        monotonic=clock.monotonic,
    )
    return verifier, path, clock


def test_a_created_key_works_at_once_and_a_revoked_one_stops_within_the_recheck(
    setup: tuple[Verifier, Path, Clock],
) -> None:
    verifier, path, clock = setup
    new = keys.create(path, "laptop", NOW)
    clock.mono += 2 * UNKNOWN_RECHECK_S  # `keys create` printed it after the gateway's last look
    # unknown to the ring: the file's stamp is looked at again before refusing
    assert verifier.verify(new.secret) == Identity(new.entry.id, "inference", "laptop")
    keys.revoke_key(path, "laptop", NOW)
    assert verifier.verify(new.secret) is not None
    clock.mono += 0.999
    assert verifier.verify(new.secret) is not None
    clock.mono += 0.001
    assert verifier.verify(new.secret) is None
    assert verifier.verify(OWNER_KEY) == OWNER


def test_an_unchanged_file_is_not_read_again(setup: tuple[Verifier, Path, Clock]) -> None:
    verifier, path, clock = setup
    keys.create(path, "laptop", NOW)
    clock.mono += 1
    assert verifier.refresh() is True
    ring = verifier.ring
    clock.mono += 1
    assert verifier.refresh() is False and verifier.ring is ring


def test_a_key_expires_by_the_wall_clock(setup: tuple[Verifier, Path, Clock]) -> None:
    verifier, path, clock = setup
    new = keys.create(path, "laptop", NOW, NOW + timedelta(hours=1))
    clock.mono += 1
    assert verifier.verify(new.secret) is not None
    clock.wall = T + 3600
    assert verifier.verify(new.secret) is None


def test_a_broken_keys_file_refuses_issued_keys_until_fixed(
    setup: tuple[Verifier, Path, Clock],
) -> None:
    verifier, path, clock = setup
    new = keys.create(path, "laptop", NOW)
    good = path.read_text()
    clock.mono += 1
    assert verifier.verify(new.secret) is not None and verifier.problem is None
    path.write_text(good[:-10])
    clock.mono += 1
    assert verifier.verify(new.secret) is None
    assert verifier.problem is not None and str(path) in verifier.problem
    assert verifier.verify(OWNER_KEY) == OWNER and verifier.verify(INFERENCE_KEY) == INFERENCE
    keys.save(path, keys.parse(good, path))
    clock.mono += 1
    assert verifier.verify(new.secret) is not None and verifier.problem is None


def test_a_removed_keys_file_is_no_issued_keys(setup: tuple[Verifier, Path, Clock]) -> None:
    verifier, path, clock = setup
    new = keys.create(path, "laptop", NOW)
    clock.mono += 1
    assert verifier.verify(new.secret) is not None
    path.unlink()
    clock.mono += 1
    assert verifier.verify(new.secret) is None and verifier.problem is None


def test_an_unknown_key_looks_again_at_most_once_per_interval(
    setup: tuple[Verifier, Path, Clock],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A flood of bad keys costs one stat per UNKNOWN_RECHECK_S, not one per request; a key
    created inside that interval works at the first request after it."""
    verifier, path, clock = setup
    stats: list[Path] = []
    real = keycheck._stamp
    monkeypatch.setattr(keycheck, "_stamp", lambda p: stats.append(p) or real(p))
    clock.mono += 2 * UNKNOWN_RECHECK_S
    assert verifier.verify("lucia_inf_" + "x" * 40) is None
    assert len(stats) == 1
    for _ in range(100):
        assert verifier.verify("lucia_inf_" + "y" * 40) is None
    assert len(stats) == 1  # inside the interval: no stat at all
    new = keys.create(path, "laptop", NOW)
    assert verifier.verify(new.secret) is None  # still inside the interval
    clock.mono += 2 * UNKNOWN_RECHECK_S
    assert verifier.verify(new.secret) is not None
    assert len(stats) == 2
    # a known key never costs a stat between the periodic rechecks
    for _ in range(100):
        assert verifier.verify(new.secret) is not None
    assert verifier.verify(OWNER_KEY) == OWNER
    assert len(stats) == 2


def test_a_revoked_key_is_not_brought_back_by_looking_again(
    setup: tuple[Verifier, Path, Clock],
) -> None:
    verifier, path, clock = setup
    new = keys.create(path, "laptop", NOW)
    clock.mono += 1
    assert verifier.verify(new.secret) is not None
    keys.revoke_key(path, "laptop", NOW)
    clock.mono += 2 * UNKNOWN_RECHECK_S
    assert verifier.verify(new.secret) is not None  # the ring knows it until the recheck
    clock.mono += 1
    assert verifier.verify(new.secret) is None
    clock.mono += 2 * UNKNOWN_RECHECK_S
    assert verifier.verify(new.secret) is None
