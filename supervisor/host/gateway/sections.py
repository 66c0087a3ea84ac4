"""The gateway settings file's sections, each key with its default.

Every default is resolved here and nowhere else; settings.py reads the file and documents
each key.
"""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path
from typing import Annotated, Final, Self

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

from supervisor.host.gateway import spans
from supervisor.host.proxy.bounds import Bounds
from supervisor.host.record.database import SQLITE_FILE, Target

DEFAULT_ADDRESS: Final = "127.0.0.1"
DEFAULT_PORT: Final = 8400
DEFAULT_HEADER_TIMEOUT_S: Final = 10.0  # a slowloris holds a connection no longer than this
DEFAULT_BODY_TIMEOUT_S: Final = 60.0  # 16 MiB, the largest body, at 2.3 Mbit/s
# the unit gives a stop 30 s (TimeoutStopSec): at most this drain, then 20 s for the streams
MAX_DRAIN_S: Final = 5.0
# 16 of the largest bodies (16 MiB) at once. The process holds up to about twice the bytes
# counted (a body as it is joined, or beside what goes upstream in its place) and the document
# of the one body parsed at a time (16 MiB of token ids: about 100 MiB): under a GiB in all
DEFAULT_BODIES_BYTES: Final = 256 * 1024 * 1024
MIN_BODIES_BYTES: Final = 1024 * 1024  # below it, ordinary chats could never pass
DEFAULT_RUNNING: Final = 4  # an engine that publishes no slots (yet, or an older worker)
MAX_RUNNING: Final = 10_000
DEFAULT_WAITING: Final = 64
DEFAULT_FLEET_STALE_S: Final = 10.0
DEFAULT_FLEET_PUBLISH_S: Final = 1.0
MACHINE_NAME: Final = r"^(|[a-z0-9][a-z0-9-]{0,62})$"  # a host name's label; "": none
DEFAULT_PER_KEY_WAITING: Final = 16  # a quarter of the waiting: see the docstring
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
# a minute: an engine that cannot generate is seen within a minute, at one token a minute
DEFAULT_PROBE_INTERVAL_S: Final = 60.0
MIN_PROBE_INTERVAL_S: Final = 0.05
DEFAULT_PROBE_TIMEOUT_S: Final = 30.0  # a one-token answer; a loaded engine queues it first
RECORD_DIR: Final = "record"  # <data>/record/: the SQLite record's directory
_DSN_SCHEMES: Final = ("postgresql://", "postgres://")


def config_home() -> Path:
    raw = os.environ.get("XDG_CONFIG_HOME")
    return (Path(raw) if raw else Path("~/.config")).expanduser() / "lucia"


def _expand(value: object) -> object:
    if isinstance(value, str):
        if value.startswith("~"):
            value = os.path.expanduser(value)
        if not value.startswith("/"):
            raise ValueError(f"{value!r} must be an absolute path (or start with ~/)")
    return value


FilePath = Annotated[Path, BeforeValidator(_expand)]


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
    # the load balancers (addresses or networks) whose X-Forwarded-For names the client
    trusted_proxies: tuple[str, ...] = ()
    drain_s: float = Field(default=0, ge=0, le=MAX_DRAIN_S)  # /healthz 503 this long at a stop

    @field_validator("address")
    @classmethod
    def _an_address(cls, value: str) -> str:
        ipaddress.ip_address(value)  # its ValueError says what is wrong
        return value

    @field_validator("trusted_proxies")
    @classmethod
    def _networks(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        networks = tuple(ipaddress.ip_network(item, strict=False) for item in value)
        if any(network.prefixlen == 0 for network in networks):
            raise ValueError("a network of every address would let any client name its own")
        return tuple(map(str, networks))

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

    @property
    def proxies(self) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
        return tuple(ipaddress.ip_network(item) for item in self.trusted_proxies)


class Keys(_Section):
    owner_file: FilePath = Field(default_factory=lambda: config_home() / "owner.key")
    inference_file: FilePath = Field(default_factory=lambda: config_home() / "inference.key")


class EngineLimits(_Section):
    """Admission for one engine; None: the [limits] value (for running, that set by hand,
    else the engine's own)."""

    running: int | None = Field(default=None, ge=1, le=MAX_RUNNING)
    waiting: int | None = Field(default=None, ge=0, le=100_000)
    per_key_waiting: int | None = Field(default=None, ge=1, le=100_000)
    max_wait_s: float | None = Field(default=None, gt=0, le=86_400)
    deadline_s: float | None = Field(default=None, gt=0, le=86_400)


class Limits(_Section):
    running: int | None = Field(default=None, ge=1, le=MAX_RUNNING)  # None: follow the engine
    waiting: int = Field(default=DEFAULT_WAITING, ge=0, le=100_000)
    per_key_waiting: int = Field(default=DEFAULT_PER_KEY_WAITING, ge=1, le=100_000)
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


class ProbeSettings(_Section):
    interval_s: float = Field(default=DEFAULT_PROBE_INTERVAL_S, ge=0, le=86_400)  # 0: off
    timeout_s: float = Field(default=DEFAULT_PROBE_TIMEOUT_S, gt=0, le=3600)

    @field_validator("interval_s")
    @classmethod
    def _off_or_an_interval(cls, value: float) -> float:
        if 0 < value < MIN_PROBE_INTERVAL_S:
            raise ValueError(f"0 (no probe) or at least {MIN_PROBE_INTERVAL_S:g} s")
        return value


class TracingSettings(_Section):
    endpoint: Annotated[str, AfterValidator(spans.receiver_url)] = ""  # "": off
    service_name: str = Field(default="lucia-gateway", pattern=spans.SERVICE_NAME)
    sample_ratio: float = Field(default=1.0, ge=0, le=1)  # every trace: a span tree is cheap
    metrics_interval_s: float = Field(default=60, ge=0.5, le=86_400)  # OpenTelemetry's own
    timeout_s: float = Field(default=10, gt=0, le=600)  # OpenTelemetry's own


class FleetSettings(_Section):
    """Several machines as one service (host/fleet): off while `machine` is empty. On, the
    record must be PostgreSQL ([record] dsn), where the catalog of every machine's engines is
    shared, and `advertise` is where the other machines' gateways reach this one."""

    machine: str = Field(default="", pattern=MACHINE_NAME)  # "": not in a fleet
    advertise: str = Field(default="", pattern=r"^(|https?://[^/\s]+)$")  # scheme://host:port
    peers_file: FilePath = Field(default_factory=lambda: config_home() / "peers.keys")
    stale_s: float = Field(default=DEFAULT_FLEET_STALE_S, ge=2, le=3600)  # a row older: unrouted
    publish_s: float = Field(default=DEFAULT_FLEET_PUBLISH_S, ge=0.2, le=60)  # at most this often
    ca_file: FilePath | None = None  # with [listen] tls_cert: the CA of every gateway's cert

    @property
    def on(self) -> bool:
        return self.machine != ""

    @model_validator(mode="after")
    def _reachable(self) -> Self:
        if self.on and not self.advertise:
            raise ValueError("machine is set: advertise must say where peers reach this gateway")
        if self.publish_s * 2 > self.stale_s:
            raise ValueError("stale_s must be at least twice publish_s, or live rows go stale")
        return self


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
