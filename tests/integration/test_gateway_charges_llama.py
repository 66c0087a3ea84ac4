"""Every request through the gateway is charged at least what the real llama-server generated
for it: chat, text completions, /v1/responses and embeddings; plain, streamed, left mid-stream,
past the deadline, and an engine killed mid-stream (tests/charges.py).

The engine's own count is its /metrics: `llamacpp:prompt_tokens_total` (the prompt tokens it
processed, not those its cache held) and `llamacpp:tokens_predicted_total`.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import docker
import pytest

from tests.charge_cases import LATE_WAYS, WAYS, cases
from tests.charges import Charges, Counters, charging, read_counters
from tests.fixtures import RUN_ID, TEST_LABEL, free_port
from tests.gguf_fixtures import TinyLlama, write_llama
from tests.llama_server import CONTAINER_DIR, CONTAINER_PORT
from tests.vllm_cpu import wait_for

pytestmark = pytest.mark.docker

MODEL = "tiny"
CONTEXT = 4096
LONG = 3000  # tokens of a long answer: about a second of this engine's on two cores


def start_llama(
    client: docker.DockerClient, image: str, network: tuple[str, str], models: Path
) -> tuple[Any, str]:
    """llama-server serving the tiny GGUF, generation and embeddings, on the network's
    gateway address: its container and url."""
    name, gateway = network
    port = free_port()
    container = client.containers.run(
        image,
        [
            "--model",
            f"{CONTAINER_DIR}/tiny.gguf",
            "--alias",
            MODEL,
            "--host",
            "0.0.0.0",
            "--port",
            str(CONTAINER_PORT),
            "--metrics",
            "--embeddings",
            "--pooling",
            "mean",
            "--parallel",
            "1",
            "--ctx-size",
            str(CONTEXT),
        ],
        name=f"lucia-t{RUN_ID}-charges-{port}",
        detach=True,
        labels={TEST_LABEL: RUN_ID},
        network=name,
        ports={f"{CONTAINER_PORT}/tcp": (gateway, port)},
        volumes={str(models): {"bind": CONTAINER_DIR, "mode": "ro"}},
    )
    url = f"http://{gateway}:{port}"
    wait_for(lambda: _healthy(url), "llama-server's /metrics")
    return container, url


BUSY = ("llamacpp:requests_processing", "llamacpp:requests_deferred")


def counters(url: str) -> Counters:
    return read_counters(
        url, "llamacpp:prompt_tokens_total", "llamacpp:tokens_predicted_total", BUSY
    )


def _healthy(url: str) -> bool:
    try:
        counters(url)
    except OSError:
        return False
    return True


@pytest.fixture(scope="module")
def llama(
    client: docker.DockerClient,
    llama_server_image: str,
    llama_network: tuple[str, str],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Any, str]]:
    models = tmp_path_factory.mktemp("charges-models")
    write_llama(models / "tiny.gguf", TinyLlama(context=CONTEXT))
    models.chmod(0o755)
    container, url = start_llama(client, llama_server_image, llama_network, models)
    yield container, url
    container.remove(force=True)


@pytest.fixture(scope="module")
def charges(llama: tuple[Any, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Charges]:
    _, url = llama
    with charging(
        tmp_path_factory.mktemp("charges"), "llama-server", url, MODEL, lambda: counters(url)
    ) as found:
        yield found


# A stream its client leaves is charged the engine's running count at the last event read, a
# margin, and what the engine can have generated unseen at its own pace (its generating slot runs
# ahead of the thread that sends its events: on a busy machine by hundreds of tokens). These
# cases run beside the shared phase's others, where the machine is busy.
CASES = cases(("chat", "completions", "responses", "embeddings"))


@pytest.mark.parametrize(("route", "way"), CASES)
def test_each_way_of_asking_is_charged_what_llama_server_generated(
    charges: Charges, route: str, way: str
) -> None:
    model = f"{MODEL}-late" if way in LATE_WAYS else MODEL
    client = charges.gateway.client(timeout=120)
    charge = charges.measure(route, way, lambda: WAYS[way](client, route, model, LONG))
    assert charge.under == 0, charge
    assert charge.charged_prompt > 0, charge
    assert charge.charged_completion >= charge.engine_generated, charge
    if route != "embeddings" and way not in LATE_WAYS:  # that may end before the engine began
        assert charge.engine_generated > 0, charge
    if way in LATE_WAYS and route != "embeddings":  # ok: a machine that generates it in time
        assert charge.outcome in ("timed_out", "ok"), charge
    if way == "left mid-stream":
        # or the engine had sent its whole answer before the client left: it was delivered
        delivered = ("ok", "engine", LONG)
        assert (charge.outcome, charge.usage_source) == ("client_gone", "engine_partial") or (
            charge.outcome,
            charge.usage_source,
            charge.engine_generated,
        ) == delivered, charge


def test_a_stream_whose_engine_is_killed_is_charged_what_passed(
    charges: Charges, llama: tuple[Any, str]
) -> None:
    """The engine's counters die with it: the row is charged at least the events the client
    got, each a token, from the engine's own running count."""
    container, _ = llama
    charges.killed_mid_stream(MODEL, LONG, container)
