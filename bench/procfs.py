"""Process figures from /proc, the machine the bench ran on, and percentiles.

The figures: RSS, PSS and CPU ticks of a process and its children.
"""

from __future__ import annotations

import hashlib
import os
import platform
import subprocess
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

CLK_TCK = os.sysconf("SC_CLK_TCK")


def _stat_fields(pid: int) -> list[str]:
    """/proc/PID/stat after the command name (which may hold spaces): field 3 onwards."""
    text = Path(f"/proc/{pid}/stat").read_text()
    return text[text.rindex(")") + 2 :].split()


def tree(pid: int) -> list[int]:
    """pid and all its live descendants."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            ppid = int(_stat_fields(int(entry))[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        todo.extend(children.get(current, []))
    return found


def _status_kb(pid: int, key: str, file: str = "status") -> int:
    try:
        for line in Path(f"/proc/{pid}/{file}").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


def rss_mb(pid: int, children: bool = True) -> float:
    """VmRSS of pid (and its descendants), in MB (10^6 bytes)."""
    pids = tree(pid) if children else [pid]
    return sum(_status_kb(p, "VmRSS") for p in pids) * 1024 / 1e6


def pss_mb(pid: int) -> float:
    """Proportional set size of pid and its descendants (shared pages split), in MB."""
    return sum(_status_kb(p, "Pss", "smaps_rollup") for p in tree(pid)) * 1024 / 1e6


def cpu_seconds(pid: int) -> float:
    """utime+stime of pid and its live descendants, plus the reaped children pid waited for."""
    ticks = 0
    for index, p in enumerate(tree(pid)):
        try:
            fields = _stat_fields(p)
        except OSError:
            continue
        ticks += int(fields[11]) + int(fields[12])  # utime, stime
        if index == 0:
            ticks += int(fields[13]) + int(fields[14])  # cutime, cstime
    return ticks / CLK_TCK


def wakeups(pid: int) -> int:
    """Context switches of every thread of pid (voluntary and not): each is the thread put to
    sleep or taken off the CPU, so their count is the process's wake-ups."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            text = (task / "status").read_text()
        except FileNotFoundError:  # a thread that ended
            continue
        for line in text.splitlines():
            if "ctxt_switches:" in line:
                total += int(line.split()[1])
    return total


def processes(pid: int) -> list[str]:
    """The command line of pid and of each descendant (in tree() order), shortened."""
    names = []
    for p in tree(pid):
        try:
            argv = Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")
        except OSError:
            names.append("?")
            continue
        text = " ".join(a.decode(errors="replace") for a in argv if a)
        names.append(text if len(text) <= 70 else text[:67] + "...")
    return names


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    low = int(k)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (k - low)


def machine(client: Any) -> dict[str, str]:
    model = "unknown"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            model = line.split(":", 1)[1].strip()
            break
    mem_kb = next(
        int(line.split()[1])
        for line in Path("/proc/meminfo").read_text().splitlines()
        if line.startswith("MemTotal:")
    )
    version = client.version()
    return {
        "CPU": model,
        "cores": str(os.cpu_count()),
        "memory": f"{mem_kb / 1024 / 1024:.1f} GiB",
        "kernel": f"{platform.system()} {platform.release()}",
        "docker": f"server {version.get('Version')} (API {version.get('ApiVersion')}), "
        f"storage {client.info().get('Driver')}",
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S UTC"),
    }


def _git(root: Path, *args: str) -> str:
    try:
        out = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=False)
    except OSError:
        return ""
    return out.stdout.strip()


def supervisor_digest(root: Path) -> str:
    """A hash of supervisor/*.py as it is on disk (others may edit it during a run)."""
    digest = hashlib.sha256()
    for path in sorted((root / "supervisor").rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]


def code_version(root: Path) -> str:
    """The commit, whether supervisor/ differs from it, and the hash of supervisor/."""
    head = _git(root, "rev-parse", "--short", "HEAD") or "unknown"
    dirty = _git(root, "status", "--porcelain", "supervisor")
    state = "with uncommitted changes in supervisor/" if dirty else "supervisor/ as committed"
    return (
        f"commit {head or 'unknown'}, {state} (sha256 of supervisor/*.py {supervisor_digest(root)})"
    )


def loadavg() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f} {five:.2f} {fifteen:.2f}"


def dockerd() -> tuple[int, int] | None:
    """(pid, start time in clock ticks since boot) of the running dockerd, to notice a restart."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if Path(f"/proc/{entry}/comm").read_text().strip() == "dockerd":
                return int(entry), int(_stat_fields(int(entry))[19])
        except (OSError, ValueError, IndexError):
            continue
    return None
