"""A Docker registry of the tests' own: Debian's `docker-registry` on 127.0.0.1 with a free port
and a storage directory private to the session, so that real pulls run here. dockerd takes
127.0.0.0/8 registries as insecure by default: plain HTTP works for push and pull.

`Gate` sits between dockerd and the registry and passes every byte through, except that it
holds a large download halfway until the test lets it go: a pull of a few tens of MB from a
local registry ends within a second, before a heartbeat could show its progress.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import docker
import pytest

from tests.fixtures import RUN_ID, TEST_LABEL
from tests.standin import free_port

BINARY = "docker-registry"  # Debian's package of the CNCF distribution registry


@dataclass(frozen=True)
class Registry:
    """A running registry: `host` is `127.0.0.1:PORT`, what image names start with."""

    host: str
    storage: Path

    @property
    def port(self) -> int:
        return int(self.host.rsplit(":", 1)[1])


def _config(storage: Path, port: int) -> str:
    return (
        "version: 0.1\n"
        "log:\n  level: warn\n"
        f"storage:\n  filesystem:\n    rootdirectory: {storage}\n  delete:\n    enabled: true\n"
        f"http:\n  addr: 127.0.0.1:{port}\n"
    )


def _answers(host: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://{host}/v2/", timeout=2) as answer:
            return bool(answer.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def _start(directory: Path) -> tuple[subprocess.Popen[bytes], Registry]:
    binary = shutil.which(BINARY)
    if binary is None:
        pytest.fail(f"these tests need {BINARY} (scripts/machine.sh installs it)")
    storage = directory / "storage"
    storage.mkdir(mode=0o700)
    for _attempt in range(5):  # the free port may be taken between the probe and the bind
        port = free_port()
        config = directory / "config.yml"
        config.write_text(_config(storage, port))
        log = open(directory / "registry.log", "ab")  # noqa: SIM115
        proc = subprocess.Popen(
            [binary, "serve", str(config)],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        log.close()
        registry = Registry(f"127.0.0.1:{port}", storage)
        deadline = time.monotonic() + 30
        while proc.poll() is None and time.monotonic() < deadline:
            if _answers(registry.host):
                return proc, registry
            time.sleep(0.1)
        _stop(proc)
    text = (directory / "registry.log").read_text(errors="replace")[-2000:]
    pytest.fail(f"{BINARY} did not start: {text}")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def ours(client: docker.DockerClient, hosts: tuple[str, ...]) -> list[str]:
    """The ids of this run's images named under one of `hosts` (pulled or pushed), by a tag
    or by a digest alone (what a pull by digest leaves)."""
    prefixes = tuple(f"{host}/" for host in hosts)
    found = []
    for image in client.images.list(filters={"label": f"{TEST_LABEL}={RUN_ID}"}):
        names = [*image.tags, *(image.attrs.get("RepoDigests") or [])]
        if any(name.startswith(prefixes) for name in names):
            found.append(str(image.id))
    return found


def remove_ours(client: docker.DockerClient, hosts: tuple[str, ...]) -> None:
    """Remove those images, every name of each (a tag removed alone leaves the image)."""
    for image_id in ours(client, hosts):
        with contextlib.suppress(docker.errors.ImageNotFound):
            client.images.remove(image_id, force=True)


@pytest.fixture(scope="session")
def registry(
    client: docker.DockerClient, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Registry]:
    proc, running = _start(tmp_path_factory.mktemp("registry"))
    try:
        yield running
    finally:
        remove_ours(client, (running.host,))
        _stop(proc)
        shutil.rmtree(running.storage, ignore_errors=True)


def publish(client: docker.DockerClient, local: str, remote: str) -> str:
    """Push the local image `local` as `remote` (`host/path:tag`); the local `remote` tag is
    removed again. The image id, the same wherever it is pulled."""
    image = client.images.get(local)
    repository, tag = remote.rsplit(":", 1)
    image.tag(repository, tag)
    try:
        for chunk in client.api.push(repository, tag=tag, stream=True, decode=True):
            if "error" in chunk:
                raise AssertionError(f"push of {remote} failed: {chunk['error']}")
    finally:
        client.images.remove(remote)
    return str(image.id)


class Gate:
    """A TCP pass-through at `127.0.0.1:<port>` to the registry. A response is held once
    `hold_after` bytes of it have passed, until `release()` (or `limit` seconds)."""

    def __init__(self, upstream: Registry, hold_after: int, limit: float = 120) -> None:
        self.upstream = upstream
        self.hold_after = hold_after
        self.limit = limit
        self.held = threading.Event()  # a download reached the hold
        self._released = threading.Event()
        self._listener = socket.socket()
        self._open: list[socket.socket] = []
        self._lock = threading.Lock()

    @property
    def port(self) -> int:
        return int(self._listener.getsockname()[1])

    def release(self) -> None:
        self._released.set()

    def __enter__(self) -> Gate:
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(16)
        threading.Thread(target=self._accept, daemon=True).start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.release()
        self._listener.close()
        with self._lock:
            for sock in self._open:
                with contextlib.suppress(OSError):
                    sock.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            server = socket.create_connection(("127.0.0.1", self.upstream.port))
            with self._lock:
                self._open += [client, server]
            threading.Thread(target=self._pump, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, True), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, gated: bool) -> None:
        passed = 0  # of what the registry sent on this connection
        try:
            while chunk := source.recv(65536):
                before, passed = passed, passed + len(chunk)
                if gated and before < self.hold_after <= passed:
                    head = self.hold_after - before
                    sink.sendall(chunk[:head])
                    self.held.set()
                    self._released.wait(self.limit)
                    chunk = chunk[head:]
                sink.sendall(chunk)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                sink.shutdown(socket.SHUT_WR)
