"""6. Heartbeat: the largest checkedAt age during a slow build, against the configured interval."""

from __future__ import annotations

import time
from typing import Any

from ..lab import Lab
from ..procfs import percentile
from ..report import Row, ratio, verdict
from ..status import answers, epoch
from .common import HEARTBEAT, Plan, Shared


def heartbeat(lab: Lab, plan: Plan, shared: Shared) -> list[Row]:
    seconds = plan.heartbeat_seconds
    engine = lab.slow(plan.slow_build)
    status = engine.watch()
    generation = engine.request("running")
    status.wait(answers(generation), 30)
    ages: list[float] = []
    writes: set[str] = set()
    building = 0
    tick = started = time.perf_counter()
    doc: dict[str, Any] = {}
    while time.perf_counter() - started < seconds:
        doc = engine.status() or doc
        if doc:
            ages.append(time.time() - epoch(doc["checkedAt"]))
            writes.add(doc["checkedAt"])
            building += "compiling kernels" in str(doc.get("message"))
        tick += 0.1
        time.sleep(max(tick - time.perf_counter(), 0))
    lab.slow_building = doc.get("state") == "starting" and "compiling" in str(doc.get("message"))
    p50, high = percentile(ages, 0.5), max(ages)
    return [
        Row(
            "heartbeat",
            f"status age polled every 100 ms during a {seconds} s slow build",
            "s",
            p50,
            high,
            len(ages),
            f"{HEARTBEAT:g} s (configured heartbeat)",
            f"max {ratio(high, HEARTBEAT)}",
            "never above 20 s",
            verdict(high <= 20),
            f"Build of the recipe image with build arg SLOW={plan.slow_build} (one 'compiling "
            f"kernels' line a second); the worker at its default heartbeat. {len(writes)} "
            f"distinct status writes seen in {seconds} s; {building} of {len(ages)} reads "
            f"showed the build's progress line. Last message: {doc.get('message')!r}.",
            always_max=True,
        )
    ]
