"""Every request through the gateway is charged at least what the real vLLM 0.32.0 CPU server
generated for it: chat, text completions and /v1/responses (the tiny model has a chat
template); plain, streamed, left mid-stream, past the deadline, and an engine killed
mid-stream (tests/charges.py). Embeddings need vLLM's pooling runner, another server: the
plain answer's usage is read as any plain answer's is (test_gateway_charges_llama.py).

The engine's own count is its /metrics: `vllm:prompt_tokens_total` and
`vllm:generation_tokens_total`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext

import pytest

from tests.charge_cases import LATE_WAYS, WAYS, cases
from tests.charges import Charges, Counters, charging, held_back, read_counters
from tests.vllm_cpu import SERVED_NAME, VllmServer

pytestmark = pytest.mark.docker

LONG = 900  # tokens of a long answer, within the server's --max-model-len of 1024
BUSY = ("vllm:num_requests_running", "vllm:num_requests_waiting")


def counters(url: str) -> Counters:
    return read_counters(url, "vllm:prompt_tokens_total", "vllm:generation_tokens_total", BUSY)


@pytest.fixture(scope="module")
def vllm(start_vllm_cpu: Callable[..., VllmServer]) -> VllmServer:
    """One server answering to the model's name and to the name of the late engine."""
    return start_vllm_cpu(args=("--served-model-name", SERVED_NAME, f"{SERVED_NAME}-late"))


@pytest.fixture(scope="module")
def charges(vllm: VllmServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Charges]:
    with charging(
        tmp_path_factory.mktemp("charges"),
        "vllm-cpu",
        vllm.url,
        SERVED_NAME,
        lambda: counters(vllm.url),
    ) as found:
        yield found


@pytest.mark.parametrize(("route", "way"), cases(("chat", "completions", "responses")))
def test_each_way_of_asking_is_charged_what_vllm_generated(
    charges: Charges, vllm: VllmServer, route: str, way: str
) -> None:
    model = f"{SERVED_NAME}-late" if way in LATE_WAYS else SERVED_NAME
    client = charges.gateway.client(timeout=300)
    slow: AbstractContextManager[None] = nullcontext()
    if way == "left mid-stream":
        slow = held_back(vllm.container)
    with slow:  # a client that leaves leaves before the end
        charge = charges.measure(route, way, lambda: WAYS[way](client, route, model, LONG))
    assert charge.under == 0, charge
    assert charge.charged_prompt > 0 and charge.charged_completion >= charge.engine_generated
    if way not in LATE_WAYS:  # one past its deadline may end before the engine began it
        assert charge.engine_generated > 0, charge
    if way in LATE_WAYS:  # ok: a machine that generates it in time
        assert charge.outcome in ("timed_out", "ok"), charge
    if way == "left mid-stream":
        assert charge.outcome == "client_gone", charge
        assert charge.usage_source == ("counted" if route == "responses" else "engine_partial")


def test_a_stream_whose_engine_is_killed_is_charged_what_passed(
    charges: Charges, vllm: VllmServer
) -> None:
    """The engine's counters die with it: the row is charged at least the events the client
    got, from the engine's own running count. The last case of the module: it ends the
    server."""
    charges.killed_mid_stream(SERVED_NAME, LONG, vllm.container)
