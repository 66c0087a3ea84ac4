"""The gateway as its real process, for the tests on the real engines.

`python -m supervisor.cli gateway --settings FILE --data-dir DATA` on 127.0.0.1 and a free port,
with an owner and an inference key in files the test writes and an issued key from `keys create`
(named `tests-<port>`, so that gateways one after another may share a data directory). The keys
reach the gateway through files only; its log is kept, to be searched for them.

Inside one of the fleet tests' machines (tests/machines.py) it is started with that machine's
`prefix()` before its command and listens on the machine's `address`: the test, in the root
namespace, reaches it there through the switch.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai

from tests.fixtures import CLI, ROOT
from tests.standin import free_port


@dataclass
class Gateway:
    """A running gateway: its URL, keys, data directory and log."""

    url: str  # http://ADDRESS:PORT (127.0.0.1 unless started with another)
    data_dir: Path
    owner: str
    inference: str
    issued: str  # a lucia_inf_ key from `keys create`
    log: Path
    proc: subprocess.Popen[bytes]

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*CLI, *args, "--data-dir", str(self.data_dir)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )

    def create_key(self, name: str, *extra: str) -> str:
        return self.cli("keys", "create", name, *extra).stdout.strip()

    def client(
        self, key: str | None = None, timeout: float = 120, retries: int = 0
    ) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=self.url + "/v1",
            api_key=key or self.issued,
            timeout=timeout,
            max_retries=retries,
        )

    def get(self, path: str, key: str | None = None) -> tuple[int, Any]:
        """A GET's status and its JSON (or text) body; an error status is returned, not raised."""
        request = urllib.request.Request(self.url + path)
        if key is not None:
            request.add_header("Authorization", f"Bearer {key}")
        try:
            with urllib.request.urlopen(request, timeout=30) as answer:
                status, raw = answer.status, answer.read()
        except urllib.error.HTTPError as error:
            status, raw = error.code, error.read()
        try:
            return status, json.loads(raw)
        except ValueError:
            return status, raw.decode(errors="replace")

    def metrics(self) -> str:
        status, text = self.get("/metrics")
        assert status == 200
        return str(text)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of a Prometheus text exposition's samples of `name` whose labels include these."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        head, _, value = line.rpartition(" ")
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total


def _wait_listening(gateway: Gateway, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if gateway.proc.poll() is not None:
            raise AssertionError(
                f"the gateway exited ({gateway.proc.returncode}):\n{gateway.log_text()[-3000:]}"
            )
        with contextlib.suppress(OSError):
            if gateway.get("/metrics")[0] == 200:
                return
        time.sleep(0.1)
    raise AssertionError(f"the gateway did not listen:\n{gateway.log_text()[-3000:]}")


@contextlib.contextmanager
def running_gateway(
    work: Path,
    data_dir: Path,
    settings: str = "",
    listen: str = "",
    keys: tuple[str, str] | None = None,
    *,
    address: str = "127.0.0.1",
    prefix: Sequence[str] = (),
    port: int | None = None,
) -> Iterator[Gateway]:
    """The gateway over `data_dir`, with `listen` (TOML lines) in [listen] and `settings`
    (TOML sections) after [listen] and [keys]. The probe is off unless `settings` name
    [probe]: a test counts the requests and rows of its own callers. It listens on `address`,
    and `prefix` comes before its command (a machine's: `Machine.prefix()`). `keys`: the owner
    and inference keys (gateways that take the same clients share them); new ones if None.
    `port`: a free one if None (a fleet's settings name their own, in `advertise`)."""
    work.mkdir(parents=True, exist_ok=True)
    owner, inference = keys or (secrets.token_urlsafe(32), secrets.token_urlsafe(32))
    for name, key in (("owner.key", owner), ("inference.key", inference)):
        (work / name).write_text(key + "\n")
        (work / name).chmod(0o600)
    port = port or free_port()
    path = work / "gateway.toml"
    path.write_text(
        f'[listen]\naddress = "{address}"\nport = {port}\n{listen}'
        f'[keys]\nowner_file = "{work / "owner.key"}"\n'
        f'inference_file = "{work / "inference.key"}"\n'
        + settings
        + ("" if "[probe]" in settings else "\n[probe]\ninterval_s = 0\n")
    )
    log = work / "gateway.log"
    issued = subprocess.run(
        [*CLI, "keys", "create", f"tests-{port}", "--data-dir", str(data_dir)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.strip()
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [*prefix, *CLI, "gateway", "--settings", str(path), "--data-dir", str(data_dir)],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    gateway = Gateway(f"http://{address}:{port}", data_dir, owner, inference, issued, log, proc)
    try:
        _wait_listening(gateway)
        yield gateway
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
