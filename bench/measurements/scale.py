"""8. Scale: acknowledgement and RSS with many workers, one request at a time and all at once.

Baseline: one worker.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

import docker.errors

from ..engine import Engine
from ..lab import Lab
from ..procfs import cpu_seconds, pss_mb, rss_mb
from ..report import Row, num, ratio, summary, verdict
from ..status import StatusWatch, Timeout, answers
from .ack import ack_sample
from .common import MS, Plan, Shared


def _all_running(engines: list[Engine], generations: dict[str, int], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    pending = {e.name: e for e in engines}
    while pending:
        for name, engine in list(pending.items()):
            doc = engine.status()
            if doc and answers(generations[name], "running", "failed")(doc):
                if doc["state"] == "failed":
                    raise RuntimeError(f"{name} failed: {doc['message']}")
                del pending[name]
        if time.monotonic() > deadline:
            first = next(iter(pending.values()))
            raise Timeout(f"{len(pending)} engines not running; {first.name}: {first.log_tail()}")
        time.sleep(0.05)


def _burst(engines: list[Engine], watches: dict[str, StatusWatch]) -> list[float]:
    """Request all engines at once; each one's request -> acknowledgement.

    A poller thread watches every requested engine's status.json (1 ms) while the requests are
    still being written, so that an early worker's answer is not seen only after the last write.
    """
    before: dict[str, int] = {}
    for engine in engines:
        status = watches[engine.name]
        status.poll()
        before[engine.name] = int((status.doc or {}).get("generation", 0))
    started: dict[str, float] = {}
    acked: dict[str, float] = {}
    give_up = threading.Event()

    def poll() -> None:
        while len(acked) < len(engines) and not give_up.is_set():
            for name in list(started):
                status = watches[name]
                if (
                    name not in acked
                    and status.poll()
                    and int((status.doc or {}).get("generation", 0)) > before[name]
                ):
                    acked[name] = time.perf_counter()
            time.sleep(0.001)

    poller = threading.Thread(target=poll, name="burst-poller", daemon=True)
    poller.start()
    generations: dict[str, int] = {}
    for engine in engines:
        started[engine.name] = time.perf_counter()
        generations[engine.name] = engine.request("running")
    poller.join(30)
    give_up.set()
    if len(acked) < len(engines):
        raise Timeout(f"not acknowledged: {sorted(set(started) - set(acked))}")
    _all_running(engines, generations, 60)
    return [(acked[name] - started[name]) * MS for name in started]


def _stop_all(lab: Lab, engines: list[Engine]) -> None:
    for engine in engines:
        if engine.proc is not None and engine.proc.poll() is None:
            engine.proc.send_signal(signal.SIGTERM)
    for engine in engines:
        if engine.proc is not None:
            engine.proc.wait(30)
        with contextlib.suppress(docker.errors.NotFound):
            lab.client.api.remove_container(engine.container, force=True)


def scale(lab: Lab, plan: Plan, shared: Shared) -> list[Row]:
    main = lab.main()  # also builds the images all the workers share
    single = shared.ack_p99
    single_note = "from the ack measurement"
    if single is None:
        status = main.watch()
        single = summary([ack_sample(main, status).ack * MS for _ in range(50)])[1]
        single_note = "50 requests to the main engine, measured here"
    count = plan.scale_workers
    engines = [lab.engine(f"s{i:02d}", prepare=False) for i in range(count)]
    try:
        began = time.perf_counter()
        for engine in engines:
            engine.start_worker()
        _all_running(engines, {e.name: e.request("running") for e in engines}, 300)
        startup = time.perf_counter() - began
        watches = {e.name: e.watch() for e in engines}
        pids = [e.proc.pid for e in engines if e.proc is not None]
        sequential = [
            ack_sample(engine, watches[engine.name]).ack * MS
            for _ in range(plan.scale_rounds)
            for engine in engines
        ]
        cpu0 = sum(cpu_seconds(p) for p in pids)
        t0 = time.perf_counter()
        burst = [a for _ in range(plan.burst_rounds) for a in _burst(engines, watches)]
        burst_cpu = sum(cpu_seconds(p) for p in pids) - cpu0
        burst_wall = time.perf_counter() - t0
        time.sleep(2)
        rss = [rss_mb(e.proc.pid) for e in engines if e.proc is not None]
        pss = [pss_mb(e.proc.pid) for e in engines if e.proc is not None]
        cpu0 = sum(cpu_seconds(p) for p in pids)
        t0 = time.perf_counter()
        time.sleep(plan.scale_idle_seconds)
        cpu = (sum(cpu_seconds(p) for p in pids) - cpu0) / (time.perf_counter() - t0) * 100
    finally:
        _stop_all(lab, engines)
    s50, s99 = summary(sequential)
    u50, u99 = summary(burst)
    total = sum(rss)
    base_rss = (
        f"{count} x {num(shared.idle_base_rss, 'MB')} (the idle baseline python) = "
        f"{num(count * shared.idle_base_rss, 'MB')}"
        if shared.idle_base_rss
        else "-"
    )
    return [
        Row(
            "scale",
            f"ack with {count} workers, one request at a time ({plan.scale_rounds} each)",
            "ms",
            s50,
            s99,
            len(sequential),
            f"{num(single, 'ms')} p99 with 1 worker",
            "p99 " + ratio(s99, single),
            "p99 < 5 ms",
            verdict(s99 < 5),
            f"{count} workers (own engine, port, data and state directories; one shared image), "
            f"started and running in {startup:.1f} s. Baseline p99 {single_note}.",
        ),
        Row(
            "scale",
            f"ack with all {count} requested at once ({plan.burst_rounds} bursts)",
            "ms",
            u50,
            u99,
            len(burst),
            f"{num(single, 'ms')} p99 with 1 worker",
            "p99 " + ratio(u99, single),
            "p99 < 20 ms",
            verdict(u99 < 20),
            "Each worker's time counts from the start of its own request write; the writes "
            "follow each other as fast as host.request() goes, while a poller thread watches "
            "every status.json at 1 ms. The workers used "
            f"{num(burst_cpu / len(burst) * MS, 'ms')} of CPU per request, "
            f"{num(burst_cpu / burst_wall * 100, '%')} of one core over the bursts "
            f"(this machine has {os.cpu_count()} cores).",
        ),
        Row(
            "scale",
            f"total RSS of {count} idle workers (sum of VmRSS)",
            "MB",
            total,
            max(rss),
            count,
            base_rss,
            ratio(total, count * shared.idle_base_rss) if shared.idle_base_rss else "-",
            note=f"p50 column: the total; p99/max column: the largest worker. These workers "
            "built nothing (the image was built once, by the main engine's worker). Total PSS "
            f"(shared pages split) {num(sum(pss), 'MB')}. The {count} workers together used "
            f"{num(cpu, '%')} of one core while idle over {plan.scale_idle_seconds:.0f} s.",
        ),
    ]
