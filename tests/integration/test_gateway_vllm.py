"""The gateway in front of the real vLLM 0.32.0 CPU server, one load: a streaming completion
from the official `openai` client starts the stopped engine on demand; vLLM's usage chunk, which
the gateway asked for and the client did not, is kept from the client and counted in /metrics.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.fixtures import Engine
from tests.gateway_proc import metric, running_gateway
from tests.system.harness import wait_for

pytestmark = pytest.mark.docker


def test_a_stream_starts_the_stopped_vllm_engine_and_its_usage_is_counted_not_shown(
    make_engine: Callable[..., Engine], tmp_path: Path
) -> None:
    engine: Engine = make_engine(kind="vllm", vllm_device="cpu")
    engine.start_worker()
    # stopped as the gateway stops an idle engine it started: traffic may start it again
    stopped = engine.wait_state(engine.request("stopped", by="gateway"), "stopped", timeout=120)
    assert stopped["models"] == ["tiny"], "the served name, while stopped"
    with running_gateway(
        tmp_path / "gateway", engine.data_dir, "[limits]\nload_wait_s = 900\n"
    ) as gateway:
        # the client's own timeout is the bound of the load (the recipe allows 900 s)
        stream = gateway.client(timeout=1200).completions.create(
            model="tiny", prompt="the quick brown fox", max_tokens=6, temperature=0, stream=True
        )
        chunks = list(stream)
        assert chunks and all(c.usage is None and c.choices for c in chunks), "no usage chunk"
        text = "".join(c.choices[0].text for c in chunks)
        assert text and chunks[-1].choices[0].finish_reason == "length"
        running = engine.status()
        assert running is not None and running["state"] == "running"
        labels = {"model": "tiny", "engine": engine.name}
        # the request is counted as its handler ends, just after the client saw the stream end
        wait_for(
            lambda: metric(gateway.metrics(), "lucia_gateway_requests_total", **labels) == 1,
            30,
            "the request counted",
        )
        exposed = gateway.metrics()
        shown = [line for line in exposed.splitlines() if "tiny" in line]
        assert metric(exposed, "lucia_gateway_completion_tokens_total", **labels) == 6, shown
        assert metric(exposed, "lucia_gateway_prompt_tokens_total", **labels) > 0
        assert metric(exposed, "lucia_gateway_requests_total", outcome="ok", **labels) == 1
        for key in (gateway.owner, gateway.inference, gateway.issued):
            assert key not in gateway.log_text()
    engine.request("stopped")
    assert engine.wait_status(lambda s: s["state"] == "stopped", timeout=120)["engine"] is None
