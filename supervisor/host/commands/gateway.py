"""The gateway's commands: the gateway, the inference keys it checks, and its record's usage.

They read and write the host's files only (the data directory, keys.json); none touches Docker,
an engine or a worker.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

from supervisor import paths
from supervisor.console import EXIT_CONFIG, EXIT_FAILED, EXIT_OK, Subparsers, print_err
from supervisor.host import keys
from supervisor.protocol.documents import utc_now


def _cmd_gateway(args: argparse.Namespace) -> int:
    from supervisor import logs
    from supervisor.host.gateway import settings as gateway_settings
    from supervisor.host.gateway.service import Service, serve
    from supervisor.host.keycheck import Verifier

    logs.configure()
    log = logs.get("gateway")
    try:
        settings = gateway_settings.load(args.settings)
        data = paths.data_dir(args.data_dir)
        auth = Verifier.open(
            paths.keys_file(data), settings.keys.owner_file, settings.keys.inference_file
        )
        service = Service(settings, data, auth)
    except (gateway_settings.SettingsError, keys.KeyConfigError) as exc:
        log.error("gateway refused to start", error=str(exc))
        print_err(str(exc))
        return EXIT_CONFIG
    return serve(service)


def _cmd_keys_create(args: argparse.Namespace) -> int:
    """The key goes to stdout alone (KEY=$(lucia-supervisor keys create NAME)), once."""
    now = utc_now()
    try:
        expires = keys.parse_expiry(args.expires, now) if args.expires else None
        budget = _tokens(args.budget) if args.budget is not None else None
        new = keys.create(
            paths.keys_file(paths.data_dir(args.data_dir)),
            args.name,
            now,
            expires,
            budget,
            exempt=args.exempt,
        )
    except keys.KeysFileInvalid as exc:
        print_err(str(exc))
        return EXIT_CONFIG
    except (keys.KeyRefused, keys.BadExpiry, argparse.ArgumentTypeError) as exc:
        print_err(str(exc))
        return EXIT_FAILED
    entry = new.entry
    until = f"expires {entry.expires:%Y-%m-%dT%H:%M:%SZ}" if entry.expires else "never expires"
    exempt = ", exempt from the daily budget" if entry.exempt else ""
    print_err(f"created key {entry.id} ({entry.name}, {until}{exempt}); it is shown once, here:")
    print(new.secret)
    return EXIT_OK


def _cmd_keys_list(args: argparse.Namespace) -> int:
    try:
        rows = keys.describe(keys.load(paths.keys_file(paths.data_dir(args.data_dir))), utc_now())
    except keys.KeysFileInvalid as exc:
        print_err(str(exc))
        return EXIT_CONFIG
    if args.json:
        print(json.dumps(rows, indent=2))
        return EXIT_OK
    header = ("ID", "NAME", "CREATED", "EXPIRES", "STATE", "BUDGET", "EXEMPT")
    table = [header] + [
        (
            str(r["id"]),
            str(r["name"]),
            str(r["created"]),
            str(r["expires"] or "never"),
            str(r["state"]),
            str(r["budget"] or "default"),
            "yes" if r["exempt"] else "no",
        )
        for r in rows
    ]
    widths = [max(len(line[i]) for line in table) for i in range(len(header))]
    for line in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip())
    return EXIT_OK


def _changed(
    args: argparse.Namespace, change: Callable[[Path], keys.IssuedKey]
) -> keys.IssuedKey | int:
    """One change to keys.json, made under its lock; or, refused, the exit status (said)."""
    try:
        return change(paths.keys_file(paths.data_dir(args.data_dir)))
    except keys.KeysFileInvalid as exc:
        print_err(str(exc))
        return EXIT_CONFIG
    except keys.KeyRefused as exc:
        print_err(str(exc))
        return EXIT_FAILED


def _cmd_keys_budget(args: argparse.Namespace) -> int:
    try:
        budget = None if args.tokens == "default" else _tokens(args.tokens)
    except argparse.ArgumentTypeError as exc:
        print_err(str(exc))
        return EXIT_FAILED
    done = _changed(args, lambda path: keys.set_budget(path, args.key, budget))
    if isinstance(done, int):
        return done
    what = f"{done.budget} tokens a day" if done.budget else "the settings' default budget"
    print(f"{done.id} ({done.name}) now has {what}; the gateway applies it within a second")
    return EXIT_OK


def _cmd_keys_exempt(args: argparse.Namespace) -> int:
    on = args.setting == "on"
    done = _changed(args, lambda path: keys.set_exempt(path, args.key, on))
    if isinstance(done, int):
        return done
    what = (
        "is exempt from the daily budget (still counted and recorded)"
        if done.exempt
        else "is held to its daily budget again"
    )
    print(f"{done.id} ({done.name}) {what}; the gateway applies it within a second")
    return EXIT_OK


def _tokens(text: str) -> int:
    """A daily token budget, or ArgumentTypeError saying what is wrong."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of tokens") from None
    if not 1 <= value <= keys.MAX_BUDGET:
        raise argparse.ArgumentTypeError(f"a budget is 1 to {keys.MAX_BUDGET} tokens a day")
    return value


def _cmd_keys_revoke(args: argparse.Namespace) -> int:
    now = utc_now()
    done = _changed(args, lambda path: keys.revoke_key(path, args.key, now))
    if isinstance(done, int):
        return done
    when = "now" if done.revoked == now else f"already, at {done.revoked}"
    print(f"revoked {done.id} ({done.name}) {when}; the gateway refuses it within a second")
    return EXIT_OK


def _since(text: str) -> datetime:
    from supervisor.host.record.report import BadSince, parse_since

    try:
        return parse_since(text, utc_now())
    except BadSince as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _cmd_usage(args: argparse.Namespace) -> int:
    from supervisor.host.gateway import settings as gateway_settings
    from supervisor.host.record import database, queries, report

    try:
        settings = gateway_settings.load(args.settings)
    except gateway_settings.SettingsError as exc:
        print_err(str(exc))
        return EXIT_CONFIG
    data = paths.data_dir(args.data_dir)
    target = settings.record.target(data)
    try:
        lines = queries.read(target, args.since, args.by)
    except database.failures() as exc:
        reason = str(exc) if isinstance(exc, database.StoreFailed) else database.one_line(exc)
        print_err(f"the record ({target.describe()}): {reason}")
        return EXIT_FAILED
    names = keys.names(paths.keys_file(data)) if args.by == "key" else None
    if args.json:
        print(json.dumps(report.as_json(lines, args.by, args.since, names), indent=2))
        return EXIT_OK
    if not lines:
        print_err(f"nothing recorded since {args.since:%Y-%m-%dT%H:%M:%SZ}")
        return EXIT_OK
    print(report.table(lines, args.by, names))
    return EXIT_OK


def add_usage(sub: Subparsers, common: argparse.ArgumentParser) -> None:
    us = sub.add_parser(
        "usage", parents=[common], help="what the record says: requests, tokens, ttft, refusals"
    )
    us.add_argument(
        "--since",
        type=_since,
        default="1d",
        metavar="WHEN",
        help="a span back from now (30m, 12h, 1d, 2w), an ISO date (UTC) or an ISO time with "
        "its offset; default 1d",
    )
    us.add_argument("--by", choices=("key", "model", "engine", "build"), default="key")
    us.add_argument("--json", action="store_true")
    us.add_argument(
        "--settings",
        metavar="PATH",
        help="the gateway's settings file, whose [record] says where the record is",
    )
    us.set_defaults(func=_cmd_usage)


def add_keys(sub: Subparsers, common: argparse.ArgumentParser) -> None:
    ks = sub.add_parser("keys", help="issued inference keys: create, list, revoke, budget, exempt")
    ksub = ks.add_subparsers(dest="keys_command", required=True, metavar="ACTION")
    kc = ksub.add_parser(
        "create", parents=[common], help="issue a lucia_inf_ key; it is printed once"
    )
    kc.add_argument("name", help="1-64 letters, digits, '.', '_' or '-'")
    kc.add_argument(
        "--expires",
        metavar="WHEN",
        help="a duration (12h, 30d, 8w), an ISO date (2026-12-31: from that day's start, UTC) "
        "or an ISO time with its offset; default: never",
    )
    kc.add_argument(
        "--budget",
        metavar="TOKENS",
        help="the key's own daily token budget; default: [budget] daily_tokens",
    )
    kc.add_argument(
        "--exempt",
        action="store_true",
        help="no daily budget is enforced against it (its use is still counted and recorded)",
    )
    kc.set_defaults(func=_cmd_keys_create)
    kl = ksub.add_parser("list", parents=[common], help="show the keys (never the keys themselves)")
    kl.add_argument("--json", action="store_true")
    kl.set_defaults(func=_cmd_keys_list)
    kr = ksub.add_parser("revoke", parents=[common], help="revoke a key by its id or name")
    kr.add_argument("key", metavar="ID|NAME")
    kr.set_defaults(func=_cmd_keys_revoke)
    kb = ksub.add_parser("budget", parents=[common], help="set a key's own daily token budget")
    kb.add_argument("key", metavar="ID|NAME")
    kb.add_argument("tokens", metavar="TOKENS|default", help="tokens a day, or `default`")
    kb.set_defaults(func=_cmd_keys_budget)
    ke = ksub.add_parser(
        "exempt", parents=[common], help="make a key exempt from the daily budget, or not"
    )
    ke.add_argument("key", metavar="ID|NAME")
    ke.add_argument("setting", choices=("on", "off"), help="on: exempt; off: budgeted again")
    ke.set_defaults(func=_cmd_keys_exempt)


def add_gateway(sub: Subparsers, common: argparse.ArgumentParser) -> None:
    gw = sub.add_parser(
        "gateway", parents=[common], help="serve the authenticated /v1 in front of the engines"
    )
    gw.add_argument(
        "--settings",
        metavar="PATH",
        help="settings file (env LUCIA_GATEWAY_SETTINGS, default ~/.config/lucia/gateway.toml)",
    )
    gw.set_defaults(func=_cmd_gateway)
