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
trusted_proxies = []           # the load balancers (addresses, or networks: "10.0.0.0/24")
                               # whose X-Forwarded-For is believed: a request from one counts,
                               # for the invalid-key limit and the page's sign-in, as from the
                               # rightmost address the header names that no trusted proxy
                               # holds; from any other address the header is ignored
drain_s = 0                    # at a stop, /healthz answers 503 this long (at most 5 s) while
                               # the gateway still serves, so a load balancer's health check
                               # takes it out before it stops listening; 0: it stops at once

[keys]
owner_file = "~/.config/lucia/owner.key"
inference_file = "~/.config/lucia/inference.key"

[tiers]                        # aliases a request's `model` may name: each a served name
fast = "qwen2.5-0.5b"          # (protocol.names: letters, digits and . _ : @ + - /), the
                               # model it names any name an engine serves
default = "fast"               # the tier a request that names no model goes to (no `model`,
                               # or null); unset: such a request is refused 400. Not an alias:
                               # it names one of the other keys here, else the gateway does
                               # not start

[limits]                       # for every engine, unless [engines.NAME] says otherwise
                               # (running, waiting, per_key_waiting, max_wait_s, deadline_s)
# running = 4                  # requests forwarded at once; unset (the default): as many as
                               # the engine holds (its status.json `slots`, summed over the
                               # models it has loaded: an engine serving several models takes
                               # their sum, which one model's burst may exceed), else 4 while
                               # it publishes none (a router publishes them once it runs)
waiting = 64                   # requests held for a slot
per_key_waiting = 16           # of those, at most this many of one key; one more: 429
                               # key_busy. A quarter of the 64: a backfill of hundreds of
                               # generations leaves 48 places to the others (three such
                               # backfills at once still 16), and a client that keeps its
                               # requests in flight to the engine's slots and 16 more never
                               # meets it. What runs is not counted. Every key has its own
                               # share, the owner's and the one inference key's too (all who
                               # call with that key share it)
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
                               # owner key has none, nor has a key made exempt (`keys create
                               # --exempt`, `keys exempt ID on`), whose use is still counted

[record]                       # one row per generation, no text; each key's daily spending
enabled = true                 # false: nothing is recorded and no budget can be enforced
path = "<data>/record/record.sqlite3"   # the SQLite file (the default: the host's data dir)
# dsn = "postgresql://lucia@db.example/lucia"   # instead of path: PostgreSQL, which several
                               # gateways share; put a password in ~/.pgpass, not here
retention_days = 90            # rows (and daily totals) older are pruned; 0: kept for ever

[page]                         # the operator's page at /page/
session_s = 43200              # a sign-in lasts this long (12 hours; at least 1 s): the
                               # session and its cookie's Max-Age

[probe]                        # a one-token text completion to each serving engine's model
interval_s = 60                # this often (0: never; else at least 0.05 s); an engine that
                               # fails it is `degraded` in /v1/models and on the page until
                               # one succeeds. Never an engine that is not serving (it is
                               # never started for a probe), never while its slots are full
timeout_s = 30                 # a probe unanswered this long fails (`timed_out`)

[tracing]                      # OTLP/HTTP: a span per request, the meter Lucia.Inference
endpoint = ""                  # "": off; else http(s)://host:port[/prefix]: spans go to
                               # <endpoint>/v1/traces, metrics to <endpoint>/v1/metrics
service_name = "lucia-gateway" # the resource's service.name
sample_ratio = 1.0             # of the traces it begins; a caller's traceparent decides its own
metrics_interval_s = 60        # the metrics are exported this often (at least 0.5 s)
timeout_s = 10                 # an export waits this long for the receiver (in a thread)

[fleet]                        # several machines as one service: needs [record] dsn
machine = ""                   # this machine's name in the fleet ("": not in one)
advertise = ""                 # where the other gateways reach this one: http(s)://host:port
peers_file = "~/.config/lucia/peers.keys"   # every machine's peer key, one `name key` a line
stale_s = 10                   # a machine not heard from this long is not routed to
publish_s = 1                  # a changed engine reaches the catalog at most this often
ca_file = "/etc/lucia/fleet-ca.crt"   # with [listen] tls_cert (and only then): the CA that
                               # signed every gateway's certificate. The gateways then
                               # authenticate each other by mutual TLS as well as peer keys
```
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Final, Self

from pydantic import Field, ValidationError, field_validator, model_validator

from supervisor.host.gateway.sections import (
    BudgetSettings,
    EngineLimits,
    FleetSettings,
    Idle,
    Keys,
    Limits,
    Listen,
    PageSettings,
    ProbeSettings,
    Record,
    TracingSettings,
    _Section,
    config_home,
    running_bound,
)
from supervisor.host.proxy.admission import Admission
from supervisor.protocol import names

SETTINGS_ENV: Final = "LUCIA_GATEWAY_SETTINGS"
DEFAULT_TIER: Final = "default"  # the [tiers] key naming the tier of a request with no model
_MAX_FILE: Final = 1024 * 1024


def settings_file(value: str | None = None) -> tuple[Path, bool]:
    """The settings file, and whether it was named (the argument or the environment)."""
    raw = value or os.environ.get(SETTINGS_ENV)
    if raw:
        return Path(raw).expanduser().absolute(), True
    return (config_home() / "gateway.toml").absolute(), False


class SettingsError(ValueError):
    """Settings the gateway cannot start with; str() names the file, the setting and the rule."""


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
    probe: ProbeSettings = Field(default_factory=ProbeSettings)
    tracing: TracingSettings = Field(default_factory=TracingSettings)
    fleet: FleetSettings = Field(default_factory=FleetSettings)

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
        default = value.get(DEFAULT_TIER)
        aliases = sorted(alias for alias in value if alias != DEFAULT_TIER)
        if default is not None and default not in aliases:
            raise ValueError(
                f"{DEFAULT_TIER} names the tier a request without a model goes to, and "
                f"{default!r} is not one: the tiers are {', '.join(aliases) or 'none'}"
            )
        return value

    @model_validator(mode="after")
    def _fleet_on_postgresql(self) -> Self:
        if self.fleet.on and (self.record.dsn is None or not self.record.enabled):
            raise ValueError(
                "fleet.machine is set: the fleet's catalog is in PostgreSQL, so [record] must be "
                "enabled with a dsn"
            )
        if self.fleet.ca_file is not None and not self.listen.tls:
            raise ValueError("fleet.ca_file is for mutual TLS: set [listen] tls_cert too")
        if self.fleet.on and self.listen.tls and self.fleet.ca_file is None:
            raise ValueError(
                "fleet.machine and listen.tls_cert are set: the gateways authenticate each "
                "other by mutual TLS, so [fleet] ca_file must name the CA that signed every "
                "gateway's certificate"
            )
        return self

    @property
    def aliases(self) -> dict[str, str]:
        """The tier aliases a request's model may name: every [tiers] key but `default`."""
        return {alias: model for alias, model in self.tiers.items() if alias != DEFAULT_TIER}

    @property
    def default_tier(self) -> str | None:
        """The tier a request that names no model goes to; None: it is refused."""
        return self.tiers.get(DEFAULT_TIER)

    def admission(self, engine: str, slots: int | None = None) -> Admission:
        """The engine's limits; `slots`: what it publishes it holds at once (None: nothing)."""
        own = self.engines.get(engine, EngineLimits())
        return Admission(
            running=running_bound(own.running, self.limits.running, slots),
            waiting=own.waiting if own.waiting is not None else self.limits.waiting,
            max_wait_s=own.max_wait_s if own.max_wait_s is not None else self.limits.max_wait_s,
            deadline_s=own.deadline_s if own.deadline_s is not None else self.limits.deadline_s,
            per_key_waiting=own.per_key_waiting
            if own.per_key_waiting is not None
            else self.limits.per_key_waiting,
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
