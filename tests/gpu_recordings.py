"""A test nvidia-smi: a script printing a recorded card's outputs, for the recipe's
`vllm.nvidia_smi`. The worker runs it exactly as it runs the real one (gpu.probe's runner).

Plain `nvidia-smi` prints the recorded banner of tests/data/nvidia-smi/ as it is. The
`--query-gpu` CSV is not recorded for these cards (see that README), so it is derived from the
same banner: each GPU row's name, used and total memory, and the driver version; the compute
capability is the card's published one (the README's table), given here as an input.
"""

from __future__ import annotations

import re
from pathlib import Path

RECORDINGS = Path(__file__).resolve().parent / "data" / "nvidia-smi"
_GPU_ROW = re.compile(r"^\|\s+(\d+)\s+(.+?)\s+(?:On|Off)\s+\|")
_MEMORY = re.compile(r"(\d+)MiB\s*/\s*(\d+)MiB")
_DRIVER = re.compile(r"(?:Driver|KMD) Version:\s*([\d.]+)")

# recording -> the card's compute capability
CARDS = {
    "h100": ("h100-570.148.08-cuda12.8.txt", "9.0"),  # CUDA 12.8: passes stable (cu129)
    "a100": ("a100-40gb-580.126.09-cuda13.0.txt", "8.0"),  # CUDA 13.0, below fp8's 8.9
    "b200": ("b200-610.43.02-cuda13.3.txt", "10.0"),  # CUDA 13.3: nightly runs
    "l4": ("l4-570.133.20-cuda12.8.txt", "8.9"),
}


def query_csv(banner: str, capability: str) -> str:
    """`--query-gpu=name,compute_cap,memory.total,memory.free,driver_version
    --format=csv,nounits` as that driver would print it for the banner's GPUs."""
    driver = _DRIVER.search(banner)
    lines = banner.splitlines()
    rows = ["name, compute_cap, memory.total [MiB], memory.free [MiB], driver_version"]
    for number, line in enumerate(lines):
        found = _GPU_ROW.match(line)
        if not found:
            continue
        memory = _MEMORY.search(lines[number + 1])
        assert memory and driver, f"no memory or driver next to {line!r}"
        used, total = int(memory.group(1)), int(memory.group(2))
        rows.append(f"{found.group(2)}, {capability}, {total}, {total - used}, {driver.group(1)}")
    assert len(rows) > 1, "no GPU row in the banner"
    return "\n".join(rows) + "\n"


def memory_csv(query: str) -> str:
    """`--query-gpu=memory.total,memory.free --format=csv,noheader,nounits` from query_csv's."""
    rows = [line.split(", ") for line in query.splitlines()[1:]]
    return "".join(f"{row[2]}, {row[3]}\n" for row in rows)


def fake_nvidia_smi(directory: Path, card: str) -> Path:
    """An executable nvidia-smi printing `card`'s recorded outputs; returns its path."""
    recording, capability = CARDS[card]
    banner = RECORDINGS / recording
    directory.mkdir(parents=True, exist_ok=True)
    query = query_csv(banner.read_text(), capability)
    (directory / f"{card}-query.csv").write_text(query)
    memory = directory / f"{card}-memory.csv"
    memory.write_text(memory_csv(query))
    script = directory / f"nvidia-smi-{card}"
    script.write_text(
        "#!/bin/sh\n"
        'case "$1" in\n'
        # the memory plan's query (hw.gpu.MEMORY): total and free, no header
        f'    --query-gpu=memory.total,memory.free) exec cat "{memory}" ;;\n'
        f'    --query-gpu=*) exec cat "{directory / f"{card}-query.csv"}" ;;\n'
        f'    "") exec cat "{banner}" ;;\n'
        '    *) echo "unexpected arguments: $*" >&2; exit 9 ;;\n'
        "esac\n"
    )
    script.chmod(0o755)
    return script
