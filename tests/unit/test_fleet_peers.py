"""The peers file: its lines, its rules, its mode, its rereading; and who a peer request is."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import structlog

from supervisor import redaction
from supervisor.host.fleet.door import Denial, PeerCaller, PeerClaim, judge, shown
from supervisor.host.fleet.peers import Peers, PeersRefused, PeerTable, load, parse, taken_by
from tests.host.gateway_world import INFERENCE_KEY, KEYS, OWNER_KEY

A = "a" * 31 + "A"  # 32: the shortest a key may be
B = "b" * 40
C = "c-" * 20
GOOD = f"a {A}\nb {B}\n"


def table(text: str = GOOD, own: str = "a") -> PeerTable:
    return parse(text, "peers.keys", own)


@pytest.mark.parametrize(
    ("text", "machines"),
    [
        (GOOD, ("a", "b")),
        (f"# the fleet\n\n  a   {A}  \n\tb\t{B}\n# c {C}\n", ("a", "b")),
        (f"a {A}\r\nb {B}\r\n", ("a", "b")),
        (f"a {A}", ("a",)),  # alone: a fleet of one
        (f"a {A}\nb-2 {B}\nc9 {C}\n", ("a", "b-2", "c9")),
    ],
)
def test_a_good_file(text: str, machines: tuple[str, ...]) -> None:
    found = table(text)
    assert found.machines == machines and found.own == "a" and found.own_key == A
    assert A not in repr(found)


@pytest.mark.parametrize(
    ("text", "own", "says"),
    [
        (f"a {A} more\n", "a", "line 1: a line is `NAME KEY`"),
        (f"a {A}\n{B}\n", "a", "line 2: a line is `NAME KEY`"),
        (f"A {A}\n", "A", "line 1: the first field is no machine name"),
        (f"-a {A}\n", "-a", "line 1: the first field is no machine name"),
        (f"a_b {A}\n", "a_b", "line 1: the first field is no machine name"),
        ("a " + "k" * 31 + "\n", "a", "line 1: machine a's key has 31 characters"),
        ("a " + "k" * 1025 + "\n", "a", "machine a's key has 1025 characters"),
        ("a " + "é" * 32 + "\n", "a", "machine a's key is not printable ASCII"),
        (f"a {A}\na {B}\n", "a", "line 2: machine a has a line already (line 1)"),
        (f"a {A}\nb {A}\n", "a", "line 2: machine b's key is machine a's too (line 1)"),
        (f"b {B}\n", "a", "this machine, a ([fleet] machine), has no line"),
        ("", "a", "this machine, a ([fleet] machine), has no line"),
        ("# nothing but a comment\n", "a", "has no line"),
    ],
)
def test_a_bad_file_names_the_line_and_the_rule_never_a_key(text: str, own: str, says: str) -> None:
    with pytest.raises(PeersRefused) as refused:
        table(text, own)
    assert says in str(refused.value)
    assert str(refused.value).startswith("peers.keys")
    for key in (A, B, "k" * 31, "é" * 32):
        assert key not in str(refused.value)


@pytest.mark.parametrize(
    ("key", "what"),
    [
        (OWNER_KEY, "the owner key"),
        (INFERENCE_KEY, "the inference key"),
    ],
)
def test_a_key_that_is_the_gateways_own_is_refused(key: str, what: str) -> None:
    with pytest.raises(PeersRefused, match=f"line 2: machine b's key is {what}") as refused:
        parse(f"a {A}\nb {key}\n", "peers.keys", "a", taken_by(KEYS))
    assert key not in str(refused.value)
    assert parse(GOOD, "peers.keys", "a", taken_by(KEYS)).machines == ("a", "b")


@pytest.mark.parametrize(
    ("presented", "which"),
    [
        (A, "a"),
        (B, "b"),
        (C, None),
        (A[:-1], None),
        (A + "x", None),
        ("", None),
        ("x" * 5000, None),
    ],
)
def test_which_machine_a_key_is(presented: str, which: str | None) -> None:
    assert table(f"a {A}\nb {B}\n").which(presented) == which


def write(path: Path, text: str, mode: int = 0o600) -> Path:
    path.write_text(text)
    path.chmod(mode)
    return path


@pytest.mark.parametrize("mode", [0o600, 0o400])
def test_an_owner_only_file_is_read(tmp_path: Path, mode: int) -> None:
    found, _ = load(write(tmp_path / "peers.keys", GOOD, mode), "a")
    assert found.machines == ("a", "b")


@pytest.mark.parametrize("mode", [0o640, 0o644, 0o604, 0o660, 0o666, 0o700])
def test_a_file_others_may_read_is_refused_naming_the_path_and_mode(
    tmp_path: Path, mode: int
) -> None:
    path = write(tmp_path / "peers.keys", GOOD, mode)
    with pytest.raises(PeersRefused) as refused:
        load(path, "a")
    assert str(path) in str(refused.value) and f"mode {mode:04o}" in str(refused.value)
    assert A not in str(refused.value)


def test_a_missing_file_a_symlink_and_a_directory_are_refused(tmp_path: Path) -> None:
    with pytest.raises(PeersRefused, match="no such file"):
        load(tmp_path / "none", "a")
    real = write(tmp_path / "real", GOOD)
    (tmp_path / "link").symlink_to(real)
    with pytest.raises(PeersRefused, match="symlink"):
        load(tmp_path / "link", "a")
    (tmp_path / "dir").mkdir(mode=0o700)
    with pytest.raises(PeersRefused, match="not a regular file"):
        load(tmp_path / "dir", "a")


@pytest.mark.skipif(os.geteuid() != 0, reason="only root can give a file to another user")
def test_a_file_of_another_user_is_refused(tmp_path: Path) -> None:
    path = write(tmp_path / "peers.keys", GOOD)
    os.chown(path, 65534, 65534)
    with pytest.raises(PeersRefused, match="owned by uid 65534"):
        load(path, "a")


def test_the_keys_read_are_masked_in_the_logs(tmp_path: Path) -> None:
    load(write(tmp_path / "peers.keys", f"# x words\na {A}\nb {B}\n"), "a")
    assert redaction.redact(f"{A} {B} words") == "*** *** words"


def test_the_file_is_read_again_when_it_changes_and_a_bad_one_refuses_every_peer(
    tmp_path: Path,
) -> None:
    path = write(tmp_path / "peers.keys", f"a {A}\nb {B}\nc {C}\n")
    peers = Peers.open(path, "a")
    assert peers.which(C) == "c"
    write(path, GOOD)  # c's line removed: revoked at once
    assert peers.which(C) is None and peers.which(B) == "b"
    with structlog.testing.capture_logs() as logs:
        path.chmod(0o644)
        assert peers.which(B) is None and peers.current() is None
        assert peers.which(A) is None  # said once
        assert "mode 0644" in str(peers.problem)
        path.chmod(0o600)
        assert peers.which(B) == "b" and peers.problem is None
        path.unlink()
        assert peers.which(B) is None and "no such file" in str(peers.problem)
    events = [(e["event"], e.get("reason", e.get("machines"))) for e in logs]
    assert events[0][0] == "peers file refused: every peer is refused"
    assert events[1] == ("peers file read", ["a", "b"])
    assert events[2][0] == "peers file refused: every peer is refused" and len(events) == 3
    assert all(A not in str(e) and B not in str(e) for e in logs)


def test_a_file_that_does_not_change_is_not_read_again(tmp_path: Path) -> None:
    path = write(tmp_path / "peers.keys", GOOD)
    peers = Peers.open(path, "a")
    first = peers.current()
    assert peers.current() is first


def claim(**changes: object) -> PeerClaim:
    fields: dict[str, object] = {
        "key": A,
        "machine": "a",
        "key_id": "key_0123456789ab",
        "exempt": None,
        "budget": None,
    }
    fields.update(changes)
    return PeerClaim(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("changes", "verdict"),
    [
        ({}, PeerCaller("key_0123456789ab", False, None, "a")),
        ({"key": B, "machine": "b"}, PeerCaller("key_0123456789ab", False, None, "b")),
        ({"key_id": "owner", "exempt": "1"}, PeerCaller("owner", True, None, "a")),
        ({"key_id": "inference", "exempt": "0"}, PeerCaller("inference", False, None, "a")),
        ({"budget": "5000"}, PeerCaller("key_0123456789ab", False, 5000, "a")),
        ({"key": None}, Denial("no peer key (Authorization: Bearer)")),
        ({"machine": None}, Denial("no X-Lucia-Machine", counted=True)),
        (
            {"machine": "z"},
            Denial("a machine the peers file does not name (unknown, or revoked)", True),
        ),
        ({"key": B}, Denial("not this machine's peer key", counted=True)),
        ({"key": C}, Denial("not this machine's peer key", counted=True)),
        ({"key": OWNER_KEY}, Denial("not this machine's peer key", counted=True)),
        ({"certified": False}, Denial("no client certificate (mutual TLS: [fleet] ca_file)")),
        (
            {"key_id": None},
            Denial("X-Lucia-Key-Id is not a key id (owner, inference or key_ and 12 hex digits)"),
        ),
        (
            {"key_id": "probe"},
            Denial("X-Lucia-Key-Id is not a key id (owner, inference or key_ and 12 hex digits)"),
        ),
        (
            {"key_id": "key_0123"},
            Denial("X-Lucia-Key-Id is not a key id (owner, inference or key_ and 12 hex digits)"),
        ),
        (
            {"key_id": A},
            Denial("X-Lucia-Key-Id is not a key id (owner, inference or key_ and 12 hex digits)"),
        ),
        ({"exempt": "yes"}, Denial("X-Lucia-Key-Exempt is 1 or 0")),
        ({"budget": "-1"}, Denial("X-Lucia-Key-Budget is a whole number of tokens")),
        ({"budget": "\uff11\uff12"}, Denial("X-Lucia-Key-Budget is a whole number of tokens")),
        ({"budget": "0"}, Denial("X-Lucia-Key-Budget is 1 to 1000000000000000 tokens")),
    ],
)
def test_who_a_peer_request_is(changes: dict[str, object], verdict: object) -> None:
    assert judge(table(), None, claim(**changes)) == verdict


def test_a_refused_peers_file_refuses_every_peer_request() -> None:
    assert judge(None, "mode 0644", claim()) == Denial("the peers file is refused: mode 0644")


@pytest.mark.parametrize(
    ("header", "logged"),
    [("b", "b"), (None, "(none)"), ("B\nx", "(not a machine name)"), (A, "(not a machine name)")],
)
def test_a_claimed_machine_is_logged_only_as_a_name(header: str | None, logged: str) -> None:
    assert shown(header) == logged
