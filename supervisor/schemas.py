"""Every checked-in JSON Schema (schemas/), by file name: the protocol's and the library's."""

from __future__ import annotations

from typing import Any

from supervisor.library.models import library_schema
from supervisor.protocol.documents import json_schemas


def checked_in() -> dict[str, dict[str, Any]]:
    # the part of the host's model library (<models>/<guid>/model.json) the router relies on
    return {**json_schemas(), "library-model.schema.json": library_schema()}
