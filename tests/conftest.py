"""Shared fixtures: real dockerd engines (tests/fixtures.py), the real llama-server
(tests/llama_server.py), the real vLLM CPU server (tests/vllm_cpu.py), the systemd user manager
(tests/system/harness.py), a registry (tests/registry.py), a PostgreSQL cluster
(tests/postgres.py), the conformance suite's engine relay (tests/conformance/relay.py)."""

import importlib.util

# Without the project's test tools (a GPU machine with only torch, running
# tests/kv/test_transfer.py) there are no fixtures to share, and nothing that needs them runs.
pytest_plugins = (
    [
        "tests.fixtures",
        "tests.llama_server",
        "tests.vllm_cpu",
        "tests.system.harness",
        "tests.registry",
        "tests.postgres",
        "tests.conformance.relay",
        "tests.schedule",
        "pytester",
    ]
    if importlib.util.find_spec("docker") is not None
    else []
)
