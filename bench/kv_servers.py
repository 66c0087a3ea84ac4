"""The real vLLM CPU servers the KV benchmarks time: the tier image, an HDD stand-in, containers.

Everything made here carries the run id in its name and the label lucia.bench.run=<run id>: the
network, the containers, the tier image when this run builds it, the temp directory, the loop
device's backing file. `KvLab.cleanup()` removes all of it, also after a failure half-way.
Servers run as tests/vllm_cpu.py runs them: the tiny model of tests/vllm_model.py mounted
read-only, the port published on the network's gateway only.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import re
import shutil
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import docker
import docker.errors

from supervisor.docker.labels import TIERS_VERSION
from supervisor.docker.runtime import Runtime
from supervisor.engines.vllm import tier_image
from tests.standin import free_port
from tests.vllm_cpu import CONTAINER_PORT, MODEL_DIR, SERVED_NAME, SHM_SIZE, wait_healthy

RUN_ID = uuid.uuid4().hex[:8]
LABEL = "lucia.bench.run"
PREFIX = f"lucia-bench-{RUN_ID}"
HEALTH_LIMIT = 900.0  # the longest wait for /health; a limit, never a measurement
SOURCE = re.compile(
    r'^vllm:prompt_tokens_by_source_total\{[^}]*source="([^"]+)"[^}]*\} (\S+)$', re.M
)
PROMPT_TOKENS = re.compile(r"^vllm:prompt_tokens_total(?:\{[^}]*\})? (\S+)$", re.M)
TIER_COUNTER = re.compile(r'^lucia_kv_(\w+)_total\{tier="(\w+)"[^}]*\} (\S+)$', re.M)


class BenchError(Exception):
    """The bench cannot go on; str() says what failed."""


@dataclass(frozen=True)
class TierImage:
    ref: str
    built: bool  # by this run, so removed at its end
    seconds: float


@dataclass(frozen=True)
class Completion:
    """One streamed completion: when its first token arrived, and its text."""

    first_token: float  # seconds from sending the request
    text: str


def by_source(metrics: str) -> dict[str, float]:
    """vllm:prompt_tokens_by_source_total per source, summed over the other labels."""
    found: dict[str, float] = {}
    for source, value in SOURCE.findall(metrics):
        found[source] = found.get(source, 0.0) + float(value)
    return found


def prompt_tokens(metrics: str) -> float:
    """vllm:prompt_tokens_total (every prompt token, whatever served it), or the sum over
    sources where only that is exported."""
    found = PROMPT_TOKENS.findall(metrics)
    return sum(float(value) for value in found) if found else sum(by_source(metrics).values())


def tier_counters(metrics: str) -> dict[tuple[str, str], float]:
    """lucia_kv_<name>_total per (name, tier), summed over reasons."""
    found: dict[tuple[str, str], float] = {}
    for name, tier, value in TIER_COUNTER.findall(metrics):
        found[(name, tier)] = found.get((name, tier), 0.0) + float(value)
    return found


@dataclass
class Server:
    """One real vLLM container; `url` is the gateway address it is published on."""

    container: Any
    url: str
    seconds_to_health: float

    def metrics(self) -> str:
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as answer:
            return bytes(answer.read()).decode()

    def complete(self, prompt: Sequence[int], max_tokens: int, timeout: float = 600) -> Completion:
        """A streamed completion at temperature 0; the clock starts before the request is sent
        and stops at the first event that carries a choice (the first token)."""
        parts = urllib.parse.urlsplit(self.url)
        body = json.dumps(
            {
                "model": SERVED_NAME,
                "prompt": list(prompt),
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
            }
        ).encode()
        connection = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=timeout)
        try:
            started = time.perf_counter()
            connection.request(
                "POST", "/v1/completions", body, {"Content-Type": "application/json"}
            )
            answer = connection.getresponse()
            if answer.status != 200:
                raise BenchError(f"completion answered {answer.status}: {answer.read()[-500:]!r}")
            first: float | None = None
            text: list[str] = []
            for raw in answer:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                choices = json.loads(data).get("choices") or []
                if choices:
                    if first is None:
                        first = time.perf_counter() - started
                    text.append(str(choices[0].get("text", "")))
        finally:
            connection.close()
        if first is None:
            raise BenchError("the stream ended without a token")
        return Completion(first, "".join(text))

    def stop(self) -> None:
        with contextlib.suppress(docker.errors.APIError):
            self.container.kill(signal="SIGTERM")
            self.container.wait(timeout=120)


# Run inside a server's container (so in its blkio cgroup): the median of ROUNDS passes of an
# O_DIRECT read of each named block file in a directory, in ms.
RAW_READ = """
import mmap, os, statistics, sys, time
directory, rounds, names = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
def once():
    started = time.perf_counter()
    for name in names:
        fd = os.open(os.path.join(directory, name), os.O_RDONLY | os.O_DIRECT)
        try:
            buffer = mmap.mmap(-1, max(4096, os.fstat(fd).st_size))
            os.readv(fd, [buffer])
            buffer.close()
        finally:
            os.close(fd)
    return time.perf_counter() - started
print(statistics.median(once() for _ in range(rounds)) * 1000)
"""


def raw_read_ms(container: Any, directory: str, names: Sequence[str], rounds: int = 5) -> float:
    """The median time the container takes for an O_DIRECT read of these block files."""
    command = [tier_image.PYTHON, "-c", RAW_READ, directory, str(rounds), *names]
    code, output = container.exec_run(command)
    if code != 0:
        raise BenchError(f"the raw read in the container failed ({code}): {output[-500:]!r}")
    return float(bytes(output).decode().strip().splitlines()[-1])


class SlowDisk:
    """The HDD stand-in: ext4 on a loop device (direct I/O to a file on the root disk), its
    reads and writes throttled for one container by the blkio cgroup (IOPS and bytes/s)."""

    def __init__(self, directory: Path, iops: int, mbps: int, size_mib: int = 1024) -> None:
        self.mount = directory
        self.iops, self.mbps = iops, mbps
        self.backing = directory.parent / f"{directory.name}.img"
        self.device = ""
        with self.backing.open("wb") as handle:
            handle.truncate(size_mib << 20)
        self.device = _run("losetup", "--find", "--show", "--direct-io=on", str(self.backing))
        _run("mkfs.ext4", "-q", "-F", "-E", "nodiscard", self.device)
        directory.mkdir(mode=0o700, exist_ok=True)
        _run("mount", self.device, str(directory))
        directory.chmod(0o700)

    def throttle(self) -> dict[str, list[dict[str, Any]]]:
        """docker run's device_{read,write}_{iops,bps} for this device."""
        iops = [{"Path": self.device, "Rate": self.iops}]
        bps = [{"Path": self.device, "Rate": self.mbps * 1_000_000}]
        return {
            "device_read_iops": iops,
            "device_write_iops": iops,
            "device_read_bps": bps,
            "device_write_bps": bps,
        }

    def describe(self) -> str:
        return (
            f"ext4 on {self.device} (a loop device with direct I/O over a file on the root "
            f"disk), reads and writes of the server's container throttled by blkio to "
            f"{self.iops} IOPS and {self.mbps} MB/s"
        )

    def close(self) -> None:
        if self.device:
            subprocess.run(["umount", str(self.mount)], capture_output=True, check=False)
            subprocess.run(["losetup", "-d", self.device], capture_output=True, check=False)
            self.device = ""
        self.backing.unlink(missing_ok=True)


def _run(*argv: str) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise BenchError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout.strip()


def blkio_setting(container: Any, name: str) -> str:
    """What the container's blkio cgroup holds for `name` (cgroup v1), or why not."""
    path = Path("/sys/fs/cgroup/blkio/docker") / str(container.id) / f"blkio.throttle.{name}"
    try:
        return path.read_text().strip() or "(empty)"
    except OSError as exc:
        return f"({path}: {exc.strerror})"


class KvLab:
    """The network, the temp directory, the tier image and the servers of one run."""

    def __init__(self) -> None:
        self.client = docker.from_env(timeout=300)
        self.client.ping()
        self.tmp = Path(tempfile.mkdtemp(prefix=f"{PREFIX}-kv-"))
        self.tmp.chmod(0o700)
        network = self.client.networks.create(PREFIX, driver="bridge", labels={LABEL: RUN_ID})
        network.reload()
        self.network = network
        self.gateway = str(network.attrs["IPAM"]["Config"][0]["Gateway"])
        self.servers: list[Server] = []
        self.images: list[str] = []  # removed at the end, in order
        self.disks: list[SlowDisk] = []

    def tier_image(self, base_ref: str) -> TierImage:
        """The base's current tier image if dockerd has one, else one built now under a
        private tag (removed by cleanup)."""
        base = self.client.images.get(base_ref)
        plugin = tier_image.read_plugin()
        with contextlib.suppress(docker.errors.ImageNotFound):
            found = self.client.images.get(tier_image.tag(base_ref))
            if tier_image.current(plugin, str(base.id), found.labels or {}):
                return TierImage(tier_image.tag(base_ref), False, 0.0)
        repository = f"{PREFIX}-vllm-cpu"
        base.tag(repository, "base")
        private_base = f"{repository}:base"
        self.images.append(private_base)
        context = tier_image.write_context(plugin, str(base.id), self.tmp / "tier-context")
        request = tier_image.build_request(plugin, private_base, str(base.id), context)
        lines: list[str] = []
        started = time.monotonic()
        try:
            image = Runtime().build(request, lines.append, threading.Event())
        except Exception as exc:
            raise BenchError(f"the tier image build failed: {exc}; {lines[-5:]}") from None
        self.images.insert(0, request.tag)  # untagged first; the last tag's removal deletes it
        if image.labels.get(TIERS_VERSION) != plugin.version:
            raise BenchError(f"{request.tag} does not carry the plugin version {plugin.version}")
        return TierImage(request.tag, True, time.monotonic() - started)

    def slow_disk(self, name: str, iops: int, mbps: int) -> SlowDisk:
        disk = SlowDisk(self.tmp / name, iops, mbps)
        self.disks.append(disk)
        return disk

    def start(
        self,
        role: str,
        image: str,
        model: Path,
        args: Sequence[str] = (),
        volumes: dict[str, dict[str, str]] | None = None,
        **options: Any,
    ) -> Server:
        """A vLLM server on the tiny model; returns once /health answers."""
        port = free_port()
        container = self.client.containers.run(
            image,
            [
                "--model",
                MODEL_DIR,
                "--served-model-name",
                SERVED_NAME,
                "--host",
                "0.0.0.0",  # the container's own address; published on the gateway
                "--port",
                str(CONTAINER_PORT),
                "--dtype",
                "bfloat16",
                *args,
            ],
            detach=True,
            name=f"{PREFIX}-{role}",
            labels={LABEL: RUN_ID},
            network=self.network.name,
            ports={f"{CONTAINER_PORT}/tcp": (self.gateway, port)},
            volumes={str(model): {"bind": MODEL_DIR, "mode": "ro"}, **(volumes or {})},
            shm_size=SHM_SIZE,
            environment={"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"},
            **options,
        )
        url = f"http://{self.gateway}:{port}"
        server = Server(container, url, 0.0)
        self.servers.append(server)
        server.seconds_to_health = wait_healthy(container, url, HEALTH_LIMIT, BenchError)
        return server

    def cleanup(self) -> list[str]:
        """Remove what this run made; what could not be removed, one line each. Waits a while
        for dockerd first (a shared machine's dockerd may be restarting)."""
        left: list[str] = []
        docker_up = _docker_answers(self.client)
        for server in self.servers:
            _remove(left, f"container {server.container.name}", server.container.remove, force=True)
        for disk in self.disks:
            disk.close()
            if disk.device:
                left.append(f"loop device {disk.device} on {disk.mount}")
        _remove(left, f"network {self.network.name}", self.network.remove)
        for ref in self.images:
            _remove(left, f"image {ref}", self.client.images.remove, ref)
        shutil.rmtree(self.tmp, ignore_errors=True)
        if self.tmp.exists():
            left.append(f"directory {self.tmp}")
        if left and not docker_up:
            left.append("(dockerd did not answer: remove them when it does)")
        return left


def _docker_answers(client: Any, limit: float = 120.0) -> bool:
    began = time.monotonic()
    while True:
        try:
            client.ping()
            return True
        except (docker.errors.DockerException, OSError):
            if time.monotonic() - began > limit:
                return False
            time.sleep(2)


def _remove(left: list[str], what: str, remove: Any, *args: Any, **kwargs: Any) -> None:
    try:
        remove(*args, **kwargs)
    except docker.errors.NotFound:
        pass
    except (docker.errors.DockerException, OSError) as exc:  # requests' errors are OSErrors
        left.append(f"{what}: {exc}")
