"""The /24 the fleet tests' machines take (tests/machine_subnet.py): the pure choice, in tables."""

from __future__ import annotations

import random
from ipaddress import IPv4Network as Net

import pytest

from tests.machine_subnet import (
    SPACE,
    SubnetError,
    choose_subnet,
    named,
    overlapping,
    random_subnets,
)

CANDIDATE = Net("100.71.4.0/24")


@pytest.mark.parametrize(
    ("taken", "clash"),
    [
        ([], []),
        ([Net("192.0.2.0/24"), Net("172.17.0.0/16")], []),
        ([Net("100.71.5.0/24"), Net("100.71.3.0/24")], []),  # its neighbours
        ([Net("100.71.4.1/32")], [Net("100.71.4.1/32")]),  # one address in it (a route's dst)
        ([Net("100.71.4.0/24")], [Net("100.71.4.0/24")]),  # another set's, or an address's /24
        ([Net("100.71.4.128/25")], [Net("100.71.4.128/25")]),  # a part of it
        ([Net("100.64.0.0/10")], [Net("100.64.0.0/10")]),  # all of the space routed (a VPN)
        ([Net("0.0.0.0/1")], [Net("0.0.0.0/1")]),  # a VPN's half-default route
    ],
)
def test_what_overlaps_a_candidate(taken: list[Net], clash: list[Net]) -> None:
    assert overlapping(CANDIDATE, taken) == clash


@pytest.mark.parametrize(
    ("candidates", "taken", "chosen"),
    [
        ([CANDIDATE], [], CANDIDATE),
        ([CANDIDATE, Net("100.71.5.0/24")], [Net("100.71.4.7/32")], Net("100.71.5.0/24")),
        ([CANDIDATE, Net("100.71.5.0/24")], [Net("100.71.0.0/16")], None),
        ([], [], None),
    ],
)
def test_the_first_free_candidate_is_chosen(
    candidates: list[Net], taken: list[Net], chosen: Net | None
) -> None:
    assert choose_subnet(candidates, taken) == chosen


def test_random_candidates_are_24s_inside_the_shared_address_space() -> None:
    found = random_subnets(random.Random(7), 500)
    assert all(net.prefixlen == 24 and net.subnet_of(SPACE) for net in found)
    assert len(set(found)) > 400  # spread over the space's 16,384 /24s, not a few
    assert random_subnets(random.Random(7), 500) == found  # a set's id seeds its choice


@pytest.mark.parametrize(
    ("wanted", "taken", "refusal"),
    [
        ("100.71.4.0/24", [Net("100.71.5.0/24")], None),
        ("10.9.8.0/24", [], None),  # any /24 the operator names, if free
        ("100.71.4.0/24", [Net("100.71.4.9/32")], "in use here: 100.71.4.9/32"),
        ("100.71.0.0/16", [], "is a /24"),
        ("100.71.4.0/25", [], "is a /24"),
    ],
)
def test_a_named_subnet(wanted: str, taken: list[Net], refusal: str | None) -> None:
    if refusal is None:
        assert named(wanted, taken) == Net(wanted)
    else:
        with pytest.raises(SubnetError, match=refusal):
            named(wanted, taken)
