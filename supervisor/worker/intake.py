"""desired.json into the worker: read it, then one pure step from what was read to what is shown.

The worker's loop and the fuzz suite both call intake(), so a change to how a request is taken
in is a change to what the fuzzing checks.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from supervisor.protocol import files
from supervisor.protocol.documents import DesiredFile, parse_desired
from supervisor.protocol.strictjson import InvalidDocument
from supervisor.worker.plan import Decision, acknowledge
from supervisor.worker.pursuit import Pursuit, Reported, accept


@dataclass(frozen=True)
class Intake:
    """What one read of desired.json changes: the request applied, the refusal shown, and the
    acknowledgement of a new request (None when it asks nothing new)."""

    pursuit: Pursuit | None
    refused: str | None
    acknowledged: Decision | None = None

    def shown(self, current: Decision | None) -> Decision | None:
        """The decision status.json shows now: the acknowledgement, else the current one."""
        return self.acknowledged if self.acknowledged is not None else current


def read_request(path: Path) -> tuple[DesiredFile | None, str | None]:
    """desired.json as it is now: the request, or why it is refused (neither when absent)."""
    try:
        return parse_desired(files.read_text(path)), None
    except FileNotFoundError:
        return None, None
    except files.FileRefused as exc:
        return None, str(exc)
    except InvalidDocument as exc:
        return None, f"{path}: {exc}"


def intake(
    pursuit: Pursuit | None,
    previous: Decision | None,
    read: tuple[DesiredFile | None, str | None],
    before: Reported | None = None,
) -> Intake:
    """Pure: what was read of desired.json, applied to the request in hand. An invalid or
    absent file leaves the request as it is; a new request is acknowledged at once."""
    desired, refused = read
    if desired is None:
        return Intake(pursuit, refused)
    accepted = accept(pursuit, desired, before)
    if accepted is None:
        return Intake(pursuit, refused)
    return Intake(accepted, refused, acknowledge(accepted, previous))
