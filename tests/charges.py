"""What a request is charged against what its engine generated, on the real parts.

The real gateway process (tests/gateway_proc.py) and its SQLite record in front of one real
engine, whose status.json a heartbeat here keeps fresh: `ENGINE` serves the model as the engine
knows it, `LATE` serves `<model>-late` with a short deadline (`[engines.late] deadline_s`). One
request at a time, so the engine's own counters (its /metrics) moved for that request only:
the engine's prompt and generated tokens before and after it, against the record's row. The
rows of the module are kept as a table (`LUCIA_CHARGES_TABLE`, if set, gets it as TSV).
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import openai
from docker.models.containers import Container

from supervisor.protocol.documents import Status, dump, utc_now
from supervisor.protocol.files import ensure_dir, write_atomic
from tests.charge_cases import HELLO
from tests.gateway_proc import Gateway, metric, running_gateway

ENGINE = "charged"
LATE = "late"
DEADLINE_S = 0.2
HEARTBEAT_S = 5.0


@dataclass(frozen=True)
class Counters:
    """An engine's own counts so far: prompt tokens, tokens generated; and the requests it
    holds now (running and waiting), which it counts only once they end."""

    prompt: float
    generated: float
    busy: float = 0.0


def read_counters(url: str, prompt: str, generated: str, busy: tuple[str, ...]) -> Counters:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as answer:
        text = answer.read().decode()
    held = sum(metric(text, name) for name in busy)
    return Counters(metric(text, prompt), metric(text, generated), held)


@dataclass(frozen=True)
class Charge:
    """One row of the table."""

    engine: str
    route: str
    way: str
    outcome: str
    usage_source: str
    engine_prompt: int
    engine_generated: int
    charged_prompt: int
    charged_completion: int

    @property
    def under(self) -> int:
        """Tokens the engine counted that the row did not charge (0 when none)."""
        engine = self.engine_prompt + self.engine_generated
        return max(engine - self.charged_prompt - self.charged_completion, 0)


def _status(url: str, models: tuple[str, ...]) -> bytes:
    now = utc_now()
    return dump(
        Status(
            generation=1,
            state="running",
            since=now,
            message="running",
            url=url,
            checked_at=now,
            models=models,
        )
    )


@dataclass
class Charges:
    """The gateway in front of one engine, and the table of what each request cost."""

    gateway: Gateway
    engine_url: str
    model: str
    counters: Callable[[], Counters]
    kind: str  # the engine, in the table
    table: list[Charge]

    def rows(self) -> int:
        path = self.gateway.data_dir / "record" / "record.sqlite3"
        if not path.exists():
            return 0
        with sqlite3.connect(path) as db:
            return int(db.execute("SELECT COUNT(*) FROM generations").fetchone()[0])

    def last_row(self) -> tuple[str, str, int, int]:
        path = self.gateway.data_dir / "record" / "record.sqlite3"
        with sqlite3.connect(path) as db:
            found = db.execute(
                "SELECT outcome, usage_source, prompt_tokens, completion_tokens "
                "FROM generations ORDER BY rowid DESC LIMIT 1"
            ).fetchone()
        return str(found[0]), str(found[1]), int(found[2] or 0), int(found[3] or 0)

    def idle(self, timeout: float = 600) -> Counters:
        """The engine's counters once it holds no request and they stopped moving: an engine
        counts a request it cancelled when it notices, and a request past the gateway's
        deadline may still run there."""
        deadline = time.monotonic() + timeout
        last = self.counters()
        while time.monotonic() < deadline:
            time.sleep(0.3)
            now = self.counters()
            if now == last and not now.busy:
                return now
            last = now
        raise AssertionError(f"the engine did not go idle within {timeout} s: {last}")

    def settled(self, before: int, timeout: float = 60) -> Counters:
        """The engine's counters once the request's row is in the record and it is idle."""
        deadline = time.monotonic() + timeout
        while self.rows() <= before:
            if time.monotonic() > deadline:
                log = self.gateway.log_text()[-2000:]
                raise AssertionError(f"no row within {timeout} s:\n{log}")
            time.sleep(0.05)
        return self.idle()

    def measure(self, route: str, way: str, ask: Callable[[], object]) -> Charge:
        """Ask once; the row it left against what the engine counted for it."""
        before_rows, before = self.rows(), self.idle()
        ask()
        after = self.settled(before_rows)
        assert self.rows() == before_rows + 1, "one row for one request"
        outcome, source, prompt, completion = self.last_row()
        charge = Charge(
            self.kind,
            route,
            way,
            outcome,
            source,
            int(after.prompt - before.prompt),
            int(after.generated - before.generated),
            prompt,
            completion,
        )
        self.table.append(charge)
        return charge

    def killed_mid_stream(self, model: str, tokens: int, engine: Container) -> Charge:
        """A chat stream whose engine (a docker container) is killed after 8 events: its row,
        charged at least the events the client got (the first is the role, no token), from the
        engine's own running count. The engine's counters die with it: -1 in the table.

        The engine is first held back (`held_back`): it is killed, never let go."""
        engine.update(**HELD_BACK)
        client = self.gateway.client(timeout=300)
        before = self.rows()
        got = 0
        stream = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": HELLO}],
            max_tokens=tokens,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        try:
            for _chunk in stream:
                got += 1
                if got == 8:
                    engine.kill()
        except openai.APIError:
            pass
        deadline = time.monotonic() + 60
        while self.rows() <= before and time.monotonic() < deadline:
            time.sleep(0.1)
        outcome, source, prompt, completion = self.last_row()
        charge = Charge(
            self.kind, "chat", "engine killed", outcome, source, -1, -1, prompt, completion
        )
        self.table.append(charge)
        assert (outcome, source) == ("engine_failed", "engine_partial"), charge
        assert prompt > 0 and completion >= got - 1, (got, charge)
        return charge


# 5% of one CPU: unthrottled, a small model generates a whole long answer into the sockets'
# buffers before a busy client has read a few events, and a client that leaves, or a kill,
# comes after the end it means to cut
HELD_BACK: Final = {"cpu_period": 100_000, "cpu_quota": 5_000}


@contextmanager
def held_back(engine: Container) -> Iterator[None]:
    """The engine (a docker container) on 5% of one CPU while the block runs."""
    engine.update(**HELD_BACK)
    try:
        yield
    finally:
        engine.update(cpu_quota=-1)


def write_table(table: list[Charge]) -> None:
    target = os.environ.get("LUCIA_CHARGES_TABLE")
    if not target or not table:
        return
    fields = list(Charge.__dataclass_fields__)
    with open(target, "a", encoding="utf-8") as out:
        for charge in table:
            out.write("\t".join(str(getattr(charge, name)) for name in fields) + "\n")


@contextmanager
def charging(
    work: Path, kind: str, engine_url: str, model: str, counters: Callable[[], Counters]
) -> Iterator[Charges]:
    """The gateway and its record in front of the engine at `engine_url`."""
    data = work / "data"
    statuses = {ENGINE: (model,), LATE: (f"{model}-late",)}

    def beat() -> None:
        for name, models in statuses.items():
            write_atomic(ensure_dir(data / name) / "status.json", _status(engine_url, models))

    beat()
    stop = threading.Event()

    def heartbeat() -> None:
        while not stop.wait(HEARTBEAT_S):
            beat()

    thread = threading.Thread(target=heartbeat, daemon=True)
    thread.start()
    settings = f"[limits]\nrunning = 1\n[engines.{LATE}]\ndeadline_s = {DEADLINE_S}\n"
    table: list[Charge] = []
    try:
        with running_gateway(work / "gateway", data, settings) as gateway:
            yield Charges(gateway, engine_url, model, counters, kind, table)
    finally:
        stop.set()
        thread.join()
        write_table(table)
