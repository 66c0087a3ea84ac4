"""The peers file: each machine's peer key, how the gateways of a fleet know each other.

`[fleet] peers_file` (default ~/.config/lucia/peers.keys) is the same file on every machine: one
line per machine, `NAME KEY` (blank lines and lines that begin with `#` are skipped). A name is a
machine's `[fleet] machine`; a key is at least MIN_KEY printable ASCII characters, every key
differs from every other and from the gateway's own owner and inference keys, and this
machine's own name has a line (its key is what it presents to the others). The file is owner-only
(mode 0600 or 0400, owned by the gateway's user): anything else is refused, naming the path and
its mode. An error names the file, the line and the rule, never a key, nor a field that could be
one.

`parse` is pure. `load` reads the file under the permission rule. `Peers` holds the current
table and stats the file on every use (one stat: cheap), reading it again when its device,
inode, size, modification time, mode or owner changed: a line removed revokes that machine at
once. A file that becomes unreadable or invalid while the gateway runs refuses every peer
(fails closed) until it is fixed, said once in the journal. A presented key is hashed once and
compared with every entry's digest by `hmac.compare_digest`, all of them, whichever matches.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import os
import re
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from supervisor import logs, redaction
from supervisor.host.keys import KeyConfigError
from supervisor.host.web.auth import Authenticator

MIN_KEY: Final = 32
MAX_KEY: Final = 1024
MAX_FILE: Final = 1024 * 1024
NAME: Final = re.compile(r"[a-z0-9][a-z0-9-]{0,62}")  # as [fleet] machine (sections.py)
LINE_FORM: Final = "a line is `NAME KEY`: a machine's name, spaces, its peer key"
log = logs.get("fleet")

# what a key is besides, if anything ("the owner key"): the gateway's own keys are no peer's
Taken = Callable[[str], str | None]


def taken_by(auth: Authenticator) -> Taken:
    """What a key is to the gateway's own key check: the owner key, the inference key, an
    issued key, or nothing (None)."""

    def taken(key: str) -> str | None:
        caller = auth.verify(key)
        if caller is None:
            return None
        if caller.key_id in ("owner", "inference"):
            return f"the {caller.key_id} key"
        return f"the issued key {caller.key_id}"

    return taken


class PeersRefused(KeyConfigError):
    """A peers file that breaks a rule; str() names the file and the rule, never a key. At
    start the gateway refuses to start (exit 78)."""


def digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()


@dataclass(frozen=True)
class PeerTable:
    """One reading of the file: each machine's key digest, and this machine's own key."""

    own: str
    digests: tuple[tuple[str, bytes], ...]
    own_key: str = field(repr=False)

    @property
    def machines(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.digests)

    def which(self, presented: str) -> str | None:
        """The machine whose key this is, or None. Every entry is compared, whichever
        matches: the time taken says nothing of which, or whether."""
        if len(presented) > MAX_KEY:
            return None
        found = digest(presented)
        matched: str | None = None
        for name, known in self.digests:
            if hmac.compare_digest(found, known):
                matched = name
        return matched


def _key_rule(key: str) -> str | None:
    if not MIN_KEY <= len(key) <= MAX_KEY:
        return f"has {len(key)} characters: a peer key has {MIN_KEY} to {MAX_KEY}"
    if not all(33 <= ord(char) <= 126 for char in key):
        return "is not printable ASCII: a peer key travels in an HTTP header"
    return None


def parse(text: str, origin: str, own: str, taken: Taken | None = None) -> PeerTable:
    """Pure: the table of a peers file's text; PeersRefused naming `origin`, the line and the
    rule. `own` is this machine's name; `taken` says what else a key is, if anything."""
    names: dict[str, int] = {}
    keys: dict[bytes, tuple[str, int]] = {}
    entries: list[tuple[str, bytes]] = []
    own_key: str | None = None
    for number, line in enumerate(text.splitlines(), start=1):
        fields = line.split()
        if not fields or fields[0].startswith("#"):
            continue
        where = f"{origin}: line {number}"
        if len(fields) != 2:
            raise PeersRefused(f"{where}: {LINE_FORM} ({len(fields)} fields here)")
        name, key = fields
        if not NAME.fullmatch(name):
            raise PeersRefused(
                f"{where}: the first field is no machine name (a-z, 0-9 and -, at most 63, "
                "not beginning with -, as [fleet] machine)"
            )
        wrong = _key_rule(key)
        if wrong is not None:
            raise PeersRefused(f"{where}: machine {name}'s key {wrong}")
        if name in names:
            raise PeersRefused(f"{where}: machine {name} has a line already (line {names[name]})")
        sealed = digest(key)
        if sealed in keys:
            other, at = keys[sealed]
            raise PeersRefused(
                f"{where}: machine {name}'s key is machine {other}'s too (line {at}): every "
                "peer key differs"
            )
        what = taken(key) if taken is not None else None
        if what is not None:
            raise PeersRefused(
                f"{where}: machine {name}'s key is {what}: a peer key is none of the gateway's "
                "own keys"
            )
        names[name] = number
        keys[sealed] = (name, number)
        entries.append((name, sealed))
        if name == own:
            own_key = key
    if own_key is None:
        raise PeersRefused(
            f"{origin}: this machine, {own} ([fleet] machine), has no line: the file names "
            "every machine, this one too"
        )
    return PeerTable(own, tuple(entries), own_key)


def _keys_of(text: str) -> list[str]:
    """The keys of a file `parse` took: the second field of each line that is not skipped."""
    lines = (line.split() for line in text.splitlines())
    return [fields[1] for fields in lines if len(fields) == 2 and not fields[0].startswith("#")]


Stamp = tuple[int, int, int, int, int, int]


def _stamp_of(info: os.stat_result) -> Stamp:
    return (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_mode, info.st_uid)


def _read(path: Path) -> tuple[str, Stamp]:
    """The file's text under the permission rule, and its stamp; PeersRefused."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ENOENT:
            raise PeersRefused(
                f"{path}: no such file: [fleet] peers_file holds every machine's peer key "
                "(`NAME KEY` a line, mode 0600)"
            ) from None
        if exc.errno == errno.ELOOP:
            raise PeersRefused(f"{path}: is a symlink; name the file itself") from None
        raise PeersRefused(f"{path}: cannot be opened: {exc.strerror}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise PeersRefused(f"{path}: not a regular file")
        mode = stat.S_IMODE(info.st_mode)
        if mode & ~0o600:
            raise PeersRefused(
                f"{path}: has mode {mode:04o}; a peers file is owner-only: chmod 600 {path}"
            )
        if info.st_uid != os.geteuid():
            raise PeersRefused(
                f"{path}: is owned by uid {info.st_uid}, not by this gateway's user "
                f"(uid {os.geteuid()})"
            )
        if info.st_size > MAX_FILE:
            raise PeersRefused(f"{path}: is {info.st_size} bytes; the limit is {MAX_FILE}")
        data = os.read(fd, MAX_FILE + 1)
    finally:
        os.close(fd)
    try:
        return data.decode("utf-8"), _stamp_of(info)
    except UnicodeDecodeError as exc:
        raise PeersRefused(f"{path}: is not UTF-8 (byte {exc.start})") from None


def load(path: Path, own: str, taken: Taken | None = None) -> tuple[PeerTable, Stamp]:
    """The table from the file, and the stamp it had; PeersRefused. Its keys are masked in
    whatever this process logs from now on."""
    text, stamp = _read(path)
    table = parse(text, str(path), own, taken)
    redaction.register(_keys_of(text))
    return table, stamp


class Peers:
    """The current table of the peers file, read again when the file changes."""

    def __init__(
        self, path: Path, own: str, table: PeerTable, stamp: Stamp, taken: Taken | None = None
    ) -> None:
        self.path = path
        self.own = own
        self._table: PeerTable | None = table
        self._stamp: Stamp | None = stamp
        self._taken = taken
        self.problem: str | None = None  # why every peer is refused now, or None

    @classmethod
    def open(cls, path: Path, own: str, taken: Taken | None = None) -> Peers:
        """Read the file at start; PeersRefused (a KeyConfigError: exit 78)."""
        table, stamp = load(path, own, taken)
        return cls(path, own, table, stamp, taken)

    def current(self) -> PeerTable | None:
        """The table as the file is now; None while it is refused (`problem` says why)."""
        try:
            stamp: Stamp | None = _stamp_of(os.stat(self.path, follow_symlinks=False))
        except OSError:
            stamp = None
        if stamp != self._stamp:
            self._stamp = stamp
            self._reload()
        return self._table

    def _reload(self) -> None:
        try:
            table, self._stamp = load(self.path, self.own, self._taken)
        except PeersRefused as exc:
            if self.problem is None:
                log.error("peers file refused: every peer is refused", reason=str(exc))
            self._table, self.problem = None, str(exc)
            return
        if self.problem is not None or self._table is None or self._table != table:
            log.info("peers file read", path=str(self.path), machines=list(table.machines))
        self._table, self.problem = table, None

    def which(self, presented: str) -> str | None:
        """The machine whose peer key this is now, or None."""
        table = self.current()
        return None if table is None else table.which(presented)
