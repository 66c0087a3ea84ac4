"""Debian's haproxy for the tests: the shipped haproxy/lucia-fleet.cfg rendered for 127.0.0.1,
run as a child in the foreground (`-db`) and stopped by the test.

The rendering (`render`) changes only what names this machine: the frontend's address, the
backend's servers (each with the shipped server line's options), the stats socket (in the
test's own directory), and what needs a daemon or a syslog (chroot, user, group, daemon: none;
the log goes to its stdout, kept in a file). A shipped file that no longer has one of those
lines fails the rendering: the tests never run a configuration other than the shipped one
unnoticed. Servers' states come from the stats socket (`show stat`), never from a sleep.
"""

from __future__ import annotations

import contextlib
import csv
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.fixtures import ROOT
from tests.standin import free_port

SHIPPED = ROOT / "haproxy" / "lucia-fleet.cfg"
FRONTEND = "lucia"
BACKEND = "gateways"
_DROPPED = ("chroot", "user", "group", "daemon", "log")


def binary() -> str:
    """haproxy's path; the test is skipped, saying why, only where the machine lacks it."""
    found = shutil.which("haproxy") or shutil.which("haproxy", path="/usr/sbin")
    if found is None:
        pytest.skip("Debian's haproxy is not installed here (scripts/machine.sh installs it)")
    return found


def check(path: Path) -> subprocess.CompletedProcess[str]:
    """`haproxy -c -f PATH`: whether the file is a valid configuration, and what it said."""
    return subprocess.run(
        [binary(), "-c", "-f", str(path)], capture_output=True, text=True, timeout=60, check=False
    )


def _directive(line: str) -> str:
    words = line.split("#", 1)[0].split()
    return words[0] if words else ""


def render(
    text: str,
    front: str,
    servers: Sequence[tuple[str, str]],
    stats: Path,
    inter: str | None = None,
) -> str:
    """Pure: the shipped configuration `text` bound to `front` (address:port), its backend's
    servers these (name, address:port) with the options of its first server line, its stats
    socket at `stats`, and `inter` (if given) in place of the checks' shipped interval."""
    out: list[str] = []
    section = ""
    found: set[str] = set()
    for line in text.splitlines():
        if line and not line[0].isspace() and not line.startswith("#"):
            section = line.strip()
            out.append(line)
            continue
        word = _directive(line)
        if section == "global" and word in _DROPPED:
            continue
        if section == "global" and line.split()[:2] == ["stats", "socket"]:
            out.append(f"    stats socket {stats} mode 600 level admin")
            out.append("    log stdout format raw local0")
            found.add("stats")
        elif section == f"frontend {FRONTEND}" and word == "bind":
            out.append(f"    bind {front}")
            found.add("bind")
        elif section == f"backend {BACKEND}" and word == "server":
            if "server" not in found:
                options = line.split("#", 1)[0].split()[3:]
                out += [f"    server {name} {where} {' '.join(options)}" for name, where in servers]
                found.add("server")
        elif section == f"backend {BACKEND}" and word == "default-server" and inter is not None:
            out.append(re.sub(r"\binter \S+", f"inter {inter}", line))
            found.add("inter")
        else:
            out.append(line)
    wanted = {"stats", "bind", "server"} | ({"inter"} if inter is not None else set())
    if found != wanted:
        raise AssertionError(f"{SHIPPED.name} has no {sorted(wanted - found)} line to render")
    return "\n".join(out) + "\n"


def command(stats: Path, line: str) -> str:
    """One command on the stats socket (`show stat`, `disable health BACKEND/SERVER`): its
    answer."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(str(stats))
        sock.sendall(line.encode() + b"\n")
        raw = b""
        while chunk := sock.recv(65536):
            raw += chunk
    return raw.decode()


def stat_rows(stats: Path) -> list[dict[str, str]]:
    """`show stat`: a row per frontend, backend and server."""
    text = command(stats, "show stat").removeprefix("# ")
    return list(csv.DictReader(line for line in text.splitlines() if line.strip()))


@dataclass
class HAProxy:
    """A running haproxy: its front URL, its stats socket, its log, its process."""

    url: str
    stats: Path
    log: Path
    proc: subprocess.Popen[bytes]

    def server(self, name: str) -> dict[str, str]:
        """The backend's server `name` as the stats say now (status, check_status, ...)."""
        for row in stat_rows(self.stats):
            if row["pxname"] == BACKEND and row["svname"] == name:
                return row
        raise AssertionError(f"no server {name} in the backend {BACKEND}")

    def wait_server(
        self, name: str, holds: Callable[[dict[str, str]], bool], what: str, limit: float = 60
    ) -> dict[str, str]:
        """The server's row once `holds` is true of it (`limit`: only a bound on a hang)."""
        deadline = time.monotonic() + limit
        while True:
            row = self.server(name)
            if holds(row):
                return row
            if time.monotonic() > deadline:
                raise AssertionError(f"server {name}: never {what}; last {row}\n{self.log_text()}")
            time.sleep(0.05)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]


@contextlib.contextmanager
def running(
    work: Path, servers: Sequence[tuple[str, str]], inter: str | None, up: bool = True
) -> Iterator[HAProxy]:
    """haproxy with the shipped configuration rendered for these servers, in `work`; with `up`,
    every server up (its checks passed) before it is yielded; stopped (SIGTERM) at the end."""
    work.mkdir(parents=True, exist_ok=True)
    port = free_port()
    stats = work / "admin.sock"
    config = work / "haproxy.cfg"
    config.write_text(render(SHIPPED.read_text(), f"127.0.0.1:{port}", servers, stats, inter))
    log = work / "haproxy.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [binary(), "-db", "-f", str(config)], stdout=out, stderr=subprocess.STDOUT, cwd=work
        )
    proxy = HAProxy(f"http://127.0.0.1:{port}", stats, log, proc)
    try:
        deadline = time.monotonic() + 60
        while not stats.exists() or not _answers(stats):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"haproxy did not start ({proc.poll()}):\n{proxy.log_text()}")
            time.sleep(0.05)
        for name, _ in servers if up else ():
            proxy.wait_server(name, lambda row: state(row) == ("UP", "L7OK"), "up")
        yield proxy
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def state(row: dict[str, str]) -> tuple[str, str]:
    """A server's status (UP, DOWN; "UP 1/2" while it is going down) and its last check's
    (L7OK, L7STS: a wrong status, L4CON: refused; a "* " before one under way is dropped)."""
    return row["status"], row["check_status"].removeprefix("* ")


def _answers(stats: Path) -> bool:
    try:
        return bool(stat_rows(stats))
    except OSError:
        return False
