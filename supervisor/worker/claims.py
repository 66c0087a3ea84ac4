"""A start's memory claim, made and settled by the worker's steps.

Claimed last at its Check, held by the container its Start made, and dropped (or moved to the
container still running) when the start fails or will not run. The engine says what a start
needs (its Claimant).
"""

from __future__ import annotations

from supervisor import logs
from supervisor.engines.base import Engine

log = logs.get("engine")


def check(engine: Engine, replacing: str | None) -> None:
    """Claim the start's memory, or refuse it with the numbers (raises Permanent); last of the
    checks, so a claim is made only for a start that passed the others."""
    claim = engine.info.claim
    if claim is None:
        return
    need = claim.need()
    if need is not None:
        claim.guard.claim(need, replacing)


def started(engine: Engine, container_id: str | None) -> None:
    """After a Start step: the container it made (its claim now holds while it runs), or None
    when the start failed (the claim is dropped); then the engine's own effects of it."""
    claim = engine.info.claim
    try:
        if claim is not None:
            claim.guard.started(container_id)
    finally:
        engine.settle(container_id, started=True)


def abandoned(engine: Engine, running: str | None) -> None:
    """The start a passed Check was for will not run: its memory claim moves to the container
    still running (running), or is dropped. A ledger that cannot be written keeps the claim
    pending until the next observation."""
    engine.settle(running, started=False)
    claim = engine.info.claim
    if claim is None:
        return
    try:
        if claim.guard.abandon(running):
            log.info(
                "memory claim settled: its start was not run",
                held_by=running[:12] if running else None,
            )
    except OSError as exc:
        log.warning("memory claim not settled; retrying at the next look", error=str(exc))


def planned(engine: Engine) -> tuple[int, int] | None:
    """(need, limit) in bytes at the last memory check; None before one."""
    claim = engine.info.claim
    guard = claim.guard if claim is not None else None
    if guard is None or guard.last is None or guard.limit is None:
        return None
    return guard.last.need.need, guard.limit
