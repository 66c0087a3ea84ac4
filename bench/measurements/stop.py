"""3. Stop latency: request stopped -> container gone, and -> status stopped (vs docker stop+rm)."""

from __future__ import annotations

from ..lab import Lab
from ..report import Row, num, overhead, summary
from .common import Plan, Shared
from .cycles import measure_cycles


def stop(lab: Lab, plan: Plan, shared: Shared) -> list[Row]:
    c = measure_cycles(lab, plan, shared)
    p50, high = summary(c.gone)
    b50, b_high = summary(c.stop_base)
    s50, s_high = summary(c.stopped)
    return [
        Row(
            "stop",
            "request stopped -> container gone (inspect NotFound)",
            "ms",
            p50,
            high,
            len(c.gone),
            f"{num(b50, 'ms')} p50 (docker stop + docker rm)",
            overhead(p50, b50, "ms"),
            note="Container polled with docker inspect every ~2 ms. Baseline: stop (60 s grace, "
            "the engine exits on SIGTERM) and rm of an equivalent container, same poll; its "
            f"max {num(b_high, 'ms')}.",
        ),
        Row(
            "stop",
            "request stopped -> status stopped",
            "ms",
            s50,
            s_high,
            len(c.stopped),
            f"{num(b50, 'ms')} p50 (docker stop + docker rm)",
            overhead(s50, b50, "ms"),
        ),
    ]
