"""The model library on the page, in process against the tests' hub: an add through the CLI's
function, its progress row, retry, cancel and remove, and what is refused."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp

from supervisor.host.models import manifest as mf
from supervisor.host.models.hub import Hub as HubClient
from supervisor.host.page.memory import LedgerMemory
from supervisor.host.page.models import ModelsSection
from supervisor.host.page.routes import CSRF_HEADER
from supervisor.host.page.sources import Sources
from tests.host.gateway_world import OWNER_KEY, SETTINGS, World, world
from tests.host.library_world import COMMIT, GGUF, REPO, hub_of, make_repo
from tests.hub_standin import Hub

HOSTILE = "<img src=x onerror=alert(1)>"


def test_a_model_is_added_canceled_retried_and_removed(tmp_path: Path) -> None:
    root = tmp_path / "models"
    repo = make_repo(tmp_path / "repo")

    async def scenario(w: World, http: aiohttp.ClientSession, hub: Hub) -> None:
        base = str(w.gateway.make_url("/page/api/"))
        async with http.post(base + "signin", json={"key": OWNER_KEY}) as answer:
            headers = {CSRF_HEADER: (await answer.json())["csrf"]}

        async def post(path: str, body: Any, csrf: bool = True) -> tuple[int, Any]:
            async with http.post(base + path, json=body, headers=headers if csrf else {}) as a:
                return a.status, await a.json()

        async def models() -> list[dict[str, Any]]:
            async with http.get(base + "overview") as answer:
                section = (await answer.json())["models"]
            assert section["available"] and section["data"]["queueRunning"] is False
            return list(section["data"]["models"])

        assert await models() == []
        asked = {"repo": REPO, "revision": "main", "include": GGUF, "name": HOSTILE}
        assert (await post("models", asked, csrf=False))[0] == 403
        assert not root.exists() or mf.load_all(root) == []
        status, added = await post("models", asked)
        assert status == 201, added
        assert added["name"] == HOSTILE and added["commit"] == COMMIT
        assert added["state"] == "Queued" and added["bytesTotal"] == (repo / GGUF).stat().st_size
        [shown] = await models()
        assert shown == added
        status, refused = await post("models", {**asked, "name": "other", "include": ["*.nope"]})
        assert status == 400 and "matches --include" in refused["error"]["message"]
        status, refused = await post("models", asked)
        assert status == 400 and "already in the library" in refused["error"]["message"]
        assert (await post("models", {"repo": 7}))[0] == 400
        guid = added["id"]
        assert await post(f"models/{guid}/cancel", {}) == (
            200,
            {"action": "cancel", "applied": True},
        )
        assert mf.load(root, guid).state == "Canceled"
        status, refused = await post(f"models/{guid}/cancel", {})
        assert status == 400 and "only a queued or running download" in refused["error"]["message"]
        assert (await post(f"models/{guid}/retry", {}))[0] == 200
        assert (await models())[0]["state"] == "Queued"
        assert (await post(f"models/{guid}/explode", {}))[0] == 404
        assert (await post("models/..%2F..%2Fetc/remove", {}))[0] in (400, 404)
        assert (await post(f"models/{guid}/remove", {}))[0] == 200
        assert await models() == [] and not (root / guid).exists()

    async def main() -> None:
        with hub_of(repo) as hub:
            library = ModelsSection(root, lambda: HubClient(hub.url, None))
            sources = Sources(LedgerMemory(tmp_path), models=library)
            async with (
                world(tmp_path, SETTINGS, sources=sources) as w,
                aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as http,
            ):
                await scenario(w, http, hub)

    asyncio.run(main())


def test_without_a_library_the_models_actions_say_so(tmp_path: Path) -> None:
    async def main() -> None:
        async with (
            world(tmp_path, SETTINGS) as w,
            aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as http,
        ):
            base = str(w.gateway.make_url("/page/api/"))
            async with http.post(base + "signin", json={"key": OWNER_KEY}) as answer:
                headers = {CSRF_HEADER: (await answer.json())["csrf"]}
            async with http.post(base + "models", json={"repo": REPO}, headers=headers) as a:
                assert a.status == 404
                assert "not connected" in (await a.json())["error"]["message"]

    asyncio.run(main())
