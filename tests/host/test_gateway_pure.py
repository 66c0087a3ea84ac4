"""The gateway's pure parts, as tables: bodies, admission, start plans, the usage filter and
the settings."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import pytest

from supervisor.host.gateway.sections import DEFAULT_RUNNING, MAX_RUNNING, running_bound
from supervisor.host.gateway.settings import SettingsError, parse
from supervisor.host.proxy import body
from supervisor.host.proxy.admission import Admission, decide
from supervisor.host.proxy.catalog import CatalogEntry, route
from supervisor.host.proxy.starter import operator_stop, plan
from supervisor.host.proxy.usage import UsageFilter
from supervisor.host.web.refusal import Refusal
from supervisor.protocol.documents import DesiredFile, Status, utc_now

NOW = utc_now()
BOUNDS = parse("[limits]\nmax_tokens = 100\n", "test").limits.bounds


ASKED = {"include_usage": True, "continuous_usage_stats": True}


@pytest.mark.parametrize(
    ("path", "document", "stream", "hide", "strip", "options"),
    [
        (body.CHAT, {"model": "m"}, False, False, False, None),
        (body.CHAT, {"model": "m", "stream": True}, True, True, True, ASKED),
        (
            body.CHAT,
            {"model": "m", "stream": True, "stream_options": {"include_usage": False}},
            True,
            True,
            True,
            ASKED,
        ),
        (
            body.COMPLETIONS,
            {"model": "m", "stream": True, "stream_options": {"include_usage": True}},
            True,
            False,
            True,
            ASKED,
        ),
        (
            body.COMPLETIONS,
            {"model": "m", "stream": True, "stream_options": ASKED},
            True,
            False,
            False,
            ASKED,
        ),
        (body.RESPONSES, {"model": "m", "stream": True}, True, False, False, None),
        (body.EMBEDDINGS, {"model": "m", "input": "x"}, False, False, False, None),
    ],
)
def test_the_engines_counts_are_asked_upstream_only_for_streams_that_did_not(
    path: str, document: dict[str, Any], stream: bool, hide: bool, strip: bool, options: Any
) -> None:
    prepared = body.prepare(path, json.dumps(document).encode(), BOUNDS)
    assert (prepared.model, prepared.stream, prepared.hide_usage) == ("m", stream, hide)
    assert prepared.strip_usage == strip
    sent = json.loads(prepared.body)
    assert sent.get("stream_options") == options
    assert sent.get("timings_per_token") == (True if stream else None)


@pytest.mark.parametrize(
    "raw",
    [
        '{"model": "m", "stream": true, "messages": [{"role": "user", "content": "h\u00e9"}]}',
        ' \n\t{"stream":true,"model":"m","messages":[{"role":"user","content":"été ✓"}]}',
        '{"model": "m", "stream": true, "prompt": "' + "long " * 20000 + '"}',
    ],
)
def test_include_usage_goes_before_the_clients_own_bytes(raw: str) -> None:
    prepared = body.prepare(body.CHAT, raw.encode(), BOUNDS)
    document = json.loads(prepared.body)
    asked = {"stream_options": ASKED, "timings_per_token": True, "n_predict": 100}
    assert document == {**json.loads(raw), **asked}
    assert prepared.body.endswith(raw.lstrip()[1:].encode())  # not serialised again
    assert prepared.hide_usage


@pytest.mark.parametrize(
    ("raw", "model", "sent"),
    [  # what a peer gateway is sent: the client's own bytes, nothing this side added
        (b'{"model": "m", "stream": true, "prompt": "x"}', "m", None),
        (b'{"model": "fast", "stream": true, "prompt": "x"}', "m", {"model": "m"}),
        (b'{"stream": true, "prompt": "x"}', "m", {"model": "m"}),  # the default tier's
    ],
)
def test_a_peer_is_sent_the_clients_body_naming_the_model(
    raw: bytes, model: str, sent: dict[str, str] | None
) -> None:
    prepared = body.prepare(body.COMPLETIONS, raw, BOUNDS, default="m")
    assert prepared.body != raw  # this side's stream_options and bound
    out = body.as_sent(prepared, model)
    assert out == raw if sent is None else json.loads(out) == {**json.loads(raw), **sent}


@pytest.mark.parametrize(
    ("raw", "status", "words"),
    [
        (b'{"model": 1}', 400, "model must be a non-empty string"),
        (b'{"model": ""}', 400, "model must be"),
        (b'{"model": "m", "stream": "yes"}', 400, "stream must be"),
        (b'{"model": "m", "stream_options": 3}', 400, "stream_options must be"),
        (b'{"model": "m", "max_tokens": true}', 400, "max_tokens"),
        (b'{"model": "m", "max_tokens": 101}', 400, "from 1 to 100"),
        (b'{"model": "m", "max_completion_tokens": 0}', 400, "max_completion_tokens"),
        (b'{"model": "m", "max_output_tokens": 1.5}', 400, "max_output_tokens"),
        (b'{"model": "m"', 400, "line 1 column 14"),
        (b'{"model": "m", "x": NaX}', 400, "malformed JSON"),
        (b"\xc3(", 400, "not UTF-8"),
        (b"x" * (body.TEXT_LIMIT + 1), 413, "2 MiB"),
    ],
)
def test_bad_bodies_are_refused_naming_why(raw: bytes, status: int, words: str) -> None:
    with pytest.raises(Refusal) as caught:
        body.prepare(body.CHAT, raw, BOUNDS)
    assert caught.value.status == status
    assert words in caught.value.message


@pytest.mark.parametrize("value", [1, 100])
def test_token_bounds_within_the_range_pass(value: int) -> None:
    raw = json.dumps({"model": "m", "max_tokens": value}).encode()
    assert body.prepare(body.CHAT, raw, BOUNDS).body == raw  # a null one: see bounds


LIMITS = Admission(running=2, waiting=3, max_wait_s=1, deadline_s=60, per_key_waiting=3)


@pytest.mark.parametrize(
    ("running", "waiting", "verdict"),
    [
        (0, 0, "run"),
        (1, 0, "run"),
        (2, 0, "wait"),
        (1, 1, "wait"),  # a free slot, but someone is first in line
        (2, 2, "wait"),
        (2, 3, "refuse"),
        (0, 3, "refuse"),  # every waiter counts, loaded engine or not
    ],
)
def test_admission_decides_by_both_bounds(running: int, waiting: int, verdict: str) -> None:
    assert decide(running, waiting, 0, LIMITS) == verdict


@pytest.mark.parametrize(
    ("running", "waiting", "bound", "verdict"),
    [
        (3, 0, 1, "wait"),  # the bound fell under what runs: nothing new starts
        (1, 0, 1, "wait"),
        (0, 0, 1, "run"),
        (1, 0, 4, "run"),  # it rose: a free slot at once
        (3, 3, 1, "refuse"),  # the waiting bound holds as before
    ],
)
def test_admission_decides_by_the_bound_of_now(
    running: int, waiting: int, bound: int, verdict: str
) -> None:
    limits = Admission(bound, 3, max_wait_s=1, deadline_s=60, per_key_waiting=3)
    assert decide(running, waiting, 0, limits) == verdict


@pytest.mark.parametrize(
    ("engine_set", "limits_set", "slots", "bound"),
    [
        (None, None, None, DEFAULT_RUNNING),  # nothing published (yet), nothing set
        (None, None, 1, 1),  # a router whose 4 slots share a cache holding one context
        (None, None, 6, 6),  # the sum over the engine's models
        (None, None, 128, 128),  # vLLM's max_num_seqs
        (None, None, 10**6, MAX_RUNNING),
        (None, None, 0, DEFAULT_RUNNING),
        (None, 2, 8, 2),  # the operator's [limits] running stands
        (None, 8, 1, 8),
        (3, 2, 8, 3),  # [engines.NAME] over [limits]
        (3, None, None, 3),
    ],
)
def test_the_running_bound_is_the_operators_else_the_engines_else_four(
    engine_set: int | None, limits_set: int | None, slots: int | None, bound: int
) -> None:
    assert running_bound(engine_set, limits_set, slots) == bound


@pytest.mark.parametrize(
    ("text", "slots", "big", "small"),
    [
        ("", None, 4, 4),
        ("", 1, 1, 1),
        ("[limits]\nrunning = 2", 1, 2, 2),
        ("[engines.big]\nrunning = 6", 1, 6, 1),
        ("[engines.big]\nwaiting = 6", 3, 3, 3),  # its other limits leave running to the engine
    ],
)
def test_settings_resolve_the_running_bound_with_the_engines_slots(
    text: str, slots: int | None, big: int, small: int
) -> None:
    settings = parse(text, "gw.toml")
    assert (settings.limits.running is None) == ("[limits]" not in text)
    assert settings.admission("big", slots).running == big
    assert settings.admission("small", slots).running == small


@pytest.mark.parametrize(
    ("slots", "expected"),
    [({}, None), ({"tiny": 1}, 1), ({"alpha": 4, "zeta": 2}, 6)],
)
def test_an_engines_slots_are_the_sum_over_its_models(
    slots: dict[str, int], expected: int | None
) -> None:
    found = status("running", 1, url="http://172.18.0.1:8080").model_copy(update={"slots": slots})
    assert CatalogEntry("e", found).slots == expected
    assert CatalogEntry("e", None).slots is None


def status(state: str, generation: int, age_s: float = 0, url: str | None = None) -> Status:
    checked = NOW - timedelta(seconds=age_s)
    return Status(
        generation=generation,
        state=state,  # type: ignore[arg-type]
        since=checked,
        message=state,
        url=url,
        checked_at=checked,
    )


def desired(value: str, generation: int, by: str | None = None) -> DesiredFile:
    said = {"requestedBy": by, "requestedAt": NOW - timedelta(minutes=5)} if by else {}
    return DesiredFile.model_validate(
        {"schemaVersion": 1, "generation": generation, "desired": value, **said}
    )


@pytest.mark.parametrize(
    ("request_", "answer", "step", "generation"),
    [
        (None, None, "unavailable", 0),
        (None, status("stopped", 0, age_s=61), "unavailable", 0),
        (desired("running", 2), status("running", 2, url="http://e:1"), "ready", 0),
        (None, status("stopped", 0), "request", 0),  # nobody asked for anything
        (desired("running", 5), status("stopped", 4), "follow", 5),  # asked, not yet answered
        (desired("running", 5), status("starting", 5), "follow", 5),
        (desired("running", 5), status("failed", 5), "request", 0),  # a new try
        (desired("running", 5, "operator"), status("stopped", 4), "follow", 5),
        # the gateway's own stop (idle, swap): started again on demand, even mid-stop
        (desired("stopped", 4, "gateway"), status("stopped", 4), "request", 0),
        (desired("stopped", 6, "gateway"), status("stopping", 6), "request", 0),
        (desired("stopped", 6, "gateway"), status("running", 5, url="http://e:1"), "request", 0),
        # an operator's stop stands, settled or still in progress, worker fresh or not
        (desired("stopped", 4, "operator"), status("stopped", 4), "stopped", 4),
        (desired("stopped", 6, "operator"), status("stopping", 6), "stopped", 6),
        (desired("stopped", 6, "operator"), status("running", 5, url="http://e:1"), "stopped", 6),
        (desired("stopped", 6, "operator"), status("stopped", 6, age_s=61), "stopped", 6),
        (desired("stopped", 6, "operator"), None, "stopped", 6),
        # an older host's stop names no requester: an operator's
        (desired("stopped", 4), status("stopped", 4), "stopped", 4),
        (desired("stopped", 6), status("running", 5, url="http://e:1"), "stopped", 6),
    ],
)
def test_a_start_plan_follows_the_request_on_file(
    request_: DesiredFile | None, answer: Status | None, step: str, generation: int
) -> None:
    got = plan(request_, answer, NOW)
    assert (got.step, got.generation) == (step, generation)
    assert (got.url == "http://e:1") is (step == "ready")


def test_the_refusal_of_an_operators_stop_says_who_when_and_the_way_on() -> None:
    refusal = operator_stop("demo-router", desired("stopped", 15, "operator"))
    when = f"{NOW - timedelta(minutes=5):%Y-%m-%dT%H:%M:%S}"
    assert (refusal.status, refusal.code) == (503, "model_not_loaded")
    assert refusal.message.startswith(
        f"engine demo-router is not loaded: stopped by an operator at {when}"
    )
    assert "(generation 15)" in refusal.message
    assert "lucia-supervisor request demo-router running" in refusal.message
    stopped = refusal.body()["stoppedBy"]
    assert (stopped["requestedBy"], stopped["generation"]) == ("operator", 15)
    assert stopped["requestedAt"].startswith(when) and stopped["requestedAt"].endswith("Z")
    older = operator_stop("e", desired("stopped", 4))
    assert "an older host's request" in older.message and "not recorded" in older.message
    assert older.body()["stoppedBy"] == {
        "requestedBy": "operator",
        "requestedAt": None,
        "generation": 4,
    }


def engine(
    name: str,
    answer: Status | None,
    request_: DesiredFile | None = None,
    models: tuple[str, ...] = ("tiny",),
) -> CatalogEntry:
    if answer is not None:
        answer = answer.model_copy(update={"models": models})
    return CatalogEntry(name, answer, request_)


URL = "http://e:1"
RUNNING = status("running", 1, url=URL)
STALE_RUNNING = status("running", 1, age_s=126, url=URL)  # the measured worker gone: 126 s
STOPPED = status("stopped", 1)


@pytest.mark.parametrize(
    ("engines", "full", "chosen"),
    [
        ([engine("a", RUNNING)], set(), "a"),
        # a worker gone silent is never chosen while another can serve (the measured 503s)
        ([engine("a", STALE_RUNNING), engine("b", RUNNING)], set(), "b"),
        ([engine("a", STALE_RUNNING), engine("b", STOPPED)], set(), "b"),  # b may be started
        ([engine("a", STALE_RUNNING), engine("b", None)], set(), "a"),  # none can: the first
        # serving with a free slot, then serving (its gate queues), then a start
        ([engine("a", RUNNING), engine("b", RUNNING)], set(), "a"),
        ([engine("a", RUNNING), engine("b", RUNNING)], {"a"}, "b"),
        ([engine("a", RUNNING), engine("b", RUNNING)], {"a", "b"}, "a"),
        ([engine("a", STOPPED), engine("b", RUNNING)], {"b"}, "b"),
        (
            [engine("a", STOPPED), engine("b", status("starting", 2), desired("running", 2))],
            set(),
            "b",
        ),  # a start under way before a new one
        # an operator's stop: never started on demand, and never served while it goes on
        (
            [engine("a", STOPPED, desired("stopped", 1, "operator")), engine("b", STOPPED)],
            set(),
            "b",
        ),
        (
            [engine("a", RUNNING, desired("stopped", 2, "operator")), engine("b", STOPPED)],
            set(),
            "b",
        ),
        ([engine("a", STOPPED, desired("stopped", 1)), engine("b", STOPPED)], set(), "b"),
        # the gateway's own stop (idle): it may be started again, like any stopped engine
        (
            [engine("a", STOPPED, desired("stopped", 1, "gateway")), engine("b", STALE_RUNNING)],
            set(),
            "a",
        ),
        # none can serve: the operator's stop says more than a silent worker
        (
            [engine("a", STALE_RUNNING), engine("b", STOPPED, desired("stopped", 1, "operator"))],
            set(),
            "b",
        ),
        # only the engines naming the model count
        ([engine("a", RUNNING, models=("other",)), engine("b", STOPPED)], set(), "b"),
    ],
)
def test_route_picks_the_engine_best_able_to_serve(
    engines: list[CatalogEntry], full: set[str], chosen: str
) -> None:
    found, model = route("tiny", engines, {}, NOW, lambda e: e.name not in full)
    assert (found.name, model) == (chosen, "tiny")
    # the order the engines are listed in never matters, only their names
    assert route("tiny", engines[::-1], {}, NOW, lambda e: e.name not in full)[0].name == chosen


def test_route_resolves_a_tier_and_refuses_an_unknown_model_naming_those_there_are() -> None:
    engines = [engine("a", RUNNING), engine("b", STOPPED, models=("big",))]
    assert route("fast", engines, {"fast": "big"}, NOW)[0].name == "b"
    with pytest.raises(Refusal) as refused:
        route("nope", engines, {"fast": "big"}, NOW)
    assert refused.value.status == 404 and "big, fast, tiny" in refused.value.message


@pytest.mark.parametrize(
    ("answer", "request_", "url"),
    [
        (RUNNING, None, URL),
        (RUNNING, desired("running", 1, "operator"), URL),
        (STALE_RUNNING, None, None),
        (RUNNING, desired("stopped", 2, "operator"), None),  # a stop under way: not served
        (RUNNING, desired("stopped", 2, "gateway"), None),
        (STOPPED, None, None),
    ],
)
def test_an_engine_is_served_directly_only_while_it_runs_and_nobody_asked_it_to_stop(
    answer: Status, request_: DesiredFile | None, url: str | None
) -> None:
    assert CatalogEntry("e", answer, request_).url(NOW) == url


CONTENT = b'data: {"choices":[{"delta":{"content":"a"}}],"usage":null}\n\n'
USAGE = b'data: {"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":2}}\n\n'
DONE = b"data: [DONE]\n\n"


@pytest.mark.parametrize("cut", [1, 7, len(CONTENT), len(CONTENT) + 5, len(CONTENT + USAGE) - 1])
@pytest.mark.parametrize("hide", [True, False])
def test_the_usage_chunk_is_kept_from_a_client_that_did_not_ask(cut: int, hide: bool) -> None:
    stream = CONTENT + USAGE + DONE
    usage = UsageFilter(hide)
    first = usage.feed(stream[:cut])
    out = first + usage.feed(stream[cut:]) + usage.close()
    assert out == (CONTENT + DONE if hide else stream)
    assert usage.usage == {"prompt_tokens": 1, "completion_tokens": 2}
    assert first == (CONTENT if cut >= len(CONTENT) else b"")  # finished events go on at once


VLLM = b'data: {"choices":[{"delta":{"content":"b"}}],"usage":null}\n\n'
CRLF_CONTENT = CONTENT.replace(b"\n", b"\r\n")
CRLF_USAGE = USAGE.replace(b"\n", b"\r\n")
TEXT = b'data: {"choices":[{"delta":{"content":"\\"usage\\" [] x"}}]}\n\n'
NOT_ONLY = b'data: {"choices":[{"delta":{}}],"usage":{"prompt_tokens":9}}\n\n'
COMMENT = b": keepalive\n\n"


@pytest.mark.parametrize(
    ("events", "usage_at"),
    [
        ([CONTENT, VLLM, VLLM, USAGE, DONE], 3),  # vLLM: "usage":null in every chunk
        ([CRLF_CONTENT, CRLF_CONTENT, CRLF_USAGE, b"data: [DONE]\r\n\r\n"], 2),
        ([COMMENT, CONTENT, COMMENT, USAGE, DONE], 3),  # comments (keepalives) around it
        ([TEXT, TEXT, USAGE, DONE], 2),  # content that names "usage" and []
        ([NOT_ONLY, CONTENT, DONE], None),  # usage beside choices: the client's
        ([CONTENT, DONE], None),
    ],
)
@pytest.mark.parametrize("split", ["whole", "bytes", "events"])
@pytest.mark.parametrize("hide", [True, False])
def test_only_the_usage_only_event_is_kept_back_however_the_stream_is_cut(
    events: list[bytes], usage_at: int | None, split: str, hide: bool
) -> None:
    stream = b"".join(events)
    pieces = {
        "whole": [stream],
        "bytes": [stream[i : i + 1] for i in range(len(stream))],
        "events": events,
    }[split]
    usage = UsageFilter(hide)
    out = b"".join(usage.feed(piece) for piece in pieces) + usage.close()
    kept = [e for i, e in enumerate(events) if not (hide and i == usage_at)]
    assert out == b"".join(kept)
    assert usage.usage == (
        None if usage_at is None else {"prompt_tokens": 1, "completion_tokens": 2}
    )


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("[listen]\nport = -1", "listen.port"),
        ('[listen]\naddress = "localhost"', "listen.address"),
        ('[listen]\ntls_cert = "/c"', "tls_cert and tls_key come together"),
        ('[keys]\nowner_file = "relative"', "must be an absolute path"),
        ("[limits]\nrunning = 0", "limits.running"),
        ("[limits]\nmax_wait_s = -1", "limits.max_wait_s"),
        ("[limits]\ndeadline_s = 0", "limits.deadline_s"),
        ("[engines.big]\ndeadline_s = 0", "engines.big.deadline_s"),
        ("[engines.big]\nrunnig = 1", "engines.big.runnig: unknown setting"),
        ("[limit]\nrunning = 1", "limit: unknown setting"),
        ("[limits\n", "not valid TOML"),
        ("[page]\nsession_s = 0.5", "page.session_s"),
        ("[page]\nsession_hours = 1", "page.session_hours: unknown setting"),
        (
            '[tiers]\n"fast model" = "tiny"',
            "tiers: alias 'fast model' is not a served name: it "
            "has a space: a served name has letters, digits and . _ : @ + - / only",
        ),
        ('[tiers]\n"Qwen 7B (Q4)" = "tiny"', "tiers: alias 'Qwen 7B (Q4)' is not a served name"),
        ('[tiers]\n"" = "tiny"', "tiers: alias '' is not a served name: it is empty"),
        ('[tiers]\n"-fast" = "tiny"', "tiers: alias '-fast' is not a served name: it starts"),
        ('[tiers]\n"a/../b" = "tiny"', "tiers: alias 'a/../b' is not a served name: it has '..'"),
        ('[tiers]\n"rápido" = "tiny"', "tiers: alias 'rápido' is not a served name"),
        ('[fleet]\nmachine = "Spark 1"', "fleet.machine"),
        ('[fleet]\nmachine = "spark"', "advertise must say where peers reach this gateway"),
        ('[fleet]\nadvertise = "10.0.0.2:8400"', "fleet.advertise"),
        ('[fleet]\nadvertise = "http://h:1/v1"', "fleet.advertise"),
        ("[fleet]\nstale_s = 1", "fleet.stale_s"),
        ("[fleet]\nstale_s = 3\npublish_s = 2", "at least twice publish_s"),
        (
            '[fleet]\nmachine = "spark"\nadvertise = "http://10.0.0.2:8400"',
            "the fleet's catalog is in PostgreSQL, so [record] must be enabled with a dsn",
        ),
        (
            '[fleet]\nmachine = "spark"\nadvertise = "http://10.0.0.2:8400"\n'
            '[record]\nenabled = false\ndsn = "postgresql://db/lucia"',
            "[record] must be enabled with a dsn",
        ),
    ],
)
def test_bad_settings_name_the_setting(text: str, words: str) -> None:
    with pytest.raises(SettingsError, match=r"^gw\.toml: ") as caught:
        parse(text, "gw.toml")
    assert words in str(caught.value)


def test_a_fleet_machine_on_postgresql() -> None:
    settings = parse(
        '[fleet]\nmachine = "spark-1"\nadvertise = "https://10.0.0.2:8400"\n'
        '[record]\ndsn = "postgresql://lucia@db/lucia"',
        "gw.toml",
    )
    assert settings.fleet.on
    assert (settings.fleet.machine, settings.fleet.stale_s, settings.fleet.publish_s) == (
        "spark-1",
        10.0,
        1.0,
    )
    assert not parse("", "gw.toml").fleet.on  # off by default


def test_a_tier_alias_is_a_served_name_naming_any_model() -> None:
    """The alias keeps the rule; the model it names may be one from before it (a library's
    GGUF of that name is served still)."""
    settings = parse(
        '[tiers]\nfast = "Qwen 7B (Q4)"\n"qwen2.5:7b" = "tiny"\n"org/m@v1" = "tiny"', "gw.toml"
    )
    assert settings.tiers == {"fast": "Qwen 7B (Q4)", "qwen2.5:7b": "tiny", "org/m@v1": "tiny"}


def test_settings_defaults_and_engine_overrides() -> None:
    settings = parse(
        '[engines.big]\nrunning = 1\ndeadline_s = 7200\n[listen]\naddress = "0.0.0.0"', "gw.toml"
    )
    assert settings.admission("big") == Admission(
        1, 64, max_wait_s=30.0, deadline_s=7200.0, per_key_waiting=16
    )
    assert settings.admission("small") == Admission(
        4, 64, max_wait_s=30.0, deadline_s=1800.0, per_key_waiting=16
    )
    assert settings.listen.port == 8400
    assert settings.idle.stop_after_s == 0
    assert settings.page.session_s == 12 * 3600
    assert parse("[page]\nsession_s = 1.5", "gw.toml").page.session_s == 1.5
    assert "listen.tls_cert" in settings.warnings()[0]
    assert parse("", "gw.toml").warnings() == []
