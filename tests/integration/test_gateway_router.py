"""The gateway in front of the real llama-server router (two tiny llama models), as its real
process, with the official `openai` client and curl from loopback.

One worker and one gateway for the module, in this order: a start on demand from `stopped`, the
models RPC, streams with and without usage, admission refusals while a slow stream holds the one
slot, the record's rows naming the build that answered, bad input (each refused with its status,
the engine answering afterwards), a slowloris, Prometheus scraping the gateway's file_sd target,
and last the engine killed mid-stream.
"""

from __future__ import annotations

import json
import socket
import subprocess
import urllib.request
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import docker
import openai
import pytest

from tests.fixtures import REPO_TEMPLATE, Engine, EngineFactory, RecipeRepo, state_since
from tests.gateway_proc import Gateway, metric, running_gateway
from tests.gguf_fixtures import TinyLlama, add_model, write_llama
from tests.standin import recipe_repository
from tests.system.harness import prometheus_api, running_prometheus, wait_for

pytestmark = pytest.mark.docker

CONTEXT = 32768  # a long answer: a slow reader holds its slot while the engine writes on
HEADER_TIMEOUT_S = 3
BODY_TIMEOUT_S = 3
LISTEN = f"header_timeout_s = {HEADER_TIMEOUT_S}\nbody_timeout_s = {BODY_TIMEOUT_S}\n"
SETTINGS = """[limits]
running = 1
waiting = 0
load_wait_s = 300
"""
HI = [{"role": "user", "content": "hi"}]
WHOLE = {"ignore_eos": True}  # llama-server's own: as many tokens as asked, whatever is drawn
FRESH: list[str] = []  # the models a fresh worker named while stopped, before any run


@pytest.fixture(scope="module")
def router(
    client: docker.DockerClient,
    base_image: str,
    tmp_path_factory: pytest.TempPathFactory,
    request: pytest.FixtureRequest,
) -> Iterator[Engine]:
    """A llama-router engine with alpha and zeta, its worker running and the engine stopped."""
    directory = tmp_path_factory.mktemp("gateway-router")
    recipe_repository(directory / "recipe-repo", REPO_TEMPLATE, "recipe 0.7.0")
    repo = RecipeRepo(directory / "recipe-repo")
    factory = EngineFactory(client, base_image, directory, lambda: repo, request)
    engine = factory(kind="llama-router", models_max=2, defaults={"ctx-size": CONTEXT})
    engine.models_dir.mkdir(exist_ok=True)
    for name in ("alpha", "zeta"):
        write_llama(
            add_model(engine.models_dir, "Ready") / f"{name}.gguf", TinyLlama(context=CONTEXT)
        )
    engine.start_worker()
    stopped = engine.wait_state(engine.request("stopped"), "stopped", timeout=60)
    # a few heartbeats (2 s) later: what a fresh worker names while it never ran
    FRESH.extend(
        engine.wait_status(
            lambda s: _checked(s) - state_since(stopped) > 6, timeout=60, what="heartbeats"
        )["models"]
    )
    # one run syncs the library into the preset; stopped again, the preset's models remain: by
    # the gateway, as it stops an engine it started once idle, so that traffic may start it
    engine.wait_state(engine.request("running"), "running", timeout=120)
    engine.wait_state(engine.request("stopped", by="gateway"), "stopped", timeout=120)
    yield engine
    factory.close()


@pytest.fixture(scope="module")
def gateway(router: Engine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    with running_gateway(
        tmp_path_factory.mktemp("gateway"), router.data_dir, SETTINGS, LISTEN
    ) as gw:
        yield gw


@pytest.fixture(scope="module")
def expiring(gateway: Gateway) -> str:
    """An issued key that works now and expires in 20 s (made before the slow cases)."""
    when = (datetime.now(UTC) + timedelta(seconds=20)).isoformat(timespec="seconds")
    key = gateway.create_key("expiring", "--expires", when)
    wait_for(lambda: gateway.get("/v1/models", key)[0] == 200, 10, "the new key accepted")
    return key


def _checked(status: dict[str, Any]) -> float:
    return datetime.fromisoformat(status["checkedAt"].replace("Z", "+00:00")).timestamp()


def _answered(gateway: Gateway, model: str = "alpha") -> None:
    """The engine answers a small chat completion through the gateway."""
    answer = gateway.client().chat.completions.create(
        model=model, messages=HI, max_tokens=4, extra_body=WHOLE
    )
    assert answer.choices and answer.usage is not None and answer.usage.completion_tokens == 4


def _curl(
    gateway: Gateway,
    path: str,
    *args: str,
    key: str | None = None,
    body: bytes | None = None,
    work: Path | None = None,
) -> tuple[int, dict[str, Any]]:
    """curl's status code and JSON body; the key goes in a header file, not the argument list."""
    assert work is not None
    headers = work / "headers"
    headers.write_text(
        f"Authorization: Bearer {key or gateway.issued}\nContent-Type: application/json\n"
    )
    data: list[str] = []
    if body is not None:
        (work / "body").write_bytes(body)
        data = ["--data-binary", f"@{work / 'body'}"]
    out = work / "out"
    done = subprocess.run(
        [
            "curl",
            "-sS",
            "-o",
            str(out),
            "-w",
            "%{http_code}",
            "-H",
            f"@{headers}",
            *data,
            *args,
            gateway.url + path,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    code = int(done.stdout.strip() or 0)
    try:
        return code, json.loads(out.read_bytes())
    except (OSError, ValueError):
        return code, {"curl": done.stderr}


# -- a start on demand, the models RPC, streams ----------------------------------------------


def test_a_fresh_worker_names_the_routers_models_before_any_run(router: Engine) -> None:
    assert sorted(FRESH) == ["alpha", "zeta"]


def test_a_request_starts_the_stopped_engine_and_is_answered(
    router: Engine, gateway: Gateway, expiring: str
) -> None:
    stopped = router.status()
    assert stopped is not None and stopped["state"] == "stopped"
    assert sorted(stopped["models"]) == ["alpha", "zeta"], "the router's models, while stopped"
    answer = gateway.client().chat.completions.create(
        model="alpha", messages=HI, max_tokens=8, extra_body=WHOLE
    )
    assert answer.model and answer.choices[0].message is not None
    assert answer.usage is not None and answer.usage.completion_tokens == 8
    status = router.status()
    assert status is not None and status["state"] == "running"
    desired = json.loads((router.dir / "desired.json").read_text())
    assert desired["desired"] == "running" and desired["generation"] > stopped["generation"]
    # counted as the handler ends, just after the client has its answer: waited for
    wait_for(
        lambda: (
            metric(
                gateway.metrics(),
                "lucia_gateway_requests_total",
                model="alpha",
                engine=router.name,
                outcome="ok",
            )
            == 1
        ),
        30,
        "the request counted",
    )


def test_models_lists_each_model_with_engine_state_and_build(
    router: Engine, gateway: Gateway, router_images: tuple[str, str]
) -> None:
    listed = {m.id: m.model_dump() for m in gateway.client().models.list()}
    assert sorted(listed) == ["alpha", "zeta"]
    status = router.status()
    assert status is not None
    with urllib.request.urlopen(status["url"] + "/props", timeout=10) as answer:
        props = json.loads(answer.read())
    for entry in listed.values():
        assert entry["engine"] == router.name and entry["state"] == "running"
        assert entry["build"]["image"] == router_images[0]
        # what the worker recorded: the build the router states in its /props
        assert entry["build"]["engineVersion"] == status["engine"]["engineVersion"]
        assert entry["build"]["engineVersion"] == props["build_info"] != ""
        assert (entry["running"], entry["waiting"]) == (0, 0)


def test_a_stream_hides_the_usage_it_did_not_ask_for_and_counts_it(
    router: Engine, gateway: Gateway
) -> None:
    before = metric(gateway.metrics(), "lucia_gateway_completion_tokens_total", model="zeta")
    chunks = list(
        gateway.client().chat.completions.create(
            model="zeta", messages=HI, max_tokens=6, stream=True, extra_body=WHOLE
        )
    )
    assert chunks and all(c.usage is None and c.choices for c in chunks), "no usage chunk"
    assert chunks[-1].choices[0].finish_reason is not None
    wait_for(
        lambda: metric(gateway.metrics(), "lucia_gateway_requests_total", model="zeta") == 1,
        30,
        "the stream counted",
    )
    counted = metric(gateway.metrics(), "lucia_gateway_completion_tokens_total", model="zeta")
    assert counted - before == 6  # max_tokens 6, from the engine's own usage
    asked = list(
        gateway.client().chat.completions.create(
            model="zeta",
            messages=HI,
            max_tokens=6,
            stream=True,
            extra_body=WHOLE,
            stream_options={"include_usage": True},
        )
    )
    assert asked[-1].usage is not None and asked[-1].usage.completion_tokens == 6


# -- admission ---------------------------------------------------------------------------------


def _free(router: Engine, gateway: Gateway) -> None:
    """Until the engine runs nothing: a case before read its last answer whole, and its handler
    gives its slot back just after; a request on a connection of its own may come in between."""
    wait_for(
        lambda: metric(gateway.metrics(), "lucia_gateway_running", engine=router.name) == 0,
        30,
        "the slot free",
    )


def _slow_stream(gateway: Gateway) -> openai.Stream[Any]:
    """A stream of a long answer, its first chunk read; the rest waits for the reader."""
    stream = gateway.client(timeout=120).chat.completions.create(
        model="alpha", messages=HI, max_tokens=CONTEXT - 64, stream=True, extra_body=WHOLE
    )
    next(iter(stream))
    return stream


def test_a_full_engine_refuses_at_once_with_429_naming_its_counts(
    router: Engine, gateway: Gateway, tmp_path: Path
) -> None:
    _free(router, gateway)
    stream = _slow_stream(gateway)
    try:
        with pytest.raises(openai.RateLimitError) as refused:
            gateway.client().chat.completions.create(model="zeta", messages=HI, max_tokens=4)
        response = refused.value.response
        assert response.status_code == 429
        assert int(response.headers["retry-after"]) >= 1
        body = response.json()
        assert body["error"]["code"] == "engine_busy"
        assert (body["engine"], body["running"], body["waiting"]) == (router.name, 1, 0)
        code, raw = _curl(
            gateway,
            "/v1/chat/completions",
            work=tmp_path,
            body=json.dumps({"model": "alpha", "messages": HI, "max_tokens": 4}).encode(),
        )
        assert code == 429 and raw["engine"] == router.name
        assert metric(gateway.metrics(), "lucia_gateway_refusals_total", reason="engine_busy") == 2
    finally:
        stream.close()  # the client goes: the slot comes free
    wait_for(
        lambda: metric(gateway.metrics(), "lucia_gateway_running", engine=router.name) == 0,
        30,
        "the slot free",
    )
    _answered(gateway)


def test_the_record_names_the_build_that_answered_each_row(
    router: Engine, gateway: Gateway
) -> None:
    """The rows of the cases so far, as `usage --by build` and the owner API read them: the
    llama-server build the router's status named, the refusals by their codes."""
    status = router.status()
    assert status is not None and status["state"] == "running"
    version = status["engine"]["engineVersion"]
    assert version, "the router names its build (/props)"

    def figures() -> dict[str, Any]:
        done = gateway.cli(
            "usage",
            "--since",
            "1h",
            "--by",
            "build",
            "--json",
            "--settings",
            str(gateway.log.parent / "gateway.toml"),
        )
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    def served(found: dict[str, Any]) -> list[dict[str, Any]]:
        return [g for g in found["groups"] if g["engine"] == router.name and g["ok"] >= 3]

    wait_for(lambda: served(figures()), 30, "the answered rows committed")
    (group,) = served(figures())
    assert (group["engineVersion"], group["imageId"]) == (version, status["engine"]["imageId"])
    assert group["weightsRevision"] == "unknown"  # the router names no revision: never a guess
    assert group["refusals"].get("engine_busy") == 2, group
    assert group["completionTokens"] >= 3 * 4  # the engine's own usage
    code, body = gateway.get("/api/host/usage?by=build&since=1h", gateway.owner)
    assert code == 200 and any(g["engineVersion"] == version for g in body["groups"])
    assert gateway.get("/api/host/usage", gateway.issued)[0] == 403


# -- bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "size", "limit"),
    [
        ("/v1/chat/completions", 3 * 2**20, "2 MiB"),
        ("/v1/embeddings", 17 * 2**20, "16 MiB"),
    ],
)
def test_an_oversized_body_is_413(
    gateway: Gateway, tmp_path: Path, path: str, size: int, limit: str
) -> None:
    padding = "x" * size
    code, body = _curl(
        gateway, path, work=tmp_path, body=json.dumps({"model": "alpha", "input": padding}).encode()
    )
    assert code == 413, body
    assert limit in body["error"]["message"]
    _answered(gateway)


@pytest.mark.parametrize(
    ("raw", "words"),
    [
        (
            b'{"model": "alpha", "messages": [{"role": "user", "content": "\xff\xfe"}]}',
            "not UTF-8: byte 61 is invalid",
        ),
        (
            b'{"model": "alpha", "messages": [',
            "malformed JSON: Expecting value at line 1 column 33",
        ),
    ],
)
def test_a_body_that_is_not_json_is_400_with_where_it_broke(
    gateway: Gateway, tmp_path: Path, raw: bytes, words: str
) -> None:
    code, body = _curl(gateway, "/v1/chat/completions", work=tmp_path, body=raw)
    assert code == 400 and body["error"]["code"] == "invalid_request"
    assert words in body["error"]["message"]
    _answered(gateway)


def test_an_expired_key_is_401(gateway: Gateway, expiring: str) -> None:
    wait_for(lambda: gateway.get("/v1/models", expiring)[0] == 401, 60, "the key expired")
    with pytest.raises(openai.AuthenticationError):
        gateway.client(expiring).chat.completions.create(model="alpha", messages=HI, max_tokens=4)
    _answered(gateway)


def test_a_revoked_key_is_401(gateway: Gateway) -> None:
    key = gateway.create_key("revoked")
    wait_for(lambda: gateway.get("/v1/models", key)[0] == 200, 10, "the new key accepted")
    answer = gateway.client(key).chat.completions.create(model="alpha", messages=HI, max_tokens=4)
    assert answer.choices
    gateway.cli("keys", "revoke", "revoked")
    wait_for(lambda: gateway.get("/v1/models", key)[0] == 401, 30, "the key refused")
    with pytest.raises(openai.AuthenticationError) as refused:
        gateway.client(key).chat.completions.create(model="alpha", messages=HI, max_tokens=4)
    assert refused.value.response.json()["error"]["code"] == "invalid_api_key"
    _answered(gateway)


def test_the_inference_key_may_not_call_the_host_api(router: Engine, gateway: Gateway) -> None:
    for key in (gateway.inference, gateway.issued):
        status, body = gateway.get("/api/host/engines", key)
        assert status == 403 and body["error"]["code"] == "permission_denied"
    status, body = gateway.get("/api/host/engines", gateway.owner)
    assert status == 200 and router.name in json.dumps(body)
    _answered(gateway)


def test_a_slowloris_is_closed_and_others_are_served_meanwhile(gateway: Gateway) -> None:
    """Headers that never finish: the connection is closed at listen.header_timeout_s (the
    socket's 60 s timeout is the bound; aiohttp's own default would hold it an hour)."""
    port = int(gateway.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=60) as slow:
        slow.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nX-Pad: ")
        _answered(gateway)  # served while the slow one holds its connection
        assert slow.recv(4096) == b"", "closed, without an answer"
    _answered(gateway)


def test_a_body_that_stops_coming_gets_408_and_the_engine_answers_on(gateway: Gateway) -> None:
    """Whole headers, then a tenth of the body and nothing more: 408 and the connection closed
    at listen.body_timeout_s (the socket's 60 s timeout is the bound; the gateway used to hold
    it for ever), nothing forwarded, and the engine answers afterwards."""
    port = int(gateway.url.rsplit(":", 1)[1])
    body = json.dumps({"model": "alpha", "messages": HI, "max_tokens": 4}).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nAuthorization: Bearer {gateway.issued}\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", port), timeout=60) as slow:
        slow.sendall(head.encode() + body[: len(body) // 10])
        answer = b""
        while chunk := slow.recv(65536):  # until the gateway closes it
            answer += chunk
    top, _, error = answer.partition(b"\r\n\r\n")
    assert top.startswith(b"HTTP/1.1 408 ") and b"Connection: close" in top, top
    assert json.loads(error)["error"]["code"] == "request_timeout"
    _answered(gateway)


# -- Prometheus --------------------------------------------------------------------------------


def test_prometheus_scrapes_the_gateway_target(
    router: Engine, gateway: Gateway, tmp_path: Path
) -> None:
    _answered(gateway)
    with running_prometheus(router.data_dir / "telemetry", tmp_path) as prometheus:

        def result(expr: str) -> list[dict[str, Any]]:
            data = prometheus_api(prometheus, "/api/v1/query?query=" + expr) or {"result": []}
            return list(data["result"])

        up = wait_for(lambda: result('up{service="lucia-gateway"}'), 60, "the gateway scraped")
        assert [r["value"][1] for r in up] == ["1"]
        assert up[0]["metric"]["instance"] == gateway.url.removeprefix("http://")
        ok = wait_for(
            lambda: result(f'lucia_gateway_requests_total{{engine="{router.name}",outcome="ok"}}'),
            30,
            "a gateway metric",
        )
        assert sum(float(r["value"][1]) for r in ok) >= 1


# -- last: the engine killed mid-stream --------------------------------------------------------


def test_an_engine_killed_mid_stream_ends_the_stream_with_an_error_event(
    router: Engine, gateway: Gateway, client: docker.DockerClient
) -> None:
    _free(router, gateway)
    stream = _slow_stream(gateway)  # the client's own timeout bounds "never hangs"
    client.containers.get(router.container).kill()
    read = 0
    with pytest.raises(openai.APIError) as broken:
        for _ in stream:
            read += 1
    assert "broke off the stream" in broken.value.message, broken.value.message
    assert broken.value.body is not None and broken.value.body["code"] == "engine_failed"
    wait_for(
        lambda: (
            metric(
                gateway.metrics(),
                "lucia_gateway_requests_total",
                engine=router.name,
                outcome="engine_failed",
            )
            == 1
        ),
        10,
        "the request counted engine_failed",
    )


def test_the_gateway_logged_no_key(gateway: Gateway) -> None:
    log = gateway.log_text()
    assert "gateway listening" in log
    for key in (gateway.owner, gateway.inference, gateway.issued):
        assert key not in log
