"""The llama-router engine against the real dockerd and the real llama-server (Debian's
llama.cpp-tools): library -> cache -> preset -> router, with tiny llama GGUFs that load on the CPU.
"""

from __future__ import annotations

import json
import re
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures import CLI, ROOT, Engine, free_port
from tests.gguf_fixtures import (
    TinyLlama,
    add_model,
    break_magic,
    set_version,
    write_gguf,
    write_llama,
    write_mmproj,
)

pytestmark = pytest.mark.docker

NOT_READY = ("Queued", "Downloading", "Failed", "Canceled", "Interrupted")


def _library(engine: Engine) -> dict[str, Path]:
    """alpha (a tiny llama), beta (3 shards + mmproj), zeta (a tiny llama), a corrupt file, a
    bad version, and a model in every state that is not Ready."""
    models = engine.models_dir
    dirs = {}
    files = add_model(models, "Ready")
    write_llama(files / "alpha.gguf")
    dirs["alpha"] = files.parent
    files = add_model(models, "Ready")
    write_llama(files / "zeta.gguf")
    dirs["zeta"] = files.parent
    files = add_model(models, "Ready")
    write_llama(files / "beta.gguf", split_max_tensors=8)
    write_mmproj(files / "mmproj-beta-f16.gguf")
    dirs["beta"] = files.parent
    files = add_model(models, "Ready")
    break_magic(write_gguf(files / "gamma.gguf"))
    files = add_model(models, "Ready")
    set_version(write_gguf(files / "delta.gguf"), 7)
    for state in NOT_READY:
        files = add_model(models, state)
        write_gguf(files / f"q-{state.lower()}.gguf")
        dirs[state] = files.parent
    return dirs


def _get(engine: Engine, path: str) -> Any:
    status = engine.status()
    assert status and status["url"]
    with urllib.request.urlopen(status["url"] + path, timeout=5) as response:
        return json.loads(response.read())


def _models(engine: Engine) -> dict[str, Any]:
    return {entry["id"]: entry["status"]["value"] for entry in _get(engine, "/models")["data"]}


def _router(make_engine, **knobs: Any) -> Engine:
    engine: Engine = make_engine(kind="llama-router", **knobs)
    engine.models_dir.mkdir(exist_ok=True)
    return engine


def test_first_sync_cache_preset_and_skipped_files(make_engine, client) -> None:
    engine = _router(make_engine, load_on_startup=("alpha",))
    _library(engine)
    engine.start_worker()
    generation = engine.request("running")
    status = engine.wait_state(generation, "running", timeout=120)
    cache = engine.cache_dir
    assert sorted(p.name for p in (cache / "alpha").iterdir()) == ["alpha.gguf"]
    assert sorted(p.name for p in (cache / "beta").iterdir()) == [
        "beta-00001-of-00003.gguf",
        "beta-00002-of-00003.gguf",
        "beta-00003-of-00003.gguf",
        "mmproj-beta-f16.gguf",
    ]
    present = {p.name for p in cache.iterdir() if p.is_dir()}
    assert present == {"alpha", "beta", "zeta"}, "corrupt, bad-version, non-Ready: not copied"
    assert "gamma.gguf" in status["message"] and "delta.gguf" in status["message"]
    preset = (cache / "llama-models.ini").read_text()
    assert "version = 1" in preset
    assert "[*]\nctx-size = 4096" in preset
    assert "[alpha]\nmodel = /models/alpha/alpha.gguf\nload-on-startup = true" in preset
    assert (
        "[beta]\nmodel = /models/beta/beta-00001-of-00003.gguf\n"
        "mmproj = /models/beta/mmproj-beta-f16.gguf\n"
    ) in preset
    assert "gamma" not in preset and "delta" not in preset and "q-" not in preset
    container = client.containers.get(engine.container)
    args = container.attrs["Args"]
    assert args[args.index("--models-max") + 1] == "2"
    assert args[args.index("--port") + 1] == str(engine.port)
    assert "--metrics" in args and "/models/llama-models.ini" in args
    mounts = {m["Destination"]: m for m in container.attrs["Mounts"]}
    assert mounts["/models"]["RW"] is False
    assert mounts["/models"]["Source"] == str(engine.cache_dir)
    assert _models(engine) == {"alpha": "loaded", "beta": "unloaded", "zeta": "unloaded"}
    assert "loaded: alpha; offered: alpha, beta, zeta" in status["message"]
    assert status["models"] == ["alpha", "beta", "zeta"], "the preset's, once synced"


def test_the_router_reports_the_llama_server_build_its_props_state(make_engine) -> None:
    """status.json's engineVersion is the build the running router states of itself in
    GET /props (`build_info`; llama-server has no /version)."""
    engine = _router(make_engine, load_on_startup=("alpha",))
    write_llama(add_model(engine.models_dir, "Ready") / "alpha.gguf")
    engine.up()
    props = _get(engine, "/props")
    assert props["role"] == "router"
    assert isinstance(props["build_info"], str) and props["build_info"]
    status = engine.wait_status(
        lambda s: s["state"] == "running" and s["engine"]["engineVersion"] is not None,
        timeout=30,
        what="the engine's version",
    )
    assert status["engine"]["engineVersion"] == props["build_info"]


def test_a_stopped_router_names_its_library_and_a_model_ready_since(make_engine) -> None:
    """A router that never ran names what its first sync would offer; a model that becomes
    Ready while the engine stays stopped is named at a later look (poll_seconds), no run."""
    engine = _router(make_engine)
    write_llama(add_model(engine.models_dir, "Ready") / "alpha.gguf")
    later = add_model(engine.models_dir, "Downloading")
    write_llama(later / "zeta.gguf")
    engine.start_worker()
    stopped = engine.wait_state(engine.request("stopped"), "stopped", timeout=60)
    assert stopped["models"] == ["alpha"], "named before any run; a Downloading model is not"
    document = later.parent / "model.json"
    ready = document.with_name("model.json.tmp")
    ready.write_text(json.dumps({"state": "Ready"}))
    ready.replace(document)  # as the host writes it: atomically
    status = engine.wait_status(
        lambda s: "zeta" in s["models"], timeout=60, what="the model Ready since named"
    )
    assert (status["generation"], status["state"]) == (stopped["generation"], "stopped")
    assert status["models"] == ["alpha", "zeta"]
    assert not (engine.cache_dir / "llama-models.ini").exists(), "named without a sync"


def test_a_router_that_never_ran_says_whether_its_start_would_fit(
    make_engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before any sync, the plan of its start is the one that sync would make, from the
    library's GGUF headers: a load-on-startup model that cannot fit is said before the start
    is asked for, and a larger limit in the settings file is planned again at the next look."""
    machine = tmp_path / "machine.toml"
    machine.write_text('limit = 0.01\nprofile = "gpu-server"\n[reserves]\nruntime = 0\n')
    monkeypatch.setenv("LUCIA_MACHINE_FILE", str(machine))
    engine = _router(make_engine, load_on_startup=("alpha",), defaults={"ctx-size": 32768})
    # 2 layers x 4 KV heads x (16 + 16) x 2 B = 512 B a token: 16 MiB of KV cache at 32768
    write_llama(add_model(engine.models_dir, "Ready") / "alpha.gguf", TinyLlama(context=32768))
    engine.start_worker()
    engine.wait_state(engine.request("stopped"), "stopped", timeout=60)
    tight = engine.wait_status(lambda s: s["memory"] is not None, timeout=60, what="a plan")
    plan = tight["memory"]
    assert not plan["fits"], plan
    assert plan["message"].startswith(
        "The model alpha does not fit after voice, OS, services, and runtime reservations"
    ), plan
    assert plan["need"] > 16 * 1024**2 and plan["limit"] == round(0.01 * 1024**3), plan
    assert not (engine.cache_dir / "llama-models.ini").exists(), "planned without a sync"
    machine.write_text('limit = 1.0\nprofile = "gpu-server"\n[reserves]\nruntime = 0\n')
    again = engine.request("stopped")  # a new request is a look at once
    # its acknowledgement (`stopping`) may already carry the new plan: the answer is `stopped`
    roomy = engine.wait_status(
        lambda s: s["generation"] == again and s["state"] == "stopped" and s["memory"]["fits"],
        timeout=60,
        what="stopped, and fits in 1 GiB",
    )
    assert (roomy["memory"]["need"], roomy["memory"]["message"]) == (plan["need"], "")


def test_readiness_comes_from_models_not_health(make_engine, router_standin) -> None:
    """The stand-in: the real router loads a tiny model too fast to see /health answer
    before it; the stand-in takes LOAD_DELAY seconds."""
    engine = _router(
        make_engine,
        load_on_startup=("alpha",),
        settings={"LOAD_DELAY": "4"},
        router_image=router_standin,
    )
    write_gguf(add_model(engine.models_dir, "Ready") / "alpha.gguf")
    engine.start_worker()
    generation = engine.request("running")
    engine.wait_status(lambda s: "router listening" in s["message"], timeout=60)
    with urllib.request.urlopen(
        f"http://{engine.gateway()}:{engine.port}/health", timeout=5
    ) as response:
        assert response.status == 200
    assert engine.status()["state"] == "starting", "/health alone must not mean running"
    engine.wait_state(generation, "running", timeout=30)


def test_a_model_that_fails_to_load_fails_the_start_naming_it(make_engine) -> None:
    engine = _router(make_engine, load_on_startup=("alpha", "broken-model"))
    write_llama(add_model(engine.models_dir, "Ready") / "alpha.gguf")
    # a valid GGUF header without a model in it: llama-server's child exits 1 loading it
    write_gguf(add_model(engine.models_dir, "Ready") / "broken-model.gguf")
    engine.start_worker()
    generation = engine.request("running")
    status = engine.wait_state(generation, "failed", timeout=60)
    assert "broken-model" in status["message"] and "exit code 1" in status["message"]


def test_more_load_on_startup_models_than_models_max_is_refused_before_anything_starts(
    make_engine, client
) -> None:
    engine = _router(make_engine, load_on_startup=("a", "b", "c"), models_max=2)
    proc = engine.start_worker()
    assert proc.wait(30) == 78
    log = engine.log_tail()
    assert "3 load-on-startup models but models_max is 2" in log
    assert not client.containers.list(all=True, filters={"name": engine.container})


def test_library_changes_while_running_resync_and_reload_without_a_restart(
    make_engine, client
) -> None:
    engine = _router(make_engine, load_on_startup=("alpha",))
    dirs = _library(engine)
    engine.start_worker()
    generation = engine.request("running")
    engine.wait_state(generation, "running", timeout=120)
    container = client.containers.get(engine.container)
    preset_path = engine.cache_dir / "llama-models.ini"

    # nothing relevant changes: a non-Ready model's metadata moves on
    before = preset_path.stat()
    stamp = (engine.state_dir / "synced.json").stat()
    model_json = dirs["Downloading"] / "model.json"
    model_json.write_text(model_json.read_text().replace('"bytesTotal": 123', '"bytesTotal": 9'))
    time.sleep(3)
    assert (preset_path.stat().st_ino, preset_path.stat().st_mtime_ns) == (
        before.st_ino,
        before.st_mtime_ns,
    )
    assert (engine.state_dir / "synced.json").stat().st_mtime_ns == stamp.st_mtime_ns

    # a model becomes Ready: copied, in the preset, the router reloads; no restart
    files = add_model(engine.models_dir, "Ready")
    write_gguf(files / "epsilon.gguf")
    engine.wait_status(
        lambda s: "epsilon" in _safe_models(engine), timeout=30, what="epsilon served"
    )
    assert (engine.cache_dir / "epsilon" / "epsilon.gguf").exists()
    assert "[epsilon]" in preset_path.read_text()

    # a model stops being Ready: removed from the cache and the preset
    beta = dirs["beta"] / "model.json"
    beta.write_text(beta.read_text().replace('"Ready"', '"Failed"'))
    engine.wait_status(
        lambda s: "beta" not in _safe_models(engine), timeout=30, what="beta dropped"
    )
    assert not (engine.cache_dir / "beta").exists()
    assert "[beta]" not in preset_path.read_text()
    after = client.containers.get(engine.container)
    assert (after.id, after.attrs["State"]["StartedAt"]) == (
        container.id,
        container.attrs["State"]["StartedAt"],
    )
    status = engine.status()
    assert status["state"] == "running" and status["generation"] == generation


def _safe_models(engine: Engine) -> dict[str, Any]:
    try:
        return _models(engine)
    except (OSError, AssertionError, ValueError):
        return {}


@pytest.mark.alone  # counts answers during a load: a race the other cases would tilt
def test_a_changed_load_on_startup_set_goes_through_the_router_api(make_engine, client) -> None:
    """A new load-on-startup set reaches the running router through its API (POST
    /models/load, /models/unload), not a restart: the same container, alpha serving on."""
    engine = _router(make_engine, load_on_startup=("alpha",))
    _library(engine)
    engine.start_worker()
    generation = engine.request("running")
    engine.wait_state(generation, "running", timeout=120)
    container = client.containers.get(engine.container)
    stop = threading.Event()
    answers: list[int] = []
    chatting = threading.Thread(target=_chat_until, args=(engine, "alpha", stop, answers))
    chatting.start()
    try:
        engine.reload(load_on_startup=("alpha", "zeta"))
        engine.wait_status(
            lambda s: s["state"] == "running" and "loaded: alpha, zeta;" in s["message"],
            timeout=60,
            what="zeta loaded beside alpha",
        )
    finally:
        stop.set()
        chatting.join(60)
    assert len(answers) >= 2 and set(answers) == {200}, "alpha answered while zeta loaded"
    engine.reload(load_on_startup=("zeta",))
    engine.wait_status(
        lambda s: s["state"] == "running" and "loaded: zeta;" in s["message"],
        timeout=60,
        what="alpha unloaded",
    )
    assert _models(engine) == {"alpha": "unloaded", "beta": "unloaded", "zeta": "loaded"}
    assert [g["labels"]["model"] for g in engine.file_sd()] == ["zeta"]
    after = client.containers.get(engine.container)
    assert (after.id, after.attrs["State"]["StartedAt"]) == (
        container.id,
        container.attrs["State"]["StartedAt"],
    ), "the router was not replaced"
    # zeta was loaded by the worker's POST /models/load; alpha was unloaded by the router itself
    # as it re-read a preset whose alpha section had changed (test_llama_server_facts), before
    # the worker's POST /models/unload would have been needed
    log = (engine.root / "worker-0.log").read_text()
    assert "path='/models/load' model='zeta' answer=200" in log


RELOAD_ASKED = "router asked to reload its preset"


def test_a_changed_preset_default_keeps_the_router_and_loads_the_startup_set_again(
    make_engine, client
) -> None:
    """A new [*] section makes the router unload every model as it reloads the preset; the
    worker loads the load-on-startup set again, in the same container."""
    engine = _router(make_engine, load_on_startup=("alpha",))
    _library(engine)
    engine.start_worker()
    generation = engine.request("running")
    engine.wait_state(generation, "running", timeout=120)
    container = client.containers.get(engine.container)
    asked = engine.log_tail(10_000).count(RELOAD_ASKED)
    engine.reload(defaults={"ctx-size": 2048})
    engine.wait_status(
        lambda s: "[*]\nctx-size = 2048" in (engine.cache_dir / "llama-models.ini").read_text(),
        timeout=30,
        what="the new preset",
    )
    # a serving router stays running with its last message through the reload: wait for the
    # reload itself, then for alpha loaded again after it
    engine.wait_status(
        lambda s: engine.log_tail(10_000).count(RELOAD_ASKED) > asked,
        timeout=30,
        what="the preset reloaded",
    )
    engine.wait_status(
        lambda s: (
            s["state"] == "running"
            and "loaded: alpha;" in s["message"]
            and _models(engine).get("alpha") == "loaded"
        ),
        timeout=60,
        what="alpha loaded again",
    )
    after = client.containers.get(engine.container)
    assert (after.id, after.attrs["State"]["StartedAt"]) == (
        container.id,
        container.attrs["State"]["StartedAt"],
    ), "the router was not replaced"
    # its target is written again at the look that sees alpha loaded
    engine.wait_status(
        lambda s: [g["labels"]["model"] for g in engine.file_sd()] == ["alpha"],
        timeout=30,
        what="alpha's target",
    )


def _planned_context(engine: Engine, model: str) -> int:
    text = (engine.cache_dir / "llama-models.ini").read_text()
    found = re.search(rf"^\[{model}\]\n(?:[^\[\n].*\n)*?ctx-size = (\d+)$", text, re.MULTILINE)
    assert found, f"no ctx-size for {model} in the preset:\n{text}"
    return int(found.group(1))


def test_new_machine_settings_replan_the_contexts_in_the_same_router(
    make_engine, client, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ctx-size "auto" is what fits the machine's limit; a new limit in the settings file is
    planned again at the next look, with no new request, and the router serves on."""
    machine = tmp_path / "machine.toml"
    machine.write_text('limit = 1.0\nprofile = "gpu-server"\n[reserves]\nruntime = 0\n')
    monkeypatch.setenv("LUCIA_MACHINE_FILE", str(machine))
    engine = _router(make_engine, load_on_startup=("alpha",), defaults={"ctx-size": "auto"})
    # 2 layers x 4 KV heads x (16 + 16) x 2 B = 512 B a token: 16 MiB at its native 32768
    write_llama(add_model(engine.models_dir, "Ready") / "alpha.gguf", TinyLlama(context=32768))
    engine.start_worker()
    engine.wait_state(engine.request("running"), "running", timeout=120)
    assert _planned_context(engine, "alpha") == 32768  # 1 GiB: all of its native context
    container = client.containers.get(engine.container)
    machine.write_text('limit = 0.01\nprofile = "gpu-server"\n[reserves]\nruntime = 0\n')
    engine.wait_status(
        lambda s: _planned_context(engine, "alpha") < 32768,
        timeout=30,
        what="the context planned again for 0.01 GiB",
    )
    smaller = _planned_context(engine, "alpha")
    engine.wait_status(
        lambda s: s["state"] == "running" and "loaded: alpha;" in s["message"],
        timeout=60,
        what="alpha loaded again",
    )
    after = client.containers.get(engine.container)
    assert after.id == container.id, "the router was not replaced"
    assert 0 < smaller * 512 < 0.01 * 1024**3
    assert _models(engine)["alpha"] == "loaded"


def _chat_until(engine: Engine, model: str, stop: threading.Event, answers: list[int]) -> None:
    url = engine.status()["url"]  # type: ignore[index]
    body = json.dumps(
        {"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    ).encode()
    while not stop.is_set():
        request = urllib.request.Request(
            url + "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                answers.append(response.status)
        except urllib.error.HTTPError as error:
            answers.append(error.code)
        time.sleep(0.1)


def _scrape(group: dict[str, Any]) -> tuple[int, bytes]:
    labels = group["labels"]
    params = {k.removeprefix("__param_"): v for k, v in labels.items() if k.startswith("__param_")}
    url = f"http://{group['targets'][0]}{labels['__metrics_path__']}?" + urllib.parse.urlencode(
        params
    )
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.status, response.read()


def test_one_target_per_loaded_model_and_failures_named(make_engine) -> None:
    engine = _router(make_engine, load_on_startup=("alpha",), models_max=3)
    _library(engine)
    write_gguf(add_model(engine.models_dir, "Ready") / "broken.gguf")
    metrics_port = free_port()
    engine.start_worker("--metrics-port", str(metrics_port))
    generation = engine.request("running")
    status = engine.wait_state(generation, "running", timeout=120)
    (group,) = engine.file_sd()
    assert group["labels"] == {
        "__metrics_path__": "/metrics",
        "__param_model": "alpha",
        "__param_autoload": "false",
        "model": "alpha",
        "engine": "llama-router",
        "name": engine.name,
    }
    assert group["targets"] == [status["url"].removeprefix("http://")]

    post = urllib.request.Request(
        status["url"] + "/models/load", method="POST", data=json.dumps({"model": "zeta"}).encode()
    )
    urllib.request.urlopen(post, timeout=10).close()
    engine.wait_status(lambda s: len(engine.file_sd()) == 2, timeout=10, what="zeta's target")
    before = _models(engine)
    for target in engine.file_sd():
        code, body = _scrape(target)
        assert code == 200 and b"llamacpp:" in body, target
    assert (
        _models(engine)
        == before
        == {"alpha": "loaded", "beta": "unloaded", "zeta": "loaded", "broken": "unloaded"}
    )

    post = urllib.request.Request(
        status["url"] + "/models/load", method="POST", data=json.dumps({"model": "broken"}).encode()
    )
    urllib.request.urlopen(post, timeout=10).close()
    failed = engine.wait_status(lambda s: "failed to load" in s["message"], timeout=30)
    assert "failed to load: broken (exit code 1)" in failed["message"]
    assert failed["state"] == "running", "a model loaded on demand that fails is only named"
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as answer:
        exposed = answer.read().decode()
    assert 'lucia_router_model_load_failed{model="broken"} 1.0' in exposed

    post = urllib.request.Request(
        status["url"] + "/models/unload", method="POST", data=json.dumps({"model": "zeta"}).encode()
    )
    urllib.request.urlopen(post, timeout=10).close()
    engine.wait_status(
        lambda s: [g["labels"]["model"] for g in engine.file_sd()] == ["alpha"],
        timeout=10,
        what="zeta's target gone",
    )


def test_cli_status_reads_the_router(make_engine) -> None:
    engine = _router(make_engine, load_on_startup=("alpha",))
    write_llama(add_model(engine.models_dir, "Ready") / "alpha.gguf")
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


def test_a_missing_router_image_is_pulled_and_a_failed_pull_is_failed(make_engine) -> None:
    engine = _router(make_engine, router_image="lucia-test-absent/llama-server:never")
    engine.start_worker()
    generation = engine.request("running")
    status = engine.wait_state(generation, "failed", timeout=120)
    assert "pull of lucia-test-absent/llama-server:never failed" in status["message"]
