"""The probe's pure decisions, in tables: which engines' models are probed now, what an answer
means, the mark it leaves, the build a metric names, its settings and its record's caller."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from supervisor.host.gateway.settings import SettingsError, parse
from supervisor.host.proxy import probe
from supervisor.host.proxy.catalog import CatalogEntry
from supervisor.host.proxy.metrics import build_label
from supervisor.host.record.row import Build, Row, RowRefused
from supervisor.protocol.documents import DesiredFile, RunningEngine, Status

NOW = datetime(2026, 11, 30, 17, 0, 0, tzinfo=UTC)
URL = "http://172.18.0.1:8080"
ENGINE = RunningEngine(
    image="lucia-llama-server:1",
    image_id="sha256:cb1ee357bc78aaaa",
    container_id="c1",
    model="alpha",
    engine_version="b11669",
)


def status(
    state: str = "running",
    *,
    models: tuple[str, ...] = ("alpha",),
    slots: dict[str, int] | None = None,
    age_s: float = 0,
    since: datetime = NOW - timedelta(minutes=5),
    engine: RunningEngine | None = ENGINE,
    capabilities: dict[str, tuple[str, ...]] | None = None,
) -> Status:
    return Status(
        generation=1,
        state=state,  # type: ignore[arg-type]
        since=since,
        message=state,
        url=URL if state == "running" else None,
        checked_at=NOW - timedelta(seconds=age_s),
        models=models,
        slots=slots or {},
        engine=engine if state == "running" else None,
        capabilities=capabilities or {},
    )


def desired(value: str, by: str = "operator") -> DesiredFile:
    return DesiredFile.model_validate(
        {"schemaVersion": 1, "generation": 1, "desired": value, "requestedBy": by}
    )


def entry(name: str, found: Status | None, asked: DesiredFile | None = None) -> CatalogEntry:
    return CatalogEntry(name, found, asked or desired("running"))


@pytest.mark.parametrize(
    ("models", "slots", "probed"),
    [
        (("alpha",), {}, ("alpha",)),  # one model, no slots published: that one
        (("alpha",), {"alpha": 4}, ("alpha",)),
        (("alpha", "zeta"), {}, ()),  # a router that says nothing loaded: never loads one
        (("alpha", "zeta"), {"zeta": 1}, ("zeta",)),  # only what it has loaded
        (("alpha", "zeta"), {"zeta": 1, "alpha": 2}, ("alpha", "zeta")),
        (("served", "alias"), {"served": 128}, ("served",)),  # vLLM: its first served name
        (("alpha",), {"gone": 1}, ()),  # slots for a name it no longer serves
        ((), {}, ()),
    ],
)
def test_the_models_probed_are_those_loaded(
    models: tuple[str, ...], slots: dict[str, int], probed: tuple[str, ...]
) -> None:
    assert probe.probed_models(status(models=models, slots=slots)) == probed


@pytest.mark.parametrize(
    ("capabilities", "probed"),
    [
        ({}, ("alpha", "zeta")),  # nothing declared (a worker from before): both
        ({"alpha": ("chat", "completion")}, ("alpha", "zeta")),
        ({"alpha": ("embedding",)}, ("zeta",)),  # an embedding model is asked for no completion
        ({"alpha": ("chat",), "zeta": ()}, ()),  # declared, and no completion among it
    ],
)
def test_a_model_that_declares_no_completion_is_not_probed(
    capabilities: dict[str, tuple[str, ...]], probed: tuple[str, ...]
) -> None:
    found = status(
        models=("alpha", "zeta"), slots={"alpha": 1, "zeta": 1}, capabilities=capabilities
    )
    assert probe.probed_models(found) == probed


RUN = (NOW, "c1")


@pytest.mark.parametrize(
    ("last", "now", "expected"),
    [
        (None, 0.0, True),  # never probed: at once
        (probe.Last(100.0, RUN), 100.0, False),
        (probe.Last(100.0, RUN), 159.9, False),
        (probe.Last(100.0, RUN), 160.0, True),  # an interval on
        (probe.Last(100.0, (NOW, "c2")), 100.0, True),  # a new container: at once
        (probe.Last(100.0, (NOW - timedelta(seconds=1), "c1")), 100.0, True),  # a new run
    ],
)
def test_a_probe_is_due_at_once_in_a_new_run_then_every_interval(
    last: probe.Last | None, now: float, expected: bool
) -> None:
    assert probe.due(last, RUN, now, 60.0) is expected


SERVING = entry("e", status())


@pytest.mark.parametrize(
    ("engines", "kwargs", "expected"),
    [
        ([SERVING], {}, [("e", "alpha")]),
        ([SERVING], {"interval_s": 0}, []),  # the probe is off
        ([entry("e", status("stopped"))], {}, []),  # never an engine that is not serving
        ([entry("e", status("starting"))], {}, []),
        ([entry("e", status("failed"))], {}, []),
        ([entry("e", None)], {}, []),
        ([entry("e", status(age_s=61))], {}, []),  # its worker gone silent
        ([entry("e", status(), desired("stopped"))], {}, []),  # an operator's stop under way
        ([entry("e", status(), desired("stopped", "gateway"))], {}, []),
        ([SERVING], {"stopping": {"e"}}, []),  # being stopped for idling
        ([SERVING], {"free": lambda _: False}, []),  # its slots full, or a request waits
        ([SERVING], {"busy": {("e", "alpha")}}, []),  # its last probe still in flight
        ([SERVING], {"last": {("e", "alpha"): probe.Last(0.0, probe.run_of(status()))}}, []),
        (
            [entry("r", status(models=("alpha", "zeta"), slots={"zeta": 1})), SERVING],
            {},
            [("r", "zeta"), ("e", "alpha")],
        ),
        ([entry("r", status(models=("alpha", "zeta")))], {}, []),  # nothing known loaded
    ],
)
def test_only_serving_engines_with_a_free_slot_are_probed(
    engines: list[CatalogEntry], kwargs: dict[str, Any], expected: list[tuple[str, str]]
) -> None:
    options: dict[str, Any] = {"last": {}, "interval_s": 60.0, **kwargs}
    found = probe.targets(engines, NOW, 30.0, **options)
    assert [(target.engine, target.model) for target in found] == expected
    assert all(target.url == URL for target in found)


def test_the_probe_asks_one_greedy_token_of_a_text_completion() -> None:
    assert probe.body("alpha") == {
        "model": "alpha",
        "prompt": probe.PROMPT,
        "max_tokens": 1,
        "temperature": 0,
        "stream": False,
    }
    assert probe.PATH == "/v1/completions"


@pytest.mark.parametrize(
    ("answer", "verdict", "outcome", "reason"),
    [
        (probe.ProbeAnswer("answered", 200, 1), "ok", "ok", ""),
        (probe.ProbeAnswer("answered", 200, 0), "failed", "engine_error", "no generated choice"),
        (probe.ProbeAnswer("answered", 500), "failed", "engine_error", "answered 500"),
        (probe.ProbeAnswer("answered", 503), "failed", "engine_error", "answered 503"),
        # the engine refused the request itself (an embedding model's completion): it reasons
        (probe.ProbeAnswer("answered", 400), "inconclusive", "engine_error", "answered 400"),
        (probe.ProbeAnswer("answered", 404), "inconclusive", "engine_error", "answered 404"),
        # a route the server does not implement: refused as a 4xx is, not a failure to generate
        (probe.ProbeAnswer("answered", 501), "inconclusive", "engine_error", "answered 501"),
        (probe.ProbeAnswer("answered", 502), "failed", "engine_error", "answered 502"),
        (probe.ProbeAnswer("timed_out"), "failed", "timed_out", "no answer within 30 s"),
        (probe.ProbeAnswer("unreachable"), "failed", "engine_failed", "could not be reached"),
        (probe.ProbeAnswer("broken"), "failed", "engine_failed", "broke off its answer"),
    ],
)
def test_what_an_answer_says_of_the_engine(
    answer: probe.ProbeAnswer, verdict: str, outcome: str, reason: str
) -> None:
    assert probe.verdict(answer) == verdict
    assert probe.outcome(answer) == outcome
    assert reason in probe.reason(answer, 30.0)


OK = probe.ProbeAnswer("answered", 200, 1)
FAILED = probe.ProbeAnswer("answered", 500)
REFUSED = probe.ProbeAnswer("answered", 400)
OTHER_RUN = (NOW, "c2")


@pytest.mark.parametrize(
    ("before", "answer", "degraded", "ttft"),
    [
        (None, OK, False, 0.2),
        (None, FAILED, True, None),
        (None, REFUSED, False, None),  # nothing concluded: not marked
        (probe.Mark(RUN, False, "", NOW, 0.1), FAILED, True, 0.1),  # the last good ttft kept
        (probe.Mark(RUN, True, "the engine answered 500", NOW), OK, False, 0.2),  # recovered
        (probe.Mark(RUN, True, "the engine answered 500", NOW), REFUSED, True, None),
        (probe.Mark(OTHER_RUN, True, "the engine answered 500", NOW), REFUSED, False, None),
    ],
)
def test_a_failed_probe_marks_a_model_degraded_until_one_succeeds(
    before: probe.Mark | None, answer: probe.ProbeAnswer, degraded: bool, ttft: float | None
) -> None:
    mark = probe.after(before, RUN, answer, at=NOW, ttft_s=0.2, timeout_s=30)
    assert (mark.degraded, mark.ttft_s, mark.run, mark.checked_at) == (degraded, ttft, RUN, NOW)
    assert bool(mark.reason) is degraded
    shown = mark.shown()
    assert shown["degraded"] is degraded and shown["checkedAt"] == "2026-11-30T17:00:00.000Z"


@pytest.mark.parametrize(
    ("found", "holds"),
    [
        (status(), True),
        (status("stopped"), False),  # a stopped engine is not degraded: it does not serve
        (status(since=NOW), False),  # a new run: not known until it is probed
        (None, False),
    ],
)
def test_a_mark_holds_for_its_engines_run_only(found: Status | None, holds: bool) -> None:
    mark = probe.Mark(probe.run_of(status()), True, "the engine answered 500", NOW)
    assert (probe.current(mark, found) is mark) is holds
    assert probe.current(None, found) is None


@pytest.mark.parametrize(
    ("found", "label"),
    [
        (status(), "b11669@cb1ee357bc78"),
        (status(engine=ENGINE.model_copy(update={"engine_version": None})), "unknown@cb1ee357bc78"),
        (status("stopped"), "unknown"),
        (None, "unknown"),
    ],
)
def test_a_metrics_build_is_the_engine_version_and_its_image(
    found: Status | None, label: str
) -> None:
    assert build_label(found) == label


@pytest.mark.parametrize(
    ("text", "interval", "timeout"),
    [
        ("", 60.0, 30.0),  # the defaults: a probe a minute
        ("[probe]\ninterval_s = 0\n", 0.0, 30.0),  # off
        ("[probe]\ninterval_s = 0.05\ntimeout_s = 2\n", 0.05, 2.0),
    ],
)
def test_the_probe_settings(text: str, interval: float, timeout: float) -> None:
    found = parse(text, "gw.toml").probe
    assert (found.interval_s, found.timeout_s) == (interval, timeout)


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("[probe]\ninterval_s = 0.01\n", "probe.interval_s: 0 (no probe) or at least 0.05 s"),
        ("[probe]\ninterval_s = -1\n", "probe.interval_s"),
        ("[probe]\ntimeout_s = 0\n", "probe.timeout_s"),
        ("[probe]\nevery = 5\n", "probe.every: unknown setting"),
    ],
)
def test_bad_probe_settings_are_refused_naming_them(text: str, says: str) -> None:
    with pytest.raises(SettingsError) as refused:
        parse(text, "gw.toml")
    assert str(refused.value).startswith("gw.toml: " + says)


def row(key_id: str) -> Row:
    return Row(
        at=NOW,
        key_id=key_id,
        model="alpha",
        engine="e",
        build=Build(),
        outcome="ok",
        prompt_tokens=2,
        completion_tokens=1,
        cached_tokens=None,
        wait_s=0.0,
        ttft_s=0.01,
        duration_s=0.01,
    )


def test_the_probe_is_a_caller_of_its_own_in_the_record() -> None:
    assert row("probe").key_id == "probe"
    for wrong in ("Probe", "probe ", "probes", "key_probe"):
        with pytest.raises(RowRefused, match="probe"):
            row(wrong)
