"""sd_notify: READY, STATUS, WATCHDOG and STOPPING for a Type=notify unit; silent elsewhere."""

from __future__ import annotations

import os
import time
from typing import Final

import sdnotify

_MIN_WATCHDOG: Final = 1.0


class Notifier:
    def __init__(self) -> None:
        self.enabled = bool(os.environ.get("NOTIFY_SOCKET"))
        self._notifier = sdnotify.SystemdNotifier() if self.enabled else None
        if self._notifier is not None:
            # never block the loop on a manager that does not read: a full queue drops a ping
            self._notifier.socket.setblocking(False)
        usec = os.environ.get("WATCHDOG_USEC", "")
        pid = os.environ.get("WATCHDOG_PID", "")
        ours = not pid or pid == str(os.getpid())
        # ping at half the watchdog interval, as systemd recommends
        self.watchdog_interval = (
            max(int(usec) / 2_000_000, _MIN_WATCHDOG) if usec.isdigit() and ours else None
        )
        self._last_ping = 0.0
        self._last_status = ""

    def _send(self, message: str) -> None:
        if self._notifier is not None:
            self._notifier.notify(message)

    def ready(self) -> None:
        self._send("READY=1")

    def status(self, text: str) -> None:
        line = text.replace("\n", " ")[:200]
        if line != self._last_status:
            self._last_status = line
            self._send(f"STATUS={line}")

    def stopping(self) -> None:
        self._send("STOPPING=1")

    def watchdog(self) -> None:
        if self.watchdog_interval is None:
            return
        now = time.monotonic()
        if now - self._last_ping >= self.watchdog_interval / 2:
            self._last_ping = now
            self._send("WATCHDOG=1")
