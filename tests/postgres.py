"""A PostgreSQL cluster of the tests' own: Debian's `postgresql` binaries, `initdb` into a temp
directory, listening on 127.0.0.1 on a free port, started and removed by the tests.

The fleet's tests also have it listen on the switch address of their machines (tests/machines.py)
and trust the machines' subnet: `cluster(listen=(fleet.switch,), clients=(fleet.subnet,))`, and
`dsn(name, host=fleet.switch)` is what a gateway inside a machine connects to.

PostgreSQL refuses to run as root: as root the cluster belongs to, and runs as, Debian's
`postgres` user. Each test that wants a clean record asks for a database of its own
(`Cluster.database`), so one cluster serves a whole module; a test may stop and start it.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.standin import free_port

SUPERUSER = "lucia"  # the cluster's superuser, reached over 127.0.0.1 with trust


def bindir() -> Path | None:
    """The newest installed server's bin directory (Debian: /usr/lib/postgresql/<ver>/bin)."""
    found = [Path(p).parent for p in glob.glob("/usr/lib/postgresql/*/bin/initdb")]
    found.sort(key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else 0)
    return found[-1] if found else None


@dataclass
class Cluster:
    bin: Path
    root: Path
    port: int
    user: str | None  # the system user it runs as (root cannot), or None: this one
    frozen: list[int] = field(default_factory=list)
    listen: tuple[str, ...] = ()  # addresses it listens on besides 127.0.0.1
    clients: tuple[str, ...] = ()  # networks trusted besides loopback (pg_hba.conf)

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def log(self) -> Path:
        return self.root / "server.log"

    def _run(self, tool: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        command = [str(self.bin / tool), *args]
        if self.user is not None:
            command = ["runuser", "-u", self.user, "--", *command]
        return subprocess.run(
            command, capture_output=True, text=True, timeout=120, check=check, cwd=self.root
        )

    def initdb(self) -> None:
        self._run(
            "initdb",
            "-D",
            str(self.data),
            "-U",
            SUPERUSER,
            "--auth=trust",
            "-E",
            "UTF8",
            "--no-locale",
            "--no-sync",
        )
        if self.clients:
            with (self.data / "pg_hba.conf").open("a") as hba:
                hba.writelines(f"host all all {network} trust\n" for network in self.clients)

    def start(self) -> None:
        logged = self.log.stat().st_size if self.log.exists() else 0
        addresses = ",".join(("127.0.0.1", *self.listen))
        options = (
            f"-p {self.port} -c listen_addresses={addresses} -c unix_socket_directories={self.data}"
        )
        done = self._run(
            "pg_ctl",
            "-D",
            str(self.data),
            "-l",
            str(self.log),
            "-w",
            "-t",
            "60",
            "-o",
            options,
            "start",
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(f"pg_ctl start: {done.stderr or done.stdout}: {self._tail()}")
        with self.log.open("rb") as log:  # it starts on the addresses it could bind: not enough
            log.seek(logged)
            said = log.read().decode(errors="replace")
        if "could not bind" in said:
            self.stop("immediate")
            raise RuntimeError(f"pg_ctl start: an address is not bound: {said[-2000:]}")

    def stop(self, mode: str = "fast") -> None:
        """fast: sessions ended, a clean shutdown; immediate: no checkpoint (the end)."""
        self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "-t", "60", "stop")

    def _postmaster(self) -> int:
        return int((self.data / "postmaster.pid").read_text().split()[0])

    def _processes(self) -> list[int]:
        """The postmaster and its children (each of which is a session of its own)."""
        postmaster = self._postmaster()
        found = [postmaster]
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == postmaster:  # the parent's pid, after the state
                found.append(int(stat.parent.name))
        return found

    def freeze(self) -> None:
        """SIGSTOP the server and every backend: a server that neither fails nor answers."""
        self.frozen = []
        for pid in self._processes():
            with contextlib.suppress(ProcessLookupError):  # a backend whose client just left
                os.kill(pid, signal.SIGSTOP)
                self.frozen.append(pid)

    def thaw(self) -> None:
        for pid in self.frozen:
            with contextlib.suppress(ProcessLookupError):  # a backend that was ending as it froze
                os.kill(pid, signal.SIGCONT)

    def running(self) -> bool:
        return self._run("pg_ctl", "-D", str(self.data), "status", check=False).returncode == 0

    def _tail(self) -> str:
        try:
            return self.log.read_text()[-2000:]
        except OSError:
            return ""

    def dsn(self, database: str = "postgres", host: str = "127.0.0.1") -> str:
        return f"postgresql://{SUPERUSER}@{host}:{self.port}/{database}"

    def database(self, host: str = "127.0.0.1") -> str:
        """A new, empty database; its DSN, through `host` (one it listens on)."""
        import psycopg

        name = f"t_{uuid.uuid4().hex[:16]}"
        with psycopg.connect(self.dsn(), autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return self.dsn(name, host)


@contextmanager
def cluster(listen: Sequence[str] = (), clients: Sequence[str] = ()) -> Iterator[Cluster]:
    """A new cluster, started, listening also on `listen` and trusting `clients` (networks);
    stopped and removed at the end. RuntimeError without PostgreSQL's binaries."""
    found = bindir()
    if found is None:
        raise RuntimeError("no PostgreSQL here: Debian's postgresql (scripts/machine.sh)")
    root = Path(tempfile.mkdtemp(prefix="lucia-pg-"))
    user = None
    if os.geteuid() == 0:  # postgres refuses to run as root
        user = "postgres"
        account = pwd.getpwnam(user)
        os.chown(root, account.pw_uid, account.pw_gid)
    made = Cluster(found, root, free_port(), user, listen=tuple(listen), clients=tuple(clients))
    try:
        made.initdb()
        for attempt in range(5):  # the free port may be taken between the probe and the bind
            try:
                made.start()
                break
            except RuntimeError:
                if attempt == 4:
                    raise
                made.port = free_port()
        yield made
    finally:
        if made.data.exists() and made.running():
            made.stop("immediate")
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def postgres() -> Iterator[Cluster]:
    if bindir() is None:
        pytest.fail("these tests need Debian's postgresql (scripts/machine.sh installs it)")
    with cluster() as made:
        yield made
