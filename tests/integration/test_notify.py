"""sd_notify over a real AF_UNIX datagram socket, read as systemd's manager reads it."""

from __future__ import annotations

import signal
import socket
import threading
import time
from pathlib import Path

import pytest

from tests.fixtures import Engine

pytestmark = pytest.mark.docker


class Manager:
    """The receiving end of NOTIFY_SOCKET: drains it continuously, like systemd does."""

    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.1)
        self.messages: list[tuple[float, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._drain, daemon=True)
        self._thread.start()

    def _drain(self) -> None:
        while not self._stop.is_set():
            try:
                data = self.sock.recv(4096)
            except TimeoutError:
                continue
            now = time.monotonic()
            self.messages.extend((now, line) for line in data.decode().splitlines())

    def wait_for(self, prefix: str, timeout: float) -> float:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for at, line in list(self.messages):
                if line.startswith(prefix):
                    return at
            time.sleep(0.05)
        raise AssertionError(f"no {prefix} in {[m for _, m in self.messages][-20:]}")

    def since(self, start: float) -> list[str]:
        return [line for at, line in list(self.messages) if at >= start]

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sock.close()


def test_ready_status_watchdog_and_stopping(make_engine, monkeypatch, tmp_path) -> None:
    engine: Engine = make_engine()
    manager = Manager(tmp_path / "notify")
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "notify"))
    monkeypatch.setenv("WATCHDOG_USEC", "2000000")
    try:
        proc = engine.start_worker()
        manager.wait_for("READY=1", 30)
        assert (engine.dir / "status.json").exists(), "READY=1 before the first status"
        generation = engine.request("running")
        engine.wait_state(generation, "running", timeout=120)
        manager.wait_for("STATUS=running", 5)
        start = time.monotonic()
        time.sleep(3)
        pings = manager.since(start).count("WATCHDOG=1")
        assert pings >= 3, f"{pings} watchdog pings in 3 s with WatchdogSec=2"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        manager.wait_for("STOPPING=1", 2)
    finally:
        manager.close()


def test_without_a_notify_socket_the_worker_runs_quietly(make_engine, monkeypatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    engine: Engine = make_engine()
    proc = engine.start_worker()
    engine.wait_status(lambda s: True, timeout=30)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0


def test_a_manager_that_never_reads_cannot_stall_the_worker(
    make_engine, monkeypatch, tmp_path
) -> None:
    """A full notify queue drops messages; it must never block the loop (or the heartbeat)."""
    engine: Engine = make_engine()
    deaf = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    deaf.bind(str(tmp_path / "deaf"))
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "deaf"))
    monkeypatch.setenv("WATCHDOG_USEC", "200000")  # many pings: the queue fills quickly
    try:
        engine.start_worker()
        generation = engine.request("running")
        engine.wait_state(generation, "running", timeout=120)
    finally:
        deaf.close()
