"""Shared fixtures: real dockerd engines (tests/fixtures.py), the systemd user manager
(tests/system/harness.py)."""

pytest_plugins = ["tests.fixtures", "tests.system.harness"]
