"""2. Ready overhead: request running -> status running, against docker run -> first 200."""

from __future__ import annotations

from ..lab import Lab
from ..report import Row, num, overhead, summary, verdict
from .common import Plan, Shared
from .cycles import measure_cycles


def ready(lab: Lab, plan: Plan, shared: Shared) -> list[Row]:
    c = measure_cycles(lab, plan, shared)
    p50, high = summary(c.ready)
    b50, b_high = summary(c.ready_base)
    extra = p50 - b50
    return [
        Row(
            "ready",
            "request running -> status running (images built, READY_DELAY=0)",
            "ms",
            p50,
            high,
            len(c.ready),
            f"{num(b50, 'ms')} p50 (docker run -> first 200)",
            overhead(p50, b50, "ms"),
            "overhead < 300 ms",
            verdict(extra < 300),
            "Overhead = p50 minus the baseline's p50; ratio of the p50s. Baseline: create+start "
            "of the same grammar image, same network, same gateway-only publish (what "
            "`docker run -d` sends), then GET the ready path every 10 ms; its max "
            f"{num(b_high, 'ms')}. Samples alternate with the baseline's, one each per cycle.",
        )
    ]
