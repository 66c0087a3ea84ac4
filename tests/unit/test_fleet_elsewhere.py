"""Whether a request leaves this machine (gateway.outward.elsewhere), as a table: never while
an engine here serves the model, never with no machine of the fleet known, else to the peer
fleet.choose picks, for the model a tier alias names."""

from __future__ import annotations

from datetime import timedelta

import pytest

from supervisor.host.fleet.rows import PeerEngine
from supervisor.host.gateway.outward import elsewhere
from supervisor.host.proxy import body
from supervisor.host.proxy.catalog import CatalogEntry
from supervisor.host.web.refusal import Refusal
from supervisor.protocol.documents import Status, utc_now

NOW = utc_now()


def local(*models: str) -> CatalogEntry:
    status = Status(
        generation=0, state="running", since=NOW, message="", checked_at=NOW, models=models
    )
    return CatalogEntry("here", status)


def peer(machine: str, *models: str, age_s: float = 1.0) -> PeerEngine:
    return PeerEngine(
        machine=machine,
        engine="e",
        url=f"http://{machine}:8400",
        models=models,
        state="running",
        heard=NOW - timedelta(seconds=age_s),
        slots=1,
    )


@pytest.mark.parametrize(
    ("asked", "engines", "tiers", "peers", "expected"),
    [
        ("m", [local("m")], {}, [peer("b", "m")], None),  # served here: never leaves
        ("fast", [local("m")], {"fast": "m"}, [peer("b", "m")], None),  # through its tier
        ("m", [local("x")], {}, [], None),  # no fleet known: the local route answers
        ("m", [local("x")], {}, [peer("b", "m")], ("b", "m")),
        ("fast", [], {"fast": "m"}, [peer("c", "m"), peer("b", "m")], ("b", "m")),
    ],
)
def test_elsewhere(
    asked: str,
    engines: list[CatalogEntry],
    tiers: dict[str, str],
    peers: list[PeerEngine],
    expected: tuple[str, str] | None,
) -> None:
    found = elsewhere(asked, body.CHAT, engines, tiers, peers, now=NOW, stale_s=10)
    assert (None if found is None else (found[0].machine, found[1])) == expected


@pytest.mark.parametrize(
    ("peers", "code"),
    [
        ([peer("b", "m", age_s=60)], "model_not_loaded"),  # only a stale machine serves it
        ([peer("b", "other")], "model_not_found"),
    ],
)
def test_a_model_no_live_machine_serves_is_refused(peers: list[PeerEngine], code: str) -> None:
    with pytest.raises(Refusal) as refused:
        elsewhere("m", body.CHAT, [local("x")], {}, peers, now=NOW, stale_s=10)
    assert refused.value.code == code
