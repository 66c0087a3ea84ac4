"""The real vLLM 0.32.0 CPU server behind the gateway's real process, one load, asked through
the official `openai` client.

What a model serves: the stopped engine declares what vLLM resolves for its arguments and its
model's config.json (LlamaForCausalLM: generate); an embedding asked of it is refused 400
`capability_not_served` and nothing is started; a completion starts it, and the running
server's own routes (its /openapi.json) then say the same.

One trace through both: the gateway traces, and the recipe's `otlp_traces_endpoint` has vLLM
export its own spans, both to the tests' OTLP/HTTP receiver (tests/otlp_receiver.py) listening
on the engine network's gateway address, where the host's gateway and the engine's container
both reach it. A caller's `traceparent` is continued by the gateway's request span, and vLLM's
own `llm_request` span (vllm/v1/engine/output_processor.py in the image) is that span's child,
in the caller's trace. Neither exports the prompt: vLLM's span carries its timings, token
counts, sampling parameters and its own request id, never text.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

import docker
import openai
import pytest

from tests.fixtures import RUN_ID, TEST_LABEL, Engine, own_recipe_factory
from tests.gateway_proc import Gateway, running_gateway
from tests.otlp_receiver import ReceivedSpan, Receiver, receiving
from tests.system.harness import wait_for

pytestmark = pytest.mark.docker

GENERATES = ["chat", "completion", "responses"]
PROMPT = "zebra lantern quartz: say something"  # searched for in every exported byte
CALLER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"
CALLER = f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"
ROOT = "POST /v1/chat/completions"  # the gateway's request span
VLLM_SPAN = "llm_request"  # vLLM's own span of a request
SERVER = 2  # SpanKind.SERVER in OTLP's enum


@dataclass
class World:
    engine: Engine
    gateway: Gateway
    receiver: Receiver


def network_gateway(client: docker.DockerClient, name: str) -> str:
    """The gateway address of the engine's network (this run's own), made now if no worker has
    made it yet, so that a receiver can listen there before the recipe names it."""
    try:
        network = client.networks.get(name)
    except docker.errors.NotFound:
        try:
            network = client.networks.create(name, driver="bridge", labels={TEST_LABEL: RUN_ID})
        except docker.errors.APIError as exc:
            if exc.status_code != 409:  # made meanwhile
                raise
            network = client.networks.get(name)
    network.reload()
    return str(network.attrs["IPAM"]["Config"][0]["Gateway"])


@pytest.fixture(scope="module")
def world(
    client: docker.DockerClient,
    base_image: str,
    tmp_path_factory: pytest.TempPathFactory,
    request: pytest.FixtureRequest,
) -> Iterator[World]:
    """The vLLM CPU engine, stopped as the gateway stops an idle engine, its recipe sending
    vLLM's spans to the receiver; the gateway over it, tracing to the same receiver."""
    directory = tmp_path_factory.mktemp("capabilities-vllm")
    factory = own_recipe_factory(client, base_image, directory, request)
    engine = factory(kind="vllm", vllm_device="cpu")
    with receiving(network_gateway(client, engine.network)) as receiver:
        engine.vllm = {"otlp_traces_endpoint": receiver.url + "/v1/traces"}
        engine.start_worker()
        engine.wait_state(engine.request("stopped", by="gateway"), "stopped", timeout=120)
        settings = f'[limits]\nload_wait_s = 900\n[tracing]\nendpoint = "{receiver.url}"\n'
        with running_gateway(directory / "gateway", engine.data_dir, settings) as gateway:
            yield World(engine, gateway, receiver)
        engine.request("stopped")
        engine.wait_status(lambda s: s["state"] == "stopped" and s["engine"] is None, 120)
    factory.close()


def test_an_embedding_asked_of_a_vllm_generate_model_is_refused_before_any_start(
    world: World,
) -> None:
    engine, gateway = world.engine, world.gateway
    stopped = engine.status()
    assert stopped is not None and stopped["state"] == "stopped"
    assert stopped["capabilities"] == {"tiny": GENERATES}, "from its recipe and config.json"
    client = gateway.client(timeout=1200)
    with pytest.raises(openai.BadRequestError) as refused:
        client.embeddings.create(model="tiny", input="the quick brown fox")
    assert refused.value.code == "capability_not_served"
    assert "completion (/v1/completions)" in refused.value.message
    still = engine.status()
    assert still is not None and still["state"] == "stopped"
    assert still["generation"] == stopped["generation"], "no start was asked for"

    answer = client.completions.create(model="tiny", prompt="the quick", max_tokens=2)
    assert answer.choices
    running = engine.status()
    assert running is not None and running["state"] == "running"
    with urllib.request.urlopen(running["url"] + "/openapi.json", timeout=10) as r:
        paths = set(json.loads(r.read())["paths"])
    assert {"/v1/chat/completions", "/v1/completions", "/v1/responses"} <= paths
    assert "/v1/embeddings" not in paths
    assert running["capabilities"] == {"tiny": GENERATES}
    status, listing = gateway.get("/v1/models", gateway.issued)
    assert status == 200
    assert [m["capabilities"] for m in listing["data"] if m["id"] == "tiny"] == [GENERATES]
    with pytest.raises(openai.BadRequestError) as again:
        client.embeddings.create(model="tiny", input="the quick brown fox")
    assert again.value.code == "capability_not_served"


def the_callers_trace(receiver: Receiver) -> list[ReceivedSpan]:
    """The caller's trace once both the gateway's request span and vLLM's have come (each
    exporter sends a batch every few seconds)."""

    def both() -> list[ReceivedSpan]:
        spans = [span for span in receiver.spans() if span.trace_id == CALLER_TRACE]
        names = [span.name for span in spans]
        return spans if names.count(ROOT) == 1 and names.count(VLLM_SPAN) == 1 else []

    found: list[ReceivedSpan] = wait_for(both, 120, "the gateway's and vLLM's spans")
    return found


def test_a_callers_trace_runs_through_the_gateway_into_vllms_own_span(world: World) -> None:
    engine, gateway, receiver = world.engine, world.gateway, world.receiver
    answer = gateway.client(timeout=1200).chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=4,
        extra_headers={"traceparent": CALLER},
    )
    assert answer.usage is not None
    spans = the_callers_trace(receiver)
    root = next(span for span in spans if span.name == ROOT)
    vllm = next(span for span in spans if span.name == VLLM_SPAN)
    children = {span.name: span for span in spans if span.parent_id == root.span_id}
    assert root.parent_id == CALLER_SPAN and root.service == "lucia-gateway"
    assert root.attributes["lucia.outcome"] == "ok"
    assert root.attributes["lucia.engine"] == engine.name
    # the traceparent the engine got named the gateway's request span: vLLM's span is its child
    assert vllm.parent_id == root.span_id and vllm.trace_id == root.trace_id == CALLER_TRACE
    assert vllm.service == engine.name, "OTEL_SERVICE_NAME: the recipe's name"
    assert vllm.kind == SERVER
    assert {"lucia.dial", "lucia.answer", VLLM_SPAN} <= set(children)
    # one clock on one host: vLLM's request lies inside the gateway's
    assert children["lucia.dial"].start_ns <= vllm.start_ns <= vllm.end_ns <= root.end_ns
    # both count the same tokens
    usage = vllm.attributes
    assert usage["gen_ai.usage.prompt_tokens"] == root.attributes["lucia.prompt_tokens"]
    assert usage["gen_ai.usage.prompt_tokens"] == answer.usage.prompt_tokens
    assert usage["gen_ai.usage.completion_tokens"] == answer.usage.completion_tokens
    assert usage["gen_ai.usage.completion_tokens"] == root.attributes["lucia.completion_tokens"]
    # no prompt and no key in anything exported, the gateway's or vLLM's
    exported = receiver.exported()
    assert PROMPT.encode() not in exported and gateway.issued.encode() not in exported
    assert not [v for v in usage.values() if isinstance(v, str) and "zebra" in v]
