"""The /24 the fleet tests' machines (tests/machines.py) take: one that nothing here uses.

It is a /24 of 100.64.0.0/10, RFC 6598's shared address space, at random. That space is for a
carrier's side of its NAT, never a LAN that this machine reaches through its default route: a
/24 of a 10/8 or 192.168/16 LAN or VPN reached that way cannot be seen from here, and while the
tests ran, its hosts would be hidden behind the machines' connected route. What can be seen is
refused: any IPv4 address's network and any route but the default, in every routing table of
the root namespace (Tailscale's peers are 100.64/10 routes in table 52; another set of machines
holds its switch address). `LUCIA_TEST_MACHINES_SUBNET` (or `subnet=`) names a /24 instead, which
is checked the same way. The choice is pure; `taken_networks` reads what it is made against.
"""

from __future__ import annotations

import ipaddress
import json
import os
import random
import subprocess
from collections.abc import Iterable, Sequence
from typing import Any, Final

Net = ipaddress.IPv4Network
SPACE: Final = Net("100.64.0.0/10")
SUBNET_ENV: Final = "LUCIA_TEST_MACHINES_SUBNET"
TRIES: Final = 64  # random /24s tried before giving up


class SubnetError(RuntimeError):
    """No /24 can be taken: the one named is in use or no /24, or none of those tried is free.
    The caller names a free /24 in LUCIA_TEST_MACHINES_SUBNET."""


def overlapping(candidate: Net, taken: Iterable[Net]) -> list[Net]:
    """Pure: the networks of `taken` that overlap the candidate."""
    return [net for net in taken if net.overlaps(candidate)]


def choose_subnet(candidates: Iterable[Net], taken: Sequence[Net]) -> Net | None:
    """Pure: the first candidate that no taken network overlaps; None if all are."""
    return next((net for net in candidates if not overlapping(net, taken)), None)


def random_subnets(rng: random.Random, count: int = TRIES) -> list[Net]:
    """Pure: `count` random /24s of SPACE."""
    first = int(SPACE.network_address) >> 8
    size = SPACE.num_addresses >> 8
    return [Net(((first + rng.randrange(size)) << 8, 24)) for _ in range(count)]


def named(wanted: str, taken: Sequence[Net]) -> Net:
    """Pure: the /24 the caller named, if nothing taken overlaps it."""
    net = Net(wanted)
    if net.prefixlen != 24:
        raise SubnetError(f"{wanted}: the machines' subnet is a /24")
    clash = overlapping(net, taken)
    if clash:
        raise SubnetError(f"{wanted} is in use here: {', '.join(map(str, clash))}")
    return net


def _shown(*args: str) -> list[dict[str, Any]]:
    done = subprocess.run(["ip", "-j", "-4", *args], capture_output=True, text=True, check=True)
    return list(json.loads(done.stdout or "[]"))


def taken_networks() -> list[Net]:
    """Every IPv4 address's network and every IPv4 route but the default, in the root
    namespace, in every routing table."""
    found: list[Net] = []
    for link in _shown("addr", "show"):
        for addr in link.get("addr_info", []):
            found.append(Net(f"{addr['local']}/{addr['prefixlen']}", strict=False))
    for route in _shown("route", "show", "table", "all"):
        dst = str(route.get("dst", "default"))
        if dst != "default":
            found.append(Net(dst, strict=False))
    return found


def choose(wanted: str | None, rng: random.Random) -> Net:
    """The /24 to take now: `wanted` (else $LUCIA_TEST_MACHINES_SUBNET) if free, else a random
    free one of SPACE. Its caller holds the lock that makes the choice and the taking one."""
    wanted = wanted or os.environ.get(SUBNET_ENV) or None
    taken = taken_networks()
    if wanted is not None:
        return named(wanted, taken)
    chosen = choose_subnet(random_subnets(rng), taken)
    if chosen is None:
        raise SubnetError(
            f"no free /24 of {SPACE} among {TRIES} tried (routed here?); "
            f"name a free /24 in {SUBNET_ENV}"
        )
    return chosen
