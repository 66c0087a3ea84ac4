"""What a model serves, as its engine declares it: a request for a route its model does not
serve is refused 400 `capability_not_served` naming what it serves, before any engine is
started, and recorded as a refusal; a model whose capabilities are not known is forwarded as
before. A request that names no model goes to the default tier. The pure decisions in tables,
then end to end against the fast local upstream with the official `openai` client; the test
writes the workers' side."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from supervisor.host.gateway.settings import SettingsError, parse
from supervisor.host.proxy import body, capability
from supervisor.host.proxy.catalog import CatalogEntry, route
from supervisor.host.record.database import Target
from supervisor.host.record.store import Store
from supervisor.host.web.refusal import Refusal
from supervisor.protocol.documents import Capability, Status, utc_now
from tests.host.gateway_world import (
    AUTH,
    INFERENCE_KEY,
    SETTINGS,
    Upstream,
    World,
    run,
    until,
    world,
    write_status,
)
from tests.host.test_gateway_record import rows

NOW = utc_now()
GENERATES: tuple[Capability, ...] = ("chat", "completion", "responses")
EMBEDS: tuple[Capability, ...] = ("embedding",)
BOUNDS = parse("", "test").limits.bounds
DEFAULTED = SETTINGS.replace('fast = "tiny"', 'fast = "tiny"\ndefault = "fast"')
HI: Any = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("path", "declared", "serves"),
    [
        (body.CHAT, GENERATES, True),
        (body.COMPLETIONS, GENERATES, True),
        (body.RESPONSES, GENERATES, True),
        (body.EMBEDDINGS, GENERATES, False),
        (body.CHAT, EMBEDS, False),
        (body.COMPLETIONS, EMBEDS, False),
        (body.RESPONSES, EMBEDS, False),
        (body.EMBEDDINGS, EMBEDS, True),
        (body.CHAT, ("chat",), True),
        (body.RESPONSES, ("chat", "completion"), False),  # TensorFold's: no /v1/responses
        (body.CHAT, (), False),  # known to serve none of them (a classifier)
        (body.EMBEDDINGS, (), False),
        (body.CHAT, None, None),  # not known: forwarded as before
        (body.EMBEDDINGS, None, None),
        ("/v1/other", GENERATES, None),
    ],
)
def test_whether_a_model_serves_a_route(
    path: str, declared: tuple[Capability, ...] | None, serves: bool | None
) -> None:
    assert capability.serves(declared, path) is serves
    if serves is False:
        with pytest.raises(Refusal) as refused:
            capability.check(path, "tiny", "small", declared)
        said = refused.value
        assert (said.status, said.code, said.param) == (400, "capability_not_served", "model")
        assert said.details == {"capabilities": list(declared or ())}
        for name in declared or ("none of chat, completion, embedding and responses",):
            assert name in said.message, said.message
        assert "`tiny` (engine small)" in said.message
    else:
        capability.check(path, "tiny", "small", declared)


def entry(
    name: str, state: str, declared: tuple[Capability, ...] | None, url: str | None = None
) -> CatalogEntry:
    status = Status(
        generation=1,
        state=state,  # type: ignore[arg-type]
        since=NOW,
        message=state,
        url=url,
        checked_at=NOW,
        models=("tiny",),
        capabilities={} if declared is None else {"tiny": declared},
    )
    return CatalogEntry(name, status)


@pytest.mark.parametrize(
    ("engines", "path", "chosen"),
    [
        # of two that serve the model, the one that serves the route, even stopped
        (
            [entry("a", "running", GENERATES, "http://e:1"), entry("b", "stopped", EMBEDS)],
            body.EMBEDDINGS,
            "b",
        ),
        (
            [entry("a", "running", GENERATES, "http://e:1"), entry("b", "stopped", EMBEDS)],
            body.CHAT,
            "a",
        ),
        # not known counts as serving: the best kind first, as before
        (
            [entry("a", "stopped", None), entry("b", "running", EMBEDS, "http://e:1")],
            body.CHAT,
            "a",
        ),
        ([entry("a", "stopped", None), entry("b", "running", None, "http://e:1")], body.CHAT, "b"),
        # none serves it: the best kind, whose check then refuses
        (
            [entry("a", "stopped", EMBEDS), entry("b", "running", EMBEDS, "http://e:1")],
            body.CHAT,
            "b",
        ),
    ],
)
def test_route_prefers_an_engine_that_serves_the_route(
    engines: list[CatalogEntry], path: str, chosen: str
) -> None:
    assert route("tiny", engines, {}, NOW, path=path)[0].name == chosen
    assert route("tiny", engines[::-1], {}, NOW, path=path)[0].name == chosen


@pytest.mark.parametrize(
    ("document", "default", "model", "upstream"),
    [
        ({"model": "m"}, None, "m", None),
        ({"model": "m"}, "fast", "m", None),  # a model named is the model asked for
        ({}, "fast", "fast", "fast"),  # none: the default tier, named upstream too
        ({"model": None}, "fast", "fast", "fast"),
    ],
)
def test_a_body_without_a_model_names_the_default_tier(
    document: dict[str, Any], default: str | None, model: str, upstream: str | None
) -> None:
    raw = body.json.dumps({**document, "messages": HI}).encode()
    prepared = body.prepare(body.CHAT, raw, BOUNDS, None, default)
    assert prepared.model == model
    sent = body.json.loads(prepared.body)
    assert sent["model"] == (upstream or document["model"])
    assert sent["messages"] == HI


@pytest.mark.parametrize(
    ("document", "default", "words"),
    [
        ({}, None, "[tiers] default names none"),
        ({"model": None}, None, "[tiers] default names none"),
        ({"model": ""}, "fast", "model must be a non-empty string"),  # named, and empty
        ({"model": 3}, "fast", "model must be a non-empty string"),
    ],
)
def test_a_body_without_a_usable_model_is_refused(
    document: dict[str, Any], default: str | None, words: str
) -> None:
    raw = body.json.dumps({**document, "messages": HI}).encode()
    with pytest.raises(Refusal) as refused:
        body.prepare(body.CHAT, raw, BOUNDS, None, default)
    assert (refused.value.status, refused.value.param) == (400, "model")
    assert words in refused.value.message


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ('[tiers]\ndefault = "fast"', "'fast' is not one: the tiers are none"),
        ('[tiers]\nfast = "tiny"\ndefault = "slow"', "'slow' is not one: the tiers are fast"),
        ('[tiers]\nfast = "tiny"\ndefault = "tiny"', "'tiny' is not one"),  # a model, not a tier
        ('[tiers]\ndefault = "default"', "'default' is not one"),
    ],
)
def test_a_default_naming_no_tier_is_a_settings_error(text: str, words: str) -> None:
    with pytest.raises(SettingsError, match=r"^gw\.toml: tiers: ") as caught:
        parse(text, "gw.toml")
    assert words in str(caught.value)


def test_the_default_is_not_an_alias() -> None:
    settings = parse('[tiers]\nfast = "tiny"\nslow = "big"\ndefault = "slow"', "gw.toml")
    assert (settings.aliases, settings.default_tier) == ({"fast": "tiny", "slow": "big"}, "slow")
    assert parse('[tiers]\nfast = "tiny"', "gw.toml").default_tier is None


def client(w: World) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=w.base, api_key=INFERENCE_KEY, max_retries=0)


def test_an_embedding_asked_of_a_stopped_chat_model_is_refused_and_nothing_is_started(
    tmp_path: Path,
) -> None:
    async def scenario(w: World) -> None:
        write_status(w.data, "small", "stopped", capabilities={"tiny": GENERATES})
        with pytest.raises(openai.BadRequestError) as refused:
            await client(w).embeddings.create(model="fast", input="hello")
        assert refused.value.code == "capability_not_served"
        assert "chat (/v1/chat/completions)" in refused.value.message
        assert "does not serve embedding" in refused.value.message
        assert w.desired("small") is None, "no engine is started to refuse"
        assert w.upstream.bodies == []
        counted = w.app.metrics.render().decode()
        assert 'lucia_gateway_refusals_total{reason="capability_not_served"} 1.0' in counted

    run(tmp_path, scenario)


def test_a_chat_asked_of_a_running_embedding_model_is_refused_its_embeddings_answered(
    tmp_path: Path,
) -> None:
    async def scenario(w: World) -> None:
        write_status(w.data, "small", "running", url=w.upstream.url, capabilities={"tiny": EMBEDS})
        with pytest.raises(openai.BadRequestError) as refused:
            await client(w).chat.completions.create(model="tiny", messages=HI)
        assert refused.value.code == "capability_not_served"
        assert "it serves embedding (/v1/embeddings)" in refused.value.message
        assert w.upstream.bodies == []
        embedding = {"model": "tiny", "input": "x"}
        async with (
            aiohttp.ClientSession(headers=AUTH) as s,
            s.post(f"{w.base}/embeddings", json=embedding) as r,
        ):
            assert r.status == 200
        assert [b["model"] for b in w.upstream.bodies] == ["tiny"]

    run(tmp_path, scenario)


def test_a_model_whose_capabilities_are_not_known_is_started_and_forwarded(
    tmp_path: Path,
) -> None:
    async def scenario(w: World) -> None:
        write_status(w.data, "small", "stopped")  # an older worker: no capabilities
        async with aiohttp.ClientSession(headers=AUTH) as s:
            embedding = {"model": "tiny", "input": "x"}
            pending = asyncio.ensure_future(s.post(f"{w.base}/embeddings", json=embedding))
            await until(lambda: w.desired("small") is not None)
            write_status(w.data, "small", "running", url=w.upstream.url, generation=1)
            assert (await pending).status == 200
        assert [b["model"] for b in w.upstream.bodies] == ["tiny"]

    run(tmp_path, scenario)


def test_models_show_what_each_serves_and_the_default_tier(tmp_path: Path) -> None:
    async def scenario(w: World) -> None:
        write_status(w.data, "small", "stopped", capabilities={"tiny": GENERATES})
        write_status(
            w.data, "other", "stopped", models=("emb", "old"), capabilities={"emb": EMBEDS}
        )
        async with aiohttp.ClientSession(headers=AUTH) as s, s.get(f"{w.base}/models") as r:
            data = {m["id"]: m for m in (await r.json())["data"]}
        assert data["tiny"]["capabilities"] == list(GENERATES)
        assert (data["tiny"]["tiers"], data["tiny"]["default"]) == (["fast"], True)
        assert data["emb"]["capabilities"] == ["embedding"] and not data["emb"]["default"]
        assert data["old"]["capabilities"] is None  # not known

    run(tmp_path, scenario, DEFAULTED)


def test_a_request_naming_no_model_goes_to_the_default_tier(tmp_path: Path) -> None:
    async def scenario(w: World) -> None:
        write_status(
            w.data, "small", "running", url=w.upstream.url, capabilities={"tiny": GENERATES}
        )
        async with (
            aiohttp.ClientSession(headers=AUTH) as s,
            s.post(f"{w.base}/chat/completions", json={"messages": HI}) as r,
        ):
            assert r.status == 200, await r.text()
            assert (await r.json())["model"] == "tiny"
        assert [b["model"] for b in w.upstream.bodies] == ["tiny"]

    run(tmp_path, scenario, DEFAULTED)


def test_without_a_default_a_request_naming_no_model_is_refused(tmp_path: Path) -> None:
    async def scenario(w: World) -> None:
        write_status(w.data, "small", "running", url=w.upstream.url)
        async with (
            aiohttp.ClientSession(headers=AUTH) as s,
            s.post(f"{w.base}/chat/completions", json={"messages": HI}) as r,
        ):
            answer = await r.json()
        assert (r.status, answer["error"]["param"]) == (400, "model")
        assert "[tiers] default" in answer["error"]["message"]
        assert w.upstream.bodies == []

    run(tmp_path, scenario)


def test_a_refusal_for_a_capability_is_recorded_as_one(tmp_path: Path) -> None:
    path = tmp_path / "record.sqlite3"

    async def main() -> None:
        store = await asyncio.to_thread(Store.open, Target(path=path), 30)
        try:
            where = SETTINGS + f'[record]\npath = "{path}"\n'
            async with world(tmp_path, where, Upstream(), spending=store, recorder=store) as w:
                write_status(w.data, "small", "stopped", capabilities={"tiny": GENERATES})
                with pytest.raises(openai.BadRequestError):
                    await client(w).embeddings.create(model="fast", input="hello")
                assert w.desired("small") is None
        finally:
            await asyncio.to_thread(store.close)

    asyncio.run(main())
    (row,) = rows(path)
    assert (row["model"], row["engine"], row["outcome"]) == (
        "fast",
        "small",
        "refused:capability_not_served",
    )
    assert (row["prompt_tokens"], row["completion_tokens"], row["usage_source"]) == (
        None,
        None,
        "none",
    )
