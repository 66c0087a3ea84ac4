"""The front door's invariants, judged against truths the gateway does not make: what each
client saw (clients.jsonl), the record's rows (read with psycopg, not the product's store), the
router engine's own counters (llama-server's /metrics), desired.json as a host reads it, and the
runner's events. The judging functions are pure, so that a table of made-up observations shows
each one can fail (tests/unit/test_soak_checker.py).

Generations are counted by the clients, tokens by the engine. llama-server's /metrics counts
tokens (`llamacpp:tokens_predicted_total`) but no requests, counts a request only once it ends,
and loses its counts with its container; its log lines go with the container too. So:

- one row per generation: every request the gateway routed (each client request that got an
  answer, but for the refusals made before routing: 400, 401, 404, 408, 413, and 429
  `bodies_busy` / `too_many_failures`) has exactly one row. A request whose row may be lost by a
  fault (it ended within COMMIT_S before a gateway kill, or while the record was down, or
  within WRITER_BACK_S after it came back, when the writer may not have retried yet) is
  `maybe`; every other is `sure`. Per key: sure <= rows <= sure + maybe.
- every token generated is charged: the engine's generated tokens (the sum over its lives of
  the last count sampled in each; samples every SAMPLE_S, so tokens generated after the last
  sample before a kill are not counted, which can only make the check weaker) are at most the
  completion tokens charged to its rows, plus the max_tokens of every `maybe` request (one
  whose row may be lost: the engine generated at most its n_predict for it).
- no key spent past its budget plus its reservations: a request is admitted only when what is
  spent, what requests in flight hold, and its own bound fit the budget. So at the admission of
  the key's last admitted request, every row either was in the total already or was in flight
  (holding its bound); the key's total is at most the budget plus what those rows cost past
  their bounds (a prompt the engine counts longer than the estimate, a stream left early that
  is charged its count and AFTER_CLOSE), plus every row admitted while no budget was known
  (the record down, and WRITER_BACK_S after). A row's excess: max(0, prompt - estimate) +
  max(0, completion - max_tokens), from the key's one body.
- no engine an operator stopped is started by traffic: in each engine's desired.json
  generations, in order, a `running` by the gateway never follows an operator's `stopped`
  (or a `stopped` with no requestedBy, as an older host wrote) without an operator's
  `running` between them. Generations are sampled every 100 ms; where one was missed between
  two seen (a gap), whoever wrote it is unknown and the next is not judged against the
  operator's stop before the gap.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from tests.gateway_proc import metric

COMMIT_S: Final = 1.5  # a row is committed within 1 s of its request's end (writer.py says)
WRITER_BACK_S: Final = 16.0  # the record's writer retries within 15 s once the database is back
SAMPLE_S: Final = 0.5
CLOCKS_S: Final = 0.1
AFTER_CLOSE: Final = 16  # what an early-ended stream is charged past its engine's count
UNROUTED: Final = frozenset({400, 401, 404, 408, 413})
UNROUTED_CODES: Final = frozenset({"bodies_busy", "too_many_failures"})


@dataclass(frozen=True)
class Row:
    at: float  # when its request arrived, seconds since the epoch
    key: str  # the key's name (the record keeps its id; the runner maps it)
    engine: str
    outcome: str
    source: str
    prompt: int
    completion: int
    duration: float


@dataclass
class Lives:
    """An engine's counters over its lives: a count that falls is a new life."""

    prompt: list[float] = field(default_factory=lambda: [0.0])
    generated: list[float] = field(default_factory=lambda: [0.0])
    samples: int = 0

    def add(self, prompt: float, generated: float) -> None:
        self.samples += 1
        if generated < self.generated[-1] or prompt < self.prompt[-1]:
            self.prompt.append(0.0)
            self.generated.append(0.0)
        self.prompt[-1], self.generated[-1] = prompt, generated

    @property
    def total_generated(self) -> int:
        return int(sum(self.generated))


def windows(events: Iterable[Mapping[str, Any]]) -> list[tuple[float, float]]:
    """When a row may be lost, or a request admitted with no budget known."""
    found = []
    for event in events:
        if event["kind"] == "gateway-kill":
            found.append((event["start"] - COMMIT_S, event["end"]))
        elif event["kind"] == "record-down":
            found.append((event["start"] - COMMIT_S, event["end"] + WRITER_BACK_S))
    return found


def routed(call: Mapping[str, Any]) -> bool:
    """Did the gateway route this request (so that it owes a row)?"""
    status = call["status"]
    if status is None or status in UNROUTED:
        return False
    return not (status == 429 and call.get("code") in UNROUTED_CODES)


def maybe(call: Mapping[str, Any], lost: Sequence[tuple[float, float]]) -> bool:
    """Whether a fault may have lost this request's row: it ended (or, with no answer, began)
    inside a window."""
    end = call["end"] or call["start"]
    return any(start <= end and call["start"] <= stop for start, stop in lost)


def one_row(
    calls: Iterable[Mapping[str, Any]], rows: Iterable[Row], lost: Sequence[tuple[float, float]]
) -> list[str]:
    """Per key: sure <= rows <= sure + maybe."""
    sure: dict[str, int] = {}
    unsure: dict[str, int] = {}
    for call in calls:
        if not routed(call):
            continue
        into = unsure if maybe(call, lost) else sure
        into[call["key"]] = into.get(call["key"], 0) + 1
    counted: dict[str, int] = {}
    for row in rows:
        counted[row.key] = counted.get(row.key, 0) + 1
    problems = []
    for key in sorted(set(sure) | set(unsure) | set(counted)):
        low, have = sure.get(key, 0), counted.get(key, 0)
        high = low + unsure.get(key, 0)
        if not low <= have <= high:
            problems.append(
                f"key {key}: {have} rows for {low} requests routed (and {high - low} "
                "a fault may have lost)"
            )
    return problems


def all_charged(
    generated: int,
    rows: Iterable[Row],
    engine: str,
    calls: Iterable[Mapping[str, Any]],
    lost: Sequence[tuple[float, float]],
) -> tuple[str | None, dict[str, int]]:
    """The engine's generated tokens <= the completion tokens charged + what lost rows may have
    held; and the figures."""
    charged = sum(row.completion for row in rows if row.engine == engine)
    allowance = sum(
        call["max_tokens"] for call in calls if call["status"] in (200, None) and maybe(call, lost)
    )
    figures = {"generated": generated, "charged": charged, "allowance": allowance}
    if generated > charged + allowance:
        return (
            f"{engine} generated {generated} tokens, {charged} charged, and rows a fault "
            f"may have lost account for {allowance} more",
            figures,
        )
    return None, figures


def excess(row: Row, key: Mapping[str, Any]) -> int:
    return max(0, row.prompt - key["prompt_estimate"]) + max(0, row.completion - key["max_tokens"])


def within_budget(
    rows: Sequence[Row],
    keys: Mapping[str, Mapping[str, Any]],
    unknown: Sequence[tuple[float, float]],
) -> list[str]:
    """Per key and UTC day: total <= budget + the excess of the rows in flight at the last
    admission + every row admitted while no budget was known."""
    problems = []
    days: dict[tuple[str, str], list[Row]] = {}
    for row in rows:
        day = time.strftime("%Y-%m-%d", time.gmtime(row.at))
        days.setdefault((row.key, day), []).append(row)
    for (name, day), found in sorted(days.items()):
        key = keys.get(name)
        if key is None:
            continue
        admitted = [r for r in found if not r.outcome.startswith("refused")]
        if not admitted:
            continue
        total = sum(r.prompt + r.completion for r in found)
        last = max(r.at for r in admitted)
        # ended before the last admission: in its total (less CLOCKS_S, for a row's arrival on
        # the wall clock and its duration on the event loop's)
        in_flight = sum(excess(r, key) for r in admitted if r.at + r.duration >= last - CLOCKS_S)
        blind = sum(
            r.prompt + r.completion
            for r in found
            if any(start <= r.at <= stop for start, stop in unknown)
        )
        bound = key["budget"] + in_flight + blind
        if total > bound:
            problems.append(
                f"key {name} spent {total} tokens on {day}: past its budget "
                f"{key['budget']} + {in_flight} its last requests in flight cost "
                f"past their bounds + {blind} admitted with no budget known"
            )
    return problems


def started_by_traffic(seen: Iterable[Mapping[str, Any]]) -> list[str]:
    """desired.json generations as seen (each a document), judged in generation order."""
    problems = []
    stopped_at: int | None = None  # the operator's stop in force, as far as is known
    previous: int | None = None
    for doc in sorted(
        {d["generation"]: d for d in seen}.values(), key=lambda d: int(d["generation"])
    ):
        generation, by = int(doc["generation"]), doc.get("requestedBy", "operator")
        if previous is not None and generation != previous + 1 and by != "operator":
            stopped_at = None  # a generation between was missed: who wrote it is unknown
        previous = generation
        if by == "operator":
            stopped_at = generation if doc["desired"] == "stopped" else None
        elif doc["desired"] == "running" and stopped_at is not None:
            problems.append(
                f"generation {generation} (running) written by the gateway after "
                f"the operator's stop in generation {stopped_at}"
            )
            stopped_at = None
    return problems


def read_rows(dsn: str, names: Mapping[str, str]) -> list[Row]:
    """The record's rows, straight from PostgreSQL; `names`: key id -> the key's name."""
    import psycopg

    with psycopg.connect(dsn, connect_timeout=10) as conn:
        found = conn.execute(
            "SELECT at_us, key_id, engine, outcome, COALESCE(usage_source, ''), "
            "COALESCE(prompt_tokens, 0), COALESCE(completion_tokens, 0), duration_s "
            "FROM generations"
        ).fetchall()
    return [
        Row(
            at / 1e6,
            names.get(key, key),
            engine,
            outcome,
            source,
            int(prompt),
            int(completion),
            float(duration),
        )
        for at, key, engine, outcome, source, prompt, completion, duration in found
    ]


class Sampler:
    """The engine's own counters, read every SAMPLE_S in a thread of its own (an engine that
    does not answer must not hold up the other checks)."""

    def __init__(self, status: Path, model: str) -> None:
        self.status, self.model = status, model
        self.lives = Lives()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> Lives:
        self._stop.set()
        self._thread.join(10)
        return self.lives

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            counts = self._read()
            if counts is not None:
                self.lives.add(*counts)

    def _read(self) -> tuple[float, float] | None:
        try:
            url = json.loads(self.status.read_text())["url"]
            with urllib.request.urlopen(
                f"{url}/metrics?model={self.model}&autoload=false", timeout=1
            ) as answer:
                text = answer.read().decode()
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return (
            metric(text, "llamacpp:prompt_tokens_total"),
            metric(text, "llamacpp:tokens_predicted_total"),
        )


def judge(
    config: Mapping[str, Any],
    lives: Lives,
    events: Sequence[Mapping[str, Any]],
    desired_seen: Mapping[str, Sequence[Mapping[str, Any]]],
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Every front-door invariant at the end: violations and figures."""
    now = time.time()
    calls = [json.loads(line) for line in Path(config["calls"]).read_text().splitlines()]
    rows = read_rows(config["dsn"], config["key_ids"])
    ours = [r for r in rows if r.key in config["keys"]]
    lost = windows(events)
    unknown = [
        (e["start"] - COMMIT_S, e["end"] + WRITER_BACK_S)
        for e in events
        if e["kind"] == "record-down"
    ]
    violations: list[dict[str, Any]] = []

    def add(invariant: str, engine: str, details: Iterable[str]) -> None:
        violations.extend(
            {"t": now, "engine": engine, "invariant": invariant, "detail": d} for d in details
        )

    add("one-row", "gateway", one_row(calls, ours, lost))
    charged, figures = all_charged(lives.total_generated, ours, config["engine"], calls, lost)
    add("all-charged", config["engine"], [charged] if charged else [])
    add("budget", "gateway", within_budget(ours, config["keys"], unknown))
    for engine, seen in desired_seen.items():
        add("operator-stop", engine, started_by_traffic(seen))
    figures.update(
        calls=len(calls),
        routed=sum(routed(c) for c in calls),
        rows=len(ours),
        maybe=sum(routed(c) and maybe(c, lost) for c in calls),
        lives=len(lives.generated),
        counter_samples=lives.samples,
        left=sum(bool(c["left"]) for c in calls),
        refused=sum(r.outcome.startswith("refused") for r in ours),
        sources={s: sum(r.source == s for r in ours) for s in sorted({r.source for r in ours})},
    )
    return violations, figures
