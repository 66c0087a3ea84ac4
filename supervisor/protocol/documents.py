"""The file protocol between the host and the workers: the only definition of the contract.

desired.json is written by the host, status.json by the worker, and the file_sd file by the worker
for Prometheus. JSON Schemas in schemas/ are generated from these models.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Annotated, Any, Final, Literal

from pydantic import (
    AwareDatetime,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    RootModel,
    SerializerFunctionWrapHandler,
    ValidationError,
    WithJsonSchema,
    field_validator,
    model_serializer,
    model_validator,
)
from pydantic.alias_generators import to_camel
from pydantic_core import PydanticCustomError

from supervisor.protocol.strictjson import InvalidDocument, check_json, first_error

SCHEMA_VERSION: Final = 1
MAX_GENERATION: Final = 2**53 - 1  # the largest integer every JSON reader holds exactly
MAX_MESSAGE: Final = 500
MAX_MODELS: Final = 1000
MAX_SLOTS: Final = 100_000  # requests one model holds at once, as a worker publishes it

DesiredState = Literal["running", "stopped"]
Requester = Literal["operator", "gateway"]
REQUESTERS: Final[tuple[Requester, ...]] = ("operator", "gateway")
# an operator of another machine of a fleet, through that machine's page: `operator@<machine>`
FLEET_OPERATOR: Final = r"operator@[a-z0-9][a-z0-9-]{0,62}"
_BY: Final[list[dict[str, Any]]] = [{"enum": list(REQUESTERS)}, {"pattern": f"^{FLEET_OPERATOR}$"}]
_fleet = re.compile(FLEET_OPERATOR).fullmatch
_BY_SCHEMA: Final = {"anyOf": [*({**by, "type": "string"} for by in _BY), {"type": "null"}]}
State = Literal["starting", "running", "stopping", "stopped", "failed"]
STATES: Final[tuple[State, ...]] = ("starting", "running", "stopping", "stopped", "failed")
SETTLED: Final[dict[DesiredState, State]] = {"running": "running", "stopped": "stopped"}
# what a model may serve: the gateway's forwarded routes, one each (the host maps its routes)
Capability = Literal["chat", "completion", "embedding", "responses"]
CAPABILITIES: Final[tuple[Capability, ...]] = ("chat", "completion", "embedding", "responses")
GENERATION: Final[tuple[Capability, ...]] = ("chat", "completion", "responses")


def capabilities(names: object) -> tuple[Capability, ...]:
    """The known capabilities among `names`, once each, in CAPABILITIES' order: a name a newer
    worker may add is left out (this host serves no route for it), never a reason to refuse the
    whole status."""
    listed = names if isinstance(names, (list, tuple, set, frozenset)) else ()
    given = {name for name in listed if isinstance(name, str)}
    return tuple(known for known in CAPABILITIES if known in given)


def _known_capabilities(value: object) -> object:
    if not isinstance(value, dict):
        return value
    return {
        model: capabilities(names) if isinstance(names, list) else names
        for model, names in value.items()
    }


def utc_now() -> datetime:
    return datetime.now(UTC)


def _iso_utc(value: datetime) -> str:
    return value.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


UtcTime = Annotated[
    AwareDatetime,
    PlainSerializer(_iso_utc, return_type=str, when_used="json"),
    WithJsonSchema({"type": "string", "format": "date-time"}),
]

# RFC 3339 as the host writes it, checked before parsing: `datetime.fromisoformat` alone would
# take a date without a time, and pydantic's own parser a Unix timestamp in a string
_REQUEST_TIME = re.compile(
    r"[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}(\.[0-9]{1,6})?"
    r"(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])"
)
_REQUEST_TIME_SCHEMA: Final = {
    "type": "string",
    "format": "date-time",
    "pattern": f"^{_REQUEST_TIME.pattern}$",
}
_ESCAPES = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b[@-_]")
_CONTROLS = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def clean_message(text: str) -> str:
    """One human line: terminal escapes and control characters removed, at most 500 characters."""
    parts = []
    for raw in _ESCAPES.sub("", text.replace("\r\n", "\n").replace("\t", " ")).split("\n"):
        # A carriage return redraws the line (progress bars): show only the last redraw.
        redraws = [seg for seg in (_CONTROLS.sub("", s).strip() for s in raw.split("\r")) if seg]
        if redraws:
            parts.append(redraws[-1])
    line = " ".join(parts)
    if len(line) > MAX_MESSAGE:
        line = line[: MAX_MESSAGE - 1] + "…"
    return line


class DesiredFile(BaseModel):
    """desired.json: what the host asks for. Closed: nothing else can be said here.

    `requestedBy` and `requestedAt` say who wrote this generation and when; the worker reads
    neither (it does what `desired` says, whoever asked). Files from older hosts have neither:
    such a `stopped` is read as an operator's (`operator_stop`), the reading that never starts
    an engine someone may have stopped on purpose."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True, populate_by_name=True)

    schema_version: Literal[1] = Field(alias="schemaVersion")
    generation: int = Field(ge=0, le=MAX_GENERATION)
    desired: DesiredState
    requested_by: Annotated[str | None, WithJsonSchema(_BY_SCHEMA)] = Field(
        default=None,
        alias="requestedBy",
        description="Who wrote this generation: `operator` (the CLI, the host API, the page), "
        "`operator@<machine>` (the page of another machine of a fleet) or `gateway` (a start on "
        "demand, an idle stop, a swap); absent (or null) in files from older hosts, whose "
        "`stopped` counts as an operator's.",
    )
    requested_at: Annotated[
        datetime | None,
        PlainSerializer(_iso_utc, return_type=str, when_used="json-unless-none"),
        WithJsonSchema({"anyOf": [_REQUEST_TIME_SCHEMA, {"type": "null"}]}),
    ] = Field(
        default=None,
        alias="requestedAt",
        description="When this generation was written, RFC 3339 (`2026-11-30T17:14:35.239Z`); "
        "absent (or null) in files from older hosts.",
    )

    @field_validator("schema_version", mode="before")
    @classmethod
    def _integer_version(cls, value: object) -> object:
        # Literal[1] compares by equality, so true, 1.0 and 1e0 would pass even in strict mode.
        if type(value) is not int:
            raise PydanticCustomError("literal_error", "Input should be 1")
        return value

    @field_validator("requested_by", mode="plain")
    @classmethod
    def _requester(cls, value: object) -> str | None:
        if value is None or (type(value) is str and (value in REQUESTERS or _fleet(value))):
            return value
        raise PydanticCustomError(
            "literal_error", "Input should be 'operator', 'gateway' or 'operator@<machine>'"
        )

    @field_validator("requested_at", mode="plain")
    @classmethod
    def _request_time(cls, value: object) -> datetime | None:
        if value is None:
            return None
        if isinstance(value, datetime) and value.tzinfo is not None:  # the host's own writes
            return value
        if isinstance(value, str) and _REQUEST_TIME.fullmatch(value):
            try:
                return datetime.fromisoformat(value).astimezone(UTC)
            except (ValueError, OverflowError):
                pass  # the 30th of February, hour 24, a year 10000 in UTC: said below
        raise PydanticCustomError(
            "datetime_type", "Input should be an RFC 3339 time, as 2026-11-30T17:14:35.239Z"
        )

    @model_serializer(mode="wrap")
    def _unsaid_left_out(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # a request that says no requester is written as an older host wrote it
        data: dict[str, Any] = handler(self)
        for key in ("requestedBy", "requestedAt", "requested_by", "requested_at"):
            if key in data and data[key] is None:
                del data[key]
        return data

    @property
    def operator_stop(self) -> bool:
        """A stop only an operator may undo: any `stopped` the gateway did not write itself."""
        return self.desired == "stopped" and self.requested_by != "gateway"


class RunningEngine(BaseModel):
    """What runs, as recorded on its container when it was created: enough for a benchmark or
    a bug report to say which build served it."""

    model_config = ConfigDict(
        frozen=True, extra="ignore", alias_generator=to_camel, populate_by_name=True
    )

    image: str = Field(description="the image reference the container was created from")
    image_id: str = Field(description="the image id (sha256:...) it runs")
    container_id: str
    recipe_commit: str | None = Field(default=None, description="the recipe commit, if any")
    model: str = Field(description="the model it serves")
    model_revision: str | None = Field(
        default=None, description="the model's revision or file digest, when the engine has one"
    )
    engine_version: str | None = Field(
        default=None, description="the version the engine itself reports, once it answered"
    )


class Reserves(BaseModel):
    """The memory plan's four reserves, in bytes."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    os: int = Field(ge=0)
    services: int = Field(ge=0)
    voice: int = Field(ge=0)
    runtime: int = Field(ge=0)


class MemoryPlan(BaseModel):
    """The memory plan of the engine's recipe as the worker made it last: what a start needs
    against the machine's limit, its reserves and what other engines hold now. The host shows it
    and never plans itself (it reads no recipe, GGUF header or GPU)."""

    model_config = ConfigDict(
        frozen=True, extra="ignore", alias_generator=to_camel, populate_by_name=True
    )

    need: int | None = Field(
        ge=0, description="bytes a start needs by the plan; null when it could not be planned"
    )
    fits: bool = Field(description="whether a start fits the plan now, beside what others hold")
    message: str = Field(
        max_length=MAX_MESSAGE, description="the plan's refusal, or why it could not plan; '' fits"
    )
    limit: int = Field(ge=0, description="the machine's memory limit the plan divides, bytes")
    limit_source: Literal["host", "gpu", "fixed"] = Field(
        description="host: MemTotal; gpu: the GPUs' memory; fixed: the machine settings' number"
    )
    reserves: Reserves
    planned_at: UtcTime


class Status(BaseModel):
    """status.json: the worker's heartbeat and its answer to one generation."""

    model_config = ConfigDict(
        frozen=True, extra="ignore", alias_generator=to_camel, populate_by_name=True
    )

    generation: int = Field(ge=0, le=MAX_GENERATION)
    state: State
    since: UtcTime
    message: str = Field(max_length=MAX_MESSAGE)
    url: str | None = None
    checked_at: UtcTime
    refused: str | None = Field(
        default=None,
        max_length=MAX_MESSAGE,
        description="Why the current desired.json was refused; null while it is valid.",
    )
    engine: RunningEngine | None = Field(
        default=None, description="What runs, while the state is running; null otherwise."
    )
    retrying: bool = Field(
        default=False,
        description="While failed: the worker tries the failed step again by itself after a "
        "back-off (a port, memory or an image held or missing for now); false: it waits for a "
        "new request or a recipe reload.",
    )
    waiting_for: Literal["memory"] | None = Field(
        default=None,
        description="While retrying: `memory` when the step waits for memory that other engines "
        "hold or use now (the host may free some); null otherwise, and in files from older "
        "workers.",
    )
    models: tuple[str, ...] = Field(
        default=(),
        max_length=MAX_MODELS,
        description="The model names the engine serves, as its recipe's preset names them, in "
        "every state (the host routes by them and never reads a recipe); absent in files from "
        "older workers.",
    )
    slots: dict[str, Annotated[int, Field(ge=1, le=MAX_SLOTS)]] = Field(
        default_factory=dict,
        max_length=MAX_MODELS,
        description="While running: how many requests each model the engine has loaded holds "
        "at once, each with room for its slot's whole context, as the running engine reports "
        "it (llama-server's slots, a cache its slots share counted by the contexts it holds) or "
        "its launch sets it (vLLM's max_num_seqs, TensorFold's --parallel); a model whose slots "
        "are not known yet is left out. The host admits that many at once (the sum for an "
        "engine serving several models). Empty while unknown, and absent in files from older "
        "workers.",
    )
    capabilities: Annotated[
        dict[str, tuple[Capability, ...]],
        BeforeValidator(_known_capabilities),
        WithJsonSchema(
            {
                "type": "object",
                "maxProperties": MAX_MODELS,
                "additionalProperties": {
                    "type": "array",
                    "items": {"type": "string"},
                    "uniqueItems": True,
                },
            }
        ),
    ] = Field(
        default_factory=dict,
        max_length=MAX_MODELS,
        description="What each model the engine serves serves, in every state: a subset of "
        "`chat`, `completion`, `embedding` and `responses` (the routes /v1/chat/completions, "
        "/v1/completions, /v1/embeddings and /v1/responses), from the recipe and from what the "
        "engine itself says (vLLM's routes and runner, llama-server's arguments for the model "
        "and its GGUF's pooling type); `[]` serves none of them. A model left out is not known "
        "(the host forwards its requests as before); empty while nothing is known, and absent "
        "in files from older workers. A name a reader does not know is ignored.",
    )
    memory: MemoryPlan | None = Field(
        default=None,
        description="The memory plan of the engine's recipe, refreshed while the worker runs; "
        "null before its first plan and in files from older workers.",
    )
    worker_version: str | None = Field(
        default=None,
        max_length=100,
        description="The lucia-supervisor version of the worker that wrote this file; "
        "absent in files from older workers.",
    )

    @model_validator(mode="after")
    def _url_only_when_running(self) -> Status:
        if self.url is not None and self.state != "running":
            raise ValueError("url must be null unless state is running")
        if self.engine is not None and self.state != "running":
            raise ValueError("engine must be null unless state is running")
        if self.retrying and self.state != "failed":
            raise ValueError("retrying must be false unless state is failed")
        if self.waiting_for is not None and not self.retrying:
            raise ValueError("waitingFor must be null unless retrying")
        return self


class TargetGroup(BaseModel):
    """One Prometheus file_sd target group."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    targets: list[str]
    labels: dict[str, str] = Field(default_factory=dict)


class FileSd(RootModel[list[TargetGroup]]):
    """A Prometheus file_sd file: a list of target groups (empty when nothing runs)."""


def parse_desired(text: str) -> DesiredFile:
    checked = check_json(text)
    try:
        if checked.too_long:  # the JSON parser would only say "number out of range", unnamed
            return DesiredFile.model_validate(checked.value, strict=True, by_name=False)
        # by_name=False: on the wire only "schemaVersion" (the alias) exists, as the schema says.
        return DesiredFile.model_validate_json(text, strict=True, by_name=False)
    except ValidationError as exc:
        raise InvalidDocument(first_error(exc)) from None


def parse_status(text: str) -> Status:
    check_json(text)
    try:
        return Status.model_validate_json(text)
    except ValidationError as exc:
        raise InvalidDocument(first_error(exc)) from None


def dump(model: BaseModel) -> bytes:
    return (model.model_dump_json(by_alias=True, indent=2) + "\n").encode()


def json_schemas() -> dict[str, dict[str, Any]]:
    """The protocol's checked-in schemas, by file name (supervisor.schemas adds the library's)."""
    schemas = {
        "desired.schema.json": DesiredFile.model_json_schema(by_alias=True),
        "status.schema.json": Status.model_json_schema(by_alias=True),
        "file_sd.schema.json": FileSd.model_json_schema(by_alias=True),
    }
    for name, schema in schemas.items():
        schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
        schema["$id"] = f"https://lucia.invalid/schemas/{name}"
    return schemas
