"""The probe in the gateway, against the project's fake engine (gateway_world.Upstream): a
serving engine probed, recorded and measured; one that fails generation `degraded` in
/v1/models, the host API and the metrics until a probe succeeds; never an engine that is not
serving, never one started; none while the slots are full; and the gateway's stop ends a probe
in flight. The real llama-server's: tests/integration/test_gateway_probe_llama.py."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import aiohttp

from supervisor.host.proxy import probe
from supervisor.host.record.row import Row
from supervisor.protocol.documents import RunningEngine, utc_now
from tests.host.gateway_world import AUTH, OWNER, Upstream, World, until, world, write_status
from tests.host.test_gateway_ops import one, scrape

SETTINGS = """
[limits]
running = 1
waiting = 4
[probe]
interval_s = 0.05
timeout_s = 5
"""
ENGINE = RunningEngine(
    image="fake:1",
    image_id="sha256:0123456789abcdef",
    container_id="c1",
    model="tiny",
    engine_version="1.2.3",
)
BUILD = "1.2.3@0123456789ab"
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}


class Rows:
    def __init__(self) -> None:
        self.rows: list[Row] = []

    def record(self, row: Row) -> bool:
        self.rows.append(row)
        return True


def serving(w: World, container: str = "c1") -> None:
    write_status(
        w.data,
        "small",
        "running",
        url=w.upstream.url,
        generation=1,
        running=ENGINE.model_copy(update={"container_id": container}),
    )


def run(
    tmp_path: Path,
    scenario: Callable[[World, Rows], Awaitable[None]],
    upstream: Upstream | None = None,
    settings: str = SETTINGS,
) -> Rows:
    rows = Rows()

    async def main() -> None:
        async with world(tmp_path, settings, upstream or Upstream(), recorder=rows) as w:
            await scenario(w, rows)

    asyncio.run(main())
    return rows


async def model_entry(w: World) -> dict[str, Any]:
    async with aiohttp.ClientSession(headers=AUTH) as s, s.get(f"{w.base}/models") as r:
        assert r.status == 200
        (entry,) = (await r.json())["data"]
        return dict(entry)


async def engine_row(w: World) -> dict[str, Any]:
    url = str(w.gateway.make_url("/api/host/engines"))
    async with aiohttp.ClientSession(headers=OWNER) as s, s.get(url) as r:
        assert r.status == 200
        (row,) = (await r.json())["engines"]
        return dict(row)


async def looks(w: World, rounds: int) -> None:
    """Until the probe has looked for due probes `rounds` more times."""
    start = w.app.prober.looks
    await until(lambda: w.app.prober.looks >= start + rounds)


def test_a_serving_engine_is_probed_recorded_and_measured(tmp_path: Path) -> None:
    async def scenario(w: World, rows: Rows) -> None:
        serving(w)
        await until(lambda: w.app.prober.ended >= 1)
        sent = w.upstream.bodies[0]
        assert sent == probe.body("tiny")  # one greedy token of a text completion
        assert "Authorization" not in w.upstream.headers[0]  # no key goes upstream
        entry = await model_entry(w)
        assert entry["degraded"] is False
        assert entry["probe"]["degraded"] is False and entry["probe"]["ttftS"] >= 0
        assert entry["probe"]["checkedAt"].endswith("Z")
        row = await engine_row(w)
        assert row["probe"]["degraded"] is False and "tiny" in row["probe"]["models"]
        found = await scrape(w)
        at = {"engine": "small", "model": "tiny", "build": BUILD}
        assert one(found, "lucia_gateway_probe_ttft_seconds_count", **at) >= 1
        assert one(found, "lucia_gateway_probes_total", **at, outcome="ok") >= 1
        assert one(found, "lucia_gateway_probe_degraded", engine="small", model="tiny") == 0
        # beside admission: no request counted, no gate made (nor its idle clock moved)
        assert not [key for key in found if key[0] == "lucia_gateway_requests_total"]
        assert "small" not in w.app.gates

    rows = run(tmp_path, scenario)
    first = rows.rows[0]
    assert (first.key_id, first.model, first.engine, first.outcome) == (
        "probe",
        "tiny",
        "small",
        "ok",
    )
    assert (first.prompt_tokens, first.completion_tokens, first.usage_source) == (5, 3, "engine")
    assert (first.build.engine_version, first.build.image_id) == ("1.2.3", ENGINE.image_id)
    assert first.ttft_s is not None and first.wait_s == 0


def test_an_engine_that_cannot_generate_is_degraded_until_a_probe_succeeds(
    tmp_path: Path,
) -> None:
    up = Upstream(status=500)

    async def scenario(w: World, rows: Rows) -> None:
        serving(w)
        await until(lambda: w.app.prober.ended >= 1)
        entry = await model_entry(w)
        assert entry["degraded"] is True and entry["state"] == "running"
        assert entry["probe"]["reason"] == "the engine answered 500"
        row = await engine_row(w)
        assert row["probe"]["degraded"] is True
        assert row["probe"]["models"]["tiny"]["reason"] == "the engine answered 500"
        found = await scrape(w)
        assert one(found, "lucia_gateway_probe_degraded", engine="small", model="tiny") == 1
        at = {"engine": "small", "model": "tiny", "build": BUILD}
        assert one(found, "lucia_gateway_probes_total", **at, outcome="engine_error") >= 1
        assert one(found, "lucia_gateway_probe_ttft_seconds_count", **at) == 0
        up.status = 200  # it generates again: the next probe clears the mark
        ended = w.app.prober.ended
        await until(lambda: w.app.prober.ended > ended + 1)
        assert (await model_entry(w))["degraded"] is False
        assert (await engine_row(w))["probe"]["degraded"] is False
        assert (
            one(await scrape(w), "lucia_gateway_probe_degraded", engine="small", model="tiny") == 0
        )

    rows = run(tmp_path, scenario, up)
    outcomes = [row.outcome for row in rows.rows]
    assert outcomes[0] == "engine_error" and outcomes[-1] == "ok"
    assert {row.key_id for row in rows.rows} == {"probe"}


def test_a_mark_ends_with_its_engines_run(tmp_path: Path) -> None:
    up = Upstream(status=500)

    async def scenario(w: World, rows: Rows) -> None:
        serving(w)
        await until(lambda: w.app.prober.ended >= 1)
        assert (await model_entry(w))["degraded"] is True
        write_status(w.data, "small", "stopped", generation=2)
        entry = await model_entry(w)
        assert (entry["degraded"], entry["probe"], entry["state"]) == (False, None, "stopped")

    run(tmp_path, scenario, up)


def test_no_probe_for_an_engine_that_is_not_serving_and_none_is_started(tmp_path: Path) -> None:
    async def scenario(w: World, rows: Rows) -> None:
        write_status(w.data, "small", "stopped")  # may be started on demand, by a request
        write_status(
            w.data,
            "old",
            "running",
            url=w.upstream.url,
            checked_at=utc_now() - timedelta(seconds=61),
        )  # its worker gone silent
        await looks(w, 5)
        assert w.upstream.bodies == []
        assert w.desired("small") is None and w.desired("old") is None  # nothing asked
        assert (await model_entry_of(w, "small"))["probe"] is None

    rows = run(tmp_path, scenario)
    assert rows.rows == []


async def model_entry_of(w: World, engine: str) -> dict[str, Any]:
    async with aiohttp.ClientSession(headers=AUTH) as s, s.get(f"{w.base}/models") as r:
        found = [entry for entry in (await r.json())["data"] if entry["engine"] == engine]
        return dict(found[0])


def test_no_probe_while_the_slots_are_full_and_none_holds_a_user_back(tmp_path: Path) -> None:
    up = Upstream(hold=asyncio.Event())

    async def scenario(w: World, rows: Rows) -> None:
        up.hold = None  # the first probe answers at once
        serving(w)
        await until(lambda: w.app.prober.ended >= 1)
        up.hold = asyncio.Event()
        async with aiohttp.ClientSession(headers=AUTH) as s:
            user = asyncio.ensure_future(
                s.post(f"{w.base}/chat/completions", json={**CHAT, "stream": True})
            )
            await until(
                lambda: w.app.gates.get("small") is not None and w.app.gate("small").running
            )
            serving(w, container="c2")  # a new run: due at once, but its one slot is taken
            await looks(w, 5)
            assert len(w.upstream.bodies) == 2  # the first probe and the user's
            assert w.app.gate("small").running == 1  # the probe took no slot
            up.hold.set()
            answer = await user
            assert answer.status == 200
            await answer.read()
        await until(lambda: w.app.prober.ended >= 2)  # the slot free: probed in its new run
        assert w.upstream.bodies[-1] == probe.body("tiny")

    rows = run(tmp_path, scenario, up)
    assert [row.key_id for row in rows.rows] == ["probe", "inference", "probe"]


def test_the_gateways_stop_ends_a_probe_in_flight_unrecorded(tmp_path: Path) -> None:
    up = Upstream(answer_after=asyncio.Event())  # never answers

    async def scenario(w: World, rows: Rows) -> None:
        serving(w)
        await until(lambda: len(w.upstream.bodies) == 1)
        assert w.app.prober.inflight

    rows = run(tmp_path, scenario, up)  # the world's close returns: nothing hung on the probe
    assert rows.rows == []
