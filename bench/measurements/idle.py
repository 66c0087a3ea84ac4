"""5. Idle footprint: the worker's RSS and CPU while its engine runs.

Baseline: a sleeping python with the same imports.
"""

from __future__ import annotations

import subprocess
import time

from ..engine import PYTHON
from ..lab import Lab
from ..procfs import CLK_TCK, cpu_seconds, percentile, processes, pss_mb, rss_mb, tree, wakeups
from ..report import Row, num, overhead, ratio, summary, verdict
from ..status import epoch
from .common import HEARTBEAT, Plan, Shared

IDLE_BASELINE = (
    "import docker, pydantic, inotify_simple, structlog, prometheus_client, time\n"
    "print('ready', flush=True)\n"
    "time.sleep(3600)\n"
)


def idle(lab: Lab, plan: Plan, shared: Shared) -> list[Row]:
    engine = lab.main()
    assert engine.proc is not None
    pid = engine.proc.pid
    base = lab.spawn([PYTHON, "-c", IDLE_BASELINE], stdout=subprocess.PIPE)
    assert base.stdout is not None
    base.stdout.readline()  # its imports are done
    time.sleep(1)
    window = plan.idle_seconds
    cpu_w, cpu_b = cpu_seconds(pid), cpu_seconds(base.pid)
    wake_w, wake_b = wakeups(pid), wakeups(base.pid)
    started = time.perf_counter()
    rss_w: list[float] = []
    rss_b: list[float] = []
    ages: list[float] = []
    next_rss = started
    while (now := time.perf_counter()) - started < window:
        if now >= next_rss:
            rss_w.append(rss_mb(pid))
            rss_b.append(rss_mb(base.pid))
            next_rss += 1.0
        doc = engine.status()
        if doc is not None:
            ages.append(time.time() - epoch(doc["checkedAt"]))
        time.sleep(0.1)
    elapsed = time.perf_counter() - started
    cpu_w = (cpu_seconds(pid) - cpu_w) / elapsed * 100
    cpu_b = (cpu_seconds(base.pid) - cpu_b) / elapsed * 100
    wake_w = (wakeups(pid) - wake_w) / elapsed
    wake_b = (wakeups(base.pid) - wake_b) / elapsed
    pss_w, pss_b = pss_mb(pid), pss_mb(base.pid)
    names = [
        f"`{name}` {num(rss_mb(p, children=False), 'MB')}"
        for p, name in zip(tree(pid), processes(pid), strict=False)
    ]
    base.kill()
    base.wait()
    w50, w_max = summary(rss_w)
    b50, _ = summary(rss_b)
    shared.idle_rss = w50
    shared.idle_base_rss = b50
    a50, a_max = percentile(ages, 0.5), max(ages)
    return [
        Row(
            "idle",
            "worker RSS, engine running (VmRSS, incl. children)",
            "MB",
            w50,
            w_max,
            len(rss_w),
            f"{num(b50, 'MB')} p50 (python importing the same modules, asleep)",
            overhead(w50, b50, "MB"),
            "RSS < 60 MB",
            verdict(w_max < 60),
            f"Sampled every 1 s over {window:.0f} s from /proc/PID/status. Processes: "
            f"{'; '.join(names)}. PSS (shared pages split): worker {num(pss_w, 'MB')}, "
            f"baseline {num(pss_b, 'MB')}. 1 MB = 10^6 bytes.",
        ),
        Row(
            "idle",
            f"worker CPU over {window:.0f} s, % of one core",
            "%",
            cpu_w,
            None,
            1,
            f"{num(cpu_b, '%')} (the same sleeping python)",
            f"{'+' if cpu_w >= cpu_b else ''}{num(cpu_w - cpu_b, '%')}",
            "CPU < 0.5 %",
            verdict(cpu_w < 0.5),
            "utime+stime deltas from /proc/PID/stat (children included), over the window's "
            f"wall time; clock tick {1 / CLK_TCK:.2f} s.",
        ),
        Row(
            "idle",
            f"worker wake-ups a second over {window:.0f} s",
            "/s",
            wake_w,
            None,
            1,
            f"{wake_b:.2f}/s (the same sleeping python)",
            f"+{wake_w - wake_b:.2f}/s",
            "",
            "",
            "Context switches of all the worker's threads (voluntary and not, from "
            "/proc/PID/task/*/status) over the window's wall time: its heartbeat, its safety "
            "net's look at desired.json, and its own status writes' events, nothing else.",
        ),
        Row(
            "idle",
            "status age polled every 100 ms while settled (running)",
            "s",
            a50,
            a_max,
            len(ages),
            f"{HEARTBEAT:g} s (heartbeat interval)",
            f"max {ratio(a_max, HEARTBEAT)}",
            "never above 20 s",
            verdict(a_max <= 20),
            always_max=True,
        ),
    ]
