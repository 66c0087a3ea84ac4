"""The store's counter deltas as vLLM's connector stats carry them: take, parse, merge, series."""

from __future__ import annotations

import dataclasses
import json
import pickle
import threading
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from lucia_kv import blockfile
from lucia_kv.config import ConfigError, tiers
from lucia_kv.metrics import HELP, REASONED, UNTIERED, Metrics, exposed, label_names
from lucia_kv.report import Counts, Reporter, ReportError, merge, parse, reduce, series
from lucia_kv.store import Store

from tests.kv.support import block_key, config, payload

PAGE = blockfile.ALIGN


def test_each_take_reports_what_was_counted_since_the_last_one() -> None:
    metrics = Metrics()
    metrics.add("evictions", "nvme", 2)  # counted before the first report: in it
    reporter = Reporter(metrics)
    metrics.add("hits", "nvme")
    metrics.add("hits", "nvme")
    metrics.add("read_bytes", "hdd", 8192)
    metrics.add("corrupt", "hdd", reason="auth")
    assert reporter.take() == {
        "corrupt": {"hdd": {"auth": 1}},
        "evictions": {"nvme": {"": 2}},
        "hits": {"nvme": {"": 2}},
        "read_bytes": {"hdd": {"": 8192}},
    }
    assert reporter.take() == {}, "nothing new, nothing reported (no zeros)"
    metrics.add("hits", "nvme")
    metrics.add("corrupt", "hdd", reason="short")
    assert reporter.take() == {"corrupt": {"hdd": {"short": 1}}, "hits": {"nvme": {"": 1}}}


def test_the_reports_sum_to_the_counters_while_other_threads_count() -> None:
    metrics = Metrics()
    reporter = Reporter(metrics)
    total: Counts = {}
    done = threading.Event()

    def count() -> None:
        for _ in range(20_000):
            metrics.add("writes", "hdd")
            metrics.add("skipped_writes", "nvme", reason="pinned")
        done.set()

    threads = [threading.Thread(target=count) for _ in range(3)]
    for thread in threads:
        thread.start()
    while not done.is_set() or any(thread.is_alive() for thread in threads):
        merge(total, reporter.take())
    merge(total, reporter.take())
    assert total == {
        "writes": {"hdd": {"": 60_000}},
        "skipped_writes": {"nvme": {"pinned": 60_000}},
    }
    assert metrics.get("writes") == 60_000


def test_a_store_reports_its_reads_and_its_writers_counts(tmp_path: Path) -> None:
    store = Store(config(tmp_path, {"nvme": 2 * PAGE, "hdd": 16 * PAGE}))
    try:
        reporter = Reporter(store.metrics)
        store.save(block_key(0), payload(0, 100))
        store.flush()
        first = reporter.take()
        assert first["writes"] == {"nvme": {"": 1}, "hdd": {"": 1}}
        assert store.load(block_key(0)) == payload(0, 100)
        second = reporter.take()
        assert second["hits"] == {"nvme": {"": 1}}
        assert set(second) == {"hits", "read_bytes"}
        reported = merge(first, second)
        for name, values, amount in series(reported):
            assert store.metrics.get(name, *values) == amount
    finally:
        store.close()


def test_a_store_counts_the_skipped_requests_in_its_reports_and_its_metrics_file(
    tmp_path: Path,
) -> None:
    metrics_file = tmp_path / "lucia-kv.prom"
    settings = config(tmp_path, {"hdd": 16 * PAGE})
    store = Store(dataclasses.replace(settings, metrics_file=metrics_file))
    try:
        reporter = Reporter(store.metrics)
        store.count("requests_unkeyable", 2)
        store.count("requests_unkeyable")
        assert reporter.take() == {"requests_unkeyable": {"": {"": 3}}}
        store.flush()  # the count queued a rewrite of the metrics file
        assert "\nlucia_kv_requests_unkeyable_total 3\n" in metrics_file.read_text()
    finally:
        store.close()


def test_the_reports_survive_json_and_pickle_and_parse_back_equal() -> None:
    metrics = Metrics()
    metrics.add("hits", "shm", 3)
    metrics.add("skipped_writes", "hdd", reason="queue_full")
    counts = Reporter(metrics).take()
    assert parse(json.loads(json.dumps(counts))) == counts
    assert parse(pickle.loads(pickle.dumps(counts))) == counts


def test_merge_sums_per_tier_and_reason() -> None:
    into: Counts = {"hits": {"nvme": {"": 2}}, "corrupt": {"hdd": {"auth": 1}}}
    other: Counts = {"hits": {"nvme": {"": 3}, "hdd": {"": 1}}, "corrupt": {"hdd": {"short": 4}}}
    assert merge(into, other) == {
        "hits": {"nvme": {"": 5}, "hdd": {"": 1}},
        "corrupt": {"hdd": {"auth": 1, "short": 4}},
    }
    assert other == {"hits": {"nvme": {"": 3}, "hdd": {"": 1}}, "corrupt": {"hdd": {"short": 4}}}


def test_series_gives_label_values_in_the_order_of_label_names() -> None:
    counts: Counts = {"hits": {"nvme": {"": 2}}, "corrupt": {"hdd": {"auth": 1}}}
    assert sorted(series(counts)) == [("corrupt", ("hdd", "auth"), 1), ("hits", ("nvme",), 2)]
    for name, values, _ in series(counts):
        assert len(values) == len(label_names(name))
    assert reduce(counts) == {"hits.nvme": 2, "corrupt.hdd.auth": 1}


@pytest.mark.parametrize(
    ("data", "says"),
    [
        ({"hitz": {"nvme": {"": 1}}}, "unknown counter 'hitz'"),
        ({"hits": [1]}, "tiers must be a mapping"),
        ({"hits": {"": {"": 1}}}, "is not a name"),
        ({"hits": {"nvme": 1}}, "not a mapping of reasons"),
        ({"hits": {"nvme": {"auth": 1}}}, "counter hits has no reason"),
        ({"corrupt": {"nvme": {"": 1}}}, "counter corrupt needs a reason"),
        ({"hits": {"nvme": {"": 0}}}, "is not a positive int"),
        ({"hits": {"nvme": {"": -2}}}, "is not a positive int"),
        ({"hits": {"nvme": {"": 1.5}}}, "is not a positive int"),
        ({"hits": {"nvme": {"": True}}}, "is not a positive int"),
    ],
)
def test_a_report_that_is_not_the_stores_counters_is_refused_and_says_why(
    data: dict[str, Any], says: str
) -> None:
    with pytest.raises(ReportError, match=says.replace("(", r"\(")):
        parse(data)


def test_a_counter_takes_a_reason_exactly_where_prometheus_gives_it_one() -> None:
    metrics = Metrics()
    with pytest.raises(ValueError, match="counter corrupt needs reason"):
        metrics.add("corrupt", "hdd")
    with pytest.raises(ValueError, match="counter hits has no reason"):
        metrics.add("hits", "hdd", reason="auth")
    assert metrics.snapshot() == {}


def test_the_names_are_the_metric_files_names() -> None:
    metrics = Metrics()
    for name in HELP:
        tier = None if name in UNTIERED else "hdd"
        metrics.add(name, tier, reason="error" if name in REASONED else None)
    text = metrics.render()
    for name in HELP:
        assert f"# HELP {exposed(name)} {HELP[name]}" in text
        if name in UNTIERED:
            assert f"\n{exposed(name)} 1\n" in text
            continue
        labels = 'tier="hdd",reason="error"' if name in REASONED else 'tier="hdd"'
        assert f"{exposed(name)}{{{labels}}} 1" in text
    assert exposed("corrupt") == "lucia_kv_corrupt_total"
    assert label_names("corrupt") == ("tier", "reason")
    assert label_names("hits") == ("tier",)
    assert label_names("requests_unkeyable") == ()


def test_an_untiered_counter_is_reported_without_a_tier_and_refuses_one() -> None:
    metrics = Metrics()
    reporter = Reporter(metrics)
    metrics.add("requests_unkeyable", None, 2)
    metrics.add("hits", "nvme")
    counts = reporter.take()
    assert counts == {"requests_unkeyable": {"": {"": 2}}, "hits": {"nvme": {"": 1}}}
    assert parse(counts) == counts
    assert sorted(series(counts)) == [("hits", ("nvme",), 1), ("requests_unkeyable", (), 2)]
    assert reduce(counts) == {"hits.nvme": 1, "requests_unkeyable": 2}
    with pytest.raises(ValueError, match="counter requests_unkeyable has no tier"):
        metrics.add("requests_unkeyable", "nvme")
    with pytest.raises(ValueError, match="counter hits needs a tier"):
        metrics.add("hits", None)
    with pytest.raises(ReportError, match="counter requests_unkeyable has no tier"):
        parse({"requests_unkeyable": {"nvme": {"": 1}}})
    with pytest.raises(ReportError, match="is not a name"):
        parse({"hits": {"": {"": 1}}})


def test_the_tiers_are_named_without_the_key() -> None:
    extra = {"nvme_dir": "/kv/nvme", "nvme_bytes": 1 << 20, "hdd_dir": "/kv/hdd", "hdd_bytes": 0}
    assert [tier.name for tier in tiers(extra, environ={})] == ["nvme"]
    with pytest.raises(ConfigError, match="no tier"):
        tiers({}, environ={})


amounts = st.integers(min_value=1, max_value=10**12)
reports = st.dictionaries(
    st.sampled_from(sorted(HELP)),
    st.dictionaries(st.sampled_from(["shm", "nvme", "hdd"]), amounts, min_size=1),
)


def _counts(drawn: dict[str, dict[str, int]]) -> Counts:
    reason = {name: ("auth" if name in REASONED else "") for name in HELP}
    counts: Counts = {}
    for name, tiers_ in drawn.items():
        for tier, amount in tiers_.items():
            where = "" if name in UNTIERED else tier  # one series: the drawn amounts add up
            by_reason = counts.setdefault(name, {}).setdefault(where, {})
            by_reason[reason[name]] = by_reason.get(reason[name], 0) + amount
    return counts


@given(st.lists(reports, max_size=6))
def test_merging_reports_gives_the_sum_of_their_series(
    drawn: list[dict[str, dict[str, int]]],
) -> None:
    total: Counts = {}
    expected: dict[tuple[str, tuple[str, ...]], int] = {}
    for one in map(_counts, drawn):
        assert parse(one) == one
        for name, values, amount in series(one):
            expected[(name, values)] = expected.get((name, values), 0) + amount
        merge(total, one)
    assert {(name, values): amount for name, values, amount in series(total)} == expected
