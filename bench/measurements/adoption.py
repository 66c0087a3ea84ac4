"""4. Adoption: a restarted worker's status is current again, with no container restart.

Baseline: the import of the worker.
"""

from __future__ import annotations

import subprocess
import time
from typing import Any

from ..engine import PYTHON
from ..lab import Lab
from ..procfs import rss_mb
from ..report import Row, num, overhead, summary, verdict
from ..status import epoch, floor_ms
from .common import MS, Plan, Shared


def adoption(lab: Lab, plan: Plan, shared: Shared) -> list[Row]:
    engine = lab.main()
    generation = int((engine.status() or {})["generation"])
    api = lab.client.api
    times, shutdowns, base, adopted_rss = [], [], [], []
    restarts = flaps = 0
    for _ in range(plan.adoptions):
        before = api.inspect_container(engine.container)
        shutdowns.append(engine.stop_worker() * MS)
        since = floor_ms(time.time())
        started = time.perf_counter()
        engine.start_worker()
        states: list[str] = []

        def current(doc: dict[str, Any], since: float = since, states: list[str] = states) -> bool:
            if epoch(doc["checkedAt"]) >= since:
                states.append(str(doc.get("state")))
            return (
                doc.get("generation") == generation
                and doc.get("state") == "running"
                and epoch(doc["checkedAt"]) >= since
            )

        _, adopted = engine.watch().wait(current, 60)
        times.append((adopted - started) * MS)
        flaps += any(state != "running" for state in states)
        after = api.inspect_container(engine.container)
        restarts += int(after["Id"] != before["Id"])
        restarts += int(after["State"]["StartedAt"] != before["State"]["StartedAt"])
        restarts += int(after["RestartCount"]) - int(before["RestartCount"])
        time.sleep(1)
        adopted_rss.append(rss_mb(engine.proc.pid) if engine.proc is not None else 0.0)
        began = time.perf_counter()
        subprocess.run([PYTHON, "-c", "import supervisor.worker.loop"], check=True)
        base.append((time.perf_counter() - began) * MS)
    p50, high = summary(times)
    b50, _ = summary(base)
    d50, d_high = summary(shutdowns)
    note = (
        "New worker process started (Popen) -> status.json says the same generation, 'running', "
        "with a checkedAt after the restart. Restarts = changed container id + changed "
        "State.StartedAt + RestartCount increase, summed over all samples. Baseline: wall time "
        "of `python -c 'import supervisor.worker'` (interpreter + imports). The old worker "
        f"exited {num(d50, 'ms')} p50 (max {num(d_high, 'ms')}) after its SIGTERM. RSS of the "
        f"adopted worker (it has built nothing since it started) 1 s after: "
        f"{num(max(adopted_rss), 'MB')} max."
    )
    if flaps:
        note += (
            f" In {flaps} of {len(times)} restarts the status said 'starting' for the running "
            "engine before it said 'running' again (the restart re-acknowledges the request)."
        )
    return [
        Row(
            "adoption",
            f"worker restart -> status current again; container restarts: {restarts}",
            "ms",
            p50,
            high,
            len(times),
            f"{num(b50, 'ms')} p50 (python -c 'import supervisor.worker')",
            overhead(p50, b50, "ms"),
            "< 1 s, 0 restarts",
            verdict(high < 1000 and restarts == 0),
            note,
        )
    ]
