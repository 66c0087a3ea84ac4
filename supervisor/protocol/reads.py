"""An engine folder's request and status as a reader finds them: None when absent or unreadable.

The host (its CLI, gateway and page) and the memory plan's overview read them so; the worker
reads its own files with their errors, in worker/intake.py and worker/heartbeat.py.
"""

from __future__ import annotations

from pathlib import Path

from supervisor.protocol.documents import DesiredFile, Status, parse_desired, parse_status
from supervisor.protocol.files import FileRefused, read_text
from supervisor.protocol.layout import DESIRED, STATUS
from supervisor.protocol.strictjson import InvalidDocument


def read_desired(directory: Path) -> DesiredFile | None:
    """The current request, or None when there is none or it cannot be read."""
    try:
        return parse_desired(read_text(directory / DESIRED))
    except (FileNotFoundError, FileRefused, InvalidDocument):
        return None


def load_status(directory: Path) -> Status | None:
    """The worker's last status, or None when there is none or it cannot be read."""
    try:
        return parse_status(read_text(directory / STATUS))
    except (FileNotFoundError, FileRefused, InvalidDocument):
        return None
