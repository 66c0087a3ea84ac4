"""The gateway in front of the real vLLM 0.32.0 CPU server, one load for the module, with the
official `openai` client.

A streaming completion starts the stopped engine on demand; vLLM's usage chunk, which the
gateway asked for and the client did not, is kept from the client and counted in /metrics.
Then, on the engine that runs, each case with a gateway of its own settings: an exempt key
spends past the daily budget and is served and recorded on; one key past its share of the
waiting is refused `key_busy` while another key is admitted to wait; the probe measures and
records the engine, and marks it `degraded` while it cannot generate.

The fault is vLLM's own: its engine core process (`VLLM::EngineCore`) frozen with SIGSTOP.
The API server process still answers /health (vLLM asks the core nothing for it) and takes
requests, which wait in it; SIGCONT lets the core go on with them. Frozen, a request admitted
to the one slot holds it whatever the speed of the machine, so the waiting is not a race.
"""

from __future__ import annotations

import json
import os
import signal
import urllib.request
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import closing, contextmanager
from typing import Any

import docker
import openai
import pytest

from tests.fixtures import Engine, own_recipe_factory
from tests.gateway_proc import Gateway, metric, running_gateway
from tests.system.harness import wait_for

pytestmark = pytest.mark.docker

MODEL = "tiny"
HI = [{"role": "user", "content": "hi"}]
WHOLE = {"ignore_eos": True}  # vLLM's own: as many tokens as asked, whatever is drawn
ANSWER = 2  # completion tokens of each chat: each is slow on the machine's CPU
BUDGET = 20  # tokens a day for every key that is not exempt
PROBE_TIMEOUT_S = 10
PROBING = f"[probe]\ninterval_s = 0.5\ntimeout_s = {PROBE_TIMEOUT_S}\n"
# one slot, one waiting place per key; a wait as long as the frozen core may hold it
SHARED = "[limits]\nrunning = 1\nwaiting = 4\nper_key_waiting = 1\nmax_wait_s = 300\n"


@pytest.fixture(scope="module")
def engine(
    client: docker.DockerClient,
    base_image: str,
    tmp_path_factory: pytest.TempPathFactory,
    request: pytest.FixtureRequest,
) -> Iterator[Engine]:
    """The vLLM CPU engine under its worker, stopped as the gateway stops an idle engine it
    started: traffic may start it again. Stopped at the module's end."""
    factory = own_recipe_factory(client, base_image, tmp_path_factory.mktemp("vllm"), request)
    made = factory(kind="vllm", vllm_device="cpu")
    made.start_worker()
    made.wait_state(made.request("stopped", by="gateway"), "stopped", timeout=120)
    try:
        yield made
    finally:
        made.request("stopped")
        stopped = made.wait_status(lambda s: s["state"] == "stopped", timeout=120)
        factory.close()
    assert stopped["engine"] is None


@pytest.fixture(scope="module")
def serving(engine: Engine) -> dict[str, Any]:
    """The engine running (as the first case leaves it; started here when run alone), its
    status once it says which vLLM it runs."""
    status = engine.status()
    if status is None or status["state"] != "running":
        engine.wait_state(engine.request("running"), "running", timeout=900)
    return engine.wait_status(
        lambda s: s["state"] == "running" and s["engine"]["engineVersion"] is not None,
        timeout=120,
        what="the running engine's version",
    )


@contextmanager
def frozen_core(engine: Engine) -> Iterator[None]:
    """vLLM's engine core process stopped (SIGSTOP) while the block runs, then let go."""
    with closing(docker.from_env(timeout=30)) as cli:
        top = cli.containers.get(engine.container).top(ps_args="-o pid,args")
    (pid,) = [int(p[0]) for p in top["Processes"] if p[1].startswith("VLLM::EngineCore")]
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def by_key(gateway: Gateway) -> dict[str, dict[str, Any]]:
    """The record's figures by key name, as `lucia-supervisor usage --by key --json` gives."""
    settings = str(gateway.log.parent / "gateway.toml")
    done = gateway.cli("usage", "--since", "1h", "--by", "key", "--json", "--settings", settings)
    return {group["name"]: group for group in json.loads(done.stdout)["groups"]}


def chat(gateway: Gateway, key: str) -> int:
    """A short chat's HTTP status; the answer must be whole."""
    raw = gateway.client(key, timeout=600).chat.completions.with_raw_response.create(
        model=MODEL, messages=HI, max_tokens=ANSWER, extra_body=WHOLE
    )
    usage = raw.parse().usage
    assert usage is not None and usage.completion_tokens == ANSWER
    return raw.http_response.status_code


def test_a_stream_starts_the_stopped_vllm_engine_and_its_usage_is_counted_not_shown(
    engine: Engine, tmp_path_factory: pytest.TempPathFactory
) -> None:
    stopped = engine.status()
    assert stopped is not None and stopped["state"] == "stopped", "the first case of the module"
    assert stopped["models"] == [MODEL], "the served name, while stopped"
    with running_gateway(
        tmp_path_factory.mktemp("gateway"), engine.data_dir, "[limits]\nload_wait_s = 900\n"
    ) as gateway:
        # the client's own timeout is the bound of the load (the recipe allows 900 s)
        stream = gateway.client(timeout=1200).completions.create(
            model=MODEL, prompt="the quick brown fox", max_tokens=6, temperature=0, stream=True
        )
        chunks = list(stream)
        assert chunks and all(c.usage is None and c.choices for c in chunks), "no usage chunk"
        text = "".join(c.choices[0].text for c in chunks)
        assert text and chunks[-1].choices[0].finish_reason == "length"
        running = engine.status()
        assert running is not None and running["state"] == "running"
        labels = {"model": MODEL, "engine": engine.name}
        # the request is counted as its handler ends, just after the client saw the stream end
        wait_for(
            lambda: metric(gateway.metrics(), "lucia_gateway_requests_total", **labels) == 1,
            30,
            "the request counted",
        )
        exposed = gateway.metrics()
        shown = [line for line in exposed.splitlines() if MODEL in line]
        assert metric(exposed, "lucia_gateway_completion_tokens_total", **labels) == 6, shown
        assert metric(exposed, "lucia_gateway_prompt_tokens_total", **labels) > 0
        assert metric(exposed, "lucia_gateway_requests_total", outcome="ok", **labels) == 1
        for key in (gateway.owner, gateway.inference, gateway.issued):
            assert key not in gateway.log_text()


def test_an_exempt_key_past_the_budget_is_served_and_recorded(
    engine: Engine, serving: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> None:
    budget = f"[budget]\ndaily_tokens = {BUDGET}\n"
    with running_gateway(tmp_path_factory.mktemp("exempt"), engine.data_dir, budget) as gateway:
        radar = gateway.create_key("radar", "--exempt")
        wait_for(lambda: gateway.get("/v1/models", radar)[0] == 200, 10, "the new key accepted")

        def spent() -> int:
            code, body = gateway.get("/v1/budget", radar)
            assert code == 200, body
            return int(body["spent_tokens"] or 0)

        chats = 0
        while spent() <= BUDGET:
            assert chat(gateway, radar) == 200
            chats += 1
            assert chats <= 10, "each chat is counted: the spending passes the budget"
        assert chat(gateway, radar) == 200, "served past the budget"
        chats += 1
        code, stood = gateway.get("/v1/budget", radar)
        assert code == 200
        assert (stood["enforced"], stood["exempt"], stood["budget_tokens"]) == (False, True, None)
        # the budget is enforced in this gateway all the same: a key held to one token a day
        person = gateway.create_key("person", "--budget", "1")
        with pytest.raises(openai.RateLimitError) as refused:
            gateway.client(person).chat.completions.create(model=MODEL, messages=HI, max_tokens=1)
        assert refused.value.response.json()["error"]["code"] == "budget_exceeded"

        def recorded() -> dict[str, Any] | None:
            group = by_key(gateway).get("radar")
            return group if group is not None and group["ok"] == chats else None

        group = wait_for(recorded, 30, "the exempt key's rows committed")
        assert group["requests"] == chats and group["completionTokens"] == chats * ANSWER
        assert group["promptTokens"] > 0 and group["refusals"] == {}
        assert spent() == group["promptTokens"] + group["completionTokens"]


def test_one_key_past_its_share_is_refused_key_busy_while_another_is_admitted(
    engine: Engine, serving: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> None:
    with running_gateway(tmp_path_factory.mktemp("shared"), engine.data_dir, SHARED) as gateway:
        backfill, other = gateway.create_key("backfill"), gateway.create_key("other")
        wait_for(lambda: gateway.get("/v1/models", other)[0] == 200, 10, "the new keys accepted")

        def gate() -> tuple[int, int]:
            code, body = gateway.get("/api/host/engines", gateway.owner)
            assert code == 200
            (row,) = [row for row in body["engines"] if row["name"] == engine.name]
            return int(row["running"]), int(row["waiting"])

        with ThreadPoolExecutor(3) as pool:  # let go of the core before the pool waits
            with frozen_core(engine):
                queued: list[Future[int]] = [pool.submit(chat, gateway, backfill)]
                wait_for(lambda: gate() == (1, 0), 30, "the backfill's first request in the slot")
                queued.append(pool.submit(chat, gateway, backfill))
                wait_for(lambda: gate() == (1, 1), 30, "the backfill's second request waiting")
                with pytest.raises(openai.RateLimitError) as refused:
                    gateway.client(backfill).chat.completions.create(
                        model=MODEL, messages=HI, max_tokens=1
                    )
                response = refused.value.response
                assert int(response.headers["retry-after"]) >= 1
                body = response.json()
                assert body["error"]["code"] == "key_busy"
                assert (body["engine"], body["key_waiting"], body["per_key_waiting"]) == (
                    engine.name,
                    1,
                    1,
                )
                queued.append(pool.submit(chat, gateway, other))
                wait_for(lambda: gate() == (1, 2), 30, "the other key's request admitted to wait")
            # the core goes on: each in its turn
            results = [future.result(timeout=300) for future in queued]
        assert results == [200, 200, 200]
        refusals = metric(gateway.metrics(), "lucia_gateway_refusals_total", reason="key_busy")
        assert refusals == 1
        groups = wait_for(
            lambda: (
                (found := by_key(gateway)).get("other", {}).get("ok") == 1
                and found["backfill"]["ok"] == 2
                and found
            ),
            30,
            "the rows committed",
        )
        assert groups["backfill"]["refusals"] == {"key_busy": 1}
        assert (groups["other"]["ok"], groups["other"]["refusals"]) == (1, {})


@pytest.fixture(scope="module")
def probing(
    engine: Engine, serving: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Gateway]:
    """A gateway that probes the engine; the module's last cases."""
    with running_gateway(tmp_path_factory.mktemp("probing"), engine.data_dir, PROBING) as gw:
        yield gw


def listed(gateway: Gateway) -> dict[str, Any]:
    """The model's entry in /v1/models, as the official client gives it."""
    (model,) = [m for m in gateway.client().models.list().data if m.id == MODEL]
    return model.model_extra or {}


def probed_ok(gateway: Gateway) -> dict[str, Any] | None:
    entry = listed(gateway)
    return entry if entry["probe"] is not None and not entry["degraded"] else None


def test_the_running_engine_is_probed_measured_and_recorded(
    engine: Engine, serving: dict[str, Any], probing: Gateway
) -> None:
    entry = wait_for(lambda: probed_ok(probing), 120, "a probe of the model answered")
    assert entry["engine"] == engine.name
    assert entry["probe"]["degraded"] is False and entry["probe"]["ttftS"] > 0
    image = serving["engine"]["imageId"].removeprefix("sha256:")[:12]
    build = f"{serving['engine']['engineVersion']}@{image}"
    assert build.startswith("0.32.0@"), "the version vLLM itself reports"
    at = {"engine": engine.name, "model": MODEL, "build": build}
    exposed = probing.metrics()
    assert metric(exposed, "lucia_gateway_probe_ttft_seconds_count", **at) >= 1, exposed
    assert metric(exposed, "lucia_gateway_probes_total", **at, outcome="ok") >= 1
    assert metric(exposed, "lucia_gateway_probe_degraded", engine=engine.name, model=MODEL) == 0
    assert metric(exposed, "lucia_gateway_requests_total") == 0  # no user's request

    def probe_rows() -> dict[str, Any] | None:
        settings = str(probing.log.parent / "gateway.toml")
        done = probing.cli("usage", "--by", "key", "--json", "--settings", settings)
        groups = json.loads(done.stdout)["groups"]
        return next((g for g in groups if g["keyId"] == "probe" and g["ok"] >= 1), None)

    rows = wait_for(probe_rows, 30, "the probe's rows committed")
    assert rows["completionTokens"] >= rows["ok"]  # vLLM's own count: a token each
    assert rows["ttftSeconds"]["p50"] > 0


def test_an_engine_whose_core_is_frozen_is_degraded_and_recovers(
    engine: Engine, serving: dict[str, Any], probing: Gateway
) -> None:
    wait_for(lambda: probed_ok(probing), 120, "a probe of the model answered")
    with frozen_core(engine):
        # vLLM answers /health and lists the model: only a generation tells
        with urllib.request.urlopen(serving["url"] + "/health", timeout=10) as health:
            assert health.status == 200
        with urllib.request.urlopen(serving["url"] + "/v1/models", timeout=10) as models:
            assert [m["id"] for m in json.loads(models.read())["data"]] == [MODEL]
        entry = wait_for(
            lambda: (found := listed(probing))["degraded"] and found, 60, "the model degraded"
        )
        assert entry["probe"]["reason"] == f"no answer within {PROBE_TIMEOUT_S} s"
        assert entry["state"] == "running"
        exposed = probing.metrics()
        assert metric(exposed, "lucia_gateway_probe_degraded", engine=engine.name, model=MODEL)
        assert metric(
            exposed, "lucia_gateway_probes_total", engine=engine.name, outcome="timed_out"
        )
    wait_for(lambda: probed_ok(probing), 120, "the model probed ok again")
    exposed = probing.metrics()
    assert metric(exposed, "lucia_gateway_probe_degraded", engine=engine.name, model=MODEL) == 0
    log = probing.log_text()
    assert "engine degraded: its probe failed" in log and "engine probed ok again" in log
    assert all(key not in log for key in (probing.owner, probing.inference, probing.issued))
