"""The GPU boundary: what nvidia-smi says about the host's NVIDIA GPUs and driver.

Two reads, both plain text: the per-GPU query (`--query-gpu=...`, CSV with its header, so each
column is found by its name and not by its position) and the CUDA version the driver supports,
which only the human-readable outputs carry: the banner of plain `nvidia-smi`
(`Driver Version: 580.95.05      CUDA Version: 13.0`; R610 drivers print
`KMD Version: ...  CUDA UMD Version: 13.3`) or the `CUDA Version : 12.2` line of `nvidia-smi -q`.

The parsers are pure (text in, frozen values out, `GpuParseError` for text they cannot read);
`probe()` runs nvidia-smi through an injectable runner with a timeout and never raises for a
host without an NVIDIA driver: it answers `GpuUnavailable` with the reason.
"""

from __future__ import annotations

import csv
import io
import re
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final, Literal

QUERY_FIELDS: Final = ("name", "compute_cap", "memory.total", "memory.free", "driver_version")
QUERY: Final = ("nvidia-smi", f"--query-gpu={','.join(QUERY_FIELDS)}", "--format=csv,nounits")
BANNER: Final = ("nvidia-smi",)
MEMORY: Final = (
    "nvidia-smi",
    "--query-gpu=memory.total,memory.free",
    "--format=csv,noheader,nounits",
)
MIB: Final = 1024 * 1024
TIMEOUT: Final = 10.0

# nvidia-smi prints these for a value the device cannot report (GB10's unified memory: "[N/A]";
# older drivers: "[Not Supported]")
_UNREPORTED: Final = frozenset({"[n/a]", "n/a", "[not supported]", "not supported", ""})
_CAPABILITY = re.compile(r"(\d{1,2})\.(\d{1,2})")
_CUDA = re.compile(r"CUDA (?:UMD )?Version\s*:\s*(?:(\d{1,3})\.(\d{1,3})|(Not Found|N/A))")
_HEADER_UNIT = re.compile(r"\s*\[[^\]]*\]\s*$")  # "memory.total [MiB]" -> "memory.total"


class GpuParseError(ValueError):
    """nvidia-smi output this module cannot read; str() says what and where."""


@dataclass(frozen=True)
class CudaVersion:
    major: int
    minor: int

    def __str__(self) -> str:
        return f"{self.major}.{self.minor}"


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    compute_capability: tuple[int, int]
    memory_total_mib: int | None  # None: not reported (unified memory, e.g. GB10)
    memory_free_mib: int | None
    driver_version: str | None

    @property
    def capability(self) -> str:
        return f"{self.compute_capability[0]}.{self.compute_capability[1]}"


@dataclass(frozen=True)
class GpuFacts:
    gpus: tuple[Gpu, ...]
    cuda: CudaVersion | None  # None: the driver reports no CUDA version ("Not Found")

    @property
    def driver_version(self) -> str | None:
        return next((gpu.driver_version for gpu in self.gpus if gpu.driver_version), None)


@dataclass(frozen=True)
class GpuUnavailable:
    """No facts: why nvidia-smi could not tell (one line, for a status message)."""

    kind: Literal["absent", "failed", "timeout", "unparseable"]
    reason: str


def _clip(text: str, limit: int = 120) -> str:
    line = " ".join(text.split())
    return line[:limit] + ("…" if len(line) > limit else "")


def _mib(value: str, field: str, row: int) -> int | None:
    text = value.strip()
    if text.lower() in _UNREPORTED:
        return None
    text = text.removesuffix("MiB").strip()
    if not text.isdigit():
        raise GpuParseError(f"GPU {row}: {field} is {_clip(value, 40)!r}, not a number of MiB")
    return int(text)


def parse_query(text: str) -> tuple[Gpu, ...]:
    """Rows of `nvidia-smi --query-gpu=... --format=csv[,nounits]` (with its header line).

    `name` and `compute_cap` must be columns; memory and driver columns may be absent or
    unreported (then None). An output without a GPU row is an error: there is no GPU to use.
    """
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        raise GpuParseError("nvidia-smi printed nothing")
    rows = list(csv.reader(io.StringIO("\n".join(lines)), skipinitialspace=True))
    header = [_HEADER_UNIT.sub("", cell).strip().lower() for cell in rows[0]]
    for needed in ("name", "compute_cap"):
        if needed not in header:
            raise GpuParseError(f"no {needed!r} column in the header {_clip(lines[0], 80)!r}")
    if len(rows) < 2:
        raise GpuParseError("nvidia-smi listed no GPU")
    gpus = []
    for number, row in enumerate(rows[1:]):
        if len(row) != len(header):
            raise GpuParseError(
                f"GPU {number}: {len(row)} columns where the header has {len(header)}: "
                f"{_clip(','.join(row), 80)!r}"
            )
        cells = dict(zip(header, (cell.strip() for cell in row), strict=True))
        match = _CAPABILITY.fullmatch(cells["compute_cap"])
        if not match:
            raise GpuParseError(
                f"GPU {number}: compute_cap is {_clip(cells['compute_cap'], 40)!r}, not major.minor"
            )
        if not cells["name"]:
            raise GpuParseError(f"GPU {number}: empty name")
        driver = cells.get("driver_version", "")
        gpus.append(
            Gpu(
                index=int(cells["index"]) if cells.get("index", "").isdigit() else number,
                name=cells["name"],
                compute_capability=(int(match.group(1)), int(match.group(2))),
                memory_total_mib=_mib(cells.get("memory.total", ""), "memory.total", number),
                memory_free_mib=_mib(cells.get("memory.free", ""), "memory.free", number),
                driver_version=None if driver.lower() in _UNREPORTED else driver,
            )
        )
    return tuple(gpus)


def parse_cuda_version(text: str) -> CudaVersion | None:
    """The driver's CUDA version from plain `nvidia-smi` or `nvidia-smi -q`.

    None when the driver says it has none ("Not Found"); an error when the text has no CUDA
    version line at all (not nvidia-smi output, or a format this module does not know).
    """
    match = _CUDA.search(text)
    if not match:
        first = text.strip().splitlines()[0] if text.strip() else ""
        raise GpuParseError(f"no 'CUDA Version' in the nvidia-smi output ({_clip(first, 80)!r})")
    if match.group(3):
        return None
    return CudaVersion(int(match.group(1)), int(match.group(2)))


def parse(query: str, banner: str) -> GpuFacts:
    return GpuFacts(gpus=parse_query(query), cuda=parse_cuda_version(banner))


@dataclass(frozen=True)
class Completed:
    returncode: int
    stdout: str
    stderr: str


Runner = Callable[[Sequence[str], float], Completed]


def run_command(command: Sequence[str], timeout: float) -> Completed:
    """The real runner: no shell, bounded time, text out. Raises FileNotFoundError and
    subprocess.TimeoutExpired, which probe() turns into GpuUnavailable."""
    done = subprocess.run(
        list(command),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        errors="replace",
    )
    return Completed(done.returncode, done.stdout, done.stderr)


def with_program(nvidia_smi: str, run: Runner = run_command) -> Runner:
    """A runner that runs nvidia_smi (a path where it is not on PATH) for "nvidia-smi"."""

    def program(command: Sequence[str], timeout: float) -> Completed:
        return run((nvidia_smi, *command[1:]), timeout)

    return program


def parse_memory(text: str) -> tuple[int, int]:
    """(total, free) bytes summed over the lines `total, free` (MiB) of MEMORY's output."""
    total = free = 0
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        raise GpuParseError("nvidia-smi listed no GPU")
    for line in lines:
        cells = [cell.strip() for cell in line.split(",")]
        if len(cells) != 2 or not all(cell.isdigit() for cell in cells):
            raise GpuParseError(f"nvidia-smi: cannot read memory from {line.strip()!r}")
        total += int(cells[0]) * MIB
        free += int(cells[1]) * MIB
    return total, free


def memory(run: Runner = run_command, timeout: float = TIMEOUT) -> tuple[int, int] | GpuUnavailable:
    """The GPUs' memory, (total, free) bytes, for the memory plan; GpuUnavailable says why not."""
    outputs = _outputs((MEMORY,), run, timeout)
    if isinstance(outputs, GpuUnavailable):
        return outputs
    try:
        return parse_memory(outputs[0])
    except GpuParseError as exc:
        return GpuUnavailable("unparseable", str(exc))


def probe(run: Runner = run_command, timeout: float = TIMEOUT) -> GpuFacts | GpuUnavailable:
    outputs = _outputs((QUERY, BANNER), run, timeout)
    if isinstance(outputs, GpuUnavailable):
        return outputs
    try:
        return parse(outputs[0], outputs[1])
    except GpuParseError as exc:
        return GpuUnavailable("unparseable", f"nvidia-smi output not understood: {exc}")


def _outputs(
    commands: Sequence[Sequence[str]], run: Runner, timeout: float
) -> list[str] | GpuUnavailable:
    """Each command's output, or why nvidia-smi could not tell (never raises)."""
    outputs = []
    for command in commands:
        try:
            done = run(command, timeout)
        except FileNotFoundError:
            return GpuUnavailable(
                "absent", "no NVIDIA GPU/driver: nvidia-smi is not installed on this host"
            )
        except subprocess.TimeoutExpired:
            return GpuUnavailable("timeout", f"nvidia-smi did not answer within {timeout:g} s")
        except OSError as exc:
            return GpuUnavailable("failed", f"nvidia-smi could not run: {_clip(str(exc))}")
        if done.returncode != 0:
            said = (done.stdout.strip() or done.stderr.strip() or "no output").splitlines()[0]
            return GpuUnavailable(
                "failed",
                f"no NVIDIA GPU/driver: nvidia-smi exited with {done.returncode}: {_clip(said)}",
            )
        outputs.append(done.stdout)
    return outputs
