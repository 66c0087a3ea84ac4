"""The gateway's settings: one TOML file, every default resolved here and nowhere else.

The file is the argument, then LUCIA_GATEWAY_SETTINGS, then `$XDG_CONFIG_HOME/lucia/gateway.toml`.
A missing file at the default place means every default; a file named on purpose must exist.

```toml
[listen]
address = "127.0.0.1"          # loopback by default; a LAN address is opened on purpose
port = 8400
tls_cert = "/etc/lucia/gateway.crt"   # both or neither
tls_key = "/etc/lucia/gateway.key"
header_timeout_s = 10          # a connection that has not sent a whole request's headers this
                               # long after it opened, or after its last answer, is closed
body_timeout_s = 60            # a request whose whole body has not come this long after its
                               # headers gets 408 and its connection is closed; the answer,
                               # however long it streams, is not bounded by it
bodies_bytes = 268435456       # the bytes of request bodies held at once, over every client
                               # (256 MiB: 16 of the largest, 16 MiB); each is counted from
                               # before it is read (its Content-Length, else its route's limit)
                               # to its request's end. One that would pass it: 429 bodies_busy
                               # with Retry-After, unread, and its connection closed

[keys]
owner_file = "~/.config/lucia/owner.key"
inference_file = "~/.config/lucia/inference.key"

[tiers]                        # aliases a request's `model` may name: each a served name
fast = "qwen2.5-0.5b"          # (protocol.names: letters, digits and . _ : @ + - /), the
                               # model it names any name an engine serves

[limits]                       # for every engine, unless [engines.NAME] says otherwise
# running = 4                  # requests forwarded at once; unset (the default): as many as
                               # the engine holds (its status.json `slots`, summed over the
                               # models it has loaded: an engine serving several models takes
                               # their sum, which one model's burst may exceed), else 4 while
                               # it publishes none (a router publishes them once it runs)
waiting = 64                   # requests held for a slot
max_wait_s = 30                # how long one is held before a 429
deadline_s = 1800              # one clock from admission over the dial and the whole answer
load_wait_s = 900              # how long a start on demand is waited for
max_tokens = 32768             # the bound of max_tokens, max_completion_tokens,
                               # max_output_tokens and llama-server's n_predict; above it:
                               # 400 invalid_request. A request that sets no bound the engine
                               # reads (none, or n_predict -1, or max_completion_tokens only)
                               # gets n_predict set: to it, or to max_completion_tokens. Never
                               # max_tokens: vLLM refuses with 400 a prompt + max_tokens over
                               # its max_model_len and ignores n_predict, bounding itself by
                               # its context; llama-server takes n_predict first
max_n = 8                      # n (and llama-server's n_cmpl), answers generated at once;
                               # above it: 400 n_too_large
max_best_of = 8                # best_of (vLLM's text completions); 400 best_of_too_large
max_logprobs = 20              # top_logprobs, llama-server's n_probs, vLLM's prompt_logprobs
                               # and the text completions' logprobs; 400 logprobs_too_large
max_messages = 10000           # chat's messages, /v1/responses' input items; 400
                               # too_many_messages
max_message_chars = 1048576    # characters of text in one message (its content, or its parts'
                               # text; images, audio and files count to the body's 2 MiB only);
                               # 400 message_too_long

[engines.big]
running = 1                    # set here or in [limits]: the operator's word, whatever the
                               # engine publishes

[idle]
stop_after_s = 0               # 0: never; else an engine the gateway started is stopped
                               # after this long with nothing running or waiting on it
swap = false                   # a start the worker says waits for memory may first stop an
                               # engine the gateway started that nothing runs or waits on

[budget]
daily_tokens = 0               # per key and UTC day, prompt and completion tokens; 0: none
                               # (a key's own: `keys create --budget`, `keys budget`); the
                               # owner key has none

[record]                       # one row per generation, no text; each key's daily spending
enabled = true                 # false: nothing is recorded and no budget can be enforced
path = "<data>/record/record.sqlite3"   # the SQLite file (the default: the host's data dir)
# dsn = "postgresql://lucia@db.example/lucia"   # instead of path: PostgreSQL, which several
                               # gateways share; put a password in ~/.pgpass, not here
retention_days = 90            # rows (and daily totals) older are pruned; 0: kept for ever

[page]                         # the operator's page at /page/
session_s = 43200              # a sign-in lasts this long (12 hours; at least 1 s): the
                               # session and its cookie's Max-Age

[tracing]                      # OTLP/HTTP: a span per request, the meter Lucia.Inference
endpoint = ""                  # "": off; else http(s)://host:port[/prefix]: spans go to
                               # <endpoint>/v1/traces, metrics to <endpoint>/v1/metrics
service_name = "lucia-gateway" # the resource's service.name
sample_ratio = 1.0             # of the traces it begins; a caller's traceparent decides its own
metrics_interval_s = 60        # the metrics are exported this often (at least 0.5 s)
timeout_s = 10                 # an export waits this long for the receiver (in a thread)
```
"""

from __future__ import annotations

import ipaddress
import os
import tomllib
from pathlib import Path
from typing import Annotated, Final, Self

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from supervisor.host.gateway import spans
from supervisor.host.proxy.admission import Admission
from supervisor.host.proxy.bounds import Bounds
from supervisor.host.record.database import SQLITE_FILE, Target
from supervisor.protocol import names

SETTINGS_ENV: Final = "LUCIA_GATEWAY_SETTINGS"
DEFAULT_ADDRESS: Final = "127.0.0.1"
DEFAULT_PORT: Final = 8400
DEFAULT_HEADER_TIMEOUT_S: Final = 10.0  # a slowloris holds a connection no longer than this
DEFAULT_BODY_TIMEOUT_S: Final = 60.0  # 16 MiB, the largest body, at 2.3 Mbit/s
# 16 of the largest bodies (16 MiB) at once. The process holds up to about twice the bytes
# counted (a body as it is joined, or beside what goes upstream in its place) and the document
# of the one body parsed at a time (16 MiB of token ids: about 100 MiB): under a GiB in all
DEFAULT_BODIES_BYTES: Final = 256 * 1024 * 1024
MIN_BODIES_BYTES: Final = 1024 * 1024  # below it, ordinary chats could never pass
DEFAULT_RUNNING: Final = 4  # an engine that publishes no slots (yet, or an older worker)
MAX_RUNNING: Final = 10_000
DEFAULT_WAITING: Final = 64
DEFAULT_MAX_WAIT_S: Final = 30.0
DEFAULT_LOAD_WAIT_S: Final = 900.0  # a TensorFold first load takes minutes
DEFAULT_DEADLINE_S: Final = 1800.0  # 32,768 tokens at 20 a second, and a margin
DEFAULT_MAX_TOKENS: Final = 32768
DEFAULT_MAX_N: Final = 8  # each answer generated at once takes an engine sequence
DEFAULT_MAX_BEST_OF: Final = 8
DEFAULT_MAX_LOGPROBS: Final = 20  # OpenAI's and vLLM's own maximum
DEFAULT_MAX_MESSAGES: Final = 10_000
DEFAULT_MAX_MESSAGE_CHARS: Final = 1024 * 1024  # half the 2 MiB a text route's body may be
DEFAULT_RETENTION_DAYS: Final = 90
DEFAULT_SESSION_S: Final = 12 * 3600.0  # a working day: the owner signs in once a day
RECORD_DIR: Final = "record"  # <data>/record/: the SQLite record's directory
_DSN_SCHEMES: Final = ("postgresql://", "postgres://")
_MAX_FILE: Final = 1024 * 1024


def config_home() -> Path:
    raw = os.environ.get("XDG_CONFIG_HOME")
    return (Path(raw) if raw else Path("~/.config")).expanduser() / "lucia"


def settings_file(value: str | None = None) -> tuple[Path, bool]:
    """The settings file, and whether it was named (the argument or the environment)."""
    raw = value or os.environ.get(SETTINGS_ENV)
    if raw:
        return Path(raw).expanduser().absolute(), True
    return (config_home() / "gateway.toml").absolute(), False


def _expand(value: object) -> object:
    if isinstance(value, str):
        if value.startswith("~"):
            value = os.path.expanduser(value)
        if not value.startswith("/"):
            raise ValueError(f"{value!r} must be an absolute path (or start with ~/)")
    return value


FilePath = Annotated[Path, BeforeValidator(_expand)]


class SettingsError(ValueError):
    """Settings the gateway cannot start with; str() names the file, the setting and the rule."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Listen(_Section):
    address: str = DEFAULT_ADDRESS
    port: int = Field(default=DEFAULT_PORT, ge=0, le=65535)  # 0: any free port
    tls_cert: FilePath | None = None
    tls_key: FilePath | None = None
    header_timeout_s: float = Field(default=DEFAULT_HEADER_TIMEOUT_S, gt=0, le=3600)
    body_timeout_s: float = Field(default=DEFAULT_BODY_TIMEOUT_S, gt=0, le=3600)
    bodies_bytes: int = Field(default=DEFAULT_BODIES_BYTES, ge=MIN_BODIES_BYTES, le=2**40)

    @field_validator("address")
    @classmethod
    def _an_address(cls, value: str) -> str:
        ipaddress.ip_address(value)  # its ValueError says what is wrong
        return value

    @model_validator(mode="after")
    def _checked(self) -> Self:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key come together: set both or neither")
        return self

    @property
    def loopback(self) -> bool:
        return ipaddress.ip_address(self.address).is_loopback

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None


class Keys(_Section):
    owner_file: FilePath = Field(default_factory=lambda: config_home() / "owner.key")
    inference_file: FilePath = Field(default_factory=lambda: config_home() / "inference.key")


class EngineLimits(_Section):
    """Admission for one engine; None: the [limits] value (for running, that set by hand,
    else the engine's own)."""

    running: int | None = Field(default=None, ge=1, le=MAX_RUNNING)
    waiting: int | None = Field(default=None, ge=0, le=100_000)
    max_wait_s: float | None = Field(default=None, gt=0, le=86_400)
    deadline_s: float | None = Field(default=None, gt=0, le=86_400)


class Limits(_Section):
    running: int | None = Field(default=None, ge=1, le=MAX_RUNNING)  # None: follow the engine
    waiting: int = Field(default=DEFAULT_WAITING, ge=0, le=100_000)
    max_wait_s: float = Field(default=DEFAULT_MAX_WAIT_S, gt=0, le=86_400)
    deadline_s: float = Field(default=DEFAULT_DEADLINE_S, gt=0, le=86_400)
    load_wait_s: float = Field(default=DEFAULT_LOAD_WAIT_S, gt=0, le=86_400)
    max_tokens: int = Field(default=DEFAULT_MAX_TOKENS, ge=1, le=10_000_000)
    max_n: int = Field(default=DEFAULT_MAX_N, ge=1, le=1024)
    max_best_of: int = Field(default=DEFAULT_MAX_BEST_OF, ge=1, le=1024)
    max_logprobs: int = Field(default=DEFAULT_MAX_LOGPROBS, ge=0, le=100_000)
    max_messages: int = Field(default=DEFAULT_MAX_MESSAGES, ge=1, le=1_000_000)
    max_message_chars: int = Field(default=DEFAULT_MAX_MESSAGE_CHARS, ge=1, le=100_000_000)

    @property
    def bounds(self) -> Bounds:
        """What each request is held to (bounds.py)."""
        return Bounds(
            max_tokens=self.max_tokens,
            max_n=self.max_n,
            max_best_of=self.max_best_of,
            max_logprobs=self.max_logprobs,
            max_messages=self.max_messages,
            max_message_chars=self.max_message_chars,
        )


class Idle(_Section):
    stop_after_s: float = Field(default=0, ge=0, le=30 * 86_400)
    swap: bool = False


class BudgetSettings(_Section):
    daily_tokens: int = Field(default=0, ge=0, le=10**15)  # 0: no budget


class Record(_Section):
    enabled: bool = True
    path: FilePath | None = None  # None: <data>/record/record.sqlite3
    dsn: str | None = None
    retention_days: int = Field(default=DEFAULT_RETENTION_DAYS, ge=0, le=36_500)

    @field_validator("dsn")
    @classmethod
    def _a_dsn(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(_DSN_SCHEMES):
            raise ValueError("a PostgreSQL URI: postgresql://[user@]host[:port]/database")
        return value

    @model_validator(mode="after")
    def _one_place(self) -> Self:
        if self.path is not None and self.dsn is not None:
            raise ValueError("path (SQLite) and dsn (PostgreSQL) name two records: set one")
        return self

    def target(self, data_dir: Path) -> Target:
        """Where the record is: the DSN, the path, or the SQLite file in the data directory."""
        if self.dsn is not None:
            return Target(dsn=self.dsn)
        return Target(path=self.path or data_dir / RECORD_DIR / SQLITE_FILE)


class PageSettings(_Section):
    session_s: float = Field(default=DEFAULT_SESSION_S, ge=1, le=30 * 86_400)


class TracingSettings(_Section):
    endpoint: Annotated[str, AfterValidator(spans.receiver_url)] = ""  # "": off
    service_name: str = Field(default="lucia-gateway", pattern=spans.SERVICE_NAME)
    sample_ratio: float = Field(default=1.0, ge=0, le=1)  # every trace: a span tree is cheap
    metrics_interval_s: float = Field(default=60, ge=0.5, le=86_400)  # OpenTelemetry's own
    timeout_s: float = Field(default=10, gt=0, le=600)  # OpenTelemetry's own


def running_bound(engine_set: int | None, limits_set: int | None, slots: int | None) -> int:
    """Pure: how many requests one engine gets at once: [engines.NAME] running, else [limits]
    running, when the operator set it; else the slots the engine publishes (the sum over its
    models, at most MAX_RUNNING); else DEFAULT_RUNNING."""
    for chosen in (engine_set, limits_set):
        if chosen is not None:
            return chosen
    if slots is not None and slots >= 1:
        return min(slots, MAX_RUNNING)
    return DEFAULT_RUNNING


class GatewaySettings(_Section):
    """The whole settings file: each section, every key with its default."""

    listen: Listen = Field(default_factory=Listen)
    keys: Keys = Field(default_factory=Keys)
    tiers: dict[str, str] = Field(default_factory=dict)
    limits: Limits = Field(default_factory=Limits)
    engines: dict[str, EngineLimits] = Field(default_factory=dict)
    idle: Idle = Field(default_factory=Idle)
    budget: BudgetSettings = Field(default_factory=BudgetSettings)
    record: Record = Field(default_factory=Record)
    page: PageSettings = Field(default_factory=PageSettings)
    tracing: TracingSettings = Field(default_factory=TracingSettings)

    @field_validator("tiers")
    @classmethod
    def _aliases_are_served_names(cls, value: dict[str, str]) -> dict[str, str]:
        """An alias is asked for and recorded as a model is: it keeps the served-name rule.
        The model it names may be any an engine serves (one from before the rule too)."""
        for alias in value:
            try:
                names.check(alias)
            except ValueError as exc:
                raise ValueError(f"alias {exc}") from None
        return value

    def admission(self, engine: str, slots: int | None = None) -> Admission:
        """The engine's limits; `slots`: what it publishes it holds at once (None: nothing)."""
        own = self.engines.get(engine, EngineLimits())
        return Admission(
            running=running_bound(own.running, self.limits.running, slots),
            waiting=own.waiting if own.waiting is not None else self.limits.waiting,
            max_wait_s=own.max_wait_s if own.max_wait_s is not None else self.limits.max_wait_s,
            deadline_s=own.deadline_s if own.deadline_s is not None else self.limits.deadline_s,
        )

    def warnings(self) -> list[str]:
        """What is allowed but unwise, for the log at start."""
        if not self.listen.loopback and not self.listen.tls:
            return [
                f"listen.address {self.listen.address} is not loopback and listen.tls_cert is "
                "not set: keys cross the network in clear"
            ]
        return []


def _first_error(exc: ValidationError) -> str:
    err = exc.errors(include_url=False)[0]
    where = ".".join(str(part) for part in err["loc"]) or "settings"
    if err["type"] == "extra_forbidden":
        return f"{where}: unknown setting"
    message = str(err["msg"]).removeprefix("Value error, ")
    return f"{where}: {message}"


def parse(text: str, origin: str) -> GatewaySettings:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise SettingsError(f"{origin}: not valid TOML: {exc}") from None
    try:
        return GatewaySettings.model_validate(data)
    except ValidationError as exc:
        raise SettingsError(f"{origin}: {_first_error(exc)}") from None


def load(value: str | None = None) -> GatewaySettings:
    """The settings from the file named, or the default place; raises SettingsError."""
    path, named = settings_file(value)
    try:
        with path.open("rb") as handle:
            raw = handle.read(_MAX_FILE + 1)
    except FileNotFoundError:
        if named:
            raise SettingsError(f"{path}: no such settings file") from None
        return GatewaySettings()
    except OSError as exc:
        raise SettingsError(f"{path}: cannot be read: {exc.strerror}") from None
    if len(raw) > _MAX_FILE:
        raise SettingsError(f"{path}: larger than {_MAX_FILE} bytes")
    try:
        text = raw.decode()
    except UnicodeDecodeError:
        raise SettingsError(f"{path}: not UTF-8") from None
    return parse(text, str(path))
