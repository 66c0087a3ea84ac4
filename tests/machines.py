"""Several "machines" on this one: network namespaces of the test's own, joined by a switch.

    with machines(3, reach=[docker_subnet]) as fleet:
        one, two, three = fleet
        two.popen([sys.executable, "-m", "http.server", "--bind", two.address], user="lucia-test")
        one.run(["ip", "-j", "addr"])  # its own lo and eth0 (one.address) only
        two.cut()  # a pulled cable: silence, no RST, for everyone on either side
        two.mend()

The layout, all of it made and removed here (names carry the set's random id, `lucia-t<id>`):

    root namespace                switch namespace lucia-t<id>-sw     machine lucia-t<id>-<i>
    lt<id> (the switch address,   lt<id>br: a bridge, with ports:
      <subnet>.1)  <--veth-->       lt<id>up
                                    lt<id>p<i>        <--veth-->      eth0 (<subnet>.<i+1>), lo

- The bridge lives in a namespace of its own, not in the root namespace: dockerd loads
  br_netfilter and sets `net.bridge.bridge-nf-call-iptables = 1` and the FORWARD policy DROP, so
  frames bridged in the root namespace between two machines would pass the host's FORWARD chain
  and be dropped. In a namespace of ours the host's firewall never sees them, and nothing of the
  host's firewall is changed. The root namespace holds only one veth end, `lt<id>`, with the
  switch address: the tests' PostgreSQL listens there, and the machines reach the host through it.
- The subnet: a /24 of 100.64.0.0/10 that nothing here uses (tests/machine_subnet.py says why
  that space), chosen under a lock, so that two sets at once never share one.
- Engines: the machines share the host's dockerd. A container publishes on its network's gateway
  address in the root namespace (172.17.0.1, or a user network's); `reach` routes such a subnet
  from each machine via the switch address, and dockerd's DNAT rule for a published port
  (`! -i <its bridge> -d <gateway> --dport P`) and its FORWARD accept match packets that come in
  on `lt<id>` as they match any other interface's. A dockerd per machine would need its own data
  root, containerd and a copy of every image, too heavy for this 2-core machine. A worker may
  run inside its machine: dockerd's socket is a file, reached from any namespace.
- `cut()` sets the machine's port on the switch down: its eth0 loses carrier, as if its cable
  were pulled. Packets of established TCP connections are dropped without a RST either way (the
  peer's reads see silence, its retransmissions wait), new connections time out or fail with
  EHOSTUNREACH once ARP gives up, and `mend()` brings it back: a connection that was established
  goes on. Its engines are on the far side of the cable too (they live in the root namespace).
- Processes run in a machine's namespace only (`nsenter --net`, not `ip netns exec`, which would
  also mount a /sys of its own), as root or as a user through `setpriv`, which execs: the pid
  the test holds is the process itself, its signals reach it.
- Cleanup (the context's end, an exception or Ctrl-C): every process in the set's namespaces is
  ended, the veths, namespaces and the root's veth deleted, and a check that none remains. A set
  whose owner died (SIGKILL) is swept by the next set made: its ledger in /run/lucia-test-machines
  names what it made and who owned it; nothing else is ever touched.

Needs root, iproute2 (`ip`, `ip netns`), util-linux (`nsenter`, `setpriv`) and a kernel with
network namespaces, veth and bridge.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pwd
import random
import secrets
import signal
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.machine_subnet import Net, choose

LEDGER = Path("/run/lucia-test-machines")
STOP_S = 10.0  # SIGTERM to SIGKILL for processes left in a namespace


class MachinesError(RuntimeError):
    """The machines could not be made or removed (not root, a command of `ip` refused)."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=False)
    if check and done.returncode != 0:
        raise MachinesError(f"ip {' '.join(args)}: {done.stderr.strip() or done.returncode}")
    return done


# -- one machine --------------------------------------------------------------------------------


def user_env(user: str | None, env: Mapping[str, str] | None) -> dict[str, str]:
    """The environment a process gets: `env` (this process's when None), with the user's HOME,
    USER and LOGNAME when it runs as a user."""
    made = dict(os.environ if env is None else env)
    if user is not None:
        entry = pwd.getpwnam(user)
        made.update(HOME=entry.pw_dir, USER=user, LOGNAME=user)
    return made


@dataclass(frozen=True)
class Machine:
    """One machine: its namespace, its address on the switch and the switch's."""

    name: str  # its namespace's name, lucia-t<id>-<i>: also a valid [fleet] machine name
    index: int  # 1, 2, ...
    address: str  # on the switch, in the set's subnet
    switch: str  # the switch address: the root namespace's, where the host is reached
    subnet: str  # the set's /24
    port: str  # its port on the switch (in the switch namespace)
    switch_ns: str

    @property
    def netns_path(self) -> str:
        return f"/run/netns/{self.name}"

    def prefix(self, user: str | None = None) -> list[str]:
        """The argv prefix that runs a command in this machine (as `user`, with its groups)."""
        inside = ["nsenter", f"--net={self.netns_path}", "--"]
        if user is None:
            return inside
        entry = pwd.getpwnam(user)
        return [
            *inside,
            "setpriv",
            f"--reuid={entry.pw_uid}",
            f"--regid={entry.pw_gid}",
            "--init-groups",
            "--",
        ]

    def popen(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        user: str | None = None,
        **kwargs: Any,
    ) -> subprocess.Popen[Any]:
        """subprocess.Popen of argv in this machine; kwargs as Popen's. Ended at the set's end
        if it still runs."""
        return subprocess.Popen([*self.prefix(user), *argv], env=user_env(user, env), **kwargs)

    def run(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        user: str | None = None,
        timeout: float = 60,
        check: bool = True,
        input: str | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """argv run to its end in this machine; its output as text."""
        return subprocess.run(
            [*self.prefix(user), *argv],
            env=user_env(user, env),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=check,
            input=input,
        )

    def holds(self, pid: int) -> bool:
        """Does the process run in this machine's network namespace?"""
        return os.stat(f"/proc/{pid}/ns/net").st_ino == os.stat(self.netns_path).st_ino

    def cut(self) -> None:
        """Off the network: its port on the switch down (a pulled cable, see the docstring)."""
        _ip("-n", self.switch_ns, "link", "set", self.port, "down")

    def mend(self) -> None:
        """Back on the network."""
        _ip("-n", self.switch_ns, "link", "set", self.port, "up")

    def connected(self) -> bool:
        """Is its port on the switch up?"""
        [link] = json.loads(_ip("-n", self.switch_ns, "-j", "link", "show", self.port).stdout)
        return "UP" in link.get("flags", [])


# -- the set ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Names:
    """What one set makes, by name: all a sweep needs."""

    id: str
    count: int

    @property
    def prefix(self) -> str:  # namespaces
        return f"lucia-t{self.id}"

    @property
    def link_prefix(self) -> str:  # interfaces: at most 15 characters, so a shorter prefix
        return f"lt{self.id}"

    @property
    def switch_ns(self) -> str:
        return f"{self.prefix}-sw"

    @property
    def uplink(self) -> str:  # in the root namespace
        return self.link_prefix

    @property
    def bridge(self) -> str:
        return f"{self.link_prefix}br"

    @property
    def uplink_peer(self) -> str:
        return f"{self.link_prefix}up"

    def machine_ns(self, index: int) -> str:
        return f"{self.prefix}-{index}"

    def port(self, index: int) -> str:
        return f"{self.link_prefix}p{index}"

    def namespaces(self) -> list[str]:
        return [*(self.machine_ns(i) for i in range(1, self.count + 1)), self.switch_ns]


class Machines:
    """A set of machines on one switch; made by `machines()`, which removes it."""

    def __init__(self, names: Names, subnet: Net) -> None:
        self.names = names
        self.subnet = subnet
        hosts = list(subnet.hosts())
        self.switch = str(hosts[0])
        self.reached: list[str] = []
        self.machines = [
            Machine(
                name=names.machine_ns(i),
                index=i,
                address=str(hosts[i]),
                switch=self.switch,
                subnet=str(subnet),
                port=names.port(i),
                switch_ns=names.switch_ns,
            )
            for i in range(1, names.count + 1)
        ]

    def __iter__(self) -> Iterator[Machine]:
        return iter(self.machines)

    def __len__(self) -> int:
        return len(self.machines)

    def __getitem__(self, index: int) -> Machine:
        return self.machines[index]

    def reach(self, *subnets: str) -> None:
        """Route these subnets (dockerd's networks) from every machine via the switch address."""
        for subnet in subnets:
            for machine in self.machines:
                _ip("-n", machine.name, "route", "replace", subnet, "via", self.switch)
            self.reached.append(subnet)


def _make(names: Names, subnet: Net) -> Machines:
    """Make the switch, the root's veth end with the switch address, then each machine."""
    made = Machines(names, subnet)
    sw = names.switch_ns
    _ip("netns", "add", sw)
    _ip("-n", sw, "link", "set", "lo", "up")
    _ip("-n", sw, "link", "add", names.bridge, "type", "bridge")
    _ip("-n", sw, "link", "set", names.bridge, "up")
    # made in place, so that no transient name appears in a namespace it does not belong to
    _ip("link", "add", names.uplink, "type", "veth", "peer", "name", names.uplink_peer, "netns", sw)
    with contextlib.suppress(OSError):  # no IPv6 link-local address, no chatter on the host's side
        Path(f"/proc/sys/net/ipv6/conf/{names.uplink}/disable_ipv6").write_text("1\n")
    _ip("addr", "add", f"{made.switch}/{subnet.prefixlen}", "dev", names.uplink)
    _ip("-n", sw, "link", "set", names.uplink_peer, "master", names.bridge, "up")
    _ip("link", "set", names.uplink, "up")
    for machine in made.machines:
        _ip("netns", "add", machine.name)
        _ip("-n", machine.name, "link", "set", "lo", "up")
        _ip(
            "-n", machine.name, "link", "add", "eth0", "type", "veth",
            "peer", "name", machine.port, "netns", sw,
        )  # fmt: skip
        _ip("-n", sw, "link", "set", machine.port, "master", names.bridge, "up")
        _ip("-n", machine.name, "addr", "add", f"{machine.address}/24", "dev", "eth0")
        _ip("-n", machine.name, "link", "set", "eth0", "up")
    return made


def _pids(namespace: str) -> list[int]:
    done = _ip("netns", "pids", namespace, check=False)
    return [int(word) for word in done.stdout.split()] if done.returncode == 0 else []


def _end_processes(names: Names) -> None:
    """SIGTERM every process in the set's namespaces, SIGKILL what is left after STOP_S."""
    deadline = time.monotonic() + STOP_S
    sent = signal.SIGTERM
    while True:
        pids = [pid for ns in names.namespaces() for pid in _pids(ns)]
        if not pids:
            return
        if time.monotonic() > deadline:
            sent = signal.SIGKILL
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)  # a stopped process cannot act on SIGTERM
                os.kill(pid, sent)
        time.sleep(0.1)


def leftovers(names: Names) -> list[str]:
    """What of the set exists still: namespaces and root-namespace interfaces by its names."""
    spaces = _ip("netns", "list").stdout.split()
    links = [link["ifname"] for link in json.loads(_ip("-j", "link", "show").stdout)]
    return [
        *(ns for ns in spaces if ns.startswith(names.prefix + "-")),
        *(link for link in links if link.startswith(names.link_prefix)),
    ]


def remove(names: Names) -> None:
    """Everything the set made, gone; MachinesError naming what could not be removed."""
    _end_processes(names)
    _ip("link", "delete", names.uplink, check=False)  # its peer on the switch goes with it
    for index in range(1, names.count + 1):  # each machine's eth0 goes with its port
        _ip("-n", names.switch_ns, "link", "delete", names.port(index), check=False)
    for namespace in names.namespaces():
        if Path(f"/run/netns/{namespace}").exists():
            _ip("netns", "delete", namespace, check=False)
    (LEDGER / names.id).unlink(missing_ok=True)
    left = leftovers(names)
    if left:
        raise MachinesError(f"machines {names.id}: could not remove {', '.join(left)}")


# -- the ledger: who owns which set, so a set whose owner was killed is swept -------------------


def _started(pid: int) -> str | None:
    """A process's start time (its /proc stat's 22nd field): a pid reused is another process."""
    try:
        return (Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split())[19]
    except (OSError, IndexError):
        return None


def sweep() -> list[str]:
    """Remove the sets whose owner no longer runs; the ids swept."""
    swept = []
    for entry in sorted(LEDGER.glob("[0-9a-f]*")):
        try:
            record = json.loads(entry.read_text())
        except (OSError, ValueError):
            continue
        if _started(int(record["pid"])) == record["started"]:
            continue  # its owner still runs
        with contextlib.suppress(MachinesError):
            remove(Names(record["id"], int(record["count"])))
            swept.append(record["id"])
    return swept


@contextlib.contextmanager
def _locked() -> Iterator[None]:
    LEDGER.mkdir(mode=0o755, exist_ok=True)
    with (LEDGER / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@contextlib.contextmanager
def machines(
    count: int, reach: Sequence[str] = (), subnet: str | None = None
) -> Iterator[Machines]:
    """`count` machines on one switch (the docstring says how), with routes to `reach`
    (dockerd's subnets); all of it removed at the end, however the body ends."""
    if os.geteuid() != 0:
        raise MachinesError("the machines are network namespaces: run the tests as root")
    if not 1 <= count <= 200:
        raise MachinesError(f"{count} machines: from 1 to 200")
    sweep()
    names = Names(secrets.token_hex(3), count)
    try:
        with _locked():
            net = choose(subnet, random.Random(names.id))
            pid = os.getpid()
            record = {"id": names.id, "count": count, "pid": pid, "started": _started(pid)}
            (LEDGER / names.id).write_text(json.dumps(record) + "\n")
            made = _make(names, net)  # under the lock: the next set sees the switch address
        made.reach(*reach)
        yield made
    finally:
        remove(names)
