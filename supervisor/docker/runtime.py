"""The Docker API, narrow, typed and in our terms: containers, images and one network gateway.

With the build child (child.py) and the client (client.py), the docker/ package is the only
one that imports the docker SDK. Docker's own errors never leave it: an unreachable daemon
becomes Transient, a refusal by the daemon Permanent, a failed build BuildFailed.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import suppress
from typing import Any, Final

import docker
import docker.errors
import requests.exceptions
from docker.types import Ulimit

from supervisor.docker import child
from supervisor.docker.child import PullRequest
from supervisor.docker.client import api_client
from supervisor.docker.labels import MANAGED
from supervisor.docker.process import relay
from supervisor.docker.spec import BuildRequest, Container, Image, Mount, RunSpec
from supervisor.docker.translate import container_from, device_requests, translated
from supervisor.errors import BuildFailed, Cancelled, Permanent, Transient

Progress = Callable[[str], None]
_API_TIMEOUT: Final = 30.0


class Runtime:
    """Docker, seen as containers, images and one network gateway."""

    def __init__(self, base_url: str | None = None) -> None:
        self._base_url = base_url
        self._api: docker.APIClient | None = None

    @property
    def api(self) -> docker.APIClient:
        if self._api is None:
            with translated("connecting to docker"):
                self._api = self._client(_API_TIMEOUT)
        return self._api

    def _client(self, timeout: float | None) -> docker.APIClient:
        return api_client(self._base_url, timeout)

    def ping(self) -> None:
        with translated("ping"):
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
        with translated(f"inspecting container {name}"):
            try:
                return container_from(self.api.inspect_container(name))
            except docker.errors.NotFound:
                return None

    def containers(self, label: str | list[str], running: bool = True) -> list[Container]:
        """The containers carrying label (a key, or key=value; a list: every one of them):
        running ones, or all."""
        with translated(f"listing containers labelled {label}"):
            found = self.api.containers(all=not running, filters={"label": label})
            listed = []
            for entry in found:
                with suppress(docker.errors.NotFound):  # gone since it was listed
                    listed.append(container_from(self.api.inspect_container(entry["Id"])))
            return listed

    def running_labels(self, label: str) -> list[dict[str, str]]:
        """The labels of each running container carrying label (key=value), from one listing:
        no inspect, for a caller that needs only whose containers run (the memory plan)."""
        with translated(f"listing containers labelled {label}"):
            found = self.api.containers(filters={"label": label})
        return [dict(entry.get("Labels") or {}) for entry in found]

    def image(self, ref: str) -> Image | None:
        with translated(f"inspecting image {ref}"):
            try:
                attrs: dict[str, Any] = self.api.inspect_image(ref)  # type: ignore[no-untyped-call]
            except docker.errors.NotFound:
                return None
        return Image(id=attrs["Id"], labels=dict((attrs.get("Config") or {}).get("Labels") or {}))

    def gateway(self, network: str) -> str | None:
        """The IPv4 gateway of a bridge network; None when the network does not exist."""
        with translated(f"network {network}"):
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
        with translated(f"creating network {network}"):
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
            device_requests=device_requests(spec.gpus),
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
        with translated(f"creating container {spec.name}"):
            created = api.create_container(
                spec.image,
                name=spec.name,
                user=spec.user,
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
            with translated(f"starting container {spec.name}"):
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
        with translated(f"creating a check container on {image[:19]}"):
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
            with translated(f"running a check container on {image[:19]}"):
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

    def run_streamed(
        self,
        image: str,
        command: list[str],
        *,
        entrypoint: str,
        environment: dict[str, str],
        mounts: tuple[Mount, ...],
        network: str,
        labels: dict[str, str],
        progress: Progress,
        cancel: threading.Event,
        user: str | None = None,
    ) -> tuple[int, list[str]]:
        """Run a short-lived container to its end, its output relayed as progress (a progress
        bar redrawn with \\r as its latest redraw), and remove it: its exit code and the last
        lines. A cancel kills and removes it at once (Cancelled). It runs as user ("uid:gid";
        None: the image's). Containers carrying the same labels that a killed worker left behind
        are removed first."""
        api = self.api
        marks = {**labels, MANAGED: "step"}
        for left in self.containers([f"{k}={v}" for k, v in marks.items()], running=False):
            self.remove(left.id)
        host_config = api.create_host_config(
            network_mode=network,
            restart_policy={"Name": "no"},
            binds={
                m.source: {"bind": m.target, "mode": "ro" if m.read_only else "rw"} for m in mounts
            }
            or None,
        )
        with translated(f"creating a step container on {image[:19]}"):
            created = api.create_container(
                image,
                entrypoint=[entrypoint],
                command=command,
                environment=environment,
                labels=marks,
                host_config=host_config,
                user=user,
            )
        cid = created["Id"]
        tail: list[str] = []
        try:
            with translated("connecting to docker"):  # no timeout: a download may be silent
                follower = self._client(None)
        except Transient:
            self.remove(cid)
            raise
        try:
            # attached before the start, so nothing is missed, and read as it is written: the
            # log driver would hold a progress bar's \\r redraws back until a newline
            with translated(f"attaching to a step container on {image[:19]}"):
                stream = follower.attach(cid, stdout=True, stderr=True, stream=True, logs=True)
                api.start(cid)
            reader = threading.Thread(
                target=self._relay, args=(stream, progress, tail), daemon=True
            )
            reader.start()
            while reader.is_alive():
                if cancel.wait(0.1):
                    self.kill(cid)
                    raise Cancelled("the step container was cancelled")
            code = self.wait(cid)
        finally:
            self.remove(cid)
            follower.close()
        return (-1 if code is None else code), tail

    @staticmethod
    def _relay(stream: Iterator[bytes], progress: Progress, tail: list[str]) -> None:
        """Relay an attached container's output to its end."""
        try:
            relay(stream, progress, tail)
        except (docker.errors.DockerException, requests.exceptions.RequestException, OSError):
            return  # killed under us, or docker went away: the exit code says which

    def stop(self, container_id: str, grace: float) -> None:
        with translated(f"stopping container {container_id[:12]}"):
            try:
                self.api.stop(container_id, timeout=round(grace))
            except docker.errors.NotFound:
                return

    def kill(self, container_id: str) -> None:
        with translated(f"killing container {container_id[:12]}"):
            try:
                self.api.kill(container_id)
            except docker.errors.APIError as exc:
                if exc.status_code not in (404, 409):  # gone, or not running: both fine
                    raise

    def remove(self, container_id: str) -> None:
        with translated(f"removing container {container_id[:12]}"):
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
        with translated(f"reading logs of {container_id[:12]}"):
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
        lines: list[str] = []
        kind, text = child.run(
            self._base_url, job, lines=lines, progress=progress, cancel=cancel, what=what
        )
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
