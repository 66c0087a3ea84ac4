"""bench/fleet_forward_bench.py's pure parts: the settings it gives each machine, when a gateway
has seen the serving machine, its options, the CPUs `--pin` splits, and the goals it prints met
or MISSED."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.fleet_forward_bench import (
    MODES,
    Split,
    fleet_goals,
    fleet_section,
    modes_of,
    parser_of,
    serves,
    split_cpus,
)
from bench.gateway_figures import Samples
from bench.gateway_parts import settings_text
from supervisor.host.gateway.settings import parse


def test_each_machine_s_settings_are_a_fleet_s_the_gateway_accepts(tmp_path: Path) -> None:
    extra = fleet_section("a", 8101, "postgresql://lucia@127.0.0.1:5/db", tmp_path / "peers")
    text = settings_text(8101, tmp_path / "owner", tmp_path / "inference", 128, extra)
    settings = parse(text, "bench")
    assert settings.fleet.on
    assert (settings.fleet.machine, settings.fleet.advertise) == ("a", "http://127.0.0.1:8101")
    assert settings.fleet.peers_file == tmp_path / "peers"
    assert settings.record.dsn == "postgresql://lucia@127.0.0.1:5/db"


@pytest.mark.parametrize(
    ("entry", "seen"),
    [
        ({"id": "tiny", "machine": "b", "fresh": True}, True),
        ({"id": "tiny", "machine": "b", "fresh": False}, False),  # stale: never routed to
        ({"id": "tiny", "machine": "a", "fresh": True}, False),
        ({"id": "other", "machine": "b", "fresh": True}, False),
        ("tiny", False),
    ],
)
def test_a_gateway_has_seen_the_serving_machine_when_it_lists_it_fresh(
    entry: object, seen: bool
) -> None:
    assert serves({"object": "list", "data": [entry]}, "tiny", "b") is seen
    assert serves({"error": {"code": "x"}}, "tiny", "b") is False


def samples(total_ms: float, tokens: int, wall: float, cpu: float = 0.0) -> Samples:
    return Samples(total=[total_ms / 1000] * 10, tokens=tokens, wall=wall, cpu=cpu)


@pytest.mark.parametrize(
    ("forwarded_ms", "forwarded_tokens", "met"),
    [
        (3.9, 9_000, ("met", "met")),  # +1.9 ms, 0.9x
        (4.0, 9_000, ("MISSED", "met")),  # +2.0 ms is not under 2
        (3.0, 8_999, ("met", "MISSED")),
    ],
)
def test_the_goals_compare_the_forwarded_path_with_the_local_one(
    forwarded_ms: float, forwarded_tokens: int, met: tuple[str, str]
) -> None:
    results = {
        1: {
            "direct": samples(1, 100, 1),
            "local": samples(2, 100, 1),
            "forwarded": samples(forwarded_ms, 100, 1),
        },
        64: {
            "direct": samples(1, 20_000, 1),
            "local": samples(2, 10_000, 1),
            "forwarded": samples(3, forwarded_tokens, 1, cpu=0.005),
        },
    }
    lines = fleet_goals(results, "streamed")
    verdicts = [line.rsplit(": ", 1)[1] for line in lines if "goal" in line]
    assert tuple(verdicts) == met
    assert all(line.startswith("streamed: ") for line in lines)
    assert "A's CPU 500 µs a request" in lines[-1]


def test_failed_answers_are_said_and_a_level_not_run_speaks_to_no_goal() -> None:
    failed = samples(3, 100, 1)
    failed.failed["status 503: model_not_loaded"] = 2
    results = {1: {"direct": samples(1, 100, 1), "local": samples(2, 100, 1), "forwarded": failed}}
    lines = fleet_goals(results, "plain")
    assert not any("64 streams" in line for line in lines)
    assert lines[-1] == "plain: 1 stream(s): forwarded failed 2 of 12 (left out of its times)"


def test_the_options_default_to_the_issue_s_levels_and_both_modes() -> None:
    args = parser_of().parse_args([])
    assert (args.streams, args.modes, args.profile, args.pin) == (
        "1,64",
        "streamed,plain",
        None,
        False,
    )
    assert modes_of(args.modes) == list(MODES)
    assert parser_of().parse_args(["--profile", "a.prof"]).profile == Path("a.prof")


@pytest.mark.parametrize("text", ["", "streamed,chunked", " , "])
def test_a_mode_that_is_not_one_is_refused_by_name(text: str) -> None:
    with pytest.raises(SystemExit, match="choose from streamed, plain"):
        modes_of(text)


def test_one_mode_alone_is_taken() -> None:
    assert modes_of(" plain ") == ["plain"]


def test_pin_is_a_flag_that_takes_no_value() -> None:
    assert parser_of().parse_args(["--pin", "--streams", "64"]).pin is True
    with pytest.raises(SystemExit):
        parser_of().parse_args(["--pin=1"])


@pytest.mark.parametrize(
    ("cpus", "a", "rest"),
    [
        ({0, 1}, {1}, {0}),
        ([1, 0], {1}, {0}),  # the order given does not matter
        ({0, 1, 2, 3}, {3}, {0, 1, 2}),
        ({2, 5, 7}, {7}, {2, 5}),  # a cpuset's own numbers, not 0..n-1
        ([4, 4, 9], {9}, {4}),
    ],
)
def test_pin_gives_a_the_highest_cpu_and_the_rest_every_other(
    cpus: list[int] | set[int], a: set[int], rest: set[int]
) -> None:
    split = split_cpus(cpus)
    assert split == Split(a=frozenset(a), rest=frozenset(rest))
    assert not split.a & split.rest
    assert split.a | split.rest == set(cpus)


@pytest.mark.parametrize("cpus", [set(), {3}, [0, 0]])
def test_pin_is_refused_with_fewer_than_two_cpus(cpus: list[int] | set[int]) -> None:
    with pytest.raises(SystemExit, match=r"--pin: .* needs at least 2"):
        split_cpus(cpus)
