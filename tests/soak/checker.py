"""The soak's independent truth checker: what the supervisor claims against what is.

It runs as a process of its own and shares no code with the supervisor: it reads status.json,
desired.json and the file_sd file as a host and Prometheus would (validated against the
published schemas only), asks Docker itself, and reads the recipe's TOML itself. Every 100 ms it
samples each engine and checks the invariants below; a breach must last past a short tolerance
(samples of separate files are not taken at one instant) before it is a violation.

    python -m tests.soak.checker CONFIG.json

CONFIG names the engines, the events file the runner appends to, and where to write the
verdict (JSON: violations and figures). It stops when the runner creates the stop file.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import tomllib
import urllib.request
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Any, Final

import docker
import jsonschema

from tests.soak import frontdoor_check
from tests.soak.liveness import (
    RETURN,
    TOLERANCE,
    Request,
    late,
    reached_counts,
    unexplained_failure,
)

ROOT: Final = Path(__file__).resolve().parents[2]
SAMPLE: Final = 0.1
ACK_BOUND: Final = 5.0
STALE: Final = 20.0
EDIT_GRACE: Final = 90.0  # a recipe edit reaches the engine within this (a replacement)
_REQUIRED: Final = frozenset({"schemaVersion", "generation", "desired"})  # desired.json
_SAID: Final = frozenset({"requestedBy", "requestedAt"})  # optional: who asked, and when
CAUSES: Final = ("recipe-edit", "engine-kill", "engine-oom", "dockerd-restart")
STOPPING: Final = ("request", "burst", "race", "operator-stop")  # a cause when it asks for a stop
# faults during which a breach is expected: nothing is written, or Docker cannot be asked
QUIET: Final = {
    "worker-kill": ("stale", "ack", "file_sd", "running"),
    "worker-stop": ("stale", "ack", "file_sd", "running"),
    "disk-full": ("stale", "ack", "file_sd"),
    "dockerd-stall": ("running",),
    "dockerd-restart": ("running",),
}


def caused(events: list[dict[str, Any]], engine: str, since: float) -> bool:
    """Has a fault since the engine's last container been a cause to replace it? One that
    replaces it outright, or one that asks for a stop: the start after it makes a new container,
    whether or not a stopped state was written between (a start asked soon after the stop comes
    in while the engine is still stopping)."""
    return any(
        e["start"] >= since - TOLERANCE
        and e["engine"] in (engine, "*")
        and (e["kind"] in CAUSES or (e["kind"] in STOPPING and e.get("stops")))
        for e in events
    )


def excused(events: list[dict[str, Any]], engine: str, invariant: str, now: float) -> bool:
    """Is a fault that excuses this invariant under way (or just over) for this engine? An
    invariant of one generation ("ack 41") is excused as its kind ("ack") is."""
    kind = invariant.split(maxsplit=1)[0]
    for event in events:
        if kind not in QUIET.get(event["kind"], ()):
            continue
        if event["engine"] not in (engine, "*"):
            continue
        end = event.get("end", now + 1)
        if event["start"] - TOLERANCE <= now <= end + RETURN:
            return True
    return False


def _load_schema(name: str) -> dict[str, Any]:
    return dict(json.loads((ROOT / "schemas" / name).read_text()))


@dataclass
class EngineTruth:
    name: str
    status: Path
    desired: Path
    file_sd: Path
    recipe: Path
    container: str
    setting: str  # the setting that recipe edits change, checked in the container's env
    ready_path: str
    seen_generation: dict[int, float] = field(default_factory=dict)  # generation -> first seen
    acked: set[int] = field(default_factory=set)
    breaches: dict[str, float] = field(default_factory=dict)  # invariant -> since
    container_id: str | None = None
    causes_since: float = 0.0  # when the current container was first seen
    requests: dict[int, Request] = field(default_factory=dict)  # generation -> what it reached
    judged: set[int] = field(default_factory=set)  # generations already found late or failing
    desired_seen: dict[int, dict[str, Any]] = field(default_factory=dict)  # generation -> doc


def desired_document(path: Path) -> dict[str, Any] | None:
    """desired.json as a host wrote it: the three fields the contract needs, and who asked and
    when (written since issue 36); None for anything else."""
    try:
        value = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if not isinstance(value, dict) or not _REQUIRED <= set(value) <= _REQUIRED | _SAID:
        return None
    return value


class Checker:
    def __init__(self, config: dict[str, Any]) -> None:
        self.engines = [
            EngineTruth(
                e["name"],
                Path(e["status"]),
                Path(e["desired"]),
                Path(e["file_sd"]),
                Path(e["recipe"]),
                e["container"],
                e["setting"],
                e["ready_path"],
            )
            for e in config["engines"]
        ]
        self.events_path = Path(config["events"])
        self.stop_path = Path(config["stop"])
        self.verdict_path = Path(config["verdict"])
        self.secrets: list[str] = list(config.get("secrets", []))
        self.status_schema = jsonschema.Draft202012Validator(_load_schema("status.schema.json"))
        self.file_sd_schema = jsonschema.Draft202012Validator(_load_schema("file_sd.schema.json"))
        self.docker = docker.from_env(timeout=3)
        self._events: dict[tuple[str, str, float], dict[str, Any]] = {}
        self._events_offset = 0
        self.violations: list[dict[str, Any]] = []
        self.figures: dict[str, Any] = {"worst_heartbeat_age": 0.0, "ack": [], "samples": 0}
        self.front_door: dict[str, Any] | None = config.get("front_door")
        self.counters = (
            None
            if self.front_door is None
            else frontdoor_check.Sampler(Path(self.front_door["status"]), self.front_door["model"])
        )

    def _violate(self, violation: dict[str, Any]) -> None:
        """Record a violation, and say it at once: a long soak shows it when it happens."""
        self.violations.append(violation)
        print(
            f"  checker: VIOLATION {violation['invariant']}: {violation.get('engine', '')} "
            f"{violation['detail']}",
            flush=True,
        )

    # -- events --------------------------------------------------------------------------------

    def _read_events(self) -> None:
        try:
            with self.events_path.open() as f:
                f.seek(self._events_offset)
                for line in f:
                    if line.endswith("\n"):
                        event = json.loads(line)  # announced, then again with its real end
                        self._events[(event["kind"], event["engine"], event["start"])] = event
                        self._events_offset += len(line.encode())
        except FileNotFoundError:
            return

    @property
    def events(self) -> list[dict[str, Any]]:
        return list(self._events.values())

    def _active(self, engine: str, invariant: str, now: float) -> bool:
        return excused(self.events, engine, invariant, now)

    def _since_edit(self, engine: str, now: float) -> float:
        edits = [
            e["start"]
            for e in self.events
            if e["kind"] == "recipe-edit" and e["engine"] == engine and e["start"] <= now
        ]
        return now - max(edits) if edits else float("inf")

    # -- one sample ----------------------------------------------------------------------------

    def sample(self) -> None:
        self._read_events()
        now = time.time()
        self.figures["samples"] += 1
        for engine in self.engines:
            self._check(engine, now)

    def _breach(
        self,
        engine: EngineTruth,
        invariant: str,
        now: float,
        failing: bool,
        detail: str,
        *,
        tolerance: float = TOLERANCE,
    ) -> None:
        key = invariant
        if not failing or self._active(engine.name, invariant, now):
            engine.breaches.pop(key, None)
            return
        since = engine.breaches.setdefault(key, now)
        if now - since >= tolerance:
            self._violate(
                {"t": now, "engine": engine.name, "invariant": invariant, "detail": detail}
            )
            engine.breaches[key] = now + 3600  # once an hour at most per invariant

    def _check(self, engine: EngineTruth, now: float) -> None:
        status = self._read_json(engine, engine.status, self.status_schema, now)
        desired = self._desired(engine)
        file_sd = self._read_json(engine, engine.file_sd, self.file_sd_schema, now)
        if desired is not None:
            engine.seen_generation.setdefault(desired["generation"], now)
            engine.desired_seen.setdefault(desired["generation"], desired)
            self._track(engine, desired, now)
        if status is not None:
            self._check_status(engine, status, desired, file_sd, now)
            self._reach(engine, status, now)
        self._check_docker(engine, status, now)
        self._check_liveness(engine, now)

    # -- liveness ------------------------------------------------------------------------------

    def _track(self, engine: EngineTruth, desired: dict[str, Any], now: float) -> None:
        """A generation first seen now: a new request, and the one before it superseded."""
        generation = desired["generation"]
        if generation in engine.requests:
            return
        for older, request in engine.requests.items():
            if older < generation and request.superseded is None:
                engine.requests[older] = replace(request, superseded=now)
        engine.requests[generation] = Request(engine.name, generation, desired["desired"], now)

    def _reach(self, engine: EngineTruth, status: dict[str, Any], now: float) -> None:
        request = engine.requests.get(status["generation"])
        if request is not None and status["state"] not in request.reached:
            engine.requests[request.generation] = replace(
                request, reached={**request.reached, status["state"]: now}
            )

    def _check_liveness(self, engine: EngineTruth, now: float) -> None:
        for generation, request in engine.requests.items():
            if generation in engine.judged:
                continue
            for invariant, detail in (
                ("failed-without-cause", unexplained_failure(request, self.events)),
                ("liveness", late(request, self.events, now)),
            ):
                if detail is not None:
                    engine.judged.add(generation)
                    self._violate(
                        {"t": now, "engine": engine.name, "invariant": invariant, "detail": detail}
                    )
                    break

    def _read_json(
        self, engine: EngineTruth, path: Path, schema: jsonschema.Draft202012Validator, now: float
    ) -> Any:
        try:
            text = path.read_text()
        except (FileNotFoundError, IsADirectoryError):
            return None
        try:
            value = json.loads(text)
            schema.validate(value)  # the schema itself was checked once, when loaded
        except (json.JSONDecodeError, jsonschema.ValidationError) as exc:
            self._violate(
                {
                    "t": now,
                    "engine": engine.name,
                    "invariant": "whole-file",
                    "detail": f"{path.name}: {str(exc)[:200]}",
                }
            )
            return None
        return value

    def _desired(self, engine: EngineTruth) -> dict[str, Any] | None:
        return desired_document(engine.desired)

    def _check_status(
        self,
        engine: EngineTruth,
        status: dict[str, Any],
        desired: dict[str, Any] | None,
        file_sd: Any,
        now: float,
    ) -> None:
        checked = datetime.fromisoformat(status["checkedAt"].replace("Z", "+00:00")).timestamp()
        age = now - checked
        if not self._active(engine.name, "stale", now):
            self.figures["worst_heartbeat_age"] = max(self.figures["worst_heartbeat_age"], age)
        self._breach(engine, "stale", now, age > STALE, f"checkedAt {age:.1f} s old", tolerance=0)
        for generation, first in engine.seen_generation.items():
            if generation in engine.acked:
                continue
            if status["generation"] >= generation or (
                desired and desired["generation"] > generation
            ):
                engine.acked.add(generation)
                if status["generation"] == generation:
                    self.figures["ack"].append(now - first)
                continue
            self._breach(
                engine,
                f"ack {generation}",
                now,
                now - first > ACK_BOUND,
                f"generation {generation} not acknowledged after {now - first:.1f} s",
                tolerance=0,
            )
        for secret in self.secrets:
            if secret in json.dumps(status):
                self._violate(
                    {
                        "t": now,
                        "engine": engine.name,
                        "invariant": "secret",
                        "detail": "status.json",
                    }
                )
        current = desired is not None and status["generation"] == desired["generation"]
        if file_sd is not None and current:
            named = any(group["labels"].get("name") == engine.name for group in file_sd)
            self._breach(
                engine,
                "file_sd",
                now,
                (status["state"] == "running") != named,
                f"state {status['state']} but file_sd "
                f"{'names' if named else 'does not name'} the engine",
            )

    def _check_docker(self, engine: EngineTruth, status: dict[str, Any] | None, now: float) -> None:
        try:
            found = self.docker.containers.list(all=True, filters={"name": engine.container})
        except (docker.errors.DockerException, OSError):
            return  # dockerd down or stalled: nothing to compare with
        ours = [c for c in found if c.name == engine.container]
        self._breach(
            engine,
            "one-container",
            now,
            len(ours) > 1,
            f"{len(ours)} containers named {engine.container}",
            tolerance=0,
        )
        container = ours[0] if ours else None
        running = container is not None and container.status == "running"
        if running and container is not None and container.id != engine.container_id:
            before = engine.container_id
            if before is not None and not caused(self.events, engine.name, engine.causes_since):
                self._violate(
                    {
                        "t": now,
                        "engine": engine.name,
                        "invariant": "restart-without-cause",
                        "detail": f"{before[:12]} -> {str(container.id)[:12]}",
                    }
                )
            engine.container_id, engine.causes_since = container.id, now
        if status is None or status["state"] != "running":
            if status is not None and status["state"] == "stopped" and not running:
                engine.container_id = None  # a stop asked for: the next start has its cause
            return
        state = container.status if container is not None else "absent"
        self._breach(
            engine, "running", now, not running, f"status running but the container is {state}"
        )
        if running and container is not None:
            self._check_spec(engine, container, status, now)

    def _check_spec(
        self, engine: EngineTruth, container: Any, status: dict[str, Any], now: float
    ) -> None:
        recipe = tomllib.loads(engine.recipe.read_text())
        want = str(recipe.get("settings", {}).get(engine.setting, ""))
        env = container.attrs["Config"]["Env"] or []
        stale = f"{engine.setting}={want}" not in env
        self._breach(
            engine,
            "spec",
            now,
            stale and self._since_edit(engine.name, now) > EDIT_GRACE,
            f"runs {engine.setting} other than the recipe's {want}",
        )
        ok = False
        try:
            with urllib.request.urlopen(status["url"] + engine.ready_path, timeout=2) as r:
                ok = r.status == 200
        except (OSError, ValueError):
            ok = False
        self._breach(
            engine,
            "ready",
            now,
            not ok,
            f"{status['url']}{engine.ready_path} does not answer 200 while status is running",
        )

    # -- the end -------------------------------------------------------------------------------

    def finish(self) -> None:
        now = time.time()
        for engine in self.engines:
            status = self._read_json(engine, engine.status, self.status_schema, now)
            desired = self._desired(engine)
            if status is None or desired is None:
                self._violate(
                    {
                        "t": now,
                        "engine": engine.name,
                        "invariant": "final",
                        "detail": "no status or no valid desired.json",
                    }
                )
                continue
            self._reach(engine, status, now)
            self._check_liveness(engine, now)
            # the request's own state, or a failure (which the liveness rule needs a cause for)
            answered = status["generation"] == desired["generation"] and status["state"] in (
                desired["desired"],
                "failed",
            )
            if not answered:
                self._violate(
                    {
                        "t": now,
                        "engine": engine.name,
                        "invariant": "final",
                        "detail": f"generation {desired['generation']} "
                        f"unanswered: {status['state']} "
                        f"{status['message'][:120]}",
                    }
                )
            journal = subprocess.run(
                ["journalctl", "-q", "-o", "cat", "-t", f"lucia-{engine.name}"],
                capture_output=True,
                text=True,
                check=False,
            ).stdout
            for secret in self.secrets:
                if secret in journal:
                    self._violate(
                        {
                            "t": now,
                            "engine": engine.name,
                            "invariant": "secret",
                            "detail": "journal",
                        }
                    )
        acks = sorted(self.figures.pop("ack"))
        self.figures["ack_p50"] = acks[len(acks) // 2] if acks else None
        self.figures["ack_max"] = acks[-1] if acks else None
        self.figures["acks"] = len(acks)
        requests = [r for engine in self.engines for r in engine.requests.values()]
        self.figures["reached"] = reached_counts(requests)
        to_running = sorted(
            r.reached["running"] - r.seen
            for r in requests
            if r.desired == "running" and "running" in r.reached
        )
        self.figures["to_running_p50"] = to_running[len(to_running) // 2] if to_running else None
        self.figures["to_running_max"] = to_running[-1] if to_running else None
        if self.front_door is not None and self.counters is not None:
            self._judge_front_door(self.front_door, self.counters.stop(), now)
        self.verdict_path.write_text(
            json.dumps({"violations": self.violations, "figures": self.figures}, indent=2)
        )

    def _judge_front_door(
        self, config: dict[str, Any], lives: frontdoor_check.Lives, now: float
    ) -> None:
        try:
            violations, figures = frontdoor_check.judge(
                config,
                lives,
                self.events,
                {e.name: list(e.desired_seen.values()) for e in self.engines},
            )
        except Exception as exc:  # a front door that cannot be judged fails
            violations, figures = (
                [
                    {
                        "t": now,
                        "engine": "gateway",
                        "invariant": "front-door",
                        "detail": f"not judged: {exc!r}"[:300],
                    }
                ],
                None,
            )
        for violation in violations:
            self._violate(violation)
        self.figures["front_door"] = figures

    def run(self) -> None:
        if self.counters is not None:
            self.counters.start()
        while not self.stop_path.exists():
            started = time.monotonic()
            self.sample()
            time.sleep(max(SAMPLE - (time.monotonic() - started), 0.0))
        self.finish()


def main(argv: list[str]) -> int:
    Checker(json.loads(Path(argv[0]).read_text())).run()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
