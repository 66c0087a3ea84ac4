"""Page bench: `.venv/bin/python -m bench.page_bench [--polls N] [--minute]`.

What one open operator's page costs the host: the real gateway process (bench.gateway_parts,
one engine whose heartbeat a thread rewrites), signed in as the page signs in, polled at
/page/api/overview as page.js polls it (every 2 s: 30 polls a minute). The gateway's CPU time
(utime+stime from /proc) is read around N polls made back to back, and around as long a
wait with no poll (the idle baseline: its watchdog and idle check). The figure is CPU per poll
above the baseline, times 30: CPU seconds per minute of one open page. With --minute it also
polls every 2 s for one real minute and reports the CPU that minute took against an idle one.

Prints a table; asserts nothing about timings.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import urllib.request
from http.cookiejar import CookieJar
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.gateway_parts import OWNER_KEY, gateway  # noqa: E402
from bench.procfs import cpu_seconds  # noqa: E402

POLL_S = 2.0  # page.js's POLL_MS
PER_MINUTE = 60 / POLL_S


def opener() -> urllib.request.OpenerDirector:
    return urllib.request.build_opener(urllib.request.HTTPCookieProcessor(CookieJar()))


def sign_in(http: urllib.request.OpenerDirector, url: str) -> None:
    request = urllib.request.Request(
        url + "/page/api/signin",
        data=json.dumps({"key": OWNER_KEY}).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with http.open(request, timeout=30) as answer:
        assert answer.status == 200


def poll(http: urllib.request.OpenerDirector, url: str) -> int:
    with http.open(url + "/page/api/overview", timeout=30) as answer:
        return len(answer.read())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--polls", type=int, default=600)
    parser.add_argument("--minute", action="store_true", help="also one real minute at 2 s")
    args = parser.parse_args()
    rows = []
    with gateway("http://127.0.0.1:9", 1, None) as (url, pid):
        http = opener()
        sign_in(http, url)
        size = poll(http, url)
        for _ in range(20):  # warm
            poll(http, url)
        cpu, wall = cpu_seconds(pid), time.monotonic()
        for _ in range(args.polls):
            poll(http, url)
        busy_cpu, busy_wall = cpu_seconds(pid) - cpu, time.monotonic() - wall
        cpu = cpu_seconds(pid)
        time.sleep(busy_wall)
        idle_cpu = cpu_seconds(pid) - cpu
        per_poll_ms = max(0.0, busy_cpu - idle_cpu) / args.polls * 1000
        rows.append(("CPU per poll (ms)", f"{per_poll_ms:.2f}"))
        rows.append(("one open page, CPU s per minute", f"{per_poll_ms * PER_MINUTE / 1000:.3f}"))
        rows.append(("  as a share of one core", f"{per_poll_ms * PER_MINUTE / 60_000:.2%}"))
        rows.append(("overview answer (bytes)", str(size)))
        if args.minute:
            cpu = cpu_seconds(pid)
            start = time.monotonic()
            for index in range(int(PER_MINUTE)):
                poll(http, url)
                time.sleep(max(0.0, start + (index + 1) * POLL_S - time.monotonic()))
            polled = cpu_seconds(pid) - cpu
            cpu = cpu_seconds(pid)
            time.sleep(60)
            idle = cpu_seconds(pid) - cpu
            rows.append(("a real minute polled / idle (CPU s)", f"{polled:.2f} / {idle:.2f}"))
    cpu_name = platform.processor() or platform.machine()
    print(f"page bench: {args.polls} polls back to back; {cpu_name}")
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name.ljust(width)}  {value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
