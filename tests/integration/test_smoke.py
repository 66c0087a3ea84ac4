from __future__ import annotations

import urllib.request

from tests.fixtures import Engine


def test_running_then_stopped(make_engine, client) -> None:
    engine: Engine = make_engine()
    proc = engine.start_worker()
    gen = engine.request("running")
    status = engine.wait_state(gen, "running", timeout=120)
    assert status["url"]
    with urllib.request.urlopen(status["url"] + "/v1/models", timeout=5) as r:
        assert r.status == 200
    gen2 = engine.request("stopped")
    engine.wait_state(gen2, "stopped", timeout=60)
    engine.stop_worker(proc)
