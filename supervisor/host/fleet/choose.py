"""Pure: which peer machine's engine a request goes to, for a model no engine here serves.

The gateway asks only when none of its own engines serves the model: a local engine always
wins, and such a request never leaves the machine. Of the peers' rows that serve the model,
only those whose machine was heard from within `stale_s` count. Of those, one whose
declaration does not leave out the route's capability first (capability.py), then the best kind:

0. running with a free slot (running below its slots; slots not published: running nothing),
1. running, the fewest waiting first,
2. starting (its gateway holds the request until the engine serves),
3. one its gateway may start on demand (stopped, failed or stopping; no operator stopped it),
4. stopped by its operator, 5. unavailable (no worker answers for it): its gateway refuses,
   saying why, as it would here.

Ties go by machine name, then engine name. None fresh: 503 `model_not_loaded` naming the
machines last seen serving it. No machine serves it: 404 `model_not_found`, as the local route
says it, naming the models there are.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from datetime import datetime
from typing import Final

from supervisor.host.fleet.rows import PeerEngine
from supervisor.host.proxy import capability
from supervisor.host.web.refusal import Refusal

SHOWN: Final = 50  # model names listed in a 404, as the local route lists them


def choose(
    model: str,
    path: str,
    peers: Sequence[PeerEngine],
    now: datetime,
    stale_s: float,
    *,
    known: Collection[str] = (),
) -> PeerEngine:
    """The peer engine a request for `model` on `path` goes to (the module's order); `known`:
    the names this machine serves (its models and tiers), for a 404's list."""
    serving = [peer for peer in peers if model in peer.models]
    fresh = [peer for peer in serving if peer.fresh(now, stale_s)]
    if fresh:
        best = min(fresh, key=lambda peer: order(peer, model, path))
        try:  # the best declares it does not serve the route: so does every other
            capability.check(path, model, best.engine, best.capabilities(model))
        except Refusal as refusal:
            refusal.details["machine"] = best.machine
            raise
        return best
    if serving:
        raise not_loaded(model, serving, now, stale_s)
    raise not_found(model, {name for peer in peers for name in peer.models} | set(known))


def order(peer: PeerEngine, model: str, path: str) -> tuple[bool, int, int, str, str]:
    """Pure: a fresh row's place, smallest first."""
    refuses = capability.serves(peer.capabilities(model), path) is False
    found = rank(peer)
    return refuses, found, peer.waiting if found == 1 else 0, peer.machine, peer.engine


def rank(peer: PeerEngine) -> int:
    """Pure: the module's kinds, 0 best."""
    if peer.stopped_by_operator:
        return 4
    if peer.state == "running":
        free = peer.running < peer.slots if peer.slots is not None else peer.running == 0
        return 0 if free else 1
    if peer.state == "starting":
        return 2
    if peer.state in ("stopped", "failed", "stopping"):
        return 3
    return 5


def not_loaded(model: str, serving: Sequence[PeerEngine], now: datetime, stale_s: float) -> Refusal:
    """503: the machines last seen serving `model`, none heard from within `stale_s`."""
    last: dict[str, datetime] = {}
    for peer in serving:
        last[peer.machine] = max(last.get(peer.machine, peer.heard), peer.heard)
    machines = sorted(last, key=lambda name: (-last[name].timestamp(), name))
    shown = ", ".join(
        f"{name} (last heard {max(0.0, (now - last[name]).total_seconds()):.0f} s ago)"
        for name in machines
    )
    return Refusal(
        503,
        "model_not_loaded",
        f"the model `{model}` is served by no machine heard from in the last {stale_s:g} s; "
        f"it was last seen on {shown}",
        details={"machines": machines},
    )


def not_found(model: str, known: Collection[str]) -> Refusal:
    """404 naming the models there are, in the local route's words."""
    names = sorted(known)
    shown = ", ".join(names[:SHOWN]) + (", …" if len(names) > SHOWN else "")
    return Refusal(
        404,
        "model_not_found",
        f"The model `{model}` does not exist or is not served here. Models: {shown or 'none'}",
        param="model",
    )
