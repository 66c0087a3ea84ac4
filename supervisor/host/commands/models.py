"""`lucia-supervisor models ...`: add, list, show, retry, cancel, remove, and the queue's service.

The CLI and the queue meet in the library's files only: add writes a Queued model.json, the
other requests a <guid>/control.json (or act at once when no queue runs), and the service
(`models serve`, the lucia-models unit) holds the lease and runs the queue.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Final

from supervisor import logs, paths
from supervisor.console import (
    EXIT_CONFIG,
    EXIT_FAILED,
    EXIT_OK,
    EXIT_UNANSWERED,
    Subparsers,
    print_err,
)
from supervisor.host.models import control
from supervisor.host.models import manifest as mf
from supervisor.host.models.hub import Hub, HubRefused
from supervisor.host.models.job import QueueSettings, read_token
from supervisor.host.models.lease import CatalogHeld, CatalogLease
from supervisor.host.models.runner import Runner
from supervisor.host.waiting import Progress
from supervisor.notify import Notifier

ENDED: Final = frozenset({"Ready", "Failed", "Canceled", "Interrupted"})
ANSWER_WAIT: Final = 10.0
LEASE_WAIT: Final = 5.0  # a CLI holds the lease for a moment to apply a request itself
NO_SERVICE: Final = 60.0  # add --wait gives up after this long with no service running


def _root(args: argparse.Namespace) -> Path:
    return paths.models_dir(args.models_dir)


def size(count: float) -> str:
    """1.5 GiB, 12.0 MiB, 512 B."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if count < 1024 or unit == "TiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} TiB"


def progress_text(model: mf.ModelManifest) -> str:
    """What list and --wait show of a model's progress: done/total, speed, time left."""
    text = f"{size(model.bytes_done)}/{size(model.bytes_total)}"
    if model.state == "Downloading" and model.speed is not None:
        text += f" {size(model.speed)}/s"
        if model.seconds_left is not None:
            text += f" {int(model.seconds_left)}s left"
    return text


def _cmd_add(args: argparse.Namespace) -> int:
    root = _root(args)
    hub = Hub.from_env(read_token(paths.hf_token_file(args.token_file)))
    try:
        model = control.add(
            root, hub, args.repo, args.revision, include=args.include or [], name=args.name
        )
    except (HubRefused, control.RequestRefused, ValueError) as exc:
        print_err(str(exc))
        return EXIT_FAILED
    print(
        f"{model.id} {model.name}: queued {model.source.repo} at {model.source.commit} "
        f"({len(model.hub_files)} files, {size(model.bytes_total)})"
    )
    if CatalogLease(root).holder() is None:
        print_err("the library's service is not running: systemctl --user start lucia-models")
    if not args.wait:
        return EXIT_OK
    return _follow(root, model.id)


def _follow(root: Path, guid: str) -> int:
    """Show one progress line until the download ends; 0 when it is Ready."""
    shown = Progress(guid[:8], sys.stderr.isatty(), time.monotonic())
    serviced = time.monotonic()
    while True:
        if CatalogLease(root).holder() is not None:
            serviced = time.monotonic()
        elif time.monotonic() - serviced > NO_SERVICE:
            sys.stderr.write(shown.finish())
            print_err(
                f"no library service ran for {NO_SERVICE:g} s; the download waits Queued: "
                "systemctl --user start lucia-models"
            )
            return EXIT_UNANSWERED
        model = mf.load(root, guid)
        sys.stderr.write(
            shown.update(time.monotonic(), f"{model.state} {progress_text(model)} {model.message}")
        )
        sys.stderr.flush()
        if model.state in ENDED:
            sys.stderr.write(shown.finish())
            print(f"{model.name}: {model.state}: {model.message}")
            return EXIT_OK if model.state == "Ready" else EXIT_FAILED
        time.sleep(0.5)


def _cmd_list(args: argparse.Namespace) -> int:
    models = mf.load_all(_root(args))
    if args.json:
        print(json.dumps([json.loads(mf.dump(m)) for m in models], indent=2))
        return EXIT_OK
    table = [("ID", "NAME", "STATE", "PROGRESS", "MESSAGE")] + [
        (m.id[:12], m.name, m.state, progress_text(m), m.message[:60]) for m in models
    ]
    widths = [max(len(row[i]) for row in table) for i in range(4)]
    for row in table:
        cells = [cell.ljust(w) for cell, w in zip(row[:4], widths, strict=True)]
        print("  ".join([*cells, row[4]]).rstrip())
    return EXIT_OK


def _cmd_show(args: argparse.Namespace) -> int:
    try:
        model = mf.find(_root(args), args.model)
    except LookupError as exc:
        print_err(str(exc))
        return EXIT_FAILED
    sys.stdout.write(mf.dump(model).decode())
    return EXIT_OK


def _cmd_request(args: argparse.Namespace) -> int:
    root = _root(args)
    action: control.Action = args.action
    try:
        model = mf.find(root, args.model)
        applied = control.request(root, model.id, action)
    except (LookupError, control.RequestRefused, FileNotFoundError) as exc:
        print_err(str(exc))
        return EXIT_FAILED
    if not applied and not _answered(root, model.id, action):
        print_err(f"the library's service has not taken the {action} of {model.name} yet; it will")
        return EXIT_FAILED
    after = "removed" if action == "remove" else mf.load(root, model.id).state
    print(f"{model.id} {model.name}: {after}")
    return EXIT_OK


def _answered(root: Path, guid: str, action: str) -> bool:
    """Whether the running queue took the request within ANSWER_WAIT seconds."""
    deadline = time.monotonic() + ANSWER_WAIT
    while time.monotonic() < deadline:
        directory = mf.model_dir(root, guid)
        if not (directory / control.CONTROL).exists():
            if action == "remove":
                if not directory.exists():
                    return True
            elif mf.load(root, guid).state != "Downloading" or action == "retry":
                return True
        time.sleep(0.1)
    return False


def _cmd_serve(args: argparse.Namespace) -> int:
    logs.configure()
    log = logs.get("models")
    settings = QueueSettings(
        parallel=args.parallel,
        stall_after=args.stall_after,
        token_file=paths.hf_token_file(args.token_file),
    )
    runner = Runner(_root(args), settings)
    try:
        changes = runner.start(wait=LEASE_WAIT)
    except CatalogHeld as exc:
        log.error("the model library refused to start", error=str(exc))
        print_err(str(exc))
        return EXIT_CONFIG
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    log.info(
        "model library running",
        root=str(runner.root),
        parallel=args.parallel,
        startup_changes=len(changes),
    )
    notifier = Notifier()
    notifier.ready()
    runner.run(stop)
    notifier.stopping()
    return EXIT_OK


def _count(text: str) -> int:
    value = int(text)
    if not 1 <= value <= control.MAX_QUEUE:
        raise argparse.ArgumentTypeError(f"1 to {control.MAX_QUEUE}")
    return value


def _seconds(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError("a positive number of seconds")
    return value


def add_models(sub: Subparsers) -> None:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--models-dir",
        metavar="DIR",
        help=f"the model library (env {paths.MODELS_ENV}, default ~/.local/share/lucia/models)",
    )
    token = argparse.ArgumentParser(add_help=False)
    token.add_argument(
        "--token-file",
        metavar="PATH",
        help=f"the hub token (env {paths.HF_TOKEN_ENV}, default ~/.config/lucia/hf-token)",
    )
    ms = sub.add_parser("models", help="the model library: add, list, show, retry, cancel, remove")
    msub = ms.add_subparsers(dest="models_command", required=True, metavar="ACTION")
    add = msub.add_parser("add", parents=[common, token], help="queue a download from the hub")
    add.add_argument("repo", metavar="REPO")
    add.add_argument("--revision", required=True, help="a 40-hex commit, or a branch or tag")
    add.add_argument("--include", action="append", metavar="GLOB", help="files to take (repeat)")
    add.add_argument("--name", help="the model's name in the library")
    add.add_argument("--wait", action="store_true", help="follow the download until it ends")
    add.set_defaults(func=_cmd_add)
    ls = msub.add_parser("list", parents=[common], help="state, bytes, speed and time left")
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(func=_cmd_list)
    show = msub.add_parser("show", parents=[common], help="a model's model.json")
    show.add_argument("model", metavar="ID|NAME")
    show.set_defaults(func=_cmd_show)
    for action, text in (
        ("retry", "retry a Failed, Canceled or Interrupted download"),
        ("cancel", "cancel a queued or running download"),
        ("remove", "delete a model's directory"),
    ):
        cmd = msub.add_parser(action, parents=[common], help=text)
        cmd.add_argument("model", metavar="ID|NAME")
        cmd.set_defaults(func=_cmd_request, action=action)
    serve = msub.add_parser("serve", parents=[common, token], help="run the download queue")
    serve.add_argument("--parallel", type=_count, default=2, help="downloads at once (2)")
    serve.add_argument(
        "--stall-after",
        type=_seconds,
        default=120.0,
        help="fail a download when no byte arrives for this long (120 s)",
    )
    serve.set_defaults(func=_cmd_serve)
