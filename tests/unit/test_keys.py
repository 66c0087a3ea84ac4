"""Issued inference keys: the pure decisions in tables, the store's file, and `keys` commands."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from supervisor import cli, console, paths
from supervisor.host import keys
from supervisor.host.keys import IssuedKey, KeyRefused

NOW = datetime(2025, 6, 1, 12, 0, tzinfo=UTC)


def entry(n: int, name: str | None = None, **changes: object) -> IssuedKey:
    fields: dict[str, object] = {
        "id": f"key_{n:012x}",
        "name": name or f"k{n}",
        "sha256": hashlib.sha256(f"secret {n}".encode()).hexdigest(),
        "created": NOW,
    }
    return IssuedKey(**(fields | changes))  # type: ignore[arg-type]


# --- expiry -------------------------------------------------------------------------------------

EXPIRIES = [
    ("12h", NOW + timedelta(hours=12)),
    ("30d", NOW + timedelta(days=30)),
    ("8w", NOW + timedelta(weeks=8)),
    (" 1d ", NOW + timedelta(days=1)),
    ("2025-12-31", datetime(2025, 12, 31, tzinfo=UTC)),
    ("2025-06-01T13:00:00Z", datetime(2025, 6, 1, 13, tzinfo=UTC)),
    ("2025-06-01T15:00+02:00", datetime(2025, 6, 1, 13, tzinfo=UTC)),
]


@pytest.mark.parametrize(("text", "expected"), EXPIRIES)
def test_an_expiry_is_a_duration_or_an_iso_date_or_time(text: str, expected: datetime) -> None:
    assert keys.parse_expiry(text, NOW) == expected


BAD_EXPIRIES = [
    ("yesterday", "is not an expiry"),
    ("0d", "is not an expiry"),
    ("-1d", "is not an expiry"),
    ("30m", "is not an expiry"),
    ("1.5d", "is not an expiry"),
    ("", "is not an expiry"),
    ("2025-06-01", "is not in the future"),  # today's start has passed
    ("2025-06-01T12:00:00Z", "is not in the future"),  # exactly now
    ("2024-01-01T00:00:00Z", "is not in the future"),
    ("2025-12-31T12:00:00", "has no UTC offset"),
]


@pytest.mark.parametrize(("text", "problem"), BAD_EXPIRIES)
def test_a_bad_expiry_says_what_is_wrong(text: str, problem: str) -> None:
    with pytest.raises(keys.BadExpiry, match=problem):
        keys.parse_expiry(text, NOW)


# --- names, add, revoke ---------------------------------------------------------------------------

NAMES = [
    ("laptop", True),
    ("ci.runner-2_b", True),
    ("a" * 64, True),
    ("a" * 65, False),
    ("", False),
    ("-leading", False),
    ("has space", False),
    ("semi;colon", False),
    ("ümlaut", False),
    ("key_0123456789ab", False),  # an id's shape: revoke ID|NAME must not be ambiguous
    ("key_0123456789abc", True),
]


@pytest.mark.parametrize(("name", "valid"), NAMES)
def test_key_names(name: str, valid: bool) -> None:
    if valid:
        assert keys.check_name(name) == name
    else:
        with pytest.raises(KeyRefused, match="is not a key name"):
            keys.check_name(name)


def test_the_thousand_and_first_unrevoked_key_is_refused() -> None:
    held = tuple(entry(n) for n in range(keys.MAX_KEYS))
    with pytest.raises(KeyRefused, match="already 1000 unrevoked keys, the most there may be"):
        keys.add(held, entry(5000))


def test_a_revoked_key_makes_room_for_another() -> None:
    held = (*(entry(n) for n in range(keys.MAX_KEYS - 1)), entry(999, revoked=NOW))
    assert len(keys.add(held, entry(5000))) == keys.MAX_KEYS + 1


ADD_CLASHES = [
    ("same name", entry(2, name="k1"), "a key named 'k1' exists \\(key_000000000001\\)"),
    ("same id", entry(1, name="other", sha256="0" * 64), "id key_000000000001 is in use"),
]


@pytest.mark.parametrize(
    ("new", "problem"), [c[1:] for c in ADD_CLASHES], ids=[c[0] for c in ADD_CLASHES]
)
def test_a_clash_is_refused(new: IssuedKey, problem: str) -> None:
    with pytest.raises(KeyRefused, match=problem):
        keys.add((entry(1),), new)


def test_a_revoked_name_can_be_given_again() -> None:
    assert keys.add((entry(1, revoked=NOW),), entry(2, name="k1"))[-1].name == "k1"


REVOKES = [
    ("by id", "key_000000000002", "key_000000000002"),
    ("by name", "k2", "key_000000000002"),
    ("an id wins over a name", "key_000000000003", "key_000000000003"),
]


@pytest.mark.parametrize(("ref", "revoked"), [r[1:] for r in REVOKES], ids=[r[0] for r in REVOKES])
def test_revoke_finds_a_key_by_id_or_name(ref: str, revoked: str) -> None:
    before = (entry(1), entry(2), entry(3))
    after, done = keys.revoke(before, ref, NOW)
    assert done.id == revoked and done.revoked == NOW
    assert [k.id for k in after if k.revoked is not None] == [revoked]
    assert [k.id for k in after] == [k.id for k in before]


def test_revoking_a_revoked_key_keeps_its_first_time() -> None:
    earlier = NOW - timedelta(days=1)
    after, done = keys.revoke((entry(1, revoked=earlier),), "key_000000000001", NOW)
    assert done.revoked == earlier and after == (entry(1, revoked=earlier),)


@pytest.mark.parametrize("ref", ["nobody", "key_00000000000f", "k1"])
def test_revoking_an_unknown_key_is_refused(ref: str) -> None:
    # k1 is known only as a revoked key's name: revoke it by its id
    with pytest.raises(KeyRefused, match="no key has the id or \\(unrevoked\\) name"):
        keys.revoke((entry(1, revoked=NOW),), ref, NOW)


STATES = [
    ("active", {}, "active"),
    ("expires later", {"expires": NOW + timedelta(seconds=1)}, "active"),
    ("expires now", {"expires": NOW}, "expired"),
    ("expired", {"expires": NOW - timedelta(days=1)}, "expired"),
    ("revoked", {"revoked": NOW}, "revoked"),
    ("revoked and expired", {"revoked": NOW, "expires": NOW - timedelta(days=1)}, "revoked"),
]


@pytest.mark.parametrize(("changes", "state"), [s[1:] for s in STATES], ids=[s[0] for s in STATES])
def test_a_key_state(changes: dict[str, object], state: str) -> None:
    assert entry(1, **changes).state(NOW) == state
    assert keys.describe([entry(1, **changes)], NOW)[0]["state"] == state


# --- the file -----------------------------------------------------------------------------------


def test_create_keeps_only_the_digest_in_a_0600_file_in_a_0700_directory(tmp_path: Path) -> None:
    path = paths.keys_file(tmp_path / "data")
    assert path == tmp_path / "data" / "inference-keys" / "keys.json"
    new = keys.create(path, "laptop", NOW, NOW + timedelta(days=30))
    assert new.secret.startswith("lucia_inf_") and len(new.secret) == len("lucia_inf_") + 43
    text = path.read_text()
    assert new.secret not in text
    assert new.secret.removeprefix("lucia_inf_") not in text
    assert json.loads(text)["keys"][0]["sha256"] == hashlib.sha256(new.secret.encode()).hexdigest()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert keys.load(path) == (new.entry,)


def test_an_existing_wider_directory_is_made_0700(tmp_path: Path) -> None:
    path = paths.keys_file(tmp_path)
    path.parent.mkdir(mode=0o755)
    os.chmod(path.parent, 0o755)
    keys.create(path, "laptop", NOW)
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700


def test_writes_leave_no_temp_files(tmp_path: Path) -> None:
    path = paths.keys_file(tmp_path)
    for n in range(5):
        keys.create(path, f"k{n}", NOW)
    keys.revoke_key(path, "k3", NOW)
    keys.revoke_key(path, "k4", NOW)
    assert sorted(p.name for p in path.parent.iterdir()) == [".keys.lock", "keys.json"]
    assert [k.state(NOW) for k in keys.load(path)] == ["active"] * 3 + ["revoked"] * 2


def test_a_failed_create_leaves_the_file_as_it_was(tmp_path: Path) -> None:
    path = paths.keys_file(tmp_path)
    keys.create(path, "laptop", NOW)
    before = path.read_bytes()
    with pytest.raises(KeyRefused):
        keys.create(path, "laptop", NOW)
    assert path.read_bytes() == before


def test_no_file_is_no_keys(tmp_path: Path) -> None:
    assert keys.load(paths.keys_file(tmp_path)) == ()


INVALID = [
    ("not JSON", "{", "Invalid JSON"),
    ("unknown field", '{"schemaVersion": 1, "keys": [], "x": 1}', "x: Extra inputs"),
    ("other version", '{"schemaVersion": 2, "keys": []}', "schemaVersion"),
    (
        "a key in clear",
        '{"schemaVersion": 1, "keys": [{"id": "key_000000000001", "name": "a", '
        '"sha256": "lucia_inf_x", "created": "2025-06-01T00:00:00Z"}]}',
        "keys.0.sha256",
    ),
    (
        "naive time",
        '{"schemaVersion": 1, "keys": [{"id": "key_000000000001", "name": "a", '
        f'"sha256": "{"0" * 64}", "created": "2025-06-01T00:00:00"}}]}}',
        "keys.0.created",
    ),
]


@pytest.mark.parametrize(("text", "where"), [i[1:] for i in INVALID], ids=[i[0] for i in INVALID])
def test_an_invalid_file_is_named_with_where_it_broke(
    tmp_path: Path, text: str, where: str
) -> None:
    path = tmp_path / "keys.json"
    path.write_text(text)
    with pytest.raises(keys.KeysFileInvalid, match=where) as caught:
        keys.load(path)
    assert str(path) in str(caught.value)


def test_a_symlinked_file_is_refused(tmp_path: Path) -> None:
    keys.create(tmp_path / "real.json", "a", NOW)
    (tmp_path / "keys.json").symlink_to(tmp_path / "real.json")
    with pytest.raises(keys.KeysFileInvalid, match="is a symlink"):
        keys.load(tmp_path / "keys.json")


# --- the commands -------------------------------------------------------------------------------


def test_the_key_is_printed_once_and_never_listed_or_logged(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    data = ["--data-dir", str(tmp_path)]
    assert cli.main(["keys", "create", "laptop", "--expires", "30d", *data]) == console.EXIT_OK
    created = capsys.readouterr()
    secret = created.out.strip()
    assert secret.startswith("lucia_inf_") and created.out == secret + "\n"
    assert secret not in created.err and "laptop" in created.err
    assert cli.main(["keys", "list", *data]) == console.EXIT_OK
    assert cli.main(["keys", "list", "--json", *data]) == console.EXIT_OK
    assert cli.main(["keys", "revoke", "laptop", *data]) == console.EXIT_OK
    assert cli.main(["keys", "list", *data]) == console.EXIT_OK
    later = capsys.readouterr()
    digest = hashlib.sha256(secret.encode()).hexdigest()
    for text in (later.out, later.err, caplog.text, paths.keys_file(tmp_path).read_text()):
        assert secret not in text and secret[len("lucia_inf_") :] not in text
    assert digest not in later.out + later.err + caplog.text
    listed = later.out.splitlines()
    header = ["ID", "NAME", "CREATED", "EXPIRES", "STATE", "BUDGET", "EXEMPT"]
    assert listed[0].split() == header
    assert listed[1].split()[1:2] + listed[1].split()[-3:] == ["laptop", "active", "default", "no"]
    assert listed[-1].split()[-3] == "revoked"


COMMAND_CODES = [
    ("a name in use", [["keys", "create", "a"]], ["keys", "create", "a"], 1, "a key named 'a'"),
    ("a past expiry", [], ["keys", "create", "a", "--expires", "2000-01-01"], 1, "not in the"),
    ("a bad name", [], ["keys", "create", "a b"], 1, "is not a key name"),
    ("an unknown key", [], ["keys", "revoke", "b"], 1, "no key has the id"),
    ("a budget of none", [], ["keys", "create", "a", "--budget", "0"], 1, "1 to"),
    (
        "a budget of words",
        [["keys", "create", "a"]],
        ["keys", "budget", "a", "lots"],
        1,
        "not a whole number",
    ),
    ("a budget for nobody", [], ["keys", "budget", "b", "5"], 1, "no key has the id"),
]


@pytest.mark.parametrize(
    ("before", "argv", "code", "message"),
    [c[1:] for c in COMMAND_CODES],
    ids=[c[0] for c in COMMAND_CODES],
)
def test_command_refusals(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    before: list[list[str]],
    argv: list[str],
    code: int,
    message: str,
) -> None:
    for earlier in before:
        assert cli.main([*earlier, "--data-dir", str(tmp_path)]) == console.EXIT_OK
    capsys.readouterr()
    assert cli.main([*argv, "--data-dir", str(tmp_path)]) == code
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("command", [["list"], ["create", "a"], ["revoke", "a"]])
def test_an_invalid_keys_file_is_a_configuration_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: list[str]
) -> None:
    path = paths.keys_file(tmp_path)
    path.parent.mkdir()
    path.write_text("{")
    assert cli.main(["keys", *command, "--data-dir", str(tmp_path)]) == console.EXIT_CONFIG
    assert str(path) in capsys.readouterr().err
    assert path.read_text() == "{"


def test_a_keys_own_budget_is_kept_changed_and_given_back_to_the_default(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = ["--data-dir", str(tmp_path)]
    assert cli.main(["keys", "create", "ci", "--budget", "5000", *data]) == console.EXIT_OK
    (entry,) = keys.load(paths.keys_file(tmp_path))
    assert entry.budget == 5000
    assert cli.main(["keys", "budget", "ci", "200", *data]) == console.EXIT_OK
    assert keys.load(paths.keys_file(tmp_path))[0].budget == 200
    assert cli.main(["keys", "list", "--json", *data]) == console.EXIT_OK
    assert '"budget": "200"' in capsys.readouterr().out
    assert cli.main(["keys", "budget", entry.id, "default", *data]) == console.EXIT_OK
    assert keys.load(paths.keys_file(tmp_path))[0].budget is None
    # a keys.json from before budgets has none: every key the default
    text = paths.keys_file(tmp_path).read_text().replace('"budget": null', '"x": 1')
    assert keys.parse(text.replace(',\n      "x": 1', ""), Path("k"))[0].budget is None


# --- exempt from the daily budget ---------------------------------------------------------------

EXEMPTS = [
    ("on by id", (), "key_000000000002", True, "key_000000000002"),
    ("on by name", (), "k2", True, "key_000000000002"),
    ("off", ({"exempt": True},), "k1", False, "key_000000000001"),
    ("on again changes nothing", ({"exempt": True},), "k1", True, "key_000000000001"),
]


@pytest.mark.parametrize(
    ("first", "ref", "on", "changed"), [e[1:] for e in EXEMPTS], ids=[e[0] for e in EXEMPTS]
)
def test_a_key_is_made_exempt_or_not_by_id_or_name(
    first: tuple[dict[str, object], ...], ref: str, on: bool, changed: str
) -> None:
    before = (entry(1, **(first[0] if first else {})), entry(2))
    after, done = keys.mark_exempt(before, ref, on)
    assert done.id == changed and done.exempt is on
    assert {k.id: k.exempt for k in after} == {
        k.id: (on if k.id == changed else k.exempt) for k in before
    }
    assert [k.budget for k in after] == [k.budget for k in before], "its own budget is kept"


@pytest.mark.parametrize(
    ("keys_before", "ref", "problem"),
    [
        ((), "nobody", "no key has the id or \\(unrevoked\\) name 'nobody'"),
        ((entry(1, revoked=NOW),), "key_000000000001", "key_000000000001 \\(k1\\) was revoked at"),
        ((entry(1, revoked=NOW),), "k1", "no key has the id"),
    ],
)
def test_exempting_an_unknown_or_revoked_key_is_refused(
    keys_before: tuple[IssuedKey, ...], ref: str, problem: str
) -> None:
    with pytest.raises(KeyRefused, match=problem):
        keys.mark_exempt(keys_before, ref, True)


def test_a_key_is_created_exempt_listed_so_and_held_to_its_budget_again(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = ["--data-dir", str(tmp_path)]
    argv = ["keys", "create", "radar", "--exempt", "--budget", "500", *data]
    assert cli.main(argv) == console.EXIT_OK
    assert "exempt from the daily budget" in capsys.readouterr().err
    assert cli.main(["keys", "create", "laptop", *data]) == console.EXIT_OK
    radar, laptop = keys.load(paths.keys_file(tmp_path))
    assert (radar.exempt, radar.budget, laptop.exempt) == (True, 500, False)
    capsys.readouterr()
    assert cli.main(["keys", "list", *data]) == console.EXIT_OK
    listed = {line.split()[1]: line.split()[-2:] for line in capsys.readouterr().out.splitlines()}
    assert listed["radar"] == ["500", "yes"] and listed["laptop"] == ["default", "no"]
    assert cli.main(["keys", "list", "--json", *data]) == console.EXIT_OK
    shown = {row["name"]: row["exempt"] for row in json.loads(capsys.readouterr().out)}
    assert shown == {"radar": True, "laptop": False}
    assert cli.main(["keys", "exempt", "radar", "off", *data]) == console.EXIT_OK
    assert "held to its daily budget again" in capsys.readouterr().out
    assert keys.load(paths.keys_file(tmp_path))[0].exempt is False
    assert cli.main(["keys", "exempt", laptop.id, "on", *data]) == console.EXIT_OK
    assert keys.load(paths.keys_file(tmp_path))[1].exempt is True
    mode = stat.S_IMODE(os.stat(paths.keys_file(tmp_path)).st_mode)
    assert mode == keys.FILE_MODE and not list(paths.keys_file(tmp_path).parent.glob("*.tmp*"))


@pytest.mark.parametrize(
    ("before", "argv", "code", "message"),
    [
        ([], ["keys", "exempt", "nobody", "on"], console.EXIT_FAILED, "no key has the id"),
        (
            [["keys", "create", "a"], ["keys", "revoke", "a"]],
            ["keys", "exempt", "REVOKED", "on"],
            console.EXIT_FAILED,
            "was revoked at",
        ),
        ([["keys", "create", "a"]], ["keys", "exempt", "a", "yes"], 2, "invalid choice: 'yes'"),
        ([["keys", "create", "a"]], ["keys", "exempt", "a"], 2, "the following arguments"),
    ],
)
def test_exempt_refusals(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    before: list[list[str]],
    argv: list[str],
    code: int,
    message: str,
) -> None:
    for earlier in before:
        assert cli.main([*earlier, "--data-dir", str(tmp_path)]) == console.EXIT_OK
    if "REVOKED" in argv:
        argv = [keys.load(paths.keys_file(tmp_path))[0].id if a == "REVOKED" else a for a in argv]
    file = paths.keys_file(tmp_path)
    was = file.read_bytes() if file.exists() else None
    capsys.readouterr()
    try:
        got = cli.main([*argv, "--data-dir", str(tmp_path)])
    except SystemExit as usage:  # argparse's own refusal of the arguments
        got = int(usage.code or 0)
    assert got == code
    assert message in capsys.readouterr().err
    assert (file.read_bytes() if file.exists() else None) == was, "nothing written"


def test_an_invalid_keys_file_refuses_exempt_as_a_configuration_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = paths.keys_file(tmp_path)
    path.parent.mkdir()
    path.write_text("{")
    argv = ["keys", "exempt", "a", "on", "--data-dir", str(tmp_path)]
    assert cli.main(argv) == console.EXIT_CONFIG
    assert str(path) in capsys.readouterr().err and path.read_text() == "{"


def test_a_keys_file_from_before_exemptions_reads_every_key_as_budgeted(tmp_path: Path) -> None:
    keys.create(tmp_path / "keys.json", "old", NOW)
    text = (tmp_path / "keys.json").read_text()
    assert '"exempt": false' in text
    older = text.replace(',\n      "exempt": false', "")
    assert "exempt" not in older
    assert keys.parse(older, Path("k"))[0].exempt is False
