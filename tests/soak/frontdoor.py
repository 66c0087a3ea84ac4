"""The soak's front door: the real gateway (the installed `lucia-gateway` unit of the test user)
with its record in a PostgreSQL cluster of the soak's own (tests/postgres.py), keys issued with
small budgets, and clients streaming chat completions through it for the router's model.

Clients run as threads here: some read whole streams, some leave after a few events, and a
burster sends 10 to 30 at once now and then. Each key asks with one body (one message, one
`max_tokens`), so the checker knows what each of its requests may cost. Every request is logged
as the client saw it (when it began and ended, the HTTP status, the events read, whether it
left early) in clients.jsonl, which the checker (tests/soak/frontdoor_check.py) judges beside
the record's rows and the engine's own counters.

The faults here: the gateway SIGKILLed (systemd restarts it; a start is asked for too, in case
it gave up), and the record's database stopped at once (`pg_ctl stop -m immediate`: no
checkpoint, a crash as far as the data goes) and started again.
"""

from __future__ import annotations

import contextlib
import json
import random
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import requests

from tests.postgres import Cluster, cluster
from tests.standin import free_port
from tests.system.harness import as_user, systemctl

UNIT = "lucia-gateway.service"


@dataclass(frozen=True)
class Key:
    name: str
    budget: int
    max_tokens: int
    message: str


# small budgets, so that some keys run out within the soak; the last outlasts it, so that
# traffic flows to the end
KEYS = (
    Key("soak-tiny", 1_500, 8, "Say one word."),
    Key("soak-small", 4_000, 16, "Count to five, please."),
    Key("soak-medium", 12_000, 24, "Tell me about the sea in a few words."),
    Key("soak-large", 10_000_000, 32, "Write one sentence about mountains and rivers."),
)


@dataclass
class Call:
    """One request as its client saw it."""

    key: str
    kind: str  # whole, leave, burst
    start: float
    end: float = 0.0
    status: int | None = None  # None: no answer (connection refused or reset before one)
    code: str = ""  # the error's code, when the answer was one
    events: int = 0  # data events read
    left: bool = False  # the client closed the stream before its end
    broken: bool = False  # the stream broke (connection reset, or no [DONE])
    body_bytes: int = 0
    max_tokens: int = 0


class FrontDoor:
    def __init__(self, work: Path, cli: str, seed: int) -> None:
        self.work, self.cli = work, cli
        self.rng = random.Random(seed ^ 0x5EED)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.settings = work / "gateway.toml"
        self.calls_path = work / "clients.jsonl"
        self.secrets: dict[str, str] = {}  # key name -> the issued key
        self.key_ids: dict[str, str] = {}  # the record's key id -> the key's name
        self.model = ""
        self.db: Cluster | None = None
        # two outages of the record may overlap in a schedule: each takes its turn, whole
        self._record_turn = threading.Lock()
        self.dsn = ""
        self._stack = contextlib.ExitStack()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    # -- setting up ------------------------------------------------------------------------------

    def setup(self, model: str) -> None:
        """The record's database, the gateway's settings and keys, the gateway started."""
        self.model = model
        self.db = self._stack.enter_context(cluster())
        self.dsn = self.db.database()
        owner, inference = (self.work / "owner.key", self.work / "inference.key")
        for path in (owner, inference):
            _user_file(path, random.SystemRandom().randbytes(24).hex() + "\n")
        _user_file(
            self.settings,
            f"""\
[listen]
address = "127.0.0.1"
port = {self.port}
[keys]
owner_file = "{owner}"
inference_file = "{inference}"
[record]
dsn = "{self.dsn}"
[probe]
interval_s = 0
""",
        )
        systemctl("set-environment", f"LUCIA_GATEWAY_SETTINGS={self.settings}")
        systemctl("start", UNIT)
        for key in KEYS:
            made = as_user(self.cli, "keys", "create", key.name, "--budget", str(key.budget))
            self.secrets[key.name] = made.stdout.strip()
        listed = json.loads(as_user(self.cli, "keys", "list", "--json").stdout)
        self.key_ids = {entry["id"]: entry["name"] for entry in listed}
        self.wait_up(60)

    def up(self) -> bool:
        try:
            return requests.get(self.url + "/metrics", timeout=2).status_code == 200
        except requests.RequestException:
            return False

    def wait_up(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not self.up():
            if time.monotonic() > deadline:
                raise AssertionError(f"the gateway does not answer on {self.url}")
            time.sleep(0.2)

    def config(self) -> dict[str, Any]:
        """What the checker needs: the record, the clients' log and each key's body."""
        keys = {
            key.name: {
                "budget": key.budget,
                "max_tokens": key.max_tokens,
                "prompt_estimate": len(self._body(key, False)) // 4 + 16,
            }
            for key in KEYS
        }
        return {
            "dsn": self.dsn,
            "calls": str(self.calls_path),
            "keys": keys,
            "key_ids": self.key_ids,
            "model": self.model,
        }

    # -- faults ----------------------------------------------------------------------------------

    def kill_gateway(self) -> None:
        systemctl("kill", "-s", "KILL", UNIT, check=False)
        time.sleep(3)  # systemd restarts it after 2 s
        if not self.up():
            systemctl("reset-failed", UNIT, check=False)
            systemctl("start", UNIT, check=False)

    @contextlib.contextmanager
    def record_down(self) -> Iterator[None]:
        assert self.db is not None
        with self._record_turn:
            self.db.stop("immediate")
            try:
                yield
            finally:
                self.db.start()

    # -- the clients -----------------------------------------------------------------------------

    def start_clients(self) -> None:
        for name, target in (
            ("whole", self._whole),
            ("leave", self._leave),
            ("burst", self._burst),
        ):
            thread = threading.Thread(target=target, name=f"client-{name}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop_clients(self) -> list[Call]:
        self._stop.set()
        for thread in self._threads:
            thread.join(120)
        return self.calls()

    def calls(self) -> list[Call]:
        try:
            lines = self.calls_path.read_text().splitlines()
        except FileNotFoundError:
            return []
        return [Call(**json.loads(line)) for line in lines]

    def _pick(self) -> Key:
        with self._lock:
            return self.rng.choice(KEYS)

    def _whole(self) -> None:
        while not self._stop.is_set():
            self._ask(self._pick(), "whole", None)
            self._stop.wait(self._uniform(0.05, 0.4))

    def _leave(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                after = self.rng.randint(1, 4)
            self._ask(self._pick(), "leave", after)
            self._stop.wait(self._uniform(0.05, 0.4))

    def _burst(self) -> None:
        while not self._stop.wait(self._uniform(6.0, 14.0)):
            with self._lock:
                size = self.rng.randint(10, 30)
                plan = [
                    (self.rng.choice(KEYS), self.rng.choice((None, None, 1, 2, 3)))
                    for _ in range(size)
                ]
            threads = [
                threading.Thread(target=self._ask, args=(key, "burst", after))
                for key, after in plan
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(120)

    def _uniform(self, low: float, high: float) -> float:
        with self._lock:
            return self.rng.uniform(low, high)

    def _body(self, key: Key, stream: bool = True) -> bytes:
        return json.dumps(
            {
                "model": self.model,
                "stream": stream,
                "max_tokens": key.max_tokens,
                "messages": [{"role": "user", "content": key.message}],
            }
        ).encode()

    def _ask(self, key: Key, kind: str, after: int | None) -> None:
        """One streamed chat completion; `after`: leave after that many events."""
        body = self._body(key)
        call = Call(key.name, kind, time.time(), body_bytes=len(body), max_tokens=key.max_tokens)
        try:
            with requests.post(
                self.url + "/v1/chat/completions",
                data=body,
                stream=True,
                timeout=(5, 60),
                headers={
                    "Authorization": f"Bearer {self.secrets[key.name]}",
                    "Content-Type": "application/json",
                },
            ) as answer:
                call.status = answer.status_code
                if answer.status_code != 200:
                    with contextlib.suppress(ValueError, requests.RequestException):
                        call.code = str(answer.json().get("error", {}).get("code", ""))
                else:
                    self._read(answer, call, after)
        except requests.RequestException:
            call.broken = True
        call.end = time.time()
        with self._lock, self.calls_path.open("a") as out:
            out.write(json.dumps(asdict(call)) + "\n")

    def _read(self, answer: requests.Response, call: Call, after: int | None) -> None:
        done = False
        for line in answer.iter_lines():
            if not line.startswith(b"data:"):
                continue
            if line.strip() == b"data: [DONE]":
                done = True
                break
            call.events += 1
            if after is not None and call.events >= after:
                call.left = True
                return
        call.broken = not done

    def cleanup(self) -> None:
        self._stop.set()
        systemctl("stop", UNIT, check=False)
        systemctl("unset-environment", "LUCIA_GATEWAY_SETTINGS", check=False)
        self._stack.close()


def _user_file(path: Path, text: str) -> None:
    """A file of the test user's, mode 0600, written as that user."""
    as_user(
        "sh",
        "-c",
        'umask 077 && cat > "$1.tmp" && mv "$1.tmp" "$1"',
        "write",
        str(path),
        input=text,
    )
