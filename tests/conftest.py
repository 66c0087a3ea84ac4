"""Shared fixtures: real dockerd engines (tests/fixtures.py), the real llama-server
(tests/llama_server.py), the real vLLM CPU server (tests/vllm_cpu.py), the systemd user manager
(tests/system/harness.py), a registry (tests/registry.py), the conformance
suite's engine relay (tests/conformance/relay.py)."""

pytest_plugins = [
    "tests.fixtures",
    "tests.llama_server",
    "tests.vllm_cpu",
    "tests.system.harness",
    "tests.registry",
    "tests.conformance.relay",
]
