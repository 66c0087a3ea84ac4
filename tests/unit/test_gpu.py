"""The GPU boundary: nvidia-smi parsing on recorded real outputs, and the probe's failures."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from pathlib import Path

import pytest

from supervisor.hw import gpu
from supervisor.hw.gpu import Completed, CudaVersion, GpuFacts, GpuParseError, GpuUnavailable

DATA = Path(__file__).resolve().parents[1] / "data" / "nvidia-smi"


@pytest.mark.parametrize(
    ("name", "cuda"),
    [
        ("h100-570.148.08-cuda12.8.txt", CudaVersion(12, 8)),
        ("a100-40gb-580.126.09-cuda13.0.txt", CudaVersion(13, 0)),
        ("l4-570.133.20-cuda12.8.txt", CudaVersion(12, 8)),
        ("gb10-580.126.09-cuda13.0.txt", CudaVersion(13, 0)),
        ("gb10-580.95.05-cuda13.0.txt", CudaVersion(13, 0)),
        ("b200-610.43.02-cuda13.3.txt", CudaVersion(13, 3)),  # R610: "CUDA UMD Version"
        ("a800-pcie-550.54.15-cuda12.4.txt", CudaVersion(12, 4)),
        ("a100-80gb-q-470.103.01-cuda11.4.txt", CudaVersion(11, 4)),  # nvidia-smi -q
        ("q-580.105.06-cuda-not-found.txt", None),  # the driver says "Not Found"
    ],
)
def test_the_drivers_cuda_version_from_recorded_outputs(
    name: str, cuda: CudaVersion | None
) -> None:
    assert gpu.parse_cuda_version((DATA / name).read_text()) == cuda


def test_every_recorded_file_is_tested_and_listed_in_the_readme() -> None:
    readme = (DATA / "README.md").read_text()
    files = sorted(p.name for p in DATA.iterdir() if p.name != "README.md")
    assert len(files) == 11
    for name in files:
        assert f"`{name}`" in readme, name


def test_a_real_query_with_columns_in_another_order() -> None:
    gpus = gpu.parse_query((DATA / "query-titanv-rtx5880-570.86.15.csv").read_text())
    assert [(g.index, g.name, g.compute_capability, g.driver_version) for g in gpus] == [
        (0, "NVIDIA TITAN V", (7, 0), "570.86.15"),
        (1, "NVIDIA RTX 5880 Ada Generation", (8, 9), "570.86.15"),
    ]
    assert all(g.memory_total_mib is None and g.memory_free_mib is None for g in gpus)


def test_a_real_query_without_a_name_column_is_refused() -> None:
    with pytest.raises(GpuParseError, match="no 'name' column"):
        gpu.parse_query((DATA / "query-compute-cap-only-570.133.07.csv").read_text())


# The query the probe runs, as nvidia-smi formats it (header with units, nounits values). The
# rows are the recorded cards' values (name, memory total/used from the tables above, the driver
# from their banner) with the compute capabilities from huggingface.js PR #2010.
QUERY_HEADER = "name, compute_cap, memory.total [MiB], memory.free [MiB], driver_version\n"


@pytest.mark.parametrize(
    ("row", "expected"),
    [
        (
            "NVIDIA H100 80GB HBM3, 9.0, 81559, 81559, 570.148.08",
            ("NVIDIA H100 80GB HBM3", (9, 0), 81559, 81559, "570.148.08"),
        ),
        (
            "NVIDIA A100-SXM4-40GB, 8.0, 40960, 40362, 580.126.09",
            ("NVIDIA A100-SXM4-40GB", (8, 0), 40960, 40362, "580.126.09"),
        ),
        (
            "NVIDIA L4, 8.9, 23034, 23034, 570.133.20",
            ("NVIDIA L4", (8, 9), 23034, 23034, "570.133.20"),
        ),
        (
            "NVIDIA GB10, 12.1, [N/A], [N/A], 580.126.09",
            ("NVIDIA GB10", (12, 1), None, None, "580.126.09"),
        ),
        (
            "NVIDIA GB10, 12.1, [Not Supported], [Not Supported], 580.95.05",
            ("NVIDIA GB10", (12, 1), None, None, "580.95.05"),
        ),
        (
            "NVIDIA B200, 10.0, 183359 MiB, 183359 MiB, 610.43.02",
            ("NVIDIA B200", (10, 0), 183359, 183359, "610.43.02"),
        ),
    ],
)
def test_query_rows(row: str, expected: tuple[object, ...]) -> None:
    (one,) = gpu.parse_query(QUERY_HEADER + row + "\n")
    assert (
        one.name,
        one.compute_capability,
        one.memory_total_mib,
        one.memory_free_mib,
        one.driver_version,
    ) == expected


BAD_QUERY = [
    ("empty", "", "printed nothing"),
    ("header only", QUERY_HEADER, "listed no GPU"),
    ("no compute_cap column", "name, memory.total [MiB]\nNVIDIA L4, 23034\n", "compute_cap"),
    ("capability not a number", QUERY_HEADER + "NVIDIA L4, [N/A], 1, 1, 570\n", "not major.minor"),
    ("memory not a number", QUERY_HEADER + "NVIDIA L4, 8.9, lots, 1, 570\n", "memory.total"),
    ("short row", QUERY_HEADER + "NVIDIA L4, 8.9\n", "2 columns"),
    ("an error message instead", "No devices were found\n", "no 'name' column"),
]


@pytest.mark.parametrize(
    ("text", "needle"), [b[1:] for b in BAD_QUERY], ids=[b[0] for b in BAD_QUERY]
)
def test_unparseable_queries_say_why(text: str, needle: str) -> None:
    with pytest.raises(GpuParseError, match=needle):
        gpu.parse_query(text)


def test_text_without_a_cuda_line_is_refused() -> None:
    with pytest.raises(GpuParseError, match="no 'CUDA Version'"):
        gpu.parse_cuda_version("NVIDIA-SMI 396.24                 Driver Version: 396.24\n")


class Script:
    """A runner answering each nvidia-smi command with a recorded output or a failure."""

    def __init__(self, query: str | BaseException | Completed, banner: str) -> None:
        self.query, self.banner = query, banner
        self.calls: list[tuple[tuple[str, ...], float]] = []

    def __call__(self, command: Sequence[str], timeout: float) -> Completed:
        self.calls.append((tuple(command), timeout))
        answer = self.query if tuple(command) == gpu.QUERY else self.banner
        if isinstance(answer, BaseException):
            raise answer
        if isinstance(answer, Completed):
            return answer
        return Completed(0, answer, "")


L4_QUERY = QUERY_HEADER + "NVIDIA L4, 8.9, 23034, 23034, 570.133.20\n"


def test_probe_reads_both_outputs_with_the_timeout() -> None:
    run = Script(L4_QUERY, (DATA / "l4-570.133.20-cuda12.8.txt").read_text())
    facts = gpu.probe(run, timeout=3)
    assert isinstance(facts, GpuFacts)
    assert facts.cuda == CudaVersion(12, 8) and facts.driver_version == "570.133.20"
    assert [g.name for g in facts.gpus] == ["NVIDIA L4"]
    assert run.calls == [(gpu.QUERY, 3), (gpu.BANNER, 3)]
    assert gpu.QUERY[1] == "--query-gpu=name,compute_cap,memory.total,memory.free,driver_version"


@pytest.mark.parametrize(
    ("query", "kind", "needle"),
    [
        (FileNotFoundError(2, "No such file"), "absent", "no NVIDIA GPU/driver"),
        (subprocess.TimeoutExpired("nvidia-smi", 3), "timeout", "within 3 s"),
        (PermissionError(13, "Permission denied"), "failed", "could not run"),
        (
            Completed(
                9,
                "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA "
                "driver. Make sure that the latest NVIDIA driver is installed and running.\n",
                "",
            ),
            "failed",
            "exited with 9: NVIDIA-SMI has failed",
        ),
        (
            Completed(2, "", 'Field "compute_cap" is not a valid field to query.\n'),
            "failed",
            "compute_cap",
        ),
        ("garbage\n", "unparseable", "not understood"),
    ],
)
def test_probe_failures_are_results_not_crashes(
    query: BaseException | Completed | str, kind: str, needle: str
) -> None:
    result = gpu.probe(Script(query, "CUDA Version: 12.8"), timeout=3)
    assert isinstance(result, GpuUnavailable)
    assert result.kind == kind
    assert needle in result.reason
    assert "\n" not in result.reason


def test_the_real_runner_on_a_host_without_nvidia_smi(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    result = gpu.probe()
    assert result == GpuUnavailable(
        "absent", "no NVIDIA GPU/driver: nvidia-smi is not installed on this host"
    )


def test_the_real_runner_kills_a_hung_nvidia_smi(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\nexec sleep 30\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    result = gpu.probe(timeout=0.5)
    assert isinstance(result, GpuUnavailable) and result.kind == "timeout"
