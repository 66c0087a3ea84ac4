"""Download benchmark: `.venv/bin/python bench/download_bench.py [--mib N] [--runs N] [--models N]`.

Throughput of the model library's download (supervisor.host.models: the hub's API, the hf child
under the token rules, progress polled from disk, then every file's SHA-256 and the GGUF header
checks, to Ready) against `hf download` alone with the same arguments, from the tests' hub
(tests/hub_standin.py) on 127.0.0.1, in the same run; the two alternate, --runs times each, into
fresh directories. Then the startup re-inspection (supervisor.host.models.runner.recover) of
--models Ready GGUF models, each with a 32,000-token vocabulary in its header: headers only, warm
page cache. Prints a table; asserts nothing. The issue's goal: at least 0.9x the throughput.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import gguf  # noqa: E402
import numpy as np  # noqa: E402

from supervisor.host.models import fetch  # noqa: E402
from supervisor.host.models import manifest as mf  # noqa: E402
from supervisor.host.models.control import add  # noqa: E402
from supervisor.host.models.hub import Hub as HubClient  # noqa: E402
from supervisor.host.models.job import Job, QueueSettings, download  # noqa: E402
from supervisor.host.models.runner import Runner  # noqa: E402
from supervisor.host.models.verify import check_file, inspect  # noqa: E402

REPO = "bench/big-GGUF"
COMMIT = "b" * 40
NAME = "big-Q4_K_M.gguf"
VOCAB = 32_000


def write_model(path: Path, tensor_bytes: int, vocab: int = 0) -> None:
    """A real GGUF: llama, context 4096, a vocabulary of vocab tokens, one tensor."""
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_context_length(4096)
    if vocab:
        writer.add_token_list([f"tok{i}" for i in range(vocab)])
    writer.add_tensor("weight", np.zeros(tensor_bytes // 4, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=False)
    writer.close()


HUB_SCRIPT = f"""
import sys, threading
sys.path.insert(0, {str(ROOT)!r})
from pathlib import Path
from tests.hub_standin import Hub
with Hub({REPO!r}, {COMMIT!r}, Path(sys.argv[1]), "127.0.0.1") as hub:
    hub.files()
    print(hub.url, flush=True)
    sys.stdin.read()
"""


def hub_process(repo: Path) -> tuple[subprocess.Popen[str], str]:
    """The tests' hub in a process of its own, so that it shares no interpreter with either
    side; its URL once it has read and hashed the repo."""
    process = subprocess.Popen(
        [sys.executable, "-c", HUB_SCRIPT, str(repo)],
        text=True,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    assert process.stdout is not None
    return process, process.stdout.readline().strip()


def hf_alone(url: str, out: Path) -> float:
    env = fetch.child_env(os.environ, out / "home", None)
    argv = fetch.child_argv(fetch.hf_program(), REPO, COMMIT, out / "files", [NAME])
    start = time.perf_counter()
    subprocess.run(argv, env=env, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def library(url: str, root: Path, checks: list[float]) -> float:
    start = time.perf_counter()
    model = add(root, HubClient(url), REPO, COMMIT, include=[NAME], name=None)
    final = download(root, model, Job(model.id), QueueSettings(poll=0.5))
    elapsed = time.perf_counter() - start
    if final.state != "Ready":
        raise SystemExit(f"the library's download ended {final.state}: {final.message}")
    local = mf.files_dir(root, model.id)
    begin = time.perf_counter()  # the checks again, alone: their share of the figure above
    for file in model.hub_files:
        check_file(local, file)
    inspect(local, model.hub_files)
    checks.append(time.perf_counter() - begin)
    return elapsed


def reinspection(models: int, work: Path) -> tuple[float, float, int]:
    """Seconds for recover() over models Ready GGUF models: median, max, header bytes each."""
    root = work / "library"
    template = work / "template.gguf"
    write_model(template, 4096, VOCAB)
    size = template.stat().st_size
    for _ in range(models):
        guid = mf.new_guid()
        files = root / guid / "files"
        files.mkdir(parents=True)
        shutil.copyfile(template, files / NAME)
        stamp = mf.now()
        mf.save(
            root,
            mf.ModelManifest(
                id=guid,
                name=guid,
                state="Ready",
                since=stamp,
                created=stamp,
                source=mf.FileOrigin(repo=REPO, revision="main", commit=COMMIT),
                hubFiles=[mf.HubFile(path=NAME, size=size, gitOid="0", verified=True)],
                files=[mf.FileName(name=NAME)],
            ),
        )
    runner = Runner(root, QueueSettings())
    times = []
    for _ in range(5):
        start = time.perf_counter()
        changes = runner.recover()
        times.append(time.perf_counter() - start)
        if changes:
            raise SystemExit(f"re-inspection changed models: {changes[:3]}")
    return statistics.median(times), max(times), size


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=512, help="the GGUF's size (512 MiB)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--models", type=int, default=100)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="lucia-dl-bench-") as tmp:
        work = Path(tmp)
        write_model(work / "repo" / NAME, args.mib * 1024 * 1024)
        size = (work / "repo" / NAME).stat().st_size
        alone: list[float] = []
        ours: list[float] = []
        checks: list[float] = []
        hub, url = hub_process(work / "repo")
        os.environ["HF_ENDPOINT"] = url
        try:
            for run in range(args.runs):
                alone.append(hf_alone(url, work / f"alone{run}"))
                shutil.rmtree(work / f"alone{run}")
                ours.append(library(url, work / f"ours{run}", checks))
                shutil.rmtree(work / f"ours{run}")
        finally:
            hub.communicate("")
        median, worst, header = reinspection(args.models, work)
    mb = size / 1e6
    a, o = statistics.median(alone), statistics.median(ours)
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"python {platform.python_version()}, hf {hub_version()}"
    )
    print(f"file: {size} bytes; runs: {args.runs} each, alternating")
    print("| row | median | throughput | runs (s) |")
    print("|---|---|---|---|")
    print(
        f"| `hf download` alone | {a:.2f} s | {mb / a:.0f} MB/s | "
        f"{', '.join(f'{t:.2f}' for t in alone)} |"
    )
    print(
        f"| library: add + download + SHA-256 + GGUF checks to Ready | {o:.2f} s | "
        f"{mb / o:.0f} MB/s | {', '.join(f'{t:.2f}' for t in ours)} |"
    )
    c = statistics.median(checks)
    print(
        f"| of which SHA-256 + GGUF checks (timed again alone, warm cache) | {c:.2f} s | "
        f"{mb / c:.0f} MB/s | {', '.join(f'{t:.2f}' for t in checks)} |"
    )
    print(
        f"| ratio (library / hf alone, throughput) | x{a / o:.2f} | goal >= x0.90: "
        f"{'met' if a / o >= 0.9 else 'MISSED'} | |"
    )
    best = min(alone) / min(ours)
    print(
        f"| ratio of the best runs (the least disturbed by other load) | x{best:.2f} | "
        f"goal >= x0.90: {'met' if best >= 0.9 else 'MISSED'} | |"
    )
    print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(
        f"| startup re-inspection of {args.models} Ready GGUFs ({header} bytes each, "
        f"{VOCAB}-token vocabulary) | {median * 1000:.0f} ms | "
        f"{median / args.models * 1e6:.0f} us a model | max {worst * 1000:.0f} ms |"
    )
    return 0


def hub_version() -> str:
    import huggingface_hub

    return str(huggingface_hub.__version__)


if __name__ == "__main__":
    sys.exit(main())
