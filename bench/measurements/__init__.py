"""The eight measurements of issue 6, one module each, each against a same-run baseline.

common.py holds what they share.
"""

from __future__ import annotations

from collections.abc import Callable

from ..lab import Lab
from ..report import Row
from .ack import acknowledgement
from .adoption import adoption
from .cancel import cancel
from .common import Plan, Shared
from .heartbeat import heartbeat
from .idle import idle
from .ready import ready
from .scale import scale
from .stop import stop

MEASUREMENTS: dict[str, Callable[[Lab, Plan, Shared], list[Row]]] = {
    "ack": acknowledgement,
    "ready": ready,
    "stop": stop,
    "adoption": adoption,
    "idle": idle,
    "heartbeat": heartbeat,
    "cancel": cancel,
    "scale": scale,
}
