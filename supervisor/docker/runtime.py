"""The Docker boundary: the only module that imports docker. Narrow, typed, and in our terms.

Docker's own errors never leave this module: an unreachable daemon becomes Transient, a refusal
by the daemon Permanent, a failed build BuildFailed.
"""

from __future__ import annotations

import io
import json
import os
import re
import select
import subprocess
import sys
import tarfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass
from typing import IO, Any, Final, cast

import docker
import docker.errors
import requests.exceptions
from docker.types import DeviceRequest, Ulimit
from docker.utils import parse_repository_tag

from supervisor.docker.labels import MANAGED
from supervisor.docker.spec import BuildRequest, Container, Gpus, Image, RunSpec
from supervisor.errors import BuildFailed, Cancelled, Permanent, Transient

Progress = Callable[[str], None]
_API_TIMEOUT: Final = 30.0
# dockerd's words for a registry that did not answer (Go's net errors; a 5xx of the registry):
# it may answer later, unlike a refusal such as "manifest unknown"
_REGISTRY_DOWN: Final = re.compile(
    r"connection refused|i/o timeout|no route to host|network is unreachable"
    r"|connection reset|TLS handshake timeout|Client\.Timeout|unexpected EOF"
    r"|HTTP status: 5\d\d|toomanyrequests",
    re.IGNORECASE,
)


@dataclass(frozen=True)
class PullRequest:
    ref: str


@contextmanager
def _translated(what: str) -> Iterator[None]:
    try:
        yield
    except docker.errors.NotFound as exc:
        raise Permanent(f"{what}: {exc.explanation or exc}") from None
    except docker.errors.APIError as exc:
        if exc.status_code is not None and exc.status_code >= 500 and "connect" in str(exc).lower():
            raise Transient(f"{what}: docker is unavailable: {exc.explanation}") from None
        raise Permanent(f"{what}: {exc.explanation or exc}") from None
    except (requests.exceptions.ConnectionError, docker.errors.DockerException) as exc:
        raise Transient(f"{what}: docker is unavailable ({type(exc).__name__})") from None
    except requests.exceptions.Timeout:
        raise Transient(f"{what}: docker did not answer in time") from None


def _container(attrs: dict[str, Any]) -> Container:
    state = attrs.get("State") or {}
    ports = (attrs.get("HostConfig") or {}).get("PortBindings") or {}
    bindings = tuple(
        (binding.get("HostIp") or "0.0.0.0", int(binding.get("HostPort") or 0))  # noqa: S104
        for published in ports.values()
        for binding in (published or [])
    )
    return Container(
        id=attrs["Id"],
        name=str(attrs.get("Name", "")).lstrip("/"),
        image_id=attrs.get("Image", ""),
        status=state.get("Status", "unknown"),
        exit_code=int(state.get("ExitCode") or 0),
        oom_killed=bool(state.get("OOMKilled")),
        started_at=state.get("StartedAt", ""),
        labels=dict((attrs.get("Config") or {}).get("Labels") or {}),
        bindings=bindings,
    )


class Runtime:
    """Docker, seen as containers, images and one network gateway."""

    def __init__(self, base_url: str | None = None) -> None:
        self._base_url = base_url
        self._api: docker.APIClient | None = None

    @property
    def api(self) -> docker.APIClient:
        if self._api is None:
            with _translated("connecting to docker"):
                self._api = self._client(_API_TIMEOUT)
        return self._api

    def _client(self, timeout: float | None) -> docker.APIClient:
        return _api_client(self._base_url, timeout)

    def ping(self) -> None:
        with _translated("ping"):
            self.api.ping()

    def _stays_up(self, cancel: threading.Event, checks: int = 3, every: float = 0.5) -> bool:
        """After a failed build: was it the build, or dockerd shutting down under it (which
        kills the running step first, then closes its API)? Answered by a few pings."""
        for _ in range(checks):
            try:
                self.api.ping()
            except (docker.errors.DockerException, requests.exceptions.RequestException):
                return False
            if cancel.wait(every):
                break
        return True

    def container(self, name: str) -> Container | None:
        with _translated(f"inspecting container {name}"):
            try:
                return _container(self.api.inspect_container(name))
            except docker.errors.NotFound:
                return None

    def containers(self, label: str | list[str], running: bool = True) -> list[Container]:
        """The containers carrying label (a key, or key=value; a list: every one of them):
        running ones, or all."""
        with _translated(f"listing containers labelled {label}"):
            found = self.api.containers(all=not running, filters={"label": label})
            listed = []
            for entry in found:
                with suppress(docker.errors.NotFound):  # gone since it was listed
                    listed.append(_container(self.api.inspect_container(entry["Id"])))
            return listed

    def image(self, ref: str) -> Image | None:
        with _translated(f"inspecting image {ref}"):
            try:
                attrs: dict[str, Any] = self.api.inspect_image(ref)  # type: ignore[no-untyped-call]
            except docker.errors.NotFound:
                return None
        return Image(id=attrs["Id"], labels=dict((attrs.get("Config") or {}).get("Labels") or {}))

    def gateway(self, network: str) -> str | None:
        """The IPv4 gateway of a bridge network; None when the network does not exist."""
        with _translated(f"network {network}"):
            try:
                attrs = self.api.inspect_network(network)
            except docker.errors.NotFound:
                return None
        for config in (attrs.get("IPAM") or {}).get("Config") or []:
            if config.get("Gateway"):
                return str(config["Gateway"])
        raise Permanent(f"network {network} has no IPv4 gateway; use a bridge network")

    def create_network(self, network: str) -> None:
        """A bridge network, labelled as lucia's; one that exists already is left alone."""
        with _translated(f"creating network {network}"):
            try:
                self.api.create_network(
                    network, driver="bridge", labels={MANAGED: "true"}, check_duplicate=True
                )
            except docker.errors.APIError as exc:
                if exc.status_code != 409:  # created meanwhile by another worker: fine
                    raise

    def run(self, spec: RunSpec) -> Container:
        """Create and start a container; a half-created one is removed again."""
        api = self.api
        port = f"{spec.container_port}/tcp"
        host_config = api.create_host_config(
            port_bindings={port: (spec.host_ip, spec.host_port)},
            restart_policy={"Name": "no"},
            device_requests=_gpus(spec.gpus),
            shm_size=spec.shm_size,
            mem_limit=spec.memory,
            ipc_mode=spec.ipc_mode,
            ulimits=[Ulimit(name=k, soft=v, hard=v) for k, v in spec.ulimits.items()] or None,
            binds={
                m.source: {"bind": m.target, "mode": "ro" if m.read_only else "rw"}
                for m in spec.mounts
            }
            or None,
        )
        with _translated(f"creating container {spec.name}"):
            created = api.create_container(
                spec.image,
                name=spec.name,
                command=list(spec.command) or None,
                environment=dict(spec.environment),
                labels=dict(spec.labels),
                ports=[(spec.container_port, "tcp")],
                host_config=host_config,
                networking_config=api.create_networking_config(
                    {spec.network: api.create_endpoint_config()}  # type: ignore[arg-type]
                ),
            )
        try:
            with _translated(f"starting container {spec.name}"):
                api.start(created["Id"])
        except Permanent:
            self.remove(created["Id"])
            raise
        found = self.container(created["Id"])
        if found is None:
            raise Transient(f"container {spec.name} vanished right after it started")
        return found

    def run_once(
        self,
        image: str,
        entrypoint: str,
        command: list[str],
        timeout: float,
        labels: dict[str, str] | None = None,
    ) -> tuple[int, list[str]]:
        """Run a throwaway container (no network, GPU or mounts) to its end and remove it:
        its exit code (-1 when it ran out of time) and the last lines of its output. Check
        containers carrying the same labels that a worker killed mid-check, or a dockerd
        restart, left behind are removed first."""
        api = self.api
        marks = {**(labels or {}), MANAGED: "check"}
        for left in self.containers([f"{k}={v}" for k, v in marks.items()], running=False):
            self.remove(left.id)
        host_config = api.create_host_config(network_mode="none", restart_policy={"Name": "no"})
        with _translated(f"creating a check container on {image[:19]}"):
            created = api.create_container(
                image,
                entrypoint=[entrypoint],
                command=command,
                labels=marks,
                host_config=host_config,
                network_disabled=True,
            )
        cid = created["Id"]
        try:
            with _translated(f"running a check container on {image[:19]}"):
                api.start(cid)
                client = self._client(timeout)
                try:
                    code = int(client.wait(cid).get("StatusCode", -1))
                except requests.exceptions.RequestException:
                    code = -1
                finally:
                    client.close()
                raw = api.logs(cid, stdout=True, stderr=True, tail=20)
        finally:
            self.remove(cid)
        text = raw.decode("utf-8", errors="replace") if isinstance(raw, bytes) else str(raw)
        return code, [line for line in text.splitlines() if line.strip()]

    def stop(self, container_id: str, grace: float) -> None:
        with _translated(f"stopping container {container_id[:12]}"):
            try:
                self.api.stop(container_id, timeout=round(grace))
            except docker.errors.NotFound:
                return

    def kill(self, container_id: str) -> None:
        with _translated(f"killing container {container_id[:12]}"):
            try:
                self.api.kill(container_id)
            except docker.errors.APIError as exc:
                if exc.status_code not in (404, 409):  # gone, or not running: both fine
                    raise

    def remove(self, container_id: str) -> None:
        with _translated(f"removing container {container_id[:12]}"):
            try:
                self.api.remove_container(container_id, force=True)
            except docker.errors.NotFound:
                return

    def wait(self, container_id: str) -> int | None:
        """Block until the container exits; its exit code, or None if docker went away."""
        try:
            client = self._client(None)
            try:
                result = client.wait(container_id)
            finally:
                client.close()
        except (docker.errors.DockerException, requests.exceptions.RequestException):
            return None
        return int(result.get("StatusCode", -1))

    def logs(self, container_id: str, tail: int = 5) -> list[str]:
        with _translated(f"reading logs of {container_id[:12]}"):
            try:
                raw = self.api.logs(container_id, stdout=True, stderr=True, tail=tail)
            except docker.errors.NotFound:
                return []
        text = raw.decode("utf-8", errors="replace") if isinstance(raw, bytes) else str(raw)
        return [line for line in text.splitlines() if line.strip()]

    def build(self, request: BuildRequest, progress: Progress, cancel: threading.Event) -> Image:
        """Build an image in a child process, so that a cancel can abandon it within a second.

        Killing the child closes its connection; dockerd then cancels the build and removes the
        intermediate container of the step that was running.
        """
        return self._in_child(request, request.tag, f"build of {request.tag}", progress, cancel)

    def pull(self, ref: str, progress: Progress, cancel: threading.Event) -> Image:
        """Pull an image (in a child process, for the same reason as build)."""
        return self._in_child(PullRequest(ref), ref, f"pull of {ref}", progress, cancel)

    def _in_child(
        self,
        job: BuildRequest | PullRequest,
        ref: str,
        what: str,
        progress: Progress,
        cancel: threading.Event,
    ) -> Image:
        # A plain child process (not multiprocessing, whose resource tracker would outlive the
        # build by the worker's whole life, 13 MB of it): the job in on stdin, JSON lines out.
        child = subprocess.Popen(
            [sys.executable, "-m", "supervisor.docker.runtime"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        assert child.stdin is not None and child.stdout is not None
        lines: list[str] = []
        try:
            child.stdin.write(_encode_job(self._base_url, job))
            child.stdin.close()
            kind, text = _receive(
                child.stdout, lines=lines, progress=progress, cancel=cancel, what=what
            )
        finally:
            if child.poll() is None:
                child.kill()
            child.wait(5)
            child.stdout.close()
        if kind == "unavailable":
            raise Transient(f"{what}: docker is unavailable ({text})")
        if kind == "unreachable":
            raise Transient(f"{what}: the registry did not answer ({text})")
        if kind == "error" and not self._stays_up(cancel):
            raise Transient(f"{what}: docker went away during it ({text})")
        if kind == "error":
            raise BuildFailed(what, [*lines, text])
        image = self.image(ref)
        if image is None:
            raise BuildFailed(what, [*lines, "no image was produced"])
        return image


def _receive(
    stream: IO[bytes],
    *,
    lines: list[str],
    progress: Progress,
    cancel: threading.Event,
    what: str,
) -> tuple[str, str]:
    """Relay the child's lines until it says how the build ended; cancel is checked 5x/s."""
    fd, pending = stream.fileno(), b""
    while not cancel.is_set():
        if not select.select([fd], [], [], 0.2)[0]:
            continue
        chunk = os.read(fd, 65536)
        if not chunk:
            return "unavailable", "the build ended without an answer from docker"
        *complete, pending = (pending + chunk).split(b"\n")
        for raw in complete:
            kind, text = json.loads(raw)
            if kind != "line":
                return str(kind), str(text)
            lines.append(text)
            del lines[:-50]
            progress(text)
    raise Cancelled(f"{what} cancelled")


def _api_client(base_url: str | None, timeout: float | None) -> docker.APIClient:
    """None means no timeout (docker wait, builds); the stubs only admit an int."""
    limit = cast(int, timeout)
    if base_url:
        return docker.APIClient(base_url=base_url, timeout=limit)
    return docker.from_env(timeout=limit).api


def _gpus(gpus: Gpus) -> list[DeviceRequest] | None:
    if gpus == "none":
        return None
    count = -1 if gpus == "all" else int(gpus)
    return [DeviceRequest(count=count, capabilities=[["gpu"]])]


def _context_tar(dockerfile_text: str) -> io.BytesIO:
    buffer = io.BytesIO()
    data = dockerfile_text.encode()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        info = tarfile.TarInfo("Dockerfile")
        info.size = len(data)
        info.mode = 0o644
        tar.addfile(info, io.BytesIO(data))
    buffer.seek(0)
    return buffer


def _encode_job(base_url: str | None, job: BuildRequest | PullRequest) -> bytes:
    kind = "pull" if isinstance(job, PullRequest) else "build"
    return json.dumps({"base_url": base_url, "kind": kind, "job": asdict(job)}).encode()


def _decode_job(data: bytes) -> tuple[str | None, BuildRequest | PullRequest]:
    message = json.loads(data)
    job_type = PullRequest if message["kind"] == "pull" else BuildRequest
    return message["base_url"], job_type(**message["job"])


def _send(kind: str, text: str) -> None:
    sys.stdout.write(json.dumps([kind, text]) + "\n")
    sys.stdout.flush()


def _failed(job: BuildRequest | PullRequest, text: str) -> None:
    """A pull from a registry that did not answer may work later; any other failure will not."""
    unreachable = isinstance(job, PullRequest) and _REGISTRY_DOWN.search(text) is not None
    _send("unreachable" if unreachable else "error", text)


def _child(base_url: str | None, job: BuildRequest | PullRequest) -> None:
    """Runs in the child process: stream a build's or a pull's output lines to the parent."""
    try:
        api = _api_client(base_url, None)
        for chunk in _stream(api, job):
            if "error" in chunk:
                _failed(job, str(chunk.get("error", "")).strip())
                return
            text = chunk.get("stream") or _pull_line(chunk)
            for line in str(text).splitlines():
                if line.strip():
                    _send("line", line.rstrip())
        _send("done", "")
    except (requests.exceptions.ConnectionError, requests.exceptions.Timeout) as exc:
        _send("unavailable", type(exc).__name__)
    except docker.errors.APIError as exc:
        _failed(job, str(exc.explanation or exc))
    except (docker.errors.DockerException, OSError, TypeError) as exc:
        _send("error", f"{type(exc).__name__}: {exc}")


def _stream(api: docker.APIClient, job: BuildRequest | PullRequest) -> Iterator[dict[str, Any]]:
    if isinstance(job, PullRequest):
        repository, tag = parse_repository_tag(job.ref)
        return iter(api.pull(repository, tag=tag or "latest", stream=True, decode=True))
    common: dict[str, Any] = {
        "tag": job.tag,
        "labels": dict(job.labels),
        "buildargs": dict(job.build_args),
        "rm": True,
        "forcerm": True,
        "decode": True,
    }
    if job.dockerfile_text is not None:
        return iter(
            api.build(fileobj=_context_tar(job.dockerfile_text), custom_context=True, **common)
        )
    return iter(api.build(path=job.context, dockerfile=job.dockerfile, **common))


def _pull_line(chunk: dict[str, Any]) -> str:
    """A pull's progress as one line: "<layer>: Downloading 12.3MB/40.1MB"."""
    status = str(chunk.get("status") or "")
    layer = str(chunk.get("id") or "")
    detail = chunk.get("progressDetail") or {}
    if detail.get("total"):
        status += f" {detail.get('current', 0) / 1e6:.1f}MB/{detail['total'] / 1e6:.1f}MB"
    return f"{layer}: {status}" if layer else status


if __name__ == "__main__":  # the build and pull child: python -m supervisor.docker.runtime
    _child(*_decode_job(sys.stdin.buffer.read()))
