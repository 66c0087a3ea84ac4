"""A fleet on the real engine: the real llama-server router (Debian sid's) serving `tiny` under
its real worker, on machine `b`, and machine `a` with no engine at all, each a real gateway
process on loopback, one PostgreSQL record and catalog, one peers file; the official `openai`
client speaks only to a.

In this order, one engine and two gateways for the module: a's `/v1/models` lists b's model
with its machine; a chat and a stream for it through a are answered by b's llama-server, each
one row in the record, b's, with the tokens llama-server counted, and none of a's; a stream its
client leaves after a few chunks is recorded by b as `client_gone`; and last, the engine
stopped by its operator: a chat through a is b's 503 naming machine b, and nothing starts it.

The router is test_gateway_exempt_router's fixture (imported, so this module loads it once for
itself, as every router module does).
"""

from __future__ import annotations

import contextlib
import json
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import psycopg
import pytest

from tests.fixtures import Engine
from tests.gateway_proc import Gateway, running_gateway
from tests.host.fleet_world import fleet_settings, write_peers
from tests.integration.test_gateway_exempt_router import router
from tests.postgres import Cluster
from tests.record_world import until
from tests.standin import free_port

pytestmark = pytest.mark.docker

__all__ = ["router"]  # the fixture, imported for this module's own router

MODEL = "tiny"  # the one model the router serves
HI: Any = [{"role": "user", "content": "hi"}]
WHOLE = {"ignore_eos": True}  # llama-server's own: as many tokens as asked, whatever is drawn
LONG = 20000  # a stream's tokens asked for, far more than a client that leaves reads
BUDGET = "daily_tokens = 100000000"  # the long streams are not what this module counts


@dataclass
class Fleet:
    """Machines a (no engine) and b (the router), the record's DSN."""

    a: Gateway
    b: Gateway
    dsn: str

    def client(self, timeout: float = 300) -> openai.OpenAI:
        """The official client on a's address, with a's inference key."""
        return self.a.client(self.a.inference, timeout=timeout)

    def rows(self) -> list[dict[str, Any]]:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            found = conn.execute(
                "SELECT machine, outcome, engine, model, prompt_tokens, completion_tokens "
                "FROM generations ORDER BY at_us"
            )
            names = [column.name for column in found.description or ()]
            return [dict(zip(names, row, strict=True)) for row in found.fetchall()]

    def recorded(self, count: int) -> list[dict[str, Any]]:
        """The record's rows once `count` are committed (the writer's bound: a second)."""
        until(lambda: len(self.rows()) >= count, 30, f"{count} rows")
        return self.rows()


@contextlib.contextmanager
def machine(work: Path, name: str, data: Path, dsn: str, peers: Path) -> Iterator[Gateway]:
    port = free_port()
    settings = fleet_settings(name, port, dsn, peers).replace("daily_tokens = 1000", BUDGET, 1)
    assert BUDGET in settings, "fleet_settings names its budget otherwise now"
    with running_gateway(work / f"gateway-{name}", data, settings, port=port) as gateway:
        yield gateway


@pytest.fixture(scope="module")
def fleet(
    router: Engine, postgres: Cluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Fleet]:
    work = tmp_path_factory.mktemp("fleet-llama")
    peers = work / "peers.keys"
    write_peers(peers, {name: secrets.token_urlsafe(32) for name in ("a", "b")})
    empty = work / "data-a"
    empty.mkdir()
    dsn = postgres.database()
    with (
        machine(work, "b", router.data_dir, dsn, peers) as b,
        machine(work, "a", empty, dsn, peers) as a,
    ):
        yield Fleet(a, b, dsn)


def listed(fleet: Fleet) -> list[tuple[str, str | None]]:
    return [(m.id, (m.model_extra or {}).get("machine")) for m in fleet.client().models.list()]


def test_a_lists_the_routers_model_on_machine_b(fleet: Fleet, router: Engine) -> None:
    until(lambda: (MODEL, "b") in listed(fleet), 30, "a seeing b's catalog")
    assert listed(fleet) == [(MODEL, "b")], "a serves nothing of its own"
    status = router.status()
    assert status is not None and status["state"] == "running"


def test_a_chat_through_a_is_answered_by_bs_llama_server_and_recorded_once_by_b(
    fleet: Fleet, router: Engine
) -> None:
    before = len(fleet.rows())
    answer = fleet.client().chat.completions.create(
        model=MODEL, messages=HI, max_tokens=12, extra_body=WHOLE
    )
    assert answer.choices[0].message.content, "llama-server's text"
    assert answer.usage is not None and answer.usage.completion_tokens == 12
    rows = fleet.recorded(before + 1)
    assert rows[before:] == [
        {
            "machine": "b",
            "outcome": "ok",
            "engine": router.name,
            "model": MODEL,
            "prompt_tokens": answer.usage.prompt_tokens,
            "completion_tokens": 12,
        }
    ]


def test_a_stream_through_a_comes_in_chunks_from_b_with_its_usage(
    fleet: Fleet, router: Engine
) -> None:
    before = len(fleet.rows())
    stream = fleet.client().chat.completions.create(
        model=MODEL,
        messages=HI,
        max_tokens=16,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=WHOLE,
    )
    texts: list[str] = []
    usage = None
    for chunk in stream:
        texts.extend(c.delta.content for c in chunk.choices if c.delta.content)
        usage = chunk.usage or usage
    assert len(texts) > 1 and "".join(texts), "the text, in several chunks"
    assert usage is not None and usage.completion_tokens == 16
    rows = fleet.recorded(before + 1)
    assert [(r["machine"], r["outcome"], r["engine"]) for r in rows[before:]] == [
        ("b", "ok", router.name)
    ]
    assert (rows[before]["prompt_tokens"], rows[before]["completion_tokens"]) == (
        usage.prompt_tokens,
        16,
    )


def test_a_stream_its_client_leaves_is_bs_client_gone(fleet: Fleet, router: Engine) -> None:
    """Chunks reach the client through a while llama-server writes on: it leaves after three,
    and b records the generation as the client's leaving, with fewer tokens than asked."""
    before = len(fleet.rows())
    stream = fleet.client().chat.completions.create(
        model=MODEL, messages=HI, max_tokens=LONG, stream=True, extra_body=WHOLE
    )
    read = 0
    for chunk in stream:
        read += sum(1 for c in chunk.choices if c.delta.content)
        if read >= 3:
            break
    stream.close()
    rows = fleet.recorded(before + 1)
    assert [(r["machine"], r["outcome"], r["engine"]) for r in rows[before:]] == [
        ("b", "client_gone", router.name)
    ]
    assert (rows[before]["completion_tokens"] or 0) < LONG, "the engine stopped short of the end"


def desired(router: Engine) -> dict[str, Any]:
    return dict(json.loads((router.dir / "desired.json").read_text()))


def test_the_operators_stop_on_b_is_bs_refusal_through_a_and_nothing_starts(
    fleet: Fleet, router: Engine
) -> None:
    generation = router.request("stopped", wait_s=120)
    before = len(fleet.rows())
    for _ in range(2):
        with pytest.raises(openai.InternalServerError) as refused:
            fleet.client().chat.completions.create(model=MODEL, messages=HI, max_tokens=4)
        assert refused.value.status_code == 503
        error = refused.value.response.json()["error"]
        assert (error["code"], error["machine"]) == ("model_not_loaded", "b"), error
        assert error["message"].startswith(f"engine {router.name} is not loaded: stopped by an")
    time.sleep(3)  # long enough for a start either gateway wrote to show in both files
    asked = desired(router)
    assert (asked["generation"], asked["desired"], asked["requestedBy"]) == (
        generation,
        "stopped",
        "operator",
    )
    now = router.status()
    assert now is not None and (now["generation"], now["state"]) == (generation, "stopped")
    refusals = fleet.recorded(before + 2)[before:]
    assert [(r["machine"], r["outcome"]) for r in refusals] == [
        ("b", "refused:model_not_loaded")
    ] * 2, "b's refusals, b's rows"
