"""The worker rules (docs/protocol.md), one suite run once per engine against the real dockerd.

An engine is done when it passes this suite: acknowledgement, heartbeat, cancel, readiness,
death with exit code, adoption, replacement, lease, gateway-only port, file_sd, refused input,
a refused recipe reload.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import socket
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import docker
import pytest

from supervisor.engines import registry
from supervisor.engines.vllm.recipe import PLUGIN_BUFFER_BYTES, PLUGIN_QUEUE_BYTES
from tests.conformance.driver import Kind
from tests.corpus import INVALID, materialise
from tests.fixtures import ROOT, Engine, age, free_port, http_status, state_since
from tests.vllm_cpu import library_revision

pytestmark = pytest.mark.docker


TEST_ENGINES = tuple(
    f"tests.engines.{path.parent.name}.kind"
    for path in sorted((ROOT / "tests" / "engines").glob("*/kind.py"))
)
KINDS = registry.kinds(registry.configured() + TEST_ENGINES)  # the shipped, then tests/engines/*


@pytest.fixture(params=list(KINDS))
def kind(
    request: pytest.FixtureRequest,
    make_engine: Callable[..., Engine],
    monkeypatch: pytest.MonkeyPatch,
) -> Kind:
    """Each registered kind, driven by the conformance driver its EngineKind names; the workers
    find the kinds defined under tests/engines through LUCIA_ENGINE_MODULES."""
    extra = [m for m in os.environ.get(registry.MODULES_ENV, "").split(",") if m]
    monkeypatch.setenv(registry.MODULES_ENV, ",".join([*extra, *TEST_ENGINES]))
    driver = importlib.import_module(KINDS[request.param].conformance)
    made: Kind = driver.kind(make_engine, request)
    return made


def _scrape_url(group: dict[str, Any]) -> str:
    """The URL Prometheus scrapes for a file_sd group: its __param_* labels are the query."""
    labels = group["labels"]
    params = {k.removeprefix("__param_"): v for k, v in labels.items() if k.startswith("__param_")}
    query = "?" + urllib.parse.urlencode(params) if params else ""
    return f"http://{group['targets'][0]}{labels['__metrics_path__']}{query}"


def test_acknowledgement_then_running_then_stopped(kind: Kind, client) -> None:
    knobs, _ = kind.slow_step(3)
    engine = kind.make(**knobs)
    engine.start_worker()
    generation = engine.request("running")
    first = engine.wait_status(lambda s: s["generation"] == generation, timeout=5)
    assert first["state"] == "starting" and first["url"] is None
    status = engine.wait_state(generation, "running", timeout=120)
    assert status["url"] == f"http://{engine.gateway()}:{engine.port}"
    labels = client.containers.get(engine.container).labels
    assert labels["lucia.managed"] == "true" and labels["lucia.name"] == engine.name
    assert labels["lucia.generation"] == str(generation)
    stopped = engine.request("stopped")
    first = engine.wait_status(lambda s: s["generation"] == stopped, timeout=5)
    assert first["state"] in ("stopping", "stopped")
    engine.wait_state(stopped, "stopped", timeout=90)
    with pytest.raises(docker.errors.NotFound):
        client.containers.get(engine.container)


def test_heartbeat_during_a_long_step(kind: Kind) -> None:
    knobs, marker = kind.slow_step(12)
    engine = kind.make(**knobs)
    engine.start_worker(heartbeat=2.0)
    generation = engine.request("running")
    engine.wait_status(lambda s: marker in s["message"], timeout=60)
    ages = []
    deadline = time.monotonic() + 6
    while time.monotonic() < deadline:
        status = engine.status()
        if status:
            ages.append(age(status))
            assert status["generation"] == generation and status["state"] == "starting"
        time.sleep(0.1)
    assert max(ages) < 2.0 + 1.5, f"heartbeat gap {max(ages):.1f}s"


def _processes() -> dict[int, tuple[str, int, int]]:
    """Every process: its state, parent and process group (/proc/<pid>/stat)."""
    found = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            text = Path(entry.path, "stat").read_text()
        except OSError:
            continue  # ended meanwhile
        fields = text[text.rfind(")") + 2 :].split()
        found[int(entry.name)] = (fields[0], int(fields[1]), int(fields[2]))
    return found


def _groups_under(pid: int) -> set[int]:
    """The process groups that pid's descendants lead: the commands its steps run, each in a
    session of its own (supervisor/docker/process.py)."""
    processes = _processes()
    below, found = {pid}, True
    while found:
        found = False
        for child, (_, parent, _) in processes.items():
            if parent in below and child not in below:
                below.add(child)
                found = True
    own = processes.get(pid, ("", 0, 0))[2]
    return {p for p in below - {pid} if processes[p][2] == p and p != own}


def _running_in(group: int) -> list[int]:
    """The processes of a group that have not ended (a zombie waiting for its reaper has)."""
    return [p for p, (state, _, pgid) in _processes().items() if pgid == group and state != "Z"]


def test_a_new_request_cancels_a_long_step_and_ends_its_processes(kind: Kind, client) -> None:
    """A step held for 300 s is cancelled by a new request: the worker stops the engine, and
    every process the step started on the host, its whole process group (a `docker run` the
    command left behind included), ends. What is waited for are those events; the deadlines
    only bound a failure, far below the step's 300 s."""
    knobs, marker = kind.slow_step(300)
    engine = kind.make(**knobs)
    worker = engine.start_worker()
    engine.request("running")
    engine.wait_status(lambda s: marker in s["message"], timeout=60)
    groups = _groups_under(worker.pid)
    if kind.step_processes:
        assert groups, "no process group of the step's command found"
    stopped = engine.request("stopped")
    engine.wait_state(stopped, "stopped", timeout=30)
    # the worker says stopped once the step ended, and the step ends only when every process
    # of its group has: killed, and the output they all hold read to its end
    left = {group: members for group in groups if (members := _running_in(group))}
    assert not left, f"the step's processes outlived the cancel: {left}"
    with pytest.raises(docker.errors.NotFound):
        client.containers.get(engine.container)


def test_readiness_with_the_engine_output_as_message(kind: Kind) -> None:
    knobs, marker = kind.slow_ready(4)
    engine = kind.make(**knobs)
    engine.start_worker()
    generation = engine.request("running")
    seen = engine.wait_status(
        lambda s: s["generation"] == generation and marker in s["message"], timeout=60
    )
    assert seen["state"] == "starting" and seen["url"] is None
    assert engine.file_sd() == []
    engine.wait_state(generation, "running", timeout=60)


def test_one_worker_per_directory(kind: Kind) -> None:
    engine = kind.make()
    first = engine.start_worker()
    engine.wait_status(lambda s: True, timeout=30)
    second = engine.start_worker()
    assert second.wait(30) != 0
    log = (engine.root / "worker-1.log").read_text()
    assert str(engine.dir) in log and f"pid {first.pid}" in log
    assert first.poll() is None


def test_the_port_is_published_on_the_gateway_only(kind: Kind, client) -> None:
    engine, _ = kind.running()
    attrs = client.containers.get(engine.container).attrs
    gateway = engine.gateway()
    bindings = [b for published in attrs["HostConfig"]["PortBindings"].values() for b in published]
    live = [
        b for published in attrs["NetworkSettings"]["Ports"].values() for b in (published or [])
    ]
    assert bindings and live
    assert {b["HostIp"] for b in bindings + live} == {gateway}
    with socket.socket() as sock:
        sock.settimeout(2)
        assert sock.connect_ex(("127.0.0.1", engine.port)) != 0, "answers on loopback"
    kind.hand_on(engine)


def test_refused_input_leaves_the_engine_untouched(kind: Kind, client) -> None:
    engine, status = kind.running()
    container = client.containers.get(engine.container)
    desired = engine.dir / "desired.json"
    valid = json.dumps(
        {"schemaVersion": 1, "generation": status["generation"], "desired": "running"}
    )
    for case in INVALID:
        materialise(case, desired)
        refused = engine.wait_status(
            lambda s: s.get("refused") is not None, timeout=10, what=f"refusal of {case.name}"
        )
        assert refused["state"] == "running", case.name
        assert refused["generation"] == status["generation"], case.name
        assert "refused" in refused["message"], case.name
        tmp = engine.dir / ".restore.tmp"
        tmp.write_text(valid)
        if desired.is_dir() and not desired.is_symlink():
            shutil.rmtree(desired)
        os.replace(tmp, desired)
        engine.wait_status(lambda s: s.get("refused") is None, timeout=10)
    after = client.containers.get(engine.container)
    assert (after.id, after.attrs["State"]["StartedAt"]) == (
        container.id,
        container.attrs["State"]["StartedAt"],
    )
    assert engine.file_sd()
    kind.hand_on(engine)


def test_a_refused_recipe_reload_is_in_the_status_while_the_engine_serves_on(
    kind: Kind, client
) -> None:
    """A recipe that cannot be loaded is said in status.json, state `running`, until a valid
    one is; the engine serves on, untouched, on the recipe it has."""
    engine, status = kind.running()
    container = client.containers.get(engine.container)
    kept = dict(engine.run_extra)
    engine.reload(run_extra={**kept, "no_such_setting": "1"})
    refused = engine.wait_status(
        lambda s: "recipe reload refused" in s["message"], timeout=10, what="the refused reload"
    )
    assert refused["message"].startswith("recipe reload refused"), refused["message"]
    assert "no_such_setting" in refused["message"]
    assert (refused["state"], refused["generation"], refused["url"]) == (
        "running",
        status["generation"],
        status["url"],
    )
    assert refused["refused"] is None  # desired.json is valid: only the recipe was refused
    engine.reload(run_extra=kept)
    engine.wait_status(
        lambda s: s["message"] == status["message"],
        timeout=10,
        what="the refusal gone once a valid recipe is loaded",
    )
    after = client.containers.get(engine.container)
    assert (after.id, after.attrs["State"]["StartedAt"]) == (
        container.id,
        container.attrs["State"]["StartedAt"],
    )
    assert engine.file_sd()
    kind.hand_on(engine)


def test_adoption_across_a_worker_restart(kind: Kind, client) -> None:
    engine, status = kind.running()
    before = client.containers.get(engine.container).attrs
    engine.stop_worker(engine.procs[-1])
    assert client.containers.get(engine.container).status == "running"
    restarted = time.time()
    engine.start_worker()
    engine.wait_status(
        lambda s: (
            s["generation"] == status["generation"]
            and s["state"] == "running"
            and state_since(s) > restarted
        ),
        timeout=30,
    )
    after = client.containers.get(engine.container).attrs
    assert (after["Id"], after["State"]["StartedAt"]) == (
        before["Id"],
        before["State"]["StartedAt"],
    )
    assert "preparing" not in engine.log_tail(), "a restart must not rebuild or re-sync"
    kind.hand_on(engine)


def test_status_names_what_runs(kind: Kind, client) -> None:
    engine, status = kind.running()
    container = client.containers.get(engine.container)
    running = status["engine"]
    assert running["containerId"] == container.id
    assert running["imageId"] == container.image.id
    assert running["image"] == kind.image(engine)  # this kind's name, no other kind's
    assert running["image"] in container.image.tags  # a name of the image it runs (by id)
    if kind.name == "tensorfold":
        assert running["recipeCommit"] == engine.commit
    if kind.name == "vllm" and engine.vllm_device == "cpu":  # a library model's file digest
        files = engine.models_dir / engine.vllm_guid / "files"
        assert running["modelRevision"] == library_revision(files, engine.vllm_guid), running
        assert running["model"] == "tiny-llama"
        assert running["engineVersion"] == "0.32.0"  # the real server's /version
    elif kind.name == "vllm":
        assert running["modelRevision"] == engine.revision
    kind.hand_on(engine)


def test_file_sd_holds_the_target_only_while_running(kind: Kind, client) -> None:
    engine, _ = kind.running()
    (group,) = engine.file_sd()
    assert group["targets"] == [f"{engine.gateway()}:{engine.port}"]
    assert group["labels"]["engine"] == kind.name and group["labels"]["name"] == engine.name
    assert http_status(_scrape_url(group)) == 200
    path = engine.data_dir / "telemetry" / f"{engine.name}.json"
    assert os.stat(path).st_mode & 0o777 == 0o644
    # a request for what already runs is re-acknowledged; the target stays while it serves.
    # The file is written only when its content changes, a new file renamed over it: the one
    # held open here (its inode cannot be reused meanwhile) is still in place once the worker
    # answered the request, unless a write came in between, a target dropped and put back too
    held = os.open(path, os.O_RDONLY)
    try:
        again = engine.request("running")
        engine.wait_state(again, "running", timeout=30)
        replaced = not os.path.samestat(os.fstat(held), os.stat(path))
    finally:
        os.close(held)
    assert not replaced, "the target was written again while the engine kept serving"
    stopped = engine.request("stopped")
    status = engine.wait_state(stopped, "stopped", timeout=90)
    assert engine.file_sd() == []
    assert status["engine"] is None and status["url"] is None


def test_an_engine_on_another_image_is_replaced_with_the_grace(kind: Kind, client) -> None:
    engine, status = kind.running(**kind.slow_stop)
    old = client.containers.get(engine.container)
    engine.stop_worker(engine.procs[-1])
    kind.change_image(engine)
    since = time.time()
    engine.start_worker()
    # dockerd keeps only its last 256 events: read the old container's as soon as it is gone,
    # not after a slow engine's load, when a busy machine's other containers pushed them out
    engine.wait_status(lambda s: _gone(client, old.id), timeout=120, what="the old one gone")
    events = client.events(
        since=since, until=time.time(), decode=True, filters={"container": old.id}
    )
    actions = [(e["Action"], e["Actor"]["Attributes"]) for e in events]
    engine.wait_status(
        lambda s: (
            s["generation"] == status["generation"]
            and s["state"] == "running"
            and state_since(s) > since
        ),
        timeout=kind.start_timeout,
    )
    new = client.containers.get(engine.container)
    assert new.id != old.id and new.image.id != old.image.id
    kills = [attrs for action, attrs in actions if action == "kill"]
    dies = [attrs for action, attrs in actions if action == "die"]
    assert kills and kills[0]["signal"] == "15", actions
    assert dies and dies[0]["exitCode"] == "0", f"killed, not stopped: {actions}"
    kind.hand_on(engine)


def _gone(client: docker.DockerClient, container_id: str) -> bool:
    try:
        client.containers.get(container_id)
    except docker.errors.NotFound:
        return True
    return False


def _edit_environment(engine: Engine) -> None:
    engine.settings["CONTEXT_LIMIT"] = "150000"


def _edit_port(engine: Engine) -> None:
    engine.port = free_port()


def _edit_volume(engine: Engine) -> None:
    extra = engine.root / "extra-volume"
    extra.mkdir(exist_ok=True)
    engine.run_extra["volumes"] = [{"source": str(extra), "target": "/extra", "read_only": True}]


def _edit_memory_limit(engine: Engine, kind: Kind) -> None:
    engine.run_extra["memory"] = kind.edited_memory


def _edit_shm(engine: Engine, kind: Kind) -> None:
    engine.run_extra["shm_size"] = kind.edited_shm


def _bytes(size: str) -> int:
    return int(size[:-1]) * {"m": 1024**2, "g": 1024**3}[size[-1]]


def _memory_limit(engine: Engine, kind: Kind) -> int:
    """Docker's limit for the edited run.memory: a vLLM engine with [tiers] (the GPU recipe's,
    or the CPU one's a test gives) holds the tier plugin's staging buffer and write queue too."""
    tiers = kind.name == "vllm" and (engine.vllm_device != "cpu" or bool(engine.tiers_extra))
    return _bytes(kind.edited_memory) + (PLUGIN_BUFFER_BYTES + PLUGIN_QUEUE_BYTES if tiers else 0)


Edit = Callable[[Engine, Kind], None]
EDITS: dict[str, tuple[Edit, Callable[[Any, Engine, Kind], bool]]] = {
    "environment": (
        lambda e, k: _edit_environment(e),
        lambda c, e, k: "CONTEXT_LIMIT=150000" in c.attrs["Config"]["Env"],
    ),
    "port": (
        lambda e, k: _edit_port(e),
        lambda c, e, k: str(e.port) in json.dumps(c.attrs["HostConfig"]["PortBindings"]),
    ),
    "volume": (
        lambda e, k: _edit_volume(e),
        lambda c, e, k: any(m["Destination"] == "/extra" for m in c.attrs["Mounts"]),
    ),
    "memory limit": (
        _edit_memory_limit,
        lambda c, e, k: c.attrs["HostConfig"]["Memory"] == _memory_limit(e, k),
    ),
    "shm": (_edit_shm, lambda c, e, k: c.attrs["HostConfig"]["ShmSize"] == _bytes(k.edited_shm)),
}


EVERY = "every field"  # all the edits in one reload


@pytest.mark.parametrize("edit", [*EDITS, EVERY])
def test_a_reloaded_recipe_that_changes_the_run_spec_replaces_the_engine(
    kind: Kind, client, edit: str
) -> None:
    """What runs is what the recipe says: any change to what the container would be created
    with, picked up by SIGHUP, replaces it, and status says running only once it does. A kind
    whose engine is shared between cases (a load of minutes) takes every edit in one reload:
    the replacement is the rule's own, the same for one field or five, and the fields reaching
    the kind's container are what its case proves."""
    if kind.take is not None and edit != EVERY:
        pytest.skip(
            f"{kind.name} shares one engine: the run-spec edits in one reload "
            f"([{EVERY}]), one load instead of {len(EDITS)}"
        )
    edits = [EDITS[edit]] if edit != EVERY else list(EDITS.values())
    engine, status = kind.running()
    before = client.containers.get(engine.container)
    for change, applied in edits:
        change(engine, kind)
        assert not applied(before, engine, kind)
    engine.reload()
    after_status = engine.wait_status(
        lambda s: (
            s["state"] == "running"
            and s["url"] == f"http://{engine.gateway()}:{engine.port}"
            and (s.get("engine") or {}).get("containerId") not in (None, before.id)
        ),
        timeout=kind.start_timeout,
    )
    after = client.containers.get(engine.container)
    assert after.id != before.id and after.status == "running"
    missed = [
        name
        for name, (_, applied) in EDITS.items()
        if (edit in (name, EVERY)) and not applied(after, engine, kind)
    ]
    assert not missed, f"{missed} did not reach the new container"
    assert after_status["engine"]["containerId"] == after.id
    assert after_status["generation"] == status["generation"]
    assert all(http_status(_scrape_url(group)) == 200 for group in engine.file_sd())
    with pytest.raises(docker.errors.NotFound):
        client.containers.get(before.id)
    kind.hand_on(engine)


def test_a_replacement_that_cannot_start_leaves_the_engine_serving(kind: Kind, client) -> None:
    """The new port is taken by another program: the Check refuses before the running engine is
    stopped, the status stays running and says why, the file_sd target stays, and the Check is
    tried again after a back-off: once the port is free, the replacement goes ahead."""
    engine, status = kind.running()
    before = client.containers.get(engine.container)
    (target,) = {tuple(group["targets"]) for group in engine.file_sd()}
    with socket.socket() as squatter:
        squatter.bind((engine.gateway(), 0))
        squatter.listen()
        engine.reload(port=squatter.getsockname()[1])
        refused = engine.wait_status(lambda s: "taken" in s["message"], timeout=60)
        assert refused["state"] == "running", refused
        assert refused["url"] == status["url"]  # where the old engine answers, not the new port
        assert refused["engine"]["containerId"] == before.id
        assert f"port {engine.port}" in refused["message"]
        change, _, why = refused["message"].partition(" was refused: ")
        assert "the replacement (its " in change and "ports" in change, refused["message"]
        assert why.startswith(f"port {engine.port} ")
        assert "trying again in" in refused["message"]
        assert {tuple(group["targets"]) for group in engine.file_sd()} == {target}
        # tried again, and refused again, with a longer wait: the back-off grows
        again = engine.wait_status(
            lambda s: (
                "trying again in 2 s" in s["message"] or "trying again in 5 s" in s["message"]
            ),
            timeout=60,
        )
        assert again["state"] == "running" and engine.file_sd()
        after = client.containers.get(engine.container)
        assert after.id == before.id and after.status == "running"
        assert after.attrs["State"]["StartedAt"] == before.attrs["State"]["StartedAt"]
        assert (
            http_status(
                f"{status['url']}/v1/models"
                if kind.name == "tensorfold"
                else f"{status['url']}/health"
            )
            == 200
        )
    # the port is free now: the next try passes and the engine is replaced, with no new request
    replaced = engine.wait_status(
        lambda s: (
            s["state"] == "running"
            and (s.get("engine") or {}).get("containerId") not in (None, before.id)
        ),
        timeout=kind.start_timeout,
    )
    assert replaced["generation"] == status["generation"]
    assert replaced["url"] == f"http://{engine.gateway()}:{engine.port}"
    assert all(
        group["targets"] == [f"{engine.gateway()}:{engine.port}"] for group in engine.file_sd()
    )
    kind.hand_on(engine)


def test_death_is_failed_with_the_exit_code_within_two_seconds(kind: Kind, client) -> None:
    engine, _ = kind.running()
    died = time.monotonic()
    exit_text, logged = kind.die(client.containers.get(engine.container))
    status = engine.wait_status(lambda s: s["state"] == "failed", timeout=10)
    assert time.monotonic() - died < 2.5
    assert exit_text in status["message"]
    assert logged in status["message"]  # its last log lines
    assert status["url"] is None and engine.file_sd() == []
