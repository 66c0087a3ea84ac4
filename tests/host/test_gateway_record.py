"""The gateway and its record: a row per generation with the build that answered, budgets read
from the real SQLite record, no text anywhere, and a record that cannot be opened said on every
response. The engine is the fast local upstream; its status.json is written by the test."""

from __future__ import annotations

import asyncio
import hashlib
import sqlite3
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
import structlog

from supervisor.host.gateway.service import UNRECORDED, Service
from supervisor.host.proxy.budget import HEADER, NOT_RECORDING
from supervisor.host.record.database import Target
from supervisor.host.record.store import Store
from supervisor.protocol.documents import RunningEngine, Status, dump, utc_now
from supervisor.protocol.files import ensure_dir, write_atomic
from tests.host.gateway_world import (
    AUTH,
    INFERENCE_KEY,
    KEYS,
    OWNER,
    SETTINGS,
    Upstream,
    World,
    settings_of,
    world,
)

BUDGETED = SETTINGS + "[budget]\ndaily_tokens = 60\n"
BUILD = RunningEngine(
    image="lucia-llama-server:1",
    image_id="sha256:" + "ab" * 32,
    container_id="c1",
    model="tiny",
    model_revision="rev-1",
    engine_version="b11669-Debian",
)


def serving(data: Path, url: str, models: tuple[str, ...] = ("tiny",)) -> None:
    now = utc_now()
    status = Status(
        generation=1,
        state="running",
        since=now,
        message="serving",
        url=url,
        checked_at=now,
        engine=BUILD.model_copy(update={"model": models[0]}),
        models=models,
    )
    write_atomic(ensure_dir(data / "small") / "status.json", dump(status))


def rows(path: Path) -> list[dict[str, Any]]:
    with sqlite3.connect(path) as db:
        db.row_factory = sqlite3.Row
        return [dict(r) for r in db.execute("SELECT * FROM generations ORDER BY at_us")]


def run(
    tmp_path: Path,
    scenario: Callable[[World, Store], Awaitable[None]],
    settings: str,
    upstream: Upstream | None = None,
) -> Path:
    """The scenario against a gateway recording into a real SQLite file; its path."""
    path = tmp_path / "record.sqlite3"

    async def main() -> None:
        store = await asyncio.to_thread(Store.open, Target(path=path), 30)
        assert store.available, store.reason
        try:
            where = settings + f'[record]\npath = "{path}"\n'  # the owner API reads it
            up = upstream or Upstream()
            async with world(tmp_path, where, up, spending=store, recorder=store) as w:
                serving(w.data, w.upstream.url)
                await scenario(w, store)
        finally:
            await asyncio.to_thread(store.close)

    asyncio.run(main())
    return path


def test_every_generation_is_a_row_naming_the_build_and_no_text(tmp_path: Path) -> None:
    secret = f"prompt-{uuid.uuid4().hex}"

    async def scenario(w: World, _: Store) -> None:
        client = openai.AsyncOpenAI(base_url=w.base, api_key=INFERENCE_KEY)
        messages: Any = [{"role": "user", "content": secret}]
        await client.chat.completions.create(model="fast", messages=messages)  # a tier
        stream = await client.chat.completions.create(model="tiny", messages=messages, stream=True)
        async for _chunk in stream:
            pass
        async with aiohttp.ClientSession(headers=AUTH) as s:  # a refusal of the body's
            body = {"model": "tiny", "messages": messages, "max_tokens": 10**9}
            async with s.post(f"{w.base}/chat/completions", json=body) as r:
                assert r.status == 400 and HEADER not in r.headers  # recorded: nothing said

    with structlog.testing.capture_logs() as logs:
        path = run(tmp_path, scenario, SETTINGS)
    found = rows(path)
    assert [(r["model"], r["engine"], r["outcome"]) for r in found] == [
        ("fast", "small", "ok"),
        ("tiny", "small", "ok"),
    ]  # a body refused names no model
    for row in found:
        assert row["key_id"] == "inference"
        assert (row["engine_version"], row["image_id"], row["weights_revision"]) == (
            "b11669-Debian",
            BUILD.image_id,
            "rev-1",
        )
        assert (row["prompt_tokens"], row["completion_tokens"]) == (5, 3)  # the engine's usage
        assert row["ttft_s"] is not None and 0 <= row["ttft_s"] <= row["duration_s"]
        assert row["wait_s"] >= 0
    for file in path.parent.glob(path.name + "*"):  # the database, its WAL and shared memory
        assert secret.encode() not in file.read_bytes(), file
    assert secret not in repr(logs)


def test_the_owner_api_gives_the_usage_figures_by_build(tmp_path: Path) -> None:
    async def scenario(w: World, store: Store) -> None:
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
        url = str(w.gateway.make_url("/api/host/usage"))
        async with aiohttp.ClientSession(headers=AUTH) as s:
            for _ in range(3):
                async with s.post(f"{w.base}/chat/completions", json=chat) as r:
                    assert r.status == 200
            async with asyncio.timeout(30):
                while store.committed < 3:
                    await asyncio.sleep(0.02)
            async with s.get(url, params={"by": "build"}, headers=OWNER) as r:
                assert r.status == 200
                figures = await r.json()
            async with s.get(url, params={"by": "build"}) as r:
                assert r.status == 403  # the inference key: /v1 only
            async with s.get(url, params={"by": "colour"}, headers=OWNER) as r:
                assert r.status == 400 and (await r.json())["error"]["param"] == "by"
            async with s.get(url, params={"since": "yesterday"}, headers=OWNER) as r:
                assert r.status == 400 and (await r.json())["error"]["param"] == "since"
        (group,) = figures["groups"]
        assert (
            group["engine"],
            group["engineVersion"],
            group["imageId"],
            group["weightsRevision"],
        ) == ("small", "b11669-Debian", BUILD.image_id, "rev-1")
        assert group["requests"] == 3 and group["promptTokens"] == 15

    run(tmp_path, scenario, SETTINGS)


@pytest.mark.parametrize(
    "since", ["999999w", "999999d", "0001-01-01T00:00:00+05:00", "9999-12-31T23:00:00-05:00"]
)
def test_a_since_out_of_range_is_a_400_naming_since(tmp_path: Path, since: str) -> None:
    """Was: 500, an OverflowError in the span's or the offset's arithmetic."""

    async def scenario(w: World, store: Store) -> None:
        url = str(w.gateway.make_url("/api/host/usage"))
        async with (
            aiohttp.ClientSession(headers=OWNER) as s,
            s.get(url, params={"since": since}) as r,
        ):
            assert r.status == 400
            error = (await r.json())["error"]
        assert (error["code"], error["param"]) == ("invalid_request", "since")
        assert error["message"] == (
            f"--since {since!r}: out of range, before the year 1 or after 9999 (UTC)"
        )

    run(tmp_path, scenario, SETTINGS)


def test_a_budget_read_from_the_record_refuses_what_its_rest_cannot_hold(
    tmp_path: Path,
) -> None:
    """An engine that generates past the bound the gateway set (vLLM ignores n_predict; this
    stand-in ignores any) is charged all it generated; the next request is then refused with
    the count from the record, before the engine."""

    async def scenario(w: World, store: Store) -> None:
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
        async with aiohttp.ClientSession(headers=AUTH) as s:
            async with s.post(f"{w.base}/chat/completions", json={**chat, "stream": True}) as r:
                assert r.status == 200 and (await r.read()).endswith(b"data: [DONE]\n\n")
            assert store.spent("inference") == 45  # 5 + 40: what the engine said it generated
            async with s.post(f"{w.base}/chat/completions", json=chat) as r:
                assert r.status == 429
                refused = await r.json()
            async with s.get(f"{w.base}/budget") as r:
                standing = await r.json()
        assert refused["error"]["code"] == "budget_exceeded"
        assert refused["budget"]["spent_tokens"] == 45 and refused["budget"]["budget_tokens"] == 60
        assert refused["reserved_tokens"] == 0 and refused["request_tokens"] > 15
        assert standing["spent_tokens"] == 45 and standing["remaining_tokens"] == 15
        assert len(w.upstream.bodies) == 1, "the refused request never reached the engine"

    path = run(tmp_path, scenario, BUDGETED, Upstream(chunks=40))
    assert [r["outcome"] for r in rows(path)] == ["ok", "refused:budget_exceeded"]


LEGACY = "Qwen 7B (Q4)"  # a GGUF a library held before the served-name rule: served still


def test_a_model_named_outside_the_rule_is_recorded_by_its_digest_and_charged(
    tmp_path: Path,
) -> None:
    """Was: each row refused for the model's name and only logged, so nothing was charged: the
    key spent 0 and was never refused. Its rows are kept under the name's digest form now."""
    kept = "Qwen_7B__Q4_~" + hashlib.sha256(LEGACY.encode()).hexdigest()[:16]

    async def scenario(w: World, store: Store) -> None:
        serving(w.data, w.upstream.url, models=(LEGACY,))
        client = openai.AsyncOpenAI(base_url=w.base, api_key=INFERENCE_KEY, max_retries=0)
        messages: Any = [{"role": "user", "content": "hi"}]
        stream = await client.chat.completions.create(model=LEGACY, messages=messages, stream=True)
        async for _chunk in stream:
            pass  # 5 + 40 tokens: under 60
        with pytest.raises(openai.RateLimitError) as refused:  # 15 left: less than its bound
            await client.chat.completions.create(model=LEGACY, messages=messages)
        assert refused.value.code == "budget_exceeded"
        async with aiohttp.ClientSession(headers=AUTH) as s:
            async with s.get(f"{w.base}/budget") as r:
                standing = await r.json()
            async with asyncio.timeout(30):
                while store.committed < 2:
                    await asyncio.sleep(0.02)
            url = str(w.gateway.make_url("/api/host/usage"))
            async with s.get(url, params={"by": "model"}, headers=OWNER) as r:
                figures = await r.json()
        assert (standing["spent_tokens"], standing["remaining_tokens"]) == (45, 15)
        assert [
            (g["model"], g["requests"], g["promptTokens"], g["completionTokens"])
            for g in figures["groups"]
        ] == [(kept, 2, 5, 40)]
        assert [b["model"] for b in w.upstream.bodies] == [LEGACY], "its own name"

    with structlog.testing.capture_logs() as logs:
        path = run(tmp_path, scenario, BUDGETED, Upstream(chunks=40))
    assert [(r["model"], r["engine"], r["outcome"], r["prompt_tokens"]) for r in rows(path)] == [
        (kept, "small", "ok", 5),
        (kept, "small", "refused:budget_exceeded", None),
    ]
    assert not [e for e in logs if e["event"] == "request not recorded"], logs


def test_a_record_that_cannot_be_opened_is_said_at_start_and_on_every_response(
    tmp_path: Path,
) -> None:
    data = ensure_dir(tmp_path / "served")
    (tmp_path / "a-file").write_text("")
    settings = settings_of(f'[listen]\nport = 0\n[record]\npath = "{tmp_path}/a-file/record.db"\n')

    async def main() -> None:
        up = Upstream()
        async with world(tmp_path, SETTINGS, up):  # for its upstream
            serving(data, up.url)
            service = Service(settings, data, KEYS)
            running = asyncio.create_task(service.run())
            await asyncio.wait_for(service.listening.wait(), 60)
            base = f"http://127.0.0.1:{service.port}/v1"
            chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
            async with aiohttp.ClientSession(headers=AUTH) as s:
                async with s.post(f"{base}/chat/completions", json=chat) as r:
                    assert r.status == 200 and r.headers[HEADER] == NOT_RECORDING
                async with s.get(f"{base}/models") as r:
                    assert r.headers[HEADER] == NOT_RECORDING
            service.stop.set()
            await running

    with structlog.testing.capture_logs() as logs:
        asyncio.run(main())
    said = [e for e in logs if e["event"] == UNRECORDED]
    assert said and "a-file" in said[0]["where"], logs


@pytest.mark.parametrize(
    ("bound", "expected"),
    [({"max_tokens": 300}, 300), ({}, None)],  # None: the n_predict the gateway set
)
def test_a_stream_past_its_deadline_before_its_answer_began_costs_its_bound(
    tmp_path: Path, bound: dict[str, int], expected: int | None
) -> None:
    """Was: its prompt's estimate and one token, though an engine may go on generating for a
    while before it notices the closed connection (llama-server did 1,823 tokens on a loaded
    machine). What it generated is unknown: it costs every token it may generate."""

    async def scenario(w: World, store: Store) -> None:
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True}
        async with (
            aiohttp.ClientSession(headers=AUTH) as s,
            s.post(f"{w.base}/chat/completions", json={**chat, **bound}) as r,
        ):
            assert r.status == 504 and (await r.json())["error"]["code"] == "timeout"
        async with asyncio.timeout(30):
            while store.committed < 1:
                await asyncio.sleep(0.02)

    answer_after = asyncio.Event()  # never set: the engine's answer never begins
    short = SETTINGS.replace("max_wait_s = 30", "max_wait_s = 30\ndeadline_s = 0.3")
    upstream = Upstream(answer_after=answer_after)
    path = run(tmp_path, scenario, short, upstream)
    (row,) = rows(path)
    sent = upstream.bodies[0]
    limit = expected if expected is not None else sent["n_predict"]
    assert (row["outcome"], row["usage_source"]) == ("timed_out", "bound"), row
    assert row["completion_tokens"] == limit and row["prompt_tokens"] > 0, (row, sent)
