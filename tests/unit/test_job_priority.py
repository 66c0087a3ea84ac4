"""Jobs yield the CPU to the loop: a job thread's nice value is raised, the loop's is not."""

from __future__ import annotations

import os
import threading

from supervisor.worker import jobs


def test_a_job_thread_runs_below_the_loop() -> None:
    seen: list[int] = []

    def job() -> None:
        jobs._yield_cpu()
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))

    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    thread = threading.Thread(target=job)
    thread.start()
    thread.join()
    assert seen == [min(before + jobs.JOB_NICE, 19)]
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before
