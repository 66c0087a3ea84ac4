"""plan() and its companions: the whole decision, as tables, without Docker."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from supervisor.docker import labels
from supervisor.docker.spec import Container, Mount, RunSpec, changed_settings
from supervisor.engines.base import Observed
from supervisor.engines.loader import parse
from supervisor.engines.look import Network
from supervisor.engines.tensorfold.engine import (
    Checkout,
    GrammarImage,
    PreparedCheckout,
    RecipeImage,
    missing,
)
from supervisor.engines.vllm.steps import TierImage
from supervisor.protocol.documents import DesiredFile, RunningEngine, Status, TargetGroup
from supervisor.worker.plan import (
    UNREQUESTED,
    Answer,
    Decision,
    acknowledge,
    failed,
    plan,
    shown,
    stalled,
    unobserved,
)
from supervisor.worker.pursuit import (
    BACKOFF,
    Pursuit,
    Reported,
    accept,
    conclude,
    due,
    means_to_start,
    reloaded,
    reported,
)
from supervisor.worker.steps import AwaitReady, Check, Prepare, Remove, Start, Stop
from tests.support import MINIMAL_RECIPE

IMAGE = "sha256:" + "a" * 64
OTHER = "sha256:" + "b" * 64
URL = "http://172.30.0.1:8888"
TARGETS = (TargetGroup(targets=["172.30.0.1:8888"], labels={"engine": "tensorfold"}),)
SPEC = RunSpec(
    name="lucia-x",
    image=IMAGE,
    network="lucia",
    host_ip="172.30.0.1",
    host_port=8888,
    container_port=8888,
    environment={"CONTEXT": "200000"},
    labels={
        labels.MANAGED: "true",
        labels.IMAGE_REF: "tf:grammar",
        labels.MODEL: "qwen",
        labels.RECIPE_COMMIT: "c" * 40,
    },
    command=("serve", "--context", "200000"),
)


def container(
    status: str = "running",
    *,
    image: str = IMAGE,
    managed: bool = True,
    exit_code: int = 0,
    oom: bool = False,
    cid: str = "c1",
    spec: RunSpec | None = SPEC,
) -> Container:
    found: dict[str, str] = {labels.MANAGED: "true"} if managed else {}
    if spec is not None and managed:
        found = {**spec.labels, labels.FINGERPRINT: spec.fingerprint()}
    return Container(
        id=cid,
        name="lucia-x",
        image_id=image,
        status=status,
        exit_code=exit_code,
        oom_killed=oom,
        started_at="t",
        labels=found,
        bindings=(),
    )


def seen(
    c: Container | None = None,
    missing: tuple[Any, ...] = (),
    spec: RunSpec | None = SPEC,
    log: tuple[str, ...] = (),
) -> Observed:
    return Observed(container=c, missing=missing, spec=spec, url=URL, targets=TARGETS, log=log)


RUN = Pursuit(1, "running")
READY = Pursuit(1, "running", ready="c1")
CHECKED = Pursuit(1, "running", checked=SPEC.fingerprint())
CHECKED_READY = Pursuit(1, "running", ready="c1", checked=SPEC.fingerprint())
STOP = Pursuit(1, "stopped")
ENGINE = RunningEngine(
    image="tf:grammar", image_id=IMAGE, container_id="c1", recipe_commit="c" * 40, model="qwen"
)
EDITED = replace(SPEC, environment={"CONTEXT": "150000"})
NOW = 100.0  # the loop's monotonic clock when it plans
TAKEN = "port 8889 on 172.30.0.1 is taken by another program; free it or change run.port"
BOOM = "stopping container c1: 500 Server Error"


def failing(pursuit: Pursuit, reason: str, retry_in: float | None, failures: int = 1) -> Pursuit:
    """pursuit after `failures` failures, the last for reason, tried again in retry_in s."""
    at = None if retry_in is None else NOW + retry_in
    return replace(pursuit, failure=reason, retry_at=at, failures=failures)


# (case, pursuit, observed) -> (step, state, message, targets, failure remembered)
TABLE: list[tuple[str, Pursuit | None, Observed, Any, str, str, bool, str | None]] = [
    ("nothing requested, nothing there", None, seen(), None, "stopped", UNREQUESTED, False, None),
    (
        "nothing requested, an engine runs",
        None,
        seen(container()),
        None,
        "running",
        UNREQUESTED,
        False,
        None,
    ),
    # stopped requests
    ("stopped, nothing there", STOP, seen(), None, "stopped", "stopped", False, None),
    (
        "stopped, engine runs",
        STOP,
        seen(container()),
        Stop("c1", "stop requested"),
        "stopping",
        "stopping the engine container (stop requested)",
        False,
        None,
    ),
    (
        "stopped, engine exited",
        STOP,
        seen(container("exited")),
        Remove("c1"),
        "stopping",
        "removing the old engine container",
        False,
        None,
    ),
    (
        "stopped, prerequisites missing do not matter",
        STOP,
        seen(None, (Checkout("c" * 40),), None),
        None,
        "stopped",
        "stopped",
        False,
        None,
    ),
    # running requests
    (
        "running, the network first",
        RUN,
        seen(None, (Network("lucia"), Checkout("c" * 40)), None),
        Prepare(Network("lucia")),
        "starting",
        "preparing: creating the Docker network lucia",
        False,
        None,
    ),
    (
        "running, build while the old engine serves",
        READY,
        seen(container(image=OTHER), (GrammarImage("tf-grammar"),), None),
        Prepare(GrammarImage("tf-grammar")),
        "running",
        "preparing: Adding structured output support to the TensorFold image",
        True,
        None,
    ),
    (
        "running, the KV tier image builds while the old engine serves",
        READY,
        seen(container(image=OTHER), (TierImage("v:1-tiers"),), None),
        Prepare(TierImage("v:1-tiers")),
        "running",
        "preparing: Adding the KV cache tiers to the vLLM image",
        True,
        None,
    ),
    (
        "running, build while an unproven engine runs",
        RUN,
        seen(container(image=OTHER), (RecipeImage("tf"),), None),
        Prepare(RecipeImage("tf")),
        "starting",
        "preparing: building tf",
        False,
        None,
    ),
    (
        "running, nothing there, not yet checked",
        RUN,
        seen(),
        Check(SPEC),
        "starting",
        "checking that the engine can start",
        False,
        None,
    ),
    (
        "running, nothing there, checked",
        CHECKED,
        seen(),
        Start(SPEC),
        "starting",
        "starting the engine container",
        False,
        None,
    ),
    (
        "running, checked for another spec",
        replace(CHECKED, checked="x"),
        seen(),
        Check(SPEC),
        "starting",
        "checking that the engine can start",
        False,
        None,
    ),
    (
        "running, right spec, not yet answered",
        RUN,
        seen(container()),
        AwaitReady("c1"),
        "starting",
        "waiting for the engine to answer",
        False,
        None,
    ),
    (
        "running, right spec, answered",
        READY,
        seen(container()),
        None,
        "running",
        f"serving at {URL}",
        True,
        None,
    ),
    (
        "running, another container answered before",
        Pursuit(1, "running", ready="c0"),
        seen(container()),
        AwaitReady("c1"),
        "starting",
        "waiting for the engine to answer",
        False,
        None,
    ),
    (
        "running, wrong image: checked before the serving engine is touched",
        READY,
        seen(container(image=OTHER)),
        Check(SPEC, "c1"),
        "running",
        "checking that the engine can start",
        True,
        None,
    ),
    (
        "running, wrong image, not serving: checked",
        RUN,
        seen(container(image=OTHER)),
        Check(SPEC, "c1"),
        "starting",
        "checking that the engine can start",
        False,
        None,
    ),
    (
        "running, wrong image, checked",
        replace(READY, checked=SPEC.fingerprint()),
        seen(container(image=OTHER)),
        Stop("c1", "replacing: it runs on another image"),
        "starting",
        "stopping the engine container (replacing: it runs on another image)",
        False,
        None,
    ),
    (
        "running, environment edited",
        replace(READY, checked=EDITED.fingerprint()),
        seen(container(), spec=EDITED),
        Stop("c1", "replacing: its environment changed"),
        "starting",
        "stopping the engine container (replacing: its environment changed)",
        False,
        None,
    ),
    (
        "running, created before fingerprints",
        CHECKED_READY,
        seen(container(spec=None)),
        Stop(
            "c1",
            "replacing: its image, command, environment, ports, gpus, limits, mounts, "
            "labels changed",
        ),
        "starting",
        "stopping the engine container (replacing: its image, command, environment, ports, gpus, "
        "limits, mounts, labels changed)",
        False,
        None,
    ),
    (
        "running, leftover exited container",
        RUN,
        seen(container("exited")),
        Remove("c1"),
        "starting",
        "removing the old engine container",
        False,
        None,
    ),
    (
        "running, our engine died",
        READY,
        seen(container("exited", exit_code=3), log=("boom",)),
        None,
        "failed",
        "exited with code 3: boom",
        False,
        "exited with code 3: boom",
    ),
    (
        "running, killed for memory",
        READY,
        seen(container("exited", exit_code=137, oom=True)),
        None,
        "failed",
        "exited with code 137: killed for using too much memory",
        False,
        "exited with code 137: killed for using too much memory",
    ),
    (
        "running, died while no worker looked (the last status said it served)",
        Pursuit(1, "running", served_before="c1"),
        seen(container("exited", exit_code=137), log=("srv killed",)),
        None,
        "failed",
        "exited with code 137: srv killed",
        False,
        "exited with code 137: srv killed",
    ),
    (
        "running, an older container than the one the last status said served",
        Pursuit(1, "running", served_before="c0"),
        seen(container("exited", exit_code=137)),
        Remove("c1"),
        "starting",
        "removing the old engine container",
        False,
        None,
    ),
    (
        "running, the last status said it served and it still runs: probed again",
        Pursuit(1, "running", served_before="c1"),
        seen(container()),
        AwaitReady("c1"),
        "starting",
        "waiting for the engine to answer",
        False,
        None,
    ),
    (
        "running, failed generation stays failed",
        Pursuit(1, "running", failure="x"),
        seen(container("exited")),
        None,
        "failed",
        "x",
        False,
        "x",
    ),
    (
        "running, failed build leaves the old engine alone",
        Pursuit(1, "running", failure="x"),
        seen(container(image=OTHER)),
        None,
        "failed",
        "x",
        False,
        "x",
    ),
    (
        "running, image missing after build",
        RUN,
        seen(None, (), None),
        None,
        "failed",
        "the engine image is missing after it was built",
        False,
        "the engine image is missing after it was built",
    ),
    (
        "a foreign container, running asked",
        RUN,
        seen(container(managed=False)),
        None,
        "failed",
        "a container named lucia-x exists that lucia-supervisor did not create; remove or rename "
        "it, then request again",
        False,
        "a container named lucia-x exists that lucia-supervisor "
        "did not create; remove or rename it, then request again",
    ),
    (
        "a foreign container, stopped asked",
        STOP,
        seen(container(managed=False)),
        None,
        "failed",
        "a container named lucia-x exists that lucia-supervisor did not create; remove or rename "
        "it, then request again",
        False,
        "a container named lucia-x exists that lucia-supervisor "
        "did not create; remove or rename it, then request again",
    ),
    # a remembered failure is shown wherever a step would be planned, until its retry time
    (
        "stopped, a failed stop is not planned again before its retry time",
        failing(STOP, BOOM, 5),
        seen(container()),
        None,
        "failed",
        f"{BOOM}; trying again in 5 s",
        False,
        BOOM,
    ),
    (
        "stopped, a failed stop is planned again once its time has come",
        failing(STOP, BOOM, 0),
        seen(container()),
        Stop("c1", "stop requested"),
        "stopping",
        "stopping the engine container (stop requested)",
        False,
        BOOM,
    ),
    (
        "stopped, a failed remove waits too",
        failing(STOP, BOOM, 2.5),
        seen(container("exited")),
        None,
        "failed",
        f"{BOOM}; trying again in 3 s",
        False,
        BOOM,
    ),
    (
        "stopped, the container went away after a failed stop: stopped, the failure forgotten",
        failing(STOP, BOOM, 5),
        seen(),
        None,
        "stopped",
        "stopped",
        False,
        None,
    ),
    (
        "running, a refused replacement: the old engine serves on, saying why",
        failing(READY, TAKEN, 10),
        seen(container(), spec=EDITED),
        None,
        "running",
        f"serving at {URL}; the replacement (its environment changed) was refused: {TAKEN}; "
        "trying again in 10 s",
        True,
        TAKEN,
    ),
    (
        "running, a refused replacement is checked again once its time has come",
        failing(READY, TAKEN, -1),
        seen(container(), spec=EDITED),
        Check(EDITED, "c1"),
        "running",
        "checking that the engine can start",
        True,
        TAKEN,
    ),
    (
        "running, a replacement refused for good: shown, never checked again",
        failing(READY, "refused --kv-dtpye", None),
        seen(container(image=OTHER)),
        None,
        "running",
        f"serving at {URL}; the replacement (it runs on another image) was refused: "
        "refused --kv-dtpye",
        True,
        "refused --kv-dtpye",
    ),
    (
        "running, a failed stop of a replacement: the old engine still serves",
        failing(replace(READY, checked=EDITED.fingerprint()), BOOM, 2),
        seen(container(), spec=EDITED),
        None,
        "running",
        f"serving at {URL}; stopping the engine container (replacing: its environment changed) "
        f"failed: {BOOM}; trying again in 2 s",
        True,
        BOOM,
    ),
    (
        "running, a failed build while the old engine serves",
        failing(READY, "build failed", None),
        seen(container(image=OTHER), (GrammarImage("tf-grammar"),), None),
        None,
        "running",
        f"serving at {URL}; preparing: Adding structured output support to the TensorFold image "
        "failed: build failed",
        True,
        "build failed",
    ),
    (
        "running, a failed KV tier image build while the old engine serves",
        failing(READY, "tiers build failed", None),
        seen(container(image=OTHER), (TierImage("v:1-tiers"),), None),
        None,
        "running",
        f"serving at {URL}; preparing: Adding the KV cache tiers to the vLLM image failed: "
        "tiers build failed",
        True,
        "tiers build failed",
    ),
    (
        "running, a refused first start: failed, with when it is tried again",
        failing(RUN, TAKEN, 30),
        seen(),
        None,
        "failed",
        f"{TAKEN}; trying again in 30 s",
        False,
        TAKEN,
    ),
    (
        "running, a reason's full stop gives way to when it is tried again",
        failing(RUN, "Lower CONTEXT or stop b.", 5),
        seen(),
        None,
        "failed",
        "Lower CONTEXT or stop b; trying again in 5 s",
        False,
        "Lower CONTEXT or stop b.",
    ),
    (
        "running, a refused first start is checked again once its time has come",
        failing(RUN, TAKEN, 0),
        seen(),
        Check(SPEC),
        "starting",
        "checking that the engine can start",
        False,
        TAKEN,
    ),
    (
        "running, a first start refused for good stays failed",
        failing(RUN, "refused", None),
        seen(),
        None,
        "failed",
        "refused",
        False,
        "refused",
    ),
    (
        "running, the engine serving as asked: a remembered failure is forgotten",
        failing(READY, TAKEN, 10),
        seen(container()),
        None,
        "running",
        f"serving at {URL}",
        True,
        None,
    ),
    (
        "running, the serving engine died after a refused replacement: its exit is the failure",
        failing(READY, TAKEN, 10),
        seen(container("exited", exit_code=3), spec=EDITED),
        None,
        "failed",
        "exited with code 3",
        False,
        "exited with code 3",
    ),
]


RETRYING = {  # a failed answer says whether the worker tries its step again by itself
    "stopped, a failed stop is not planned again before its retry time": True,
    "stopped, a failed remove waits too": True,
    "running, a refused first start: failed, with when it is tried again": True,
    "running, a first start refused for good stays failed": False,
    "running, the serving engine died after a refused replacement: its exit is the failure": False,
    "running, image missing after build": False,
}


@pytest.mark.parametrize("row", [row for row in TABLE if row[0] in RETRYING], ids=lambda r: r[0])
def test_a_failed_answer_says_whether_it_is_retried(row: tuple[Any, ...]) -> None:
    decision = plan(row[1], row[2], NOW)
    assert decision.answer.state == "failed"
    assert decision.answer.retrying is RETRYING[row[0]]


@pytest.mark.parametrize(
    ("pursuit", "waiting_for"),
    [
        (replace(failing(RUN, TAKEN, 30), memory_blocked=True), "memory"),
        (failing(RUN, TAKEN, 30), None),  # a port: stopping an engine would not help
        (replace(failing(RUN, "refused", None), memory_blocked=True), None),  # not retried
    ],
)
def test_a_failed_answer_says_when_it_waits_for_memory(
    pursuit: Pursuit, waiting_for: str | None
) -> None:
    decision = plan(pursuit, seen(), NOW)
    assert decision.answer.state == "failed"
    assert decision.answer.waiting_for == waiting_for


@pytest.mark.parametrize(
    ("pursuit", "observed", "step", "state", "message", "targets", "failure"),
    [row[1:] for row in TABLE],
    ids=[row[0] for row in TABLE],
)
def test_plan(
    pursuit: Pursuit | None,
    observed: Observed,
    step: Any,
    state: str,
    message: str,
    targets: bool,
    failure: str | None,
) -> None:
    decision = plan(pursuit, observed, NOW)
    assert decision.step == step
    assert decision.answer.state == state
    assert decision.answer.message == message
    assert decision.targets == (TARGETS if targets else ())
    assert decision.answer.url == (URL if state == "running" and pursuit else None)
    if pursuit is None:
        assert decision.pursuit is None and decision.answer.generation == 0
    else:
        assert decision.pursuit is not None
        assert decision.pursuit.failure == failure
        assert decision.answer.generation == pursuit.generation


def test_a_death_leaves_nothing_answering() -> None:
    decision = plan(READY, seen(container("exited", exit_code=3)), NOW)
    assert decision.pursuit is not None and decision.pursuit.ready is None
    again = plan(decision.pursuit, seen(container("exited", exit_code=3)), NOW)
    assert (again.answer.state, again.answer.message, again.step) == (
        "failed",
        "exited with code 3",
        None,
    )


@pytest.mark.parametrize(
    ("pursuit", "expected"),
    [
        (failing(READY, TAKEN, 30, failures=4), READY),  # a refused replacement: tried at once
        (
            failing(replace(CHECKED_READY, generation=3), "x", None),
            Pursuit(3, "running", ready="c1"),
        ),
        (failing(STOP, BOOM, 60, failures=9), STOP),
    ],
)
def test_a_reload_tries_everything_at_once_and_keeps_what_serves(
    pursuit: Pursuit, expected: Pursuit
) -> None:
    assert reloaded(pursuit) == expected


def test_a_serving_answer_names_what_runs() -> None:
    decision = plan(READY, seen(container()), NOW)
    assert decision.answer.engine == ENGINE
    assert plan(RUN, seen(container()), NOW).answer.engine is None


def test_notes_join_the_serving_message() -> None:
    observed = replace(seen(container()), notes="skipped bad.gguf")
    assert plan(READY, observed, NOW).answer.message == f"serving at {URL}; skipped bad.gguf"


def desired(generation: int, want: str) -> DesiredFile:
    return DesiredFile.model_validate(
        {"schemaVersion": 1, "generation": generation, "desired": want}
    )


ACCEPT = [
    ("first request", None, desired(1, "running"), Pursuit(1, "running")),
    ("the same request again", READY, desired(1, "running"), None),
    (
        "a new generation of what serves keeps the proof",
        READY,
        desired(2, "running"),
        Pursuit(2, "running", ready="c1"),
    ),
    (
        "a new generation after a failure retries, and what still serves keeps its proof",
        Pursuit(1, "running", ready="c1", failure="x", retry_at=5.0, failures=2),
        desired(2, "running"),
        Pursuit(2, "running", ready="c1"),
    ),
    (
        "a new generation after a death starts afresh",
        Pursuit(1, "running", failure="exited"),
        desired(2, "running"),
        Pursuit(2, "running"),
    ),
    ("the other way", READY, desired(2, "stopped"), Pursuit(2, "stopped")),
    (
        "desired changed without a new generation",
        READY,
        desired(1, "stopped"),
        Pursuit(1, "stopped"),
    ),
]


@pytest.mark.parametrize(
    ("pursuit", "request_", "expected"), [row[1:] for row in ACCEPT], ids=[row[0] for row in ACCEPT]
)
def test_accept(pursuit: Pursuit | None, request_: DesiredFile, expected: Pursuit | None) -> None:
    assert accept(pursuit, request_) == expected


BEFORE = Reported(4, "c1")
ACCEPT_AFTER_RESTART = [
    (
        "the generation the last status said served",
        None,
        desired(4, "running"),
        Pursuit(4, "running", served_before="c1"),
    ),
    ("another generation", None, desired(5, "running"), Pursuit(5, "running")),
    ("a stop", None, desired(4, "stopped"), Pursuit(4, "stopped")),
    (
        "only the worker's first request",
        Pursuit(3, "running"),
        desired(4, "running"),
        Pursuit(4, "running"),
    ),
]


@pytest.mark.parametrize(
    ("pursuit", "request_", "expected"),
    [row[1:] for row in ACCEPT_AFTER_RESTART],
    ids=[row[0] for row in ACCEPT_AFTER_RESTART],
)
def test_accept_after_a_worker_restart(
    pursuit: Pursuit | None, request_: DesiredFile, expected: Pursuit
) -> None:
    assert accept(pursuit, request_, BEFORE) == expected


BOOT = datetime(2025, 1, 2, 8, 0, tzinfo=UTC)


def status(
    state: str = "running",
    checked: datetime = BOOT + timedelta(hours=1),
    engine: RunningEngine | None = ENGINE,
) -> Status:
    return Status(
        generation=4,
        state=state,
        since=BOOT,
        message="m",  # type: ignore[arg-type]
        url=URL if state == "running" else None,
        checked_at=checked,
        engine=engine if state == "running" else None,
    )


@pytest.mark.parametrize(
    ("found", "expected"),
    [
        (None, None),
        (status(), Reported(4, "c1")),
        (status("starting"), None),
        (status("failed"), None),
        (status(engine=None), None),
        (status(checked=BOOT - timedelta(seconds=1)), None),  # a reboot: re-applied, not failed
    ],
)
def test_what_the_last_status_reported(found: Status | None, expected: Reported | None) -> None:
    assert reported(found, BOOT) == expected


SERVING = Decision(READY, Answer(1, "running", f"serving at {URL}", URL, ENGINE), TARGETS)

ACKNOWLEDGE = [
    ("first ever", Pursuit(1, "running"), None, "starting", "acknowledged: running requested", ()),
    (
        "re-request of a serving engine keeps its target",
        Pursuit(2, "running", ready="c1"),
        SERVING,
        "starting",
        "acknowledged: running requested",
        TARGETS,
    ),
    (
        "a stop drops the target at once",
        Pursuit(2, "stopped"),
        SERVING,
        "stopping",
        "acknowledged: stopped requested",
        (),
    ),
]


@pytest.mark.parametrize(
    ("pursuit", "previous", "state", "message", "targets"),
    [row[1:] for row in ACKNOWLEDGE],
    ids=[row[0] for row in ACKNOWLEDGE],
)
def test_acknowledge(
    pursuit: Pursuit,
    previous: Decision | None,
    state: str,
    message: str,
    targets: tuple[TargetGroup, ...],
) -> None:
    decision = acknowledge(pursuit, previous)
    assert decision.pursuit == pursuit and decision.step is None
    assert (decision.answer.generation, decision.answer.state) == (pursuit.generation, state)
    assert decision.answer.message == message
    assert decision.targets == targets


RECIPE = "recipe reload refused (the recipe loaded before stays in use): "
NVME = "tiers.nvme.path: '~/kv/nvme' must be an absolute path"


@pytest.mark.parametrize(
    ("state", "refused", "recipe", "message"),
    [
        ("running", "bad", None, "request refused: bad"),
        ("stopped", "bad", None, "request refused: bad"),
        ("failed", "bad", None, "request refused: bad"),
        ("starting", "bad", None, "working"),
        ("stopping", "bad", None, "working"),
        ("running", None, None, "working"),
        # a refused recipe reload leads what a settled answer says; the engine is left as it is
        ("running", None, NVME, f"{RECIPE}{NVME}; working"),
        ("stopped", None, NVME, f"{RECIPE}{NVME}; working"),
        ("failed", None, NVME, f"{RECIPE}{NVME}; working"),
        ("running", "bad", NVME, f"{RECIPE}{NVME}; request refused: bad"),
        ("starting", None, NVME, "working"),  # a step's progress is not hidden
        ("stopping", "bad", NVME, "working"),
    ],
)
def test_a_refusal_is_shown_on_settled_answers(
    state: str, refused: str | None, recipe: str | None, message: str
) -> None:
    answer = Answer(1, state, "working")  # type: ignore[arg-type]
    assert shown(answer, refused, recipe).message == message


def test_a_stall_keeps_the_last_answer_and_says_why() -> None:
    decision = stalled(SERVING, "docker did not answer within 10 s")
    assert decision.answer == replace(
        SERVING.answer, message=f"serving at {URL}; docker did not answer within 10 s"
    )
    assert decision.targets == TARGETS and decision.step is None
    working = Decision(RUN, Answer(1, "starting", "waiting for the engine to answer"))
    assert stalled(working, "late").answer == Answer(1, "starting", "late")
    # a stall of a stall says it once
    again = stalled(decision, "docker did not answer within 10 s")
    assert again.answer.message == decision.answer.message


def test_a_stall_while_serving_never_says_starting() -> None:
    """Was (issue 19): the client's timeout became unobserved(), which said starting while the
    engine served; and every later stall kept that starting answer."""
    reason = "inspecting container lucia-x: docker did not answer in time; retrying in 1s"
    decision = unobserved(READY, reason, SERVING, answering=True)
    assert decision.answer == replace(
        SERVING.answer, message=f"serving at {URL}; docker does not answer: {reason}"
    )
    assert decision.targets == TARGETS and decision.step is None
    later = stalled(decision, "docker did not answer within 10 s; still waiting")
    assert later.answer.state == "running" and later.answer.engine == ENGINE
    assert unobserved(READY, reason, later, answering=None).answer.state == "running"


DURING_A_STEP = Decision(
    READY,
    Answer(1, "running", "preparing: building tf", URL, ENGINE),
    TARGETS,
    Prepare(RecipeImage("tf")),
)
NEWER = Pursuit(2, "running", ready="c1")

UNOBSERVED = [
    ("serving, answering", READY, SERVING, True, "running"),
    ("serving, not asked (a step's docker call)", READY, SERVING, None, "running"),
    ("serving during a build", READY, DURING_A_STEP, True, "running"),
    ("serving, but the ready path does not answer", READY, SERVING, False, "starting"),
    (
        "nothing seen answering yet",
        RUN,
        Decision(RUN, Answer(1, "starting", "x")),
        True,
        "starting",
    ),
    ("a newer request not yet answered", NEWER, SERVING, True, "starting"),
    ("a stop requested", STOP, SERVING, True, "stopping"),
    ("no previous decision", READY, None, True, "starting"),
]


@pytest.mark.parametrize(
    ("pursuit", "previous", "answering", "state"),
    [row[1:] for row in UNOBSERVED],
    ids=[row[0] for row in UNOBSERVED],
)
def test_unobserved_keeps_serving_only_what_served(
    pursuit: Pursuit, previous: Decision | None, answering: bool | None, state: str
) -> None:
    decision = unobserved(pursuit, "docker did not answer in time", previous, answering)
    assert (decision.answer.state, decision.answer.generation) == (state, pursuit.generation)
    assert decision.step is None
    if state == "running":
        assert previous is not None
        assert decision.targets == TARGETS and decision.answer.url == URL
        assert decision.answer.engine == ENGINE and decision.pursuit == pursuit
        assert "docker does not answer" in decision.answer.message
    else:
        assert decision.targets == () and decision.answer.url is None


@pytest.mark.parametrize(
    ("pursuit", "state", "generation"),
    [(None, "failed", 0), (READY, "starting", 1), (STOP, "stopping", 1)],
)
def test_docker_unavailable_claims_nothing_serves(
    pursuit: Pursuit | None, state: str, generation: int
) -> None:
    decision = unobserved(pursuit, "docker is unavailable")
    assert (decision.answer.state, decision.answer.generation) == (state, generation)
    assert decision.targets == () and decision.step is None and decision.answer.url is None


@pytest.mark.parametrize(
    ("pursuit", "step", "error", "waitable", "expected"),
    [
        (RUN, AwaitReady("c2"), None, False, Pursuit(1, "running", ready="c2")),
        (RUN, Start(SPEC), None, False, RUN),
        (RUN, Check(SPEC), None, False, Pursuit(1, "running", checked=SPEC.fingerprint())),
        # a refusal that may pass by waiting is tried again after the back-off; one that cannot
        # is not
        (RUN, Check(SPEC, "c1"), TAKEN, True, failing(RUN, TAKEN, BACKOFF[0])),
        (
            RUN,
            Check(SPEC, "c1"),
            "arguments refused",
            False,
            failing(RUN, "arguments refused", None),
        ),
        (
            RUN,
            Prepare(PreparedCheckout()),
            "prepare failed",
            False,
            failing(RUN, "prepare failed", None),
        ),
        (RUN, AwaitReady("c2"), "not ready", False, failing(RUN, "not ready", None)),
        # a failed Stop or Remove is always tried again: the operator may fix Docker meanwhile
        (STOP, Stop("c1", "stop requested"), BOOM, False, failing(STOP, BOOM, BACKOFF[0])),
        (STOP, Remove("c1"), BOOM, False, failing(STOP, BOOM, BACKOFF[0])),
        (
            READY,
            Stop("c1", "replacing: its ports changed"),
            BOOM,
            False,
            failing(READY, BOOM, BACKOFF[0]),
        ),
        # the back-off grows with the failures in a row, and is bounded
        (
            failing(RUN, TAKEN, -1, failures=2),
            Check(SPEC),
            TAKEN,
            True,
            failing(RUN, TAKEN, BACKOFF[2], failures=3),
        ),
        (
            failing(RUN, TAKEN, -1, failures=40),
            Check(SPEC),
            TAKEN,
            True,
            failing(RUN, TAKEN, BACKOFF[-1], failures=41),
        ),
        # a pass forgets the failure, but not how many came in a row (a Start may fail next)
        (
            failing(RUN, TAKEN, -1, failures=2),
            Check(SPEC),
            None,
            False,
            Pursuit(1, "running", checked=SPEC.fingerprint(), failures=2),
        ),
        (
            failing(STOP, BOOM, -1, failures=1),
            Stop("c1", "stop requested"),
            None,
            False,
            replace(STOP, failures=1),
        ),
    ],
)
def test_conclude(
    pursuit: Pursuit, step: Any, error: str | None, waitable: bool, expected: Pursuit
) -> None:
    assert conclude(pursuit, step, error, NOW, waitable=waitable) == expected


def test_the_back_off_grows_to_a_bound() -> None:
    pursuit, delays = STOP, []
    for _ in range(8):
        pursuit = conclude(pursuit, Stop("c1", "stop requested"), BOOM, NOW)
        assert pursuit.retry_at is not None
        assert not due(pursuit, pursuit.retry_at - 0.001) and due(pursuit, pursuit.retry_at)
        delays.append(pursuit.retry_at - NOW)
    assert delays == [1, 2, 5, 10, 30, 60, 60, 60]


def test_a_failed_look_is_tried_again_but_a_failure_found_is_not() -> None:
    looked = failed(RUN, "docker refused the listing", NOW)
    assert looked.pursuit == failing(RUN, "docker refused the listing", BACKOFF[0])
    found = failed(READY, "exited with code 3")
    assert found.pursuit == failing(READY, "exited with code 3", None)
    assert not due(found.pursuit, float("inf"))


@pytest.mark.parametrize(
    ("pursuit", "expected"),
    [
        (None, False),
        (Pursuit(1, "running"), False),  # nothing checked yet: nothing was claimed
        (Pursuit(1, "running", checked=SPEC.fingerprint()), True),  # a Start or a Stop for it next
        (Pursuit(1, "running", checked=SPEC.fingerprint(), failure="stop failed"), False),
        (Pursuit(2, "stopped"), False),  # a stop came between the Check and the Start
        (accept(Pursuit(1, "running", checked=SPEC.fingerprint()), desired(2, "running")), False),
    ],
)
def test_what_a_passed_check_claimed_is_wanted_until_its_start(
    pursuit: Pursuit | None, expected: bool
) -> None:
    assert means_to_start(pursuit) is expected


# -- the run spec's fingerprint: every setting a container is created with ---------------------

CHANGES: list[tuple[str, dict[str, Any], str]] = [
    ("image", {"image": OTHER}, "image"),
    ("command", {"command": ("serve", "--context", "150000")}, "command"),
    ("environment value", {"environment": {"CONTEXT": "150000"}}, "environment"),
    ("environment added", {"environment": {"CONTEXT": "200000", "X": "1"}}, "environment"),
    ("host port", {"host_port": 8889}, "ports"),
    ("container port", {"container_port": 9000}, "ports"),
    ("gateway", {"host_ip": "172.31.0.1"}, "ports"),
    ("network", {"network": "other"}, "ports"),
    ("gpus", {"gpus": "all"}, "gpus"),
    ("gpu count", {"gpus": 1}, "gpus"),
    ("shm", {"shm_size": "10g"}, "limits"),
    ("memory limit", {"memory": "26g"}, "limits"),
    ("ipc", {"ipc_mode": "host"}, "limits"),
    ("ulimits", {"ulimits": {"memlock": -1}}, "limits"),
    ("volume", {"mounts": (Mount("/a", "/b"),)}, "mounts"),
    ("volume read-only", {"mounts": (Mount("/a", "/b", True),)}, "mounts"),
    ("a recorded label", {"labels": {**SPEC.labels, labels.RECIPE_COMMIT: "d" * 40}}, "labels"),
]


@pytest.mark.parametrize(
    ("change", "setting"), [row[1:] for row in CHANGES], ids=[row[0] for row in CHANGES]
)
def test_every_setting_is_in_the_fingerprint(change: dict[str, Any], setting: str) -> None:
    edited = replace(SPEC, **change)
    assert changed_settings(SPEC.fingerprint(), edited.fingerprint()) == (setting,)
    assert plan(READY, seen(container(), spec=edited), NOW).step == Check(edited, "c1")
    checked = replace(READY, checked=edited.fingerprint())
    step = plan(checked, seen(container(), spec=edited), NOW).step
    if setting == "image":
        assert step == Stop("c1", "replacing: it runs on another image")
    else:
        assert step == Stop("c1", f"replacing: its {setting} changed")


def test_bookkeeping_labels_are_not_in_the_fingerprint() -> None:
    stamped = replace(SPEC, labels={**SPEC.labels, labels.GENERATION: "7", labels.FINGERPRINT: "x"})
    assert stamped.fingerprint() == SPEC.fingerprint()
    # a container made before it carried its data directory is adopted, never replaced for it
    located = replace(SPEC, labels={**SPEC.labels, labels.DATA: "/home/u/.local/share/lucia/x"})
    assert located.fingerprint() == SPEC.fingerprint()
    assert replace(SPEC, environment={"CONTEXT": "200000"}).fingerprint() == SPEC.fingerprint()


def test_missing_prerequisites() -> None:
    recipe = parse(MINIMAL_RECIPE, "minimal.toml")
    commit = recipe.source.commit  # type: ignore[union-attr]
    grammar = f"{recipe.image.tag}-grammar"  # type: ignore[union-attr]
    tag = recipe.image.tag  # type: ignore[union-attr]
    rows = [
        # checkout, recipe, prepared, grammar -> steps
        ((True, True, True, True), ()),
        ((False, True, True, True), ()),  # a restart with images in place never touches git
        ((False, False, True, False), (Checkout(commit), RecipeImage(tag), GrammarImage(grammar))),
        ((True, False, True, False), (RecipeImage(tag), GrammarImage(grammar))),
        ((False, True, False, True), (Checkout(commit), PreparedCheckout())),
        ((True, True, True, False), (GrammarImage(grammar),)),
        (
            (False, False, False, False),
            (Checkout(commit), RecipeImage(tag), GrammarImage(grammar), PreparedCheckout()),
        ),
    ]
    for (checkout, built, prepared, grammar_ok), expected in rows:
        assert (
            missing(
                recipe,
                checkout_ok=checkout,
                recipe_ok=built,  # type: ignore[arg-type]
                prepared=prepared,
                grammar_ok=grammar_ok,
            )
            == expected
        )


PREPARE_MAKES_IMAGE = MINIMAL_RECIPE.replace(
    'tag = "img:1"', 'tag = "img:1"\nfrom = "prepare"\n[prepare]\ncommands = [["bash", "p.sh"]]'
)


@pytest.mark.parametrize(
    ("checkout", "image", "prepared", "grammar_ok", "expected"),
    [
        (True, True, True, True, ()),
        (False, True, True, True, ()),  # a restart with everything in place never touches git
        (False, True, True, False, ("grammar",)),  # a new pin or base id: only the grammar image
        (False, True, False, True, ("checkout", "prepare")),  # commit, commands or settings
        (True, True, False, True, ("prepare",)),
        (False, False, True, False, ("checkout", "prepare", "grammar")),  # the image is gone
        (True, False, True, False, ("prepare", "grammar")),
        (False, False, False, False, ("checkout", "prepare", "grammar")),
    ],
)
def test_missing_when_the_prepare_makes_the_image(
    checkout: bool, image: bool, prepared: bool, grammar_ok: bool, expected: tuple[str, ...]
) -> None:
    recipe = parse(PREPARE_MAKES_IMAGE, "prepare.toml")
    assert recipe.image_from_prepare  # type: ignore[union-attr]
    made = {
        "checkout": Checkout(recipe.source.commit),  # type: ignore[union-attr]
        "prepare": PreparedCheckout(),
        "grammar": GrammarImage("img:1-grammar"),
    }
    assert missing(
        recipe,
        checkout_ok=checkout,
        recipe_ok=image,  # type: ignore[arg-type]
        prepared=prepared,
        grammar_ok=grammar_ok,
    ) == tuple(made[e] for e in expected)


def test_importing_the_planner_imports_no_docker() -> None:
    code = (
        "import sys, supervisor.worker.plan, supervisor.worker.pursuit,"
        " supervisor.worker.steps; print('docker' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
