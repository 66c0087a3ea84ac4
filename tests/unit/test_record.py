"""The record's pure parts: the row's rules, tokens from usage, totals, percentiles, --since, the
table, the ledger's arithmetic and the [record] settings."""

from __future__ import annotations

import dataclasses
import math
from datetime import UTC, date, datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from supervisor.host.gateway.recording import Request, row_of
from supervisor.host.gateway.settings import SettingsError, parse
from supervisor.host.proxy.forward import Trace
from supervisor.host.record.batch import totals_of
from supervisor.host.record.database import Target, safe_dsn
from supervisor.host.record.ledger import SpendingLedger, Spent
from supervisor.host.record.queries import Line, percentile, pick, ranks
from supervisor.host.record.report import BadSince, as_json, parse_since, table
from supervisor.host.record.row import (
    UNKNOWN,
    Build,
    Row,
    RowRefused,
    epoch_us,
    from_epoch_us,
    refused,
    tokens_of,
)
from supervisor.host.record.stall import Stall, Stalled
from supervisor.protocol.documents import RunningEngine
from supervisor.protocol.names import digest_form
from tests.record_world import KEY, NOW, OTHER, row

SECRET = "lucia_inf_" + "x" * 43


# -- the row -------------------------------------------------------------------------------------


def test_a_row_has_these_fields_and_no_other() -> None:
    """A field added to Row is added here too, on purpose: none may carry text."""
    assert [(f.name, f.type) for f in dataclasses.fields(Row)] == [
        ("at", "datetime"),
        ("key_id", "str"),
        ("model", "str"),
        ("engine", "str"),
        ("build", "Build"),
        ("outcome", "str"),
        ("prompt_tokens", "int | None"),
        ("completion_tokens", "int | None"),
        ("cached_tokens", "int | None"),
        ("wait_s", "float"),
        ("ttft_s", "float | None"),
        ("duration_s", "float"),
        ("usage_source", "str"),
        ("machine", "str | None"),
    ]
    assert [f.name for f in dataclasses.fields(Build)] == [
        "engine_version",
        "image_id",
        "weights_revision",
    ]


PROSE = "tell me a story about zq-unique-7f3a"


@pytest.mark.parametrize(
    ("change", "names"),
    [
        ({"key_id": SECRET}, "key_id"),
        ({"key_id": "key_XYZ"}, "key_id"),
        ({"key_id": ""}, "key_id"),
        ({"model": PROSE}, "model"),
        ({"model": "a\nb"}, "model"),
        ({"model": "x" * 257}, "model"),
        ({"engine": PROSE}, "engine"),
        ({"outcome": "refused:" + PROSE}, "outcome"),
        ({"outcome": "refused:"}, "outcome"),
        ({"outcome": "fine"}, "outcome"),
        ({"prompt": -1}, "prompt_tokens"),
        ({"completion": True}, "completion_tokens"),
        ({"cached": 1.5}, "cached_tokens"),
        ({"wait_s": math.nan}, "wait_s"),
        ({"ttft_s": -0.1}, "ttft_s"),
        ({"duration_s": math.inf}, "duration_s"),
        ({"at": datetime(2026, 5, 4, 12)}, "at"),
        ({"machine": PROSE}, "machine"),
        ({"machine": ""}, "machine"),
        ({"machine": "Spark"}, "machine"),
        ({"machine": "-b"}, "machine"),
        ({"machine": "b" * 64}, "machine"),
    ],
)
def test_a_row_refuses_what_is_not_its_kind(change: dict[str, Any], names: str) -> None:
    with pytest.raises(RowRefused, match=f"^{names}") as caught:
        row(**change)
    for value in change.values():
        if isinstance(value, str) and len(value) > 10:
            assert value not in str(caught.value)  # the rule, never the value


@pytest.mark.parametrize(
    "name", ["Qwen 7B (Q4)", "模型", "Llama 3.1 8B (instruct)+v2@x", "x" * 300, "a..b", ""]
)
def test_a_name_outside_the_rule_is_kept_by_its_digest_form_never_dropped(name: str) -> None:
    """Was: RowRefused for the model's name, the row only logged and never charged."""
    trace = Trace(arrived=0.0, outcome="ok", usage={"prompt_tokens": 5, "completion_tokens": 3})
    made = row_of(trace, Request("inference", name, name, "small"), now=1.0)
    assert made.model == digest_form(name) != name and made.engine == "small"
    assert made.tokens == 8 and made.key_id == "inference"
    assert row(model=made.model).model == made.model  # a row takes a digest form as it is
    with pytest.raises(RowRefused, match=r"^model"):
        row(model=name)  # but never the name itself: only names.kept's forms


@pytest.mark.parametrize("name", ["tiny", "Qwen/Qwen2.5-0.5B-Instruct", "qwen2.5:7b", "m@r+b"])
def test_a_served_name_is_kept_as_it_is(name: str) -> None:
    trace = Trace(arrived=0.0, outcome="ok")
    made = row_of(trace, Request("inference", name, name, name), now=1.0)
    assert (made.model, made.engine) == (name, name)


def test_a_key_passed_by_mistake_is_still_refused_not_stored() -> None:
    with pytest.raises(RowRefused, match=r"^key_id"):
        row_of(Trace(arrived=0.0, outcome="ok"), Request(SECRET, "Qwen 7B (Q4)", "m", "e"), 1.0)


@pytest.mark.parametrize("field", ["engine_version", "image_id", "weights_revision"])
def test_a_build_takes_names_only(field: str) -> None:
    with pytest.raises(RowRefused, match=field):
        Build(**{field: PROSE})


def test_a_row_keeps_its_time_in_utc_and_its_day_is_the_utc_day() -> None:
    late = datetime(2026, 5, 4, 23, 30, tzinfo=timezone(timedelta(hours=-2)))
    made = row(late)
    assert made.at == datetime(2026, 5, 5, 1, 30, tzinfo=UTC)
    assert made.day == date(2026, 5, 5)


@pytest.mark.parametrize(
    ("prompt", "completion", "tokens"), [(10, 20, 30), (None, 5, 5), (7, None, 7), (None, None, 0)]
)
def test_a_row_spends_its_prompt_and_completion_tokens(
    prompt: int | None, completion: int | None, tokens: int
) -> None:
    assert row(prompt=prompt, completion=completion).tokens == tokens


@pytest.mark.parametrize(
    ("code", "outcome"), [("rate_limited", "refused:rate_limited"), ("timeout", "refused:timeout")]
)
def test_a_refusal_is_kept_as_its_code(code: str, outcome: str) -> None:
    assert refused(code) == outcome
    assert row(outcome=outcome).outcome == outcome


def _engine(**fields: Any) -> RunningEngine:
    base = {"image": "img:1", "imageId": "sha256:" + "ab" * 32, "containerId": "c1", "model": "m"}
    return RunningEngine.model_validate(base | fields)


@pytest.mark.parametrize(
    ("engine", "build"),
    [
        (None, Build(UNKNOWN, UNKNOWN, UNKNOWN)),
        (_engine(), Build(UNKNOWN, "sha256:" + "ab" * 32, UNKNOWN)),
        (
            _engine(engineVersion="0.32.0", modelRevision="e5a1f00d"),
            Build("0.32.0", "sha256:" + "ab" * 32, "e5a1f00d"),
        ),
        (_engine(engineVersion="b4567 (abc)", imageId=""), Build(UNKNOWN, UNKNOWN, UNKNOWN)),
    ],
)
def test_the_build_is_what_status_named_or_unknown(
    engine: RunningEngine | None, build: Build
) -> None:
    assert Build.of(engine) == build


@pytest.mark.parametrize(
    ("usage", "counts"),
    [
        (None, (None, None, None)),
        ({}, (None, None, None)),
        ({"prompt_tokens": 5, "completion_tokens": 7}, (5, 7, None)),
        (
            {
                "prompt_tokens": 5,
                "completion_tokens": 7,
                "prompt_tokens_details": {"cached_tokens": 4},
            },
            (5, 7, 4),
        ),
        (
            {"input_tokens": 3, "output_tokens": 9, "input_tokens_details": {"cached_tokens": 0}},
            (3, 9, 0),
        ),
        ({"prompt_tokens": 8, "total_tokens": 8}, (8, None, None)),  # embeddings
        ({"prompt_tokens": -1, "completion_tokens": "7", "note": PROSE}, (None, None, None)),
        ({"prompt_tokens": True, "prompt_tokens_details": None}, (None, None, None)),
    ],
)
def test_tokens_come_from_the_engines_usage(
    usage: dict[str, Any] | None, counts: tuple[int | None, ...]
) -> None:
    assert tokens_of(usage) == counts


@pytest.mark.parametrize(
    "at",
    [
        datetime(1970, 1, 1, tzinfo=UTC),
        datetime(2026, 5, 4, 12, 0, 0, 123456, tzinfo=UTC),
        datetime(2099, 12, 31, 23, 59, 59, 999999, tzinfo=UTC),
    ],
)
def test_a_time_is_stored_to_the_microsecond(at: datetime) -> None:
    assert from_epoch_us(epoch_us(at)) == at


def test_totals_sum_tokens_and_requests_per_day_and_key_in_order() -> None:
    rows = [
        row(NOW, key_id=OTHER, prompt=1, completion=2),
        row(NOW, prompt=10, completion=None),
        row(NOW + timedelta(days=1), prompt=5, completion=5),
        row(NOW, key_id=OTHER, prompt=None, completion=4, outcome="refused:rate_limited"),
    ]
    assert totals_of(rows) == {
        ("2026-05-04", KEY): (10, 1),
        ("2026-05-04", OTHER): (7, 2),
        ("2026-05-05", KEY): (10, 1),
    }
    assert list(totals_of(rows)) == sorted(totals_of(rows))


# -- percentiles ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "p", "expected"),
    [
        ([], 0.5, None),
        ([3.0], 0.95, 3.0),
        ([1.0, 2.0], 0.5, 1.5),
        ([1.0, 2.0, 3.0, 4.0], 0.5, 2.5),
        ([1.0, 2.0, 3.0, 4.0], 0.95, 3.85),
        ([0.0] * 19 + [10.0], 0.95, 0.5),
    ],
)
def test_a_percentile_is_linear_between_the_closest_ranks(
    values: list[float], p: float, expected: float | None
) -> None:
    found = percentile(values, p)
    assert found == pytest.approx(expected) if expected is not None else found is None


@pytest.mark.parametrize("count", [1, 2, 3, 10, 101, 1000])
@pytest.mark.parametrize("p", [0.5, 0.95])
def test_percentiles_agree_with_numpys_linear_method(count: int, p: float) -> None:
    values = sorted(np.random.default_rng(count).exponential(0.3, count).tolist())
    assert percentile(values, p) == pytest.approx(float(np.percentile(values, p * 100)))


def test_pick_keeps_only_the_ranks_it_needs_per_group() -> None:
    a = [float(v) for v in range(1, 101)]
    b = [0.5]
    lines = {("a",): Line(("a",), timed=100), ("b",): Line(("b",), timed=1), ("c",): Line(("c",))}
    pick([(("a",), v) for v in a] + [(("b",), v) for v in b], lines)
    assert (lines[("a",)].ttft_p50, lines[("a",)].ttft_p95) == (
        pytest.approx(percentile(a, 0.5)),
        pytest.approx(percentile(a, 0.95)),
    )
    assert (lines[("b",)].ttft_p50, lines[("b",)].ttft_p95) == (0.5, 0.5)
    assert lines[("c",)].ttft_p50 is None


def test_ranks_of_one_value_are_that_value() -> None:
    assert ranks(1, 0.95) == (0, 0, 0.0)


# -- the report ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "since"),
    [
        ("30m", NOW - timedelta(minutes=30)),
        ("12h", NOW - timedelta(hours=12)),
        ("1d", NOW - timedelta(days=1)),
        ("2w", NOW - timedelta(weeks=2)),
        ("2026-05-01", datetime(2026, 5, 1, tzinfo=UTC)),
        ("2026-05-01T08:00:00+02:00", datetime(2026, 5, 1, 6, tzinfo=UTC)),
    ],
)
def test_since_is_a_span_a_date_or_a_time_with_its_offset(text: str, since: datetime) -> None:
    assert parse_since(text, NOW) == since


@pytest.mark.parametrize("text", ["", "0d", "1y", "yesterday", "2026-05-01T08:00:00", "-1d"])
def test_since_refuses_anything_else(text: str) -> None:
    with pytest.raises(BadSince, match="a span"):
        parse_since(text, NOW)


@pytest.mark.parametrize(
    "text", ["999999w", "999999d", "0001-01-01T00:00:00+05:00", "9999-12-31T23:00:00-05:00"]
)
def test_since_refuses_a_time_no_datetime_holds(text: str) -> None:
    """Was: OverflowError, a 500 from the host API and a traceback from `usage`."""
    with pytest.raises(BadSince, match=r"out of range, before the year 1 or after 9999 \(UTC\)"):
        parse_since(text, NOW)


@pytest.mark.parametrize(
    ("text", "since"),
    [
        ("999999h", NOW - timedelta(hours=999999)),  # 114 years: within range
        ("0001-01-01", datetime(1, 1, 1, tzinfo=UTC)),
        ("0001-01-01T00:00:00-05:00", datetime(1, 1, 1, 5, tzinfo=UTC)),
    ],
)
def test_since_at_the_edges_of_the_range_is_kept(text: str, since: datetime) -> None:
    assert parse_since(text, NOW) == since


def _line() -> Line:
    line = Line(
        ("e1", "0.32.0", "sha256:" + "ab" * 32, "e5a1f00d"),
        requests=5,
        prompt_tokens=40,
        completion_tokens=80,
        cached_tokens=8,
        timed=3,
        ttft_p50=0.1234,
        ttft_p95=0.5,
    )
    line.outcomes = {"ok": 3, "refused:rate_limited": 1, "timed_out": 1}
    return line


def test_the_table_names_the_build_and_weights_of_each_group() -> None:
    lines = table([_line()], "build").splitlines()
    assert lines[0].split() == [
        "ENGINE",
        "VERSION",
        "IMAGE",
        "WEIGHTS",
        "REQUESTS",
        "OK",
        "PROMPT",
        "COMPLETION",
        "CACHED",
        "TTFT",
        "P50",
        "S",
        "TTFT",
        "P95",
        "S",
        "REFUSED",
        "FAILED",
    ]
    assert lines[1].split() == [
        "e1",
        "0.32.0",
        "sha256:abababababab",
        "e5a1f00d",
        "5",
        "3",
        "40",
        "80",
        "8",
        "0.123",
        "0.500",
        "rate_limited=1",
        "timed_out=1",
    ]


def test_the_json_has_the_whole_image_id_and_every_outcome() -> None:
    document = as_json([_line()], "build", NOW)
    group = document["groups"][0]
    assert group["imageId"] == "sha256:" + "ab" * 32
    assert group["weightsRevision"] == "e5a1f00d"
    assert group["ttftSeconds"] == {"p50": 0.1234, "p95": 0.5}
    assert group["refusals"] == {"rate_limited": 1}
    assert group["outcomes"] == {"ok": 3, "refused:rate_limited": 1, "timed_out": 1}
    assert document["since"] == NOW.isoformat()


def test_the_table_by_key_names_each_key() -> None:
    line = Line((KEY,), requests=1)
    assert table([line], "key", {KEY: "laptop"}).splitlines()[1].split()[:2] == [KEY, "laptop"]


# -- the ledger ----------------------------------------------------------------------------------


def test_spent_is_committed_plus_queued_and_unknown_until_the_day_is_read() -> None:
    ledger = SpendingLedger(bound=10, batch=5)
    first, second = row(NOW, prompt=10, completion=5), row(NOW, prompt=1, completion=1)
    assert ledger.put(first) and ledger.put(second)
    assert ledger.spent(KEY, NOW.date()) is None
    ledger.load_day(NOW.date(), {KEY: (100, 4)})
    assert ledger.spent(KEY, NOW.date()) == Spent(117, 6)
    taken = ledger.take(1)
    assert ledger.spent(KEY, NOW.date()) == Spent(117, 6)  # taken, not yet committed
    ledger.settle(taken, committed=True)
    assert ledger.spent(KEY, NOW.date()) == Spent(117, 6)  # moved, not counted twice
    ledger.settle(ledger.take(1), committed=False)
    assert ledger.spent(KEY, NOW.date()) == Spent(115, 5)
    assert ledger.dropped() == {"write_failed": 1}
    assert ledger.spent(OTHER, NOW.date()) == Spent(0, 0)


def test_a_full_queue_drops_and_counts_and_says_so_once() -> None:
    ledger = SpendingLedger(bound=2, batch=2)
    assert [ledger.put(row()) for _ in range(4)] == [True, True, False, False]
    assert ledger.dropped() == {"queue_full": 2}
    assert ledger.was_full() and not ledger.was_full()


def test_the_writer_is_woken_by_a_first_row_and_by_a_whole_batch() -> None:
    ledger = SpendingLedger(bound=10, batch=3)
    ledger.put(row())
    assert ledger.wake.is_set()
    ledger.wake.clear()
    ledger.put(row())
    assert not ledger.wake.is_set()
    ledger.put(row())
    assert ledger.wake.is_set()


def test_the_ledger_keeps_the_latest_two_days_and_forgets_them_all_when_told() -> None:
    ledger = SpendingLedger(bound=10, batch=5)
    for offset in range(3):
        ledger.load_day(NOW.date() + timedelta(days=offset), {KEY: (offset, 1)})
    assert ledger.spent(KEY, NOW.date()) is None
    assert ledger.spent(KEY, NOW.date() + timedelta(days=2)) == Spent(2, 1)
    ledger.forget()
    assert ledger.spent(KEY, NOW.date() + timedelta(days=2)) is None


# -- the settings --------------------------------------------------------------------------------


def test_the_record_defaults_to_sqlite_in_the_data_directory() -> None:
    record = parse("", "gw.toml").record
    assert record.enabled and record.retention_days == 90
    assert record.target(Path("/d")) == Target(path=Path("/d/record/record.sqlite3"))


@pytest.mark.parametrize(
    ("text", "target"),
    [
        ('[record]\npath = "/var/x.db"', Target(path=Path("/var/x.db"))),
        (
            '[record]\ndsn = "postgresql://lucia@db/lucia"',
            Target(dsn="postgresql://lucia@db/lucia"),
        ),
    ],
)
def test_the_record_is_a_path_or_a_dsn(text: str, target: Target) -> None:
    assert parse(text, "gw.toml").record.target(Path("/d")) == target


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[record]\npath = "/x"\ndsn = "postgresql://h/d"', "set one"),
        ('[record]\ndsn = "mysql://h/d"', "record.dsn: a PostgreSQL URI"),
        ("[record]\nretention_days = -1", "record.retention_days"),
        ('[record]\npath = "rel/x.db"', "absolute"),
        ("[record]\nbudget = 5", "record.budget: unknown setting"),
    ],
)
def test_the_record_settings_refuse(text: str, message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        parse(text, "gw.toml")


@pytest.mark.parametrize(
    ("dsn", "shown"),
    [
        (
            "postgresql://lucia:hunter2-secret@db:5433/rec",
            "postgresql host=db port=5433 dbname=rec user=lucia",
        ),
        ("postgresql://db/rec?password=hunter2-secret", "postgresql host=db dbname=rec"),
        ("postgresql://[bad", "postgresql (a DSN libpq cannot parse)"),
    ],
)
def test_a_dsn_is_shown_without_its_password(dsn: str, shown: str) -> None:
    assert safe_dsn(dsn) == shown
    assert "hunter2" not in Target(dsn=dsn).describe()


def test_a_target_is_one_place() -> None:
    with pytest.raises(ValueError, match="one of them"):
        Target()
    with pytest.raises(ValueError, match="one of them"):
        Target(path=Path("/x"), dsn="postgresql://h/d")


# -- where it lives ------------------------------------------------------------------------------


def test_the_records_directory_is_no_engine(tmp_path: Path) -> None:
    """<data>/record/ holds the SQLite record: `status` lists no engine of that name, and no
    engine may take it."""
    from supervisor.host.commands.engines import engine_names
    from supervisor.protocol.layout import BadName, check_name

    (tmp_path / "record").mkdir()
    (tmp_path / "tf").mkdir()
    assert engine_names(tmp_path) == ["tf"]
    with pytest.raises(BadName, match="shared"):
        check_name("record")


def test_a_stall_is_said_once_per_call_and_its_return_only_after_it_was() -> None:
    stall = Stall(10.0)
    assert stall.look(100.0) == Stalled(False, False)  # no call under way
    stall.begin(100.0)
    assert stall.look(110.0) == Stalled(False, False)  # slow, not stalled
    assert stall.look(110.5) == Stalled(True, True)  # the first look to find it says it
    assert stall.look(111.0) == Stalled(True, False)
    assert stall.end(failed=False)  # it returned after its stall was said
    assert stall.look(200.0) == Stalled(False, False)
    stall.begin(200.0)
    assert not stall.end(failed=False)  # a quick call: nothing to say
    stall.begin(300.0)
    assert stall.look(400.0).first
    assert not stall.end(failed=True)  # a failure is said as such
