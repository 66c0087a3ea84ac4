"""Which peer machine's engine a request goes to (fleet.choose), as a table: free slot, fewest
waiting, starting, startable; an operator's stop and a silent worker last; stale rows never;
the capability the route asks for; 503 naming the machines last seen, 404 naming the models."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from supervisor.host.fleet.choose import choose
from supervisor.host.fleet.rows import PeerEngine
from supervisor.host.proxy import body
from supervisor.host.web.refusal import Refusal
from supervisor.protocol.documents import utc_now

NOW = utc_now()
STALE_S = 10.0


def peer(machine: str, state: str = "running", engine: str = "e", **extra: Any) -> PeerEngine:
    age_s = extra.pop("age_s", 1.0)
    fields: dict[str, Any] = {"models": ("qwen",), "slots": 4, **extra}
    return PeerEngine(
        machine=machine,
        engine=engine,
        url=f"http://{machine}:8400",
        state=state,  # type: ignore[arg-type]
        heard=NOW - timedelta(seconds=age_s),
        **fields,
    )


FULL: dict[str, Any] = {"running": 4, "slots": 4}


@pytest.mark.parametrize(
    ("peers", "path", "expected"),
    [
        ([peer("b"), peer("a")], body.CHAT, ("a", "e")),  # ties: by machine name
        ([peer("a", engine="z"), peer("a", engine="y")], body.CHAT, ("a", "y")),  # then engine
        ([peer("a", **FULL), peer("b", running=3)], body.CHAT, ("b", "e")),  # a free slot first
        ([peer("a", running=9, slots=None), peer("b", slots=None)], body.CHAT, ("b", "e")),
        ([peer("a", running=1, slots=None), peer("b", **FULL)], body.CHAT, ("a", "e")),
        # all full: the fewest waiting, whatever the name
        ([peer("a", **FULL, waiting=5), peer("b", **FULL, waiting=2)], body.CHAT, ("b", "e")),
        ([peer("a", **FULL, waiting=2), peer("b", **FULL, waiting=2)], body.CHAT, ("a", "e")),
        ([peer("a", "starting"), peer("b", **FULL, waiting=60)], body.CHAT, ("b", "e")),
        ([peer("a", "stopped"), peer("b", "starting")], body.CHAT, ("b", "e")),
        ([peer("a", "unavailable"), peer("b", "stopped")], body.CHAT, ("b", "e")),
        ([peer("a", "failed"), peer("b", "unavailable")], body.CHAT, ("a", "e")),
        (
            [peer("a", "stopping"), peer("b", "stopped", stopped_by_operator=True)],
            body.CHAT,
            ("a", "e"),
        ),
        # an operator's stop outranks its running state, and a silent worker comes last
        ([peer("a", stopped_by_operator=True), peer("b", "unavailable")], body.CHAT, ("a", "e")),
        ([peer("a", "unavailable")], body.CHAT, ("a", "e")),  # its gateway says why
        # a stale machine is never chosen, however good its row
        ([peer("a", age_s=11), peer("b", **FULL, waiting=50)], body.CHAT, ("b", "e")),
        ([peer("a", age_s=10), peer("b")], body.CHAT, ("a", "e")),  # at the bound: fresh
        # rows of other models are not candidates
        ([peer("a", models=("other",)), peer("b", "stopped")], body.CHAT, ("b", "e")),
        # the capability the route asks for: declared first, unknown as good as declared
        (
            [peer("a", declared={"qwen": ("embedding",)}), peer("b", "stopped")],
            body.CHAT,
            ("b", "e"),
        ),
        (
            [peer("a", declared={"qwen": ("embedding",)}), peer("b", declared={})],
            body.EMBEDDINGS,
            ("a", "e"),
        ),
        (
            [peer("a", declared={"qwen": ("chat",)}), peer("b", declared={"qwen": ()})],
            "/v1/unknown",
            ("a", "e"),
        ),
    ],
)
def test_the_best_fresh_row_is_chosen(
    peers: list[PeerEngine], path: str, expected: tuple[str, str]
) -> None:
    found = choose("qwen", path, peers, NOW, STALE_S)
    assert (found.machine, found.engine) == expected


@pytest.mark.parametrize(
    ("peers", "known", "status", "code", "said", "details"),
    [
        ([], (), 404, "model_not_found", "Models: none", {}),
        (
            [peer("a", models=("llama", "bert"))],
            ("tiny",),
            404,
            "model_not_found",
            "Models: bert, llama, tiny",
            {},
        ),
        (
            [peer("a", age_s=11)],
            (),
            503,
            "model_not_loaded",
            "last seen on a (last heard 11 s ago)",
            {"machines": ["a"]},
        ),
        (  # the one seen last first
            [peer("a", age_s=300), peer("b", age_s=20), peer("b", engine="f", age_s=20)],
            (),
            503,
            "model_not_loaded",
            "no machine heard from in the last 10 s; it was last seen on b (last heard 20 s "
            "ago), a (last heard 300 s ago)",
            {"machines": ["b", "a"]},
        ),
        (
            [peer("a", age_s=11), peer("b", models=("other",))],
            (),
            503,
            "model_not_loaded",
            "last seen on a ",
            {"machines": ["a"]},
        ),
        (  # every fresh row declares the route left out: refused here, naming the machine
            [peer("a", declared={"qwen": ("embedding",)})],
            (),
            400,
            "capability_not_served",
            "(engine e) does not serve chat",
            {"capabilities": ["embedding"], "machine": "a"},
        ),
    ],
)
def test_none_to_choose_is_refused_saying_why(
    peers: list[PeerEngine],
    known: tuple[str, ...],
    status: int,
    code: str,
    said: str,
    details: dict[str, Any],
) -> None:
    with pytest.raises(Refusal) as refused:
        choose("qwen", body.CHAT, peers, NOW, STALE_S, known=known)
    assert (refused.value.status, refused.value.code) == (status, code)
    assert said in refused.value.message, refused.value.message
    assert refused.value.details == details


def test_a_404_lists_at_most_fifty_models() -> None:
    many = tuple(f"m{n:03d}" for n in range(60))
    with pytest.raises(Refusal) as refused:
        choose("qwen", body.CHAT, [peer("a", models=many)], NOW, STALE_S)
    assert refused.value.message.endswith("m049, …")
    assert refused.value.param == "model"
