"""A seeded chaos soak against the real parts: real workers under the real systemd user manager
(tensorfold on the stand-in recipe repository, the router on the real llama-server), a fault
schedule drawn from the seed, and the independent checker judging what they claimed.

It runs as the tests' service user (tests/system/harness.py's USER), and its engines run on a
dockerd of its own (tests/dockerd.py): its faults restart and freeze that dockerd, never the
machine's, whose containers (the operator's engines) would die with it.

    .venv/bin/python -m tests.soak.run --seconds 180 --seed 1      # as root, after machine.sh

A failure prints the seed and the schedule up to the failure; the same seed replays it.

    .venv/bin/python -m tests.soak.run --seconds 90 --seed 1 --broken-engine

installs the tensorfold engine with a recipe whose engine never becomes ready (it loads for
longer than its ready timeout): every request for running fails with no fault to cause it, so
the liveness invariants must report it. The product is the same; only the soak's recipe differs.

    .venv/bin/python -m tests.soak.run --seconds 90 --seed 1 --max-stall 20 --front-door

also runs the real gateway in front of the router, its record in PostgreSQL, and clients with
keys of small budgets streaming through it (tests/soak/frontdoor.py); the schedule then also
kills the gateway, stops the record's database and has an operator stop and start the router,
and the checker judges the rows, the charges and the budgets (tests/soak/frontdoor_check.py).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pwd
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import docker
import requests

from tests import dockerd
from tests.gguf_fixtures import add_model, write_llama
from tests.soak.frontdoor import FrontDoor
from tests.soak.schedule import Fault, draw
from tests.standin import busybox_image, demo_recipe, free_port, recipe_repository
from tests.system.harness import USER, as_user, copy_project, machine_settings, systemctl

ROOT = Path(__file__).resolve().parents[2]
SETTLE = 240.0  # after the schedule: every engine answers its last request within this
# faults that last a while run beside the next ones, so that faults overlap as on a real machine
LASTING = (
    "worker-stop",
    "dockerd-stall",
    "disk-full",
    "bad-desired",
    "record-down",
    "operator-stop",
)
_DOCKER_ERRORS = (docker.errors.DockerException, requests.exceptions.RequestException)


@dataclass
class SoakEngine:
    name: str
    kind: str
    recipe: Path  # the installed copy, which recipe edits change
    container: str
    ready_path: str
    oom: bool  # whether its engine can be made to exceed its memory limit

    @property
    def unit(self) -> str:
        return f"lucia-{self.name}.service"


class Soak:
    def __init__(
        self,
        seed: int,
        seconds: float,
        max_stall: float,
        broken_engine: bool = False,
        front_door: bool = False,
    ) -> None:
        self.seed, self.seconds, self.max_stall = seed, seconds, max_stall
        self.broken_engine = broken_engine
        self.run_id = uuid.uuid4().hex[:6]
        self.user = pwd.getpwnam(USER)
        self.home = Path(self.user.pw_dir)
        self.work = self.home / f"lucia-soak-{self.run_id}"
        self.share = self.home / ".local/share/lucia"
        self.data = self.share / "host/data"
        self.cli = str(self.share / "venv/bin/lucia-supervisor")
        self.dockerd = dockerd.Private(self.run_id, "dockerd-soak.log")
        self.client: docker.DockerClient | None = None  # the private dockerd's, once started
        self.events = self.work / "events.jsonl"
        self.engines: list[SoakEngine] = []
        self.token = uuid.uuid4().hex  # a secret that must never show
        self.mounted = False
        self.network = f"lucia-soak-{self.run_id}"
        self.last_valid: dict[str, bytes] = {}  # per engine: its last whole desired.json
        # the host's requests and the repair of a damaged desired.json, one at a time: a repair
        # must see whether a request replaced the damage meanwhile
        self.writing = threading.Lock()
        self.started: dict[float, float] = {}  # a fault's offset -> when it began
        self.front = FrontDoor(self.work, self.cli, seed) if front_door else None

    # -- setting up, as an operator would --------------------------------------------------------

    def setup(self) -> None:
        self.work.mkdir(parents=True)
        self._private_dockerd()
        # as the user: created by root, the share directory would be root's, and install.sh
        # (run as the user) could not set its permissions on a machine that never ran it before
        as_user("mkdir", "-p", str(self.data))
        subprocess.run(
            [
                "mount",
                "-t",
                "tmpfs",
                "-o",
                f"size=64m,uid={self.user.pw_uid},gid={self.user.pw_gid},mode=0750",
                "tmpfs",
                str(self.data),
            ],
            check=True,
        )
        self.mounted = True
        recipes = [self._tensorfold_recipe(), self._router_recipe()]
        source = copy_project(self.work / "src")
        subprocess.run(
            ["chown", "-R", f"{self.user.pw_uid}:{self.user.pw_gid}", str(self.work)], check=True
        )
        args = [arg for recipe in recipes for arg in ("--recipe", str(recipe))]
        as_user(str(source / "install.sh"), *args, timeout=900)
        for engine in self.engines:
            systemctl("start", engine.unit)
            self.request(engine, "running")
        for engine in self.engines:
            self.wait_answered(engine, 300)
        if self.front is not None:
            router = self.router
            status = self.status(router)
            models = status.get("models") if status else None
            assert models, f"the router serves no model: {status}"
            self.front.setup(str(models[0]))

    @property
    def router(self) -> SoakEngine:
        return next(e for e in self.engines if e.kind == "llama-router")

    def _private_dockerd(self) -> None:
        """The private dockerd started, the router's image copied into it from the machine's,
        and every docker client from here on (this process's, the checker's, the units' of the
        user manager) pointed at it."""
        self.router_image = subprocess.run(
            ["bash", str(ROOT / "scripts" / "llama-server-image.sh")],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()[-1]
        self.dockerd.start()
        with contextlib.closing(docker.from_env(timeout=120)) as machine:
            self.dockerd.load(machine, self.router_image)
        os.environ.update(self.dockerd.env())
        for name, value in self.dockerd.env().items():
            systemctl("set-environment", f"{name}={value}")
        self.client = self.dockerd.client(timeout=20)

    @property
    def docker(self) -> docker.DockerClient:
        assert self.client is not None, "the private dockerd is not started"
        return self.client

    def _base_image(self) -> str:
        return busybox_image(self.docker, self.work / "base", f"lucia-soak-busybox-{self.run_id}:1")

    def _tensorfold_recipe(self) -> Path:
        repo = self.work / "recipe-repo"
        commit = recipe_repository(repo)
        name, port = f"soaktf{self.run_id}", free_port()
        secret = self.work / "token"
        secret.write_text(self.token + "\n")
        secret.chmod(0o600)
        tag = f"lucia-soak-recipe-{self.run_id}:v1"
        recipe = self.work / f"{name}.toml"
        settings: dict[str, Any] = {"SOAK_EDIT": "0"}
        run: dict[str, Any] = {"stop_grace": 5, "memory": "64m"}
        if self.broken_engine:  # loads for a day, and is given 15 s to become ready
            settings["READY_DELAY"], run["ready_timeout"] = "86400", 15
        recipe.write_text(
            demo_recipe(
                name,
                repo,
                commit,
                tag,
                self._base_image(),
                port,
                self.network,
                settings=settings,
                secrets={"SOAK_TOKEN": str(secret)},
                run=run,
            )
        )
        self.engines.append(
            SoakEngine(
                name, "tensorfold", self._installed(name), f"lucia-{name}", "/v1/models", oom=True
            )
        )
        return recipe

    def _router_recipe(self) -> Path:
        image = self.router_image
        models = self.work / "models"
        files = add_model(models, "Ready")
        write_llama(files / "tiny.gguf")
        name, port = f"soaklr{self.run_id}", free_port()
        recipe = self.work / f"{name}.toml"
        recipe.write_text(f"""\
name = "{name}"
engine = "llama-router"
model = "gguf-library"
[library]
models_dir = "{models}"
cache_dir = "{self.work / "cache"}"
poll_seconds = 2
[router]
image = "{image}"
models_max = 1
load_on_startup = ["tiny"]
defaults = {{ ctx-size = 256 }}
[settings]
SOAK_EDIT = "0"
[run]
network = "{self.network}"
port = {port}
ready_timeout = 120
stop_grace = 5
""")
        self.engines.append(
            SoakEngine(
                name, "llama-router", self._installed(name), f"lucia-{name}", "/health", oom=False
            )
        )
        return recipe

    def _installed(self, name: str) -> Path:
        return self.share / "recipes" / f"{name}.toml"

    # -- acting as the host and the operator ---------------------------------------------------

    def request(self, engine: SoakEngine, desired: str) -> bool:
        """As the host does; on a full disk the host's own write fails, and is said."""
        with self.writing:
            done = as_user(self.cli, "request", engine.name, desired, check=False)
        if done.returncode != 0:
            print(f"    (request not written: {done.stderr.strip()[:120]})", flush=True)
        return done.returncode == 0

    def status(self, engine: SoakEngine) -> dict[str, Any] | None:
        try:
            return dict(json.loads((self.data / engine.name / "status.json").read_text()))
        except (OSError, json.JSONDecodeError):
            return None

    def answered(self, engine: SoakEngine) -> bool:
        try:
            desired = json.loads((self.data / engine.name / "desired.json").read_text())
        except (OSError, json.JSONDecodeError):
            return False
        status = self.status(engine)
        return (
            status is not None
            and status["generation"] == desired["generation"]
            and status["state"] in ("running", "stopped", "failed")
        )

    def wait_answered(self, engine: SoakEngine, timeout: float) -> float | None:
        started = time.monotonic()
        while time.monotonic() - started < timeout:
            if self.answered(engine):
                return time.monotonic() - started
            time.sleep(0.2)
        return None

    def _event(self, fault: Fault, start: float, end: float, **extra: Any) -> None:
        with self.events.open("a") as out:
            out.write(
                json.dumps(
                    {
                        "kind": fault.kind,
                        "engine": fault.engine,
                        "start": start,
                        "end": end,
                        **fault.params,
                        **extra,
                    }
                )
                + "\n"
            )

    def inject(self, fault: Fault) -> None:  # noqa: PLR0912 - one case per kind of fault
        engine = next((e for e in self.engines if e.name == fault.engine), self.engines[0])
        start = time.time()
        stops = _stops(fault)
        # an announced fault: the checker excuses what it must (and knows a stop was asked for,
        # so a start after it has its cause) before it happens
        self._event(fault, start, start + 3600, stops=stops)
        p = fault.params
        match fault.kind:
            case "request":
                self.request(engine, p["desired"])
            case "burst":
                for index in range(p["count"]):
                    self.request(engine, p["desired"] if index % 2 else "running")
            case "race":
                self.request(engine, p["first"])
                self.request(engine, p["second"])
            case "recipe-edit":
                text = engine.recipe.read_text()
                lines = [
                    f'SOAK_EDIT = "{p["value"]}"' if line.startswith("SOAK_EDIT") else line
                    for line in text.splitlines()
                ]
                tmp = engine.recipe.with_suffix(".tmp")
                tmp.write_text("\n".join(lines) + "\n")
                os.replace(tmp, engine.recipe)
                systemctl("reload", engine.unit, check=False)
            case "worker-kill":
                systemctl("kill", "-s", "KILL", engine.unit, check=False)
                time.sleep(3)
            case "worker-stop":
                systemctl("stop", engine.unit, check=False)
                time.sleep(p["pause"])
                systemctl("start", engine.unit, check=False)
            case "worker-reload":
                systemctl("reload", engine.unit, check=False)
            case "dockerd-restart":
                self.dockerd.restart()
            case "dockerd-stall":
                with self.dockerd.stalled():
                    time.sleep(p["pause"])
            case "engine-kill":
                with contextlib.suppress(*_DOCKER_ERRORS):
                    self.docker.containers.get(engine.container).kill()
            case "engine-oom":
                with contextlib.suppress(*_DOCKER_ERRORS):
                    self.docker.containers.get(engine.container).exec_run(
                        ["sh", "-c", "echo 200 > /tmp/hog"]
                    )
            case "disk-full":
                filler = self.data / ".soak-filler"
                with contextlib.suppress(OSError), filler.open("wb") as out:
                    while out.write(b"\0" * 65536):
                        pass
                time.sleep(p["pause"])
                filler.unlink(missing_ok=True)
            case "bad-desired":
                self._damage(engine, p["how"], p["pause"])
            case "gateway-kill" if self.front is not None:
                self.front.kill_gateway()
            case "record-down" if self.front is not None:
                with self.front.record_down():
                    time.sleep(p["pause"])
            case "operator-stop":
                self.request(engine, "stopped")
                time.sleep(p["pause"])
                self.request(engine, "running")
        self._event(fault, start, time.time(), stops=stops)

    def _damage(self, engine: SoakEngine, how: str, pause: float) -> None:
        desired = self.data / engine.name / "desired.json"
        valid = desired.read_bytes() if desired.is_file() else self.last_valid.get(engine.name)
        if valid is not None:
            self.last_valid[engine.name] = valid
        with contextlib.suppress(OSError):  # the disk may be full meanwhile: damage is partial
            if desired.is_dir():
                desired.rmdir()
            if how == "directory":
                desired.unlink(missing_ok=True)
                desired.mkdir()
            else:
                desired.write_bytes(
                    valid[: len(valid) // 2] if how == "truncated" and valid else b"\x00garbage{"
                )
        time.sleep(pause)
        self._restore(desired, valid)

    def _restore(self, desired: Path, valid: bytes | None) -> None:
        """Put the last valid request back, as a host would (retried while the disk is full),
        unless a newer request has replaced the damage meanwhile: that one stands."""
        deadline = time.monotonic() + 60
        while True:
            try:
                with self.writing:
                    self._repair(desired, valid)
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    def _repair(self, desired: Path, valid: bytes | None) -> None:
        if desired.is_dir():
            desired.rmdir()
        elif _generation(desired) > _generation(valid):
            return  # a request came after the damage
        if valid is not None:
            tmp = desired.with_name(".soak-restore.tmp")
            tmp.write_bytes(valid)
            os.chown(tmp, self.user.pw_uid, self.user.pw_gid)
            os.replace(tmp, desired)

    # -- the run -------------------------------------------------------------------------------

    def run(self) -> int:
        names = tuple(e.name for e in self.engines)
        oom = {e.name for e in self.engines if e.oom}
        schedule = [
            f
            if f.kind != "engine-oom" or f.engine in oom
            else Fault(f.at, "engine-kill", f.engine, f.params)
            for f in draw(
                self.seed,
                self.seconds,
                names,
                max_stall=self.max_stall,
                traffic=self.router.name if self.front else None,
            )
        ]
        print(
            f"soak {self.run_id}: seed {self.seed}, {self.seconds:g} s, "
            f"{len(schedule)} faults on {', '.join(names)}",
            flush=True,
        )
        checker = self._start_checker()
        if self.front is not None:
            self.front.start_clients()
        started = time.monotonic()
        recoveries: list[float] = []
        done: list[Fault] = []
        lasting: list[threading.Thread] = []
        for fault in schedule:
            time.sleep(max(fault.at - (time.monotonic() - started), 0.0))
            print(f"  {fault.describe()}", flush=True)
            self.started[fault.at] = time.time()
            if fault.kind in LASTING and not any(
                t.name == fault.kind and t.is_alive() for t in lasting
            ):
                thread = threading.Thread(target=self.inject, args=(fault,), name=fault.kind)
                thread.start()
                lasting.append(thread)
            else:
                self.inject(fault)
            done.append(fault)
        for thread in lasting:
            thread.join()
        if self.front is not None:
            self.front.stop_clients()
            self.front.wait_up(60)
            time.sleep(2)  # the last rows committed (within 1 s of their requests' ends)
        for engine in self.engines:  # the last word: every engine asked to run, and answered
            self.request(engine, "running")
        for engine in self.engines:
            took = self.wait_answered(engine, SETTLE)
            if took is not None:
                recoveries.append(took)
        (self.work / "stop").touch()
        checker.wait(60)
        verdict = json.loads((self.work / "verdict.json").read_text())
        return self._report(verdict, done, recoveries, len(recoveries) == len(self.engines))

    def _start_checker(self) -> subprocess.Popen[bytes]:
        config = {
            "engines": [
                {
                    "name": e.name,
                    "status": str(self.data / e.name / "status.json"),
                    "desired": str(self.data / e.name / "desired.json"),
                    "file_sd": str(self.data / "telemetry" / f"{e.name}.json"),
                    "recipe": str(e.recipe),
                    "container": e.container,
                    "setting": "SOAK_EDIT",
                    "ready_path": e.ready_path,
                }
                for e in self.engines
            ],
            "events": str(self.events),
            "stop": str(self.work / "stop"),
            "verdict": str(self.work / "verdict.json"),
            "secrets": [self.token],
        }
        if self.front is not None:
            config["front_door"] = {
                **self.front.config(),
                "engine": self.router.name,
                "status": str(self.data / self.router.name / "status.json"),
            }
        path = self.work / "checker.json"
        path.write_text(json.dumps(config))
        return subprocess.Popen([sys.executable, "-m", "tests.soak.checker", str(path)], cwd=ROOT)

    def _report(
        self, verdict: dict[str, Any], done: list[Fault], recoveries: list[float], settled: bool
    ) -> int:
        figures = verdict["figures"]
        counts = Counter(f.kind for f in done)
        print("faults injected: " + ", ".join(f"{k} {n}" for k, n in sorted(counts.items())))
        print(
            f"worst heartbeat age {figures['worst_heartbeat_age']:.2f} s; acknowledgement "
            f"p50 {_ms(figures['ack_p50'])}, max {_ms(figures['ack_max'])} over "
            f"{figures['acks']}; recovery to the last answer "
            f"max {max(recoveries, default=0):.1f} s; {figures['samples']} samples"
        )
        reached = dict(figures["reached"])
        print(
            f"requests seen {reached.pop('requests')}; reached "
            + ", ".join(f"{state} {n}" for state, n in reached.items())
            + f"; written to running p50 {_ms(figures['to_running_p50'])}, "
            f"max {_ms(figures['to_running_max'])}"
        )
        front = figures.get("front_door")
        if front:
            print(
                f"front door: {front['calls']} requests, {front['routed']} routed, "
                f"{front['rows']} rows ({front['maybe']} a fault may have lost; "
                f"{front['refused']} refusals; {front['left']} left early; sources "
                f"{front['sources']}); completion tokens charged {front['charged']}, "
                f"generated {front['generated']} (allowance {front['allowance']}) over "
                f"{front['lives']} engine lives, {front['counter_samples']} samples"
            )
        violations = verdict["violations"]
        if not settled:
            violations.append(
                {
                    "invariant": "settle",
                    "detail": f"not every engine answered its last request within {SETTLE:g} s",
                }
            )
        print(f"{len(violations)} invariant violations")
        if not violations:
            return 0
        first = min((v.get("t", float("inf")) for v in violations), default=float("inf"))
        for violation in violations[:20]:
            print(
                f"  VIOLATION {violation['invariant']}: {violation.get('engine', '')} "
                f"{violation['detail']}"
            )
        print(
            f"replay with: .venv/bin/python -m tests.soak.run --seconds {self.seconds:g} "
            f"--seed {self.seed} --max-stall {self.max_stall:g}"
            f"{' --broken-engine' if self.broken_engine else ''}"
            f"{' --front-door' if self.front else ''}; "
            "the schedule up to the first violation:"
        )
        for fault in done:
            if self.started[fault.at] <= first:
                print(f"  {fault.describe()}")
        return 1

    def cleanup(self) -> None:
        """Leave the machine as it was, whatever fault was under way when the soak ended."""
        if self.client is not None:
            self.dockerd.resume()  # ended during a stall or a restart
        (self.data / ".soak-filler").unlink(missing_ok=True)
        if self.front is not None:
            self.front.cleanup()
        for engine in self.engines:
            systemctl("stop", engine.unit, check=False)
        as_user(str(self.work / "src" / "install.sh"), "--uninstall", check=False)
        for engine in self.engines:
            engine.recipe.unlink(missing_ok=True)
        if self.mounted:
            subprocess.run(["umount", "-l", str(self.data)], check=False)
        shutil.rmtree(self.work, ignore_errors=True)
        for name in self.dockerd.env():
            systemctl("unset-environment", name, check=False)
        if self.client is not None:
            self.client.close()
        self.dockerd.stop()  # and with it every container, image and network the soak made


def _stops(fault: Fault) -> bool:
    """Whether a fault asks for a stop, known before it is injected."""
    p = fault.params
    if fault.kind == "request":
        return bool(p["desired"] == "stopped")
    if fault.kind == "race":
        return "stopped" in (p["first"], p["second"])
    return fault.kind in ("burst", "operator-stop")  # a burst always has a stop among them


def _generation(request: Path | bytes | None) -> int:
    """The generation of a whole desired.json (a file or its bytes); 0 for anything else."""
    try:
        text = request.read_bytes() if isinstance(request, Path) else request
        value = json.loads(text) if text else None
    except (OSError, ValueError):
        return 0
    found = value.get("generation") if isinstance(value, dict) else None
    return found if isinstance(found, int) else 0


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f} ms"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.soak.run",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--seconds", type=float, default=180.0)
    parser.add_argument("--seed", type=int, help="default: a random seed, printed")
    parser.add_argument(
        "--max-stall",
        type=float,
        default=90.0,
        help="longest dockerd SIGSTOP, seconds (default 90)",
    )
    parser.add_argument(
        "--broken-engine",
        action="store_true",
        help="a tensorfold recipe whose engine never becomes ready: the "
        "liveness invariants must fail",
    )
    parser.add_argument(
        "--front-door",
        action="store_true",
        help="the real gateway, its record in PostgreSQL, and clients with "
        "budgeted keys streaming through it; their faults and invariants",
    )
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    soak = Soak(seed, args.seconds, args.max_stall, args.broken_engine, args.front_door)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # ended from outside: clean up too
    with machine_settings(soak.home):  # the test user's memory settings, not its defaults
        try:
            soak.setup()
            return soak.run()
        finally:
            soak.cleanup()


if __name__ == "__main__":
    sys.exit(main())
