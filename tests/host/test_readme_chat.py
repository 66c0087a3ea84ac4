"""The README's first chat, its blocks run as written (the demo's address swapped for the test
gateway's, and the clone's .venv for the tests' own interpreter) against the real gateway
process, in front of a fast engine of the test's own."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from tests.fixtures import ROOT
from tests.gateway_proc import running_gateway
from tests.host.fleet_world import EngineLoop
from tests.host.gateway_world import Upstream, write_status

DEMO_URL = "http://127.0.0.1:18400"  # where the demo's gateway listens, as the README says


def first_chat() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## A first chat\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```sh\n(.*?)```", section, re.S)


def as_here(block: str, url: str) -> str:
    assert ".venv/bin/python " in block or "curl " in block, block
    return block.replace(DEMO_URL, url).replace(".venv/bin/python ", f"{sys.executable} ")


def test_the_readme_names_the_demo_gateways_address() -> None:
    demo = (ROOT / "scripts" / "demo.sh").read_text()
    assert "port = ${LUCIA_DEMO_GATEWAY_PORT:-18400}" in demo and 'address = "127.0.0.1"' in demo
    issue, *asking = first_chat()
    assert "keys create" in issue and issue.startswith("KEY=$(")
    assert len(asking) == 2 and all(DEMO_URL in block and "$KEY" in block for block in asking)


def test_the_readme_first_chat_runs_as_written(tmp_path: Path) -> None:
    _, with_openai, with_curl = first_chat()
    engines = EngineLoop()
    try:
        up = engines.serve(Upstream())
        data = tmp_path / "data"
        write_status(data, "demo-router", "running", url=up.url, generation=1)
        with running_gateway(tmp_path / "gateway", data) as gateway:
            shown = []
            for block in (with_openai, with_curl):
                done = subprocess.run(
                    ["bash", "-euo", "pipefail", "-c", as_here(block, gateway.url)],
                    check=False,
                    cwd=ROOT,
                    env={**os.environ, "KEY": gateway.issued},
                    capture_output=True,
                    text=True,
                    timeout=120,
                )
                assert done.returncode == 0, done.stdout + done.stderr
                shown.append(done.stdout)
            log = gateway.log.read_text()
    finally:
        engines.close()
    assert "CompletionUsage(completion_tokens=3" in shown[0], shown[0]
    answer = json.loads(shown[1])
    assert answer["object"] == "chat.completion" and answer["model"] == "tiny"
    assert [body["messages"] for body in up.bodies] == [[{"role": "user", "content": "Hello"}]] * 2
    assert all(body["max_tokens"] == 16 for body in up.bodies)
    assert gateway.issued not in log
