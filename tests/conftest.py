"""Shared fixtures: real dockerd engines (tests/fixtures.py), the real llama-server
(tests/llama_server.py), the systemd user manager (tests/system/harness.py), a registry
(tests/registry.py)."""

pytest_plugins = ["tests.fixtures", "tests.llama_server", "tests.system.harness", "tests.registry"]
