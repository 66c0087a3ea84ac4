"""A dockerd of the tests' own, to restart, stall and start as a fault.

The machine's dockerd serves the operator too (the demo's engines run on it while the tests
run), and a dockerd without live-restore stops every container when it stops. So the faults that
stop or freeze dockerd (tests/faults, the soak) never touch the machine's: they run their engines
on a `Private` dockerd, started here beside it with every path of its own (socket, data root, exec
root with its own containerd, pid file, configuration), a default bridge of its own (never
`docker0`: a dockerd told `--bridge=none` deletes the machine's `docker0`, which the machine's
dockerd needs for every build), no iptables rules (the engines' ports are published by
docker-proxy on their network's gateway address, as on the machine's dockerd), and networks from
an address pool of its own. Its socket is group `docker`, so the
tests' service user reaches it as it reaches the machine's. `stop()` removes it and all it held.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Final

import docker

LOGS: Final = Path("/var/log/lucia-machine")
# the networks of a private dockerd: inside Docker's own default range, away from the /16s the
# machine's dockerd takes first; Docker skips a subnet that a route of the host already holds
ADDRESS_POOL: Final = "base=172.31.240.0/20,size=24"
BRIDGE_NETS: Final = 16  # its default bridge: one of 172.31.224.0/24 to 172.31.239.0/24
START_S: Final = 60.0


class Private:
    """One private dockerd (not started until `start()`); `host` is its DOCKER_HOST."""

    def __init__(self, run_id: str, log_name: str = "dockerd-private.log") -> None:
        self.run_id = run_id
        self.root = Path(tempfile.mkdtemp(prefix=f"lucia-dockerd-{run_id}-", dir="/var/tmp"))
        # unix socket paths are short (108 bytes): the socket and the exec root live under /run
        self.runtime = Path(tempfile.mkdtemp(prefix=f"lucia-dockerd-{run_id}-", dir="/run"))
        self.runtime.chmod(0o755)  # the socket's own mode and group decide who reaches it
        self.socket = self.runtime / "docker.sock"
        self.pidfile = self.runtime / "docker.pid"
        self.config = self.root / "daemon.json"
        self.config.write_text("{}\n")  # never the machine's /etc/docker/daemon.json
        self.log_path = LOGS / log_name
        self.bridge = f"lcdk{run_id[:10]}"  # an interface name: at most 15 characters
        octet = 224 + int(hashlib.sha256(run_id.encode()).hexdigest(), 16) % BRIDGE_NETS
        self.bridge_address = f"172.31.{octet}.1/24"
        self._log: IO[bytes] | None = None
        self._proc: subprocess.Popen[bytes] | None = None  # its child: reaped when it exits

    @property
    def host(self) -> str:
        return f"unix://{self.socket}"

    def env(self) -> dict[str, str]:
        """What a process needs to use this dockerd: the docker CLI, the SDK, a worker."""
        return {"DOCKER_HOST": self.host}

    def client(self, timeout: int = 120) -> docker.DockerClient:
        return docker.DockerClient(base_url=self.host, timeout=timeout)

    def command(self) -> list[str]:
        return [
            "dockerd",
            f"--config-file={self.config}",
            f"--host={self.host}",
            f"--data-root={self.root / 'data'}",
            f"--exec-root={self.runtime / 'exec'}",
            f"--pidfile={self.pidfile}",
            "--group=docker",
            f"--bridge={self.bridge}",
            "--iptables=false",
            "--ip-masq=false",
            "--live-restore=false",
            f"--cgroup-parent=lucia-dockerd-{self.run_id}",
            f"--default-address-pool={ADDRESS_POOL}",
        ]

    def _make_bridge(self) -> None:
        if Path(f"/sys/class/net/{self.bridge}").exists():
            return
        for command in (["ip", "link", "add", "name", self.bridge, "type", "bridge"],
                        ["ip", "addr", "add", self.bridge_address, "dev", self.bridge],
                        ["ip", "link", "set", self.bridge, "up"]):
            subprocess.run(command, check=True, capture_output=True)

    def start(self) -> None:
        """Start it in a session of its own; return once it answers."""
        self._make_bridge()
        LOGS.mkdir(parents=True, exist_ok=True)
        if self._log is None:
            self._log = self.log_path.open("ab")
        self._proc = subprocess.Popen(self.command(), stdout=self._log, stderr=self._log,
                                      stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline:
            if self.answers():
                return
            time.sleep(0.2)
        raise AssertionError(f"the private dockerd did not answer within {START_S:.0f} s "
                             f"(log: {self.log_path})")

    def pid(self) -> int:
        if self._proc is None or self._proc.poll() is not None:
            raise ProcessLookupError("the private dockerd does not run")
        return self._proc.pid

    def answers(self) -> bool:
        try:
            with contextlib.closing(self.client(timeout=5)) as cli:
                return bool(cli.ping())
        except (docker.errors.DockerException, OSError, ValueError):
            return False

    def _terminate(self) -> None:
        """SIGTERM (a stalled dockerd is woken first, so that it can stop); wait for it."""
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGCONT)
        proc.terminate()
        try:
            proc.wait(START_S)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the private dockerd (pid {proc.pid}) did not stop within "
                                 f"{START_S:.0f} s") from None

    def restart(self) -> None:
        """Stopped and started again, as a package upgrade does it: without live-restore, its
        containers die with it."""
        self._terminate()
        self.start()

    @contextlib.contextmanager
    def stalled(self) -> Iterator[int]:
        """SIGSTOP for the body of the `with` (its pid given), then SIGCONT."""
        pid = self.pid()
        os.kill(pid, signal.SIGSTOP)
        try:
            yield pid
        finally:
            with contextlib.suppress(ProcessLookupError):  # restarted meanwhile
                os.kill(pid, signal.SIGCONT)

    def resume(self) -> None:
        """Whatever a fault left (a stall, a stop half done): running and answering."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid(), signal.SIGCONT)
        if not self.answers():
            self.restart()

    def load(self, source: docker.DockerClient, reference: str) -> None:
        """An image of the machine's dockerd copied in (`docker save | docker load`)."""
        with contextlib.closing(self.client()) as target:
            target.images.load(b"".join(source.images.get(reference).save(named=True)))

    def stop(self) -> None:
        """Stopped, and everything it held removed (containers, images, networks, files)."""
        with contextlib.suppress(docker.errors.DockerException, OSError):
            if self.answers():
                with contextlib.closing(self.client()) as cli:
                    for container in cli.containers.list(all=True):
                        container.remove(force=True)
        try:
            self._terminate()
        finally:
            self._remove()

    def _remove(self) -> None:
        subprocess.run(["ip", "link", "delete", self.bridge], check=False, capture_output=True)
        for tree in (self.root, self.runtime):
            mounts = [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()
                      if line.split()[1].startswith(str(tree) + "/")]
            for mount in sorted(mounts, key=len, reverse=True):
                subprocess.run(["umount", "-l", mount], check=False, capture_output=True)
            shutil.rmtree(tree, ignore_errors=True)
        if self._log is not None:
            self._log.close()
            self._log = None


@contextlib.contextmanager
def private(run_id: str, log_name: str = "dockerd-private.log") -> Iterator[Private]:
    """A private dockerd, started; stopped and removed at the end."""
    daemon = Private(run_id, log_name)
    try:
        daemon.start()
        yield daemon
    finally:
        daemon.stop()
