"""Whether the tests left the operator's demo as they found it: `.ci/run` runs scripts/demo.sh,
then the tests and the soaks, and checks with this that the demo is untouched.

    .venv/bin/python -m tests.demo_intact save /var/tmp/demo-before.json   # after the demo
    .venv/bin/python -m tests.demo_intact check /var/tmp/demo-before.json  # after the tests

`save` records what makes the demo the demo: the state and main pid of each of the operator's
units, the id and start time of each demo container and the demo network, and a digest of each
file install.sh and the demo wrote (units, recipes, the installed package's stamp, the gateway's
settings, key files and machine settings: digests only, never their content). `check` records
the same again and compares; then each demo engine must answer on its status url and a chat
must be answered through the demo's gateway with the operator's inference key (read from its
file, sent in a header, never printed). Exit 0 when all of it holds, 1 with each difference.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import pwd
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import docker

from supervisor.host.gateway.settings import load as load_gateway_settings

ROOT = Path(__file__).resolve().parents[1]
USER = "lucia"  # the operator's user, as scripts/demo.sh installs it
ENGINES = ("demo", "demo-router", "demo-vllm-cpu")
UNITS = (*(f"lucia-{name}.service" for name in ENGINES), "lucia-gateway.service")
NETWORK = "lucia-demo"
CHAT_MODEL = "tiny"


def _home() -> Path:
    return Path(pwd.getpwnam(USER).pw_dir)


def _systemctl_show(unit: str) -> dict[str, str]:
    done = subprocess.run(
        [
            str(ROOT / "scripts" / "as-lucia"),
            "systemctl",
            "--user",
            "show",
            unit,
            "-p",
            "ActiveState",
            "-p",
            "MainPID",
        ],
        capture_output=True,
        text=True,
        check=False,
        env={"LUCIA_USER": USER, "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"},
    )
    shown = dict(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line)
    if done.returncode != 0 or set(shown) != {"ActiveState", "MainPID"}:
        raise SystemExit(
            f"demo_intact: systemctl --user show {unit} as {USER} failed "
            f"({done.returncode}): {done.stderr.strip()}"
        )
    return shown


def _digest(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except FileNotFoundError:
        return None


def _files(home: Path) -> list[Path]:
    share, config = home / ".local/share/lucia", home / ".config"
    units = sorted((config / "systemd/user").glob("lucia-*.service"))
    recipes = sorted((share / "recipes").glob("*.toml"))
    named = [
        share / "venv/.lucia-source",
        share / "README.md",
        share / "host/data/inference-keys/keys.json",
        *(
            config / "lucia" / name
            for name in ("gateway.toml", "owner.key", "inference.key", "machine.toml")
        ),
    ]
    return [*units, *recipes, *named]


def snapshot() -> dict[str, Any]:
    home = _home()
    client = docker.from_env(timeout=30)
    containers: dict[str, Any] = {}
    for name in ENGINES:
        try:
            attrs = client.containers.get(f"lucia-{name}").attrs
        except docker.errors.NotFound:
            containers[name] = None
            continue
        containers[name] = {
            "id": attrs["Id"],
            "startedAt": attrs["State"]["StartedAt"],
            "running": attrs["State"]["Running"],
        }
    try:
        network = client.networks.get(NETWORK).id
    except docker.errors.NotFound:
        network = None
    client.close()
    return {
        "units": {unit: _systemctl_show(unit) for unit in UNITS},
        "containers": containers,
        "network": network,
        "files": {str(path): _digest(path) for path in _files(home)},
    }


def _differences(before: dict[str, Any], after: dict[str, Any], where: str = "") -> list[str]:
    if isinstance(before, dict) and isinstance(after, dict):
        found = []
        for key in sorted(set(before) | set(after)):
            found += _differences(before.get(key), after.get(key), f"{where}/{key}")
        return found
    return [] if before == after else [f"{where}: {before!r} -> {after!r}"]


def _status(name: str) -> dict[str, Any]:
    path = _home() / ".local/share/lucia/host/data" / name / "status.json"
    return dict(json.loads(path.read_text()))


def _engines_answer() -> list[str]:
    problems = []
    for name in ENGINES:
        status = _status(name)
        if status.get("state") != "running" or not status.get("url"):
            problems.append(f"engine {name}: {status.get('state')}: {status.get('message')}")
            continue
        try:
            with urllib.request.urlopen(status["url"] + "/v1/models", timeout=30) as answer:
                answer.read()
        except (OSError, urllib.error.HTTPError) as exc:
            problems.append(f"engine {name}: {status['url']}/v1/models: {exc}")
    return problems


def _chat() -> list[str]:
    config = _home() / ".config/lucia"
    listen = load_gateway_settings(str(config / "gateway.toml")).listen
    key = (config / "inference.key").read_text().strip()
    body = {
        "model": CHAT_MODEL,
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 8,
    }
    request = urllib.request.Request(
        f"http://{listen.address}:{listen.port}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"},
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as answer:
            usage = json.load(answer).get("usage")
    except urllib.error.HTTPError as exc:
        return [f"a chat through the demo's gateway: {exc.code} {exc.read()[:300]!r}"]
    except OSError as exc:
        return [f"a chat through the demo's gateway: {exc}"]
    print(f"demo_intact: a chat through the demo's gateway answered, usage {usage}")
    return []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.demo_intact",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("action", choices=("save", "check"))
    parser.add_argument("path", type=Path)
    args = parser.parse_args(argv)
    now = snapshot()
    if args.action == "save":
        args.path.write_text(json.dumps(now, indent=1, sort_keys=True) + "\n")
        print(
            f"demo_intact: saved {len(now['units'])} units, {len(now['containers'])} "
            f"containers and {len(now['files'])} files to {args.path}"
        )
        return 0
    before = json.loads(args.path.read_text())
    problems = _differences(before, now)
    missing = [name for name, found in before["containers"].items() if found is None]
    problems += [f"container lucia-{name}: absent when saved" for name in missing]
    problems += _engines_answer()
    problems += _chat()
    for problem in problems:
        print(f"demo_intact: {problem}", file=sys.stderr)
    if problems:
        print(f"demo_intact: the demo was touched ({len(problems)} differences)", file=sys.stderr)
        return 1
    print(
        f"demo_intact: the demo is untouched: {len(now['units'])} units with the same pids, "
        f"{len(now['containers'])} containers with the same ids and start times, "
        f"{len(now['files'])} files unchanged, every engine answering"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
