"""A dockerd of the tests' own, to restart, stall and start as a fault.

The machine's dockerd serves the operator too (the demo's engines run on it while the tests
run), and a dockerd without live-restore stops every container when it stops. So the faults that
stop or freeze dockerd (tests/faults, the soak) never touch the machine's: they run their engines
on a `Private` dockerd, started here beside it with every path of its own (socket, data root, exec
root with its own containerd, pid file, configuration) and a network namespace of its own. In
the machine's namespace a second dockerd deletes the machine's `docker0`: at its start when
told `--bridge=none`, and at a restart when told a bridge of its own (it clears its stale default
network by the default name), and the machine's dockerd then fails every build. In its own
namespace it has its own default bridge, no iptables rules, and networks from an address pool
of its own, which the host reaches through a veth pair and one route: the engines' ports,
published by docker-proxy on their network's gateway address as on the machine's dockerd, answer
the tests, the workers and the gateway on the host as the machine's engines do. Its socket is
group `docker`, so the tests' service user reaches it as it reaches the machine's. `stop()`
removes it and all it held, its namespace, veth pair and route too.
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
# Its addresses: one of four /21s of 172.31.224.0/19, inside Docker's own default range and away
# from the /16s the machine's dockerd takes first: its default bridge the first /24, its networks
# the other seven; the veth pair to the host a /30 of 172.31.223.0/24.
SLOTS: Final = 4
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
        short = run_id[:10]  # interface names: at most 15 characters
        self.netns = f"lucia-dockerd-{short}"
        self.bridge = f"lcdk{short}"  # its default bridge, in its namespace
        self.veth_host, self.veth_ns = f"lcdh{short}", f"lcdn{short}"
        slot = int(hashlib.sha256(run_id.encode()).hexdigest(), 16) % SLOTS
        base = 224 + 8 * slot
        self.subnet = f"172.31.{base}.0/21"  # all it gives out: the host routes it to the veth
        self.bridge_address = f"172.31.{base}.1/24"
        self.pools = [f"base=172.31.{base + n}.0/24,size=24" for n in range(1, 8)]
        self.link_host = f"172.31.223.{4 * slot + 1}"
        self.link_ns = f"172.31.223.{4 * slot + 2}"
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
            # its network namespace only: `ip netns exec` would also mount a /sys of its own,
            # without the cgroup hierarchies dockerd needs
            "nsenter",
            f"--net=/run/netns/{self.netns}",
            "--",
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
            f"--cgroup-parent=/lucia-dockerd-{self.run_id}",  # beside the machine's /docker
            *(f"--default-address-pool={pool}" for pool in self.pools),
        ]

    def _namespace(self) -> None:
        """Its network namespace, its default bridge there, and the veth pair and route that
        reach its addresses from the host (made once; a restart keeps them)."""
        if Path(f"/run/netns/{self.netns}").exists():
            return
        inside = ["ip", "netns", "exec", self.netns]
        for command in (
            ["ip", "netns", "add", self.netns],
            [*inside, "ip", "link", "set", "lo", "up"],
            [*inside, "ip", "link", "add", "name", self.bridge, "type", "bridge"],
            [*inside, "ip", "addr", "add", self.bridge_address, "dev", self.bridge],
            [*inside, "ip", "link", "set", self.bridge, "up"],
            ["ip", "link", "add", self.veth_host, "type", "veth", "peer", "name", self.veth_ns],
            ["ip", "link", "set", self.veth_ns, "netns", self.netns],
            ["ip", "addr", "add", f"{self.link_host}/30", "dev", self.veth_host],
            ["ip", "link", "set", self.veth_host, "up"],
            [*inside, "ip", "addr", "add", f"{self.link_ns}/30", "dev", self.veth_ns],
            [*inside, "ip", "link", "set", self.veth_ns, "up"],
            [*inside, "ip", "route", "add", "default", "via", self.link_host],
            ["ip", "route", "add", self.subnet, "via", self.link_ns],
        ):
            subprocess.run(command, check=True, capture_output=True)

    def start(self) -> None:
        """Start it in a session of its own; return once it answers."""
        self._namespace()
        LOGS.mkdir(parents=True, exist_ok=True)
        if self._log is None:
            self._log = self.log_path.open("ab")
        self._proc = subprocess.Popen(
            self.command(),
            stdout=self._log,
            stderr=self._log,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline:
            if self.answers():
                return
            time.sleep(0.2)
        raise AssertionError(
            f"the private dockerd did not answer within {START_S:.0f} s (log: {self.log_path})"
        )

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
            raise AssertionError(
                f"the private dockerd (pid {proc.pid}) did not stop within {START_S:.0f} s"
            ) from None

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
        for parent in Path("/sys/fs/cgroup").glob(f"*/lucia-dockerd-{self.run_id}"):
            with contextlib.suppress(OSError):  # empty once its containers are gone
                parent.rmdir()
        subprocess.run(["ip", "route", "delete", self.subnet], check=False, capture_output=True)
        subprocess.run(["ip", "link", "delete", self.veth_host], check=False, capture_output=True)
        subprocess.run(["ip", "netns", "delete", self.netns], check=False, capture_output=True)
        for tree in (self.root, self.runtime):
            mounts = [
                line.split()[1]
                for line in Path("/proc/mounts").read_text().splitlines()
                if line.split()[1].startswith(str(tree) + "/")
            ]
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
