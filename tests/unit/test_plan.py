"""plan(): the whole decision table, without Docker."""

from __future__ import annotations

import pytest

from supervisor.engines.tensorfold import (
    CHECKOUT,
    GRAMMAR_IMAGE,
    PREPARE,
    RECIPE_IMAGE,
    missing,
)
from supervisor.plan import (
    AwaitReady,
    Fail,
    Memory,
    Observed,
    Prepare,
    Remove,
    Settle,
    Start,
    Stop,
    plan,
)
from supervisor.runtime import Container

IMAGE = "sha256:" + "a" * 64
OTHER = "sha256:" + "b" * 64


def container(
    status: str = "running",
    *,
    image: str = IMAGE,
    managed: bool = True,
    exit_code: int = 0,
    oom: bool = False,
    cid: str = "c1",
) -> Container:
    return Container(
        id=cid, name="lucia-x", image_id=image, status=status, exit_code=exit_code,
        oom_killed=oom, started_at="t", labels={"lucia.managed": "true"} if managed else {},
        bindings=(),
    )


def seen(c: Container | None = None, missing: tuple[str, ...] = (),
         image: str | None = IMAGE) -> Observed:
    return Observed(container=c, missing=missing, image_id=image)


RUN = Memory(1, "running")
STOP = Memory(1, "stopped")

TABLE = [
    # stopped requests
    ("stopped, nothing there", STOP, seen(), Settle("stopped")),
    ("stopped, engine runs", STOP, seen(container()), Stop("c1", "stop requested")),
    ("stopped, engine exited", STOP, seen(container("exited")), Remove("c1")),
    ("stopped, prerequisites missing do not matter", STOP, seen(None, (CHECKOUT,), None),
     Settle("stopped")),
    # running requests
    ("running, first prerequisite first", RUN, seen(None, (CHECKOUT, RECIPE_IMAGE), None),
     Prepare(CHECKOUT)),
    ("running, build while the old engine serves", RUN,
     seen(container(image=OTHER), (GRAMMAR_IMAGE,), None), Prepare(GRAMMAR_IMAGE)),
    ("running, nothing there", RUN, seen(), Start(IMAGE)),
    ("running, right image, not yet answered", RUN, seen(container()), AwaitReady("c1")),
    ("running, right image, answered", Memory(1, "running", ready="c1"), seen(container()),
     Settle("running")),
    ("running, another container answered before", Memory(1, "running", ready="c0"),
     seen(container()), AwaitReady("c1")),
    ("running, wrong image", RUN, seen(container(image=OTHER)),
     Stop("c1", "replacing: it runs on another image")),
    ("running, leftover exited container", RUN, seen(container("exited")), Remove("c1")),
    ("running, our engine died", Memory(1, "running", ready="c1"),
     seen(container("exited", exit_code=3)), Fail("exited with code 3", logs_of="c1")),
    ("running, killed for memory", Memory(1, "running", ready="c1"),
     seen(container("exited", exit_code=137, oom=True)),
     Fail("exited with code 137: killed for using too much memory", logs_of="c1")),
    ("running, failed generation stays failed", Memory(1, "running", failure="x"),
     seen(container("exited")), Settle("failed")),
    ("running, failed build leaves the old engine alone", Memory(1, "running", failure="x"),
     seen(container(image=OTHER)), Settle("failed")),
    ("running, image missing after build", RUN, seen(None, (), None),
     Fail("the engine image is missing after it was built")),
]


@pytest.mark.parametrize(("memory", "observed", "expected"),
                         [row[1:] for row in TABLE], ids=[row[0] for row in TABLE])
def test_plan(memory: Memory, observed: Observed, expected: object) -> None:
    assert plan(memory, observed) == expected


@pytest.mark.parametrize("memory", [RUN, STOP])
def test_a_foreign_container_is_never_touched(memory: Memory) -> None:
    step = plan(memory, seen(container(managed=False)))
    assert isinstance(step, Fail)
    assert "did not create" in step.message


MISSING = [
    # checkout, recipe, prepared, grammar -> steps
    (True, True, True, True, ()),
    (False, True, True, True, ()),  # a restart with images in place never touches git
    (False, False, True, False, (CHECKOUT, RECIPE_IMAGE, GRAMMAR_IMAGE)),
    (True, False, True, False, (RECIPE_IMAGE, GRAMMAR_IMAGE)),
    (False, True, False, True, (CHECKOUT, PREPARE)),
    (True, True, True, False, (GRAMMAR_IMAGE,)),
    (False, False, False, False, (CHECKOUT, RECIPE_IMAGE, GRAMMAR_IMAGE, PREPARE)),
]


@pytest.mark.parametrize(("checkout", "recipe", "prepared", "grammar", "expected"), MISSING)
def test_missing_prerequisites(checkout: bool, recipe: bool, prepared: bool, grammar: bool,
                               expected: tuple[str, ...]) -> None:
    assert missing(checkout_ok=checkout, recipe_ok=recipe, prepared=prepared,
                   grammar_ok=grammar) == expected


def test_a_changed_fingerprint_replaces_the_container() -> None:
    observed = Observed(container=container(), missing=(), image_id=IMAGE, fingerprint="new")
    assert plan(Memory(1, "running", ready="c1"), observed) == Stop(
        "c1", "replacing: its run settings changed")
    same = Container(**{**container().__dict__, "labels": {"lucia.managed": "true",
                                                          "lucia.fingerprint": "new"}})
    observed = Observed(container=same, missing=(), image_id=IMAGE, fingerprint="new")
    assert plan(Memory(1, "running", ready="c1"), observed) == Settle("running")
