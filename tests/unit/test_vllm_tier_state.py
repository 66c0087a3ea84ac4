"""The worker's reading of the tier plugin's state from vLLM's /metrics: which tiers are off, and
why, in the status message's words."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator

import pytest

from supervisor.engines.vllm.probes import TierWatch, tiers_note, tiers_off

LABELS = 'engine="0",model_name="tiny"'


def off(tier: str, reason: str, value: float) -> str:
    return f'lucia_kv_tier_off_total{{{LABELS},tier="{tier}",reason="{reason}"}} {value}'


def on(tier: str, value: float) -> str:
    return f'lucia_kv_tier_on_total{{{LABELS},tier="{tier}"}} {value}'


@pytest.mark.parametrize(
    ("lines", "found"),
    [
        ([], {}),
        ([on("nvme", 0.0), on("hdd", 0.0)], {}),
        ([off("nvme", "erofs", 1.0), on("nvme", 0.0)], {"nvme": ("erofs",)}),
        ([off("nvme", "eio", 1.0), on("nvme", 1.0)], {}),  # off, then open again
        (
            [off("nvme", "eio", 1.0), off("nvme", "erofs", 1.0), on("nvme", 1.0)],
            {"nvme": ("eio", "erofs")},
        ),
        (
            [off("hdd", "enoent", 2.0), on("hdd", 1.0), off("nvme", "eio", 1.0), on("nvme", 1.0)],
            {"hdd": ("enoent",)},
        ),
        ([off("nvme", "Not A Reason!", 1.0)], {"nvme": ()}),  # an odd label is never shown
        (
            [
                "# HELP lucia_kv_tier_off_total ...",
                "# TYPE lucia_kv_tier_off_total counter",
                'vllm:num_requests_running{engine="0"} 0.0',
            ],
            {},
        ),
    ],
)
def test_which_tiers_are_off(lines: list[str], found: dict[str, tuple[str, ...]]) -> None:
    assert tiers_off("\n".join(lines) + "\n") == found


@pytest.mark.parametrize(
    ("state", "note"),
    [
        ({}, ""),
        ({"nvme": ("erofs",)}, "tier nvme off: read-only file system"),
        ({"nvme": ("eio", "erofs")}, "tier nvme off: input/output error; read-only file system"),
        (
            {"nvme": (), "hdd": ("enoent",)},
            "tier hdd off: no such file or directory, tier nvme off: a fault",
        ),
        ({"shm": ("unsafe",)}, "tier shm off: unsafe"),
    ],
)
def test_the_status_message_says_it_in_words(state: dict[str, tuple[str, ...]], note: str) -> None:
    assert tiers_note(state) == note


class _Metrics(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        server = self.server
        server.reads += 1  # type: ignore[attr-defined]
        body = server.body.encode()  # type: ignore[attr-defined]
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def engine() -> Iterator[http.server.ThreadingHTTPServer]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Metrics)
    server.body, server.reads = "", 0  # type: ignore[attr-defined]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()


def test_the_watch_reads_at_most_every_ten_seconds_and_forgets_a_silent_engine(
    engine: http.server.ThreadingHTTPServer,
) -> None:
    now = [100.0]
    watch = TierWatch(clock=lambda: now[0])
    base = f"http://127.0.0.1:{engine.server_address[1]}"
    engine.body = off("nvme", "erofs", 1.0) + "\n"  # type: ignore[attr-defined]
    assert watch.note(base) == "tier nvme off: read-only file system"
    engine.body = off("nvme", "erofs", 1.0) + "\n" + on("nvme", 1.0) + "\n"  # type: ignore[attr-defined]
    now[0] += 5
    assert watch.note(base) == "tier nvme off: read-only file system"  # kept, not read again
    assert engine.reads == 1  # type: ignore[attr-defined]
    now[0] += 6
    assert watch.note(base) == ""  # on again
    assert engine.reads == 2  # type: ignore[attr-defined]
    now[0] += 11
    assert watch.note("http://127.0.0.1:9") == ""  # an engine that does not answer says nothing
