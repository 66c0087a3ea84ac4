"""The tensorfold engine against the real dockerd: what is its own (the common worker rules are
in tests/conformance)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import docker
import pytest

from tests.fixtures import CLI, ROOT, Engine, http_status, state_since

pytestmark = pytest.mark.docker


def test_acknowledges_at_once_then_runs_and_stops(make_engine, client) -> None:
    engine: Engine = make_engine(build_args={"SLOW": "4"})
    proc = engine.start_worker()
    generation = engine.request("running")
    # the first status of the generation says starting: acknowledged before the 4 s build
    # ends (no timed bound: a loaded machine starts the worker itself slowly)
    first = engine.wait_status(lambda s: s["generation"] == generation, timeout=60)
    assert first["state"] == "starting"
    assert first["url"] is None
    status = engine.wait_state(generation, "running", timeout=120)
    assert status["url"].startswith("http://")
    assert http_status(status["url"] + "/v1/models") == 200
    assert status["message"]
    container = client.containers.get(engine.container)
    labels = container.labels
    assert labels["lucia.managed"] == "true"
    assert labels["lucia.name"] == engine.name
    assert labels["lucia.generation"] == str(generation)
    assert labels["lucia.recipe.commit"] == engine.commit
    grammar = client.images.get(engine.image_tag + "-grammar")
    assert container.image.id == grammar.id == labels["lucia.image.id"]
    env = dict(item.split("=", 1) for item in container.attrs["Config"]["Env"])
    assert env["PARALLEL"] == "4" and env["CONTEXT"] == "200000"
    assert env["TENSORFOLD_MEMORY_RESERVE_GIB"] == "4"
    assert container.attrs["HostConfig"]["RestartPolicy"]["Name"] in ("no", "")

    stopped = engine.request("stopped")
    engine.wait_state(stopped, "stopped", timeout=90)
    with pytest.raises(docker.errors.NotFound):
        client.containers.get(engine.container)
    assert engine.file_sd() == []
    assert engine.stop_worker(proc) == 0


def test_stop_during_a_build_cancels_it(make_engine, client, base_image) -> None:
    """The build (300 s) is cancelled, not waited for: stopped well before it could end, its
    step container removed and no image made. No timed bound: a loaded machine takes longer."""
    engine: Engine = make_engine(build_args={"SLOW": "300"})
    engine.start_worker()
    generation = engine.request("running")
    engine.wait_status(lambda s: "compiling kernels" in s["message"], timeout=60)
    stopped = engine.request("stopped")
    engine.wait_state(stopped, "stopped", timeout=60)
    assert generation < stopped
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        # one listing, no inspect of each: a step container removed between the two is gone
        listed = client.api.containers(all=True, filters={"ancestor": base_image})
        builders = [c for c in listed if "compiling kernels" in (c.get("Command") or "")]
        if not builders:
            break
        time.sleep(0.5)
    assert not builders, "the abandoned build left its step container behind"
    with pytest.raises(docker.errors.ImageNotFound):
        client.images.get(engine.image_tag)
    with pytest.raises(docker.errors.NotFound):
        client.containers.get(engine.container)


def test_stop_during_the_download_kills_the_prepare_script(make_engine) -> None:
    engine: Engine = make_engine(settings={"PREPARE_SECONDS": "300"})
    engine.start_worker()
    engine.request("running")
    engine.wait_status(lambda s: "Downloading" in s["message"], timeout=60)
    assert _prepare_running(engine), "the look finds this engine's prepare script"
    stopped = engine.request("stopped")
    engine.wait_state(stopped, "stopped", timeout=30)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and _prepare_running(engine):
        time.sleep(0.1)
    assert not _prepare_running(engine)
    assert not (engine.state_dir / "prepared.json").exists()


def _prepare_running(engine: Engine) -> bool:
    """This engine's prepare script runs: one whose working directory is its checkout (other
    tests beside it run prepare scripts of their own)."""
    checkout = str(engine.state_dir / "checkout")
    for proc in Path("/proc").iterdir():
        try:
            args = (proc / "cmdline").read_bytes().split(b"\0")
            cwd = os.readlink(proc / "cwd")
        except (OSError, ValueError):
            continue
        if any(arg.endswith(b"scripts/prepare.sh") for arg in args) and (
            cwd == checkout or cwd.startswith(checkout + "/")
        ):
            return True
    return False


def test_wrong_image_is_replaced_with_the_grace_and_pin_change_rebuilds(
    make_engine, client
) -> None:
    engine: Engine = make_engine(settings={"STOP_DELAY": "3"})
    proc, _ = engine.up()
    old = client.containers.get(engine.container)
    old_grammar = client.images.get(engine.image_tag + "-grammar").id
    engine.stop_worker(proc)

    engine.requirement = "xgrammar>=0.2.9,<0.3"
    since = time.time()
    engine.start_worker()
    generation = json.loads((engine.dir / "desired.json").read_text())["generation"]
    engine.wait_status(
        lambda s: (
            s["generation"] == generation and s["state"] == "running" and state_since(s) > since
        ),
        timeout=120,
    )
    new = client.containers.get(engine.container)
    assert new.id != old.id
    new_grammar = client.images.get(engine.image_tag + "-grammar")
    assert new_grammar.id != old_grammar
    assert new_grammar.labels["lucia.grammar.requirement"] == "xgrammar>=0.2.9,<0.3"
    events = client.events(
        since=since, until=time.time(), decode=True, filters={"container": old.id}
    )
    actions = [(e["Action"], e["Actor"]["Attributes"]) for e in events]
    kills = [a for a in actions if a[0] == "kill"]
    dies = [a for a in actions if a[0] == "die"]
    assert kills and kills[0][1]["signal"] == "15", actions
    assert dies and dies[0][1]["exitCode"] == "0", "the engine was killed, not stopped: " + str(
        actions
    )


def test_grammar_image_is_rebuilt_when_the_base_changes_and_not_otherwise(
    make_engine, client, recipe_repo
) -> None:
    engine: Engine = make_engine()
    proc, _ = engine.up()
    grammar = client.images.get(engine.image_tag + "-grammar")
    engine.stop_worker(proc)
    proc = engine.start_worker()
    generation = engine.request("running")
    engine.wait_state(generation, "running", timeout=60)
    assert client.images.get(engine.image_tag + "-grammar").id == grammar.id
    engine.stop_worker(proc)

    engine.commit = recipe_repo.commit("recipe 0.7.1", {"NOTES": "a change in the base\n"})
    engine.start_worker()
    generation = engine.request("running")
    engine.wait_state(generation, "running", timeout=120)
    base = client.images.get(engine.image_tag)
    rebuilt = client.images.get(engine.image_tag + "-grammar")
    assert base.labels["lucia.recipe.commit"] == engine.commit
    assert rebuilt.id != grammar.id
    assert rebuilt.labels["lucia.grammar.base"] == base.id
    assert (engine.state_dir / "checkout" / "NOTES").exists()


def test_missing_commit_fails_naming_commit_and_repository(make_engine) -> None:
    engine: Engine = make_engine(commit="0123456789abcdef0123456789abcdef01234567")
    engine.start_worker()
    generation = engine.request("running")
    status = engine.wait_state(generation, "failed", timeout=60)
    assert "0123456789abcdef0123456789abcdef01234567" in status["message"]
    assert engine.repo.url in status["message"]


def test_failed_build_is_failed_with_the_last_lines(make_engine, recipe_repo) -> None:
    broken = (recipe_repo.path / "Dockerfile").read_text() + (
        'RUN echo "nvcc: error: unsupported gpu architecture sm_121" && exit 7\n'
    )
    commit = recipe_repo.commit("broken", {"Dockerfile": broken})
    engine: Engine = make_engine(commit=commit)
    engine.start_worker()
    generation = engine.request("running")
    status = engine.wait_state(generation, "failed", timeout=60)
    assert "unsupported gpu architecture" in status["message"]
    assert "\x1b" not in status["message"] and len(status["message"]) <= 500


def test_failed_grammar_build_and_prepare_are_failed(make_engine, recipe_repo) -> None:
    engine: Engine = make_engine(modules=("xgrammar", "tensorfold", "nosuchmodule"))
    engine.start_worker()
    generation = engine.request("running")
    status = engine.wait_state(generation, "failed", timeout=60)
    assert "No module named 'nosuchmodule'" in status["message"]

    engine2: Engine = make_engine(settings={"PREPARE_FAILS": "1"})
    engine2.start_worker()
    generation = engine2.request("running")
    status = engine2.wait_state(generation, "failed", timeout=60)
    assert "401 Unauthorized" in status["message"]


def test_file_sd_holds_the_target_while_running(make_engine, client) -> None:
    engine: Engine = make_engine()
    engine.up()
    gateway = client.networks.get(engine.network).attrs["IPAM"]["Config"][0]["Gateway"]
    (group,) = engine.file_sd()
    assert group["targets"] == [f"{gateway}:{engine.port}"]
    assert group["labels"] == {
        "__metrics_path__": "/metrics",
        "engine": "tensorfold",
        "model": "test/tiny-model",
        "recipe_commit": engine.commit,
        "name": engine.name,
    }
    assert http_status(f"http://{group['targets'][0]}/metrics") == 200
    mode = os.stat(engine.data_dir / "telemetry" / f"{engine.name}.json").st_mode & 0o777
    assert mode == 0o644


def test_sighup_rereads_the_recipe(make_engine, client) -> None:
    engine: Engine = make_engine()
    engine.up()
    first = client.containers.get(engine.container).id
    engine.settings["CONTEXT"] = "100000"
    engine.reload()
    # a lower CONTEXT is a new run spec: the engine is replaced and runs with it
    second = engine.wait_status(
        lambda s: (
            s["state"] == "running"
            and (s.get("engine") or {}).get("containerId") not in (None, first)
        ),
        timeout=120,
    )
    container = client.containers.get(engine.container)
    assert container.id == second["engine"]["containerId"]
    assert "CONTEXT=100000" in container.attrs["Config"]["Env"]
    first = container.id
    engine.reload(requirement="xgrammar>=0.2.10,<0.3")
    engine.wait_status(
        lambda s: s["state"] == "running" and client.containers.get(engine.container).id != first,
        timeout=120,
    )


def test_worker_metrics_on_loopback(make_engine) -> None:
    engine: Engine = make_engine()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    engine.start_worker("--metrics-port", str(port))
    generation = engine.request("running")
    engine.wait_state(generation, "running", timeout=120)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    assert 'lucia_worker_state{state="running"} 1.0' in text
    assert "lucia_worker_reconciles_total" in text
    assert "lucia_worker_step_seconds_bucket" in text
    assert "lucia_worker_last_heartbeat_seconds" in text


def test_cli_request_wait_against_a_live_worker(make_engine) -> None:
    engine: Engine = make_engine()
    engine.start_worker()
    out = subprocess.run(
        [
            *CLI,
            "request",
            engine.name,
            "running",
            "--wait",
            "--timeout",
            "120",
            "--data-dir",
            str(engine.data_dir),
            "--recipes-dir",
            str(engine.root),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=150,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    status = subprocess.run(
        [*CLI, "status", engine.name, "--json", "--data-dir", str(engine.data_dir)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    (row,) = json.loads(status.stdout)
    assert row["state"] == "running" and row["answer"] == "current" and row["url"]
