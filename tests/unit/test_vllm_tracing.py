"""`[vllm] otlp_traces_endpoint`: vLLM exports its own spans there, as OTLP/HTTP unless the
recipe says grpc, under the recipe's name; a bad URL or a second endpoint in `args` is
refused. What vLLM's own parser in the CPU image makes of the arguments is
tests/integration/test_vllm_tracing_args.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from supervisor.engines.base import Endpoint
from supervisor.engines.vllm.engine import Vllm
from supervisor.recipe.schema import RecipeError
from tests.unit.test_vllm_cpu_device import NoDocker, cpu_recipe, parsed

URL = "http://172.18.0.1:4318/v1/traces"


def started(
    tmp_path: Path, vllm: str, settings: str = ""
) -> tuple[tuple[str, ...], dict[str, str]]:
    """The command and the environment the engine's container would be created with."""
    (tmp_path / "library" / "g1" / "files").mkdir(parents=True, exist_ok=True)
    engine = Vllm("c", parsed(cpu_recipe(tmp_path, vllm) + settings), NoDocker(), tmp_path / "s")
    wanted = engine.prerequisites()
    assert wanted.image is not None
    spec = engine.run_spec(wanted.image, Endpoint("172.17.0.1", 8123))
    return engine.command(), dict(spec.environment)


def test_without_an_endpoint_vllm_is_given_nothing_of_tracing(tmp_path: Path) -> None:
    command, environment = started(tmp_path, "")
    assert "--otlp-traces-endpoint" not in command
    assert not [name for name in environment if name.startswith("OTEL_")]


@pytest.mark.parametrize(
    ("vllm", "settings", "protocol", "service"),
    [
        (f'otlp_traces_endpoint = "{URL}"', "", "http/protobuf", "c"),
        (f'otlp_traces_endpoint = "{URL}"\notlp_protocol = "grpc"', "", "grpc", "c"),
        (
            f'otlp_traces_endpoint = "{URL}"',
            '[settings]\nOTEL_SERVICE_NAME = "mine"\n',
            "http/protobuf",
            "mine",
        ),
    ],
)
def test_an_endpoint_is_vllms_argument_with_its_protocol_and_service_name(
    tmp_path: Path, vllm: str, settings: str, protocol: str, service: str
) -> None:
    command, environment = started(tmp_path, vllm, settings)
    at = command.index("--otlp-traces-endpoint")
    assert command[at + 1] == URL
    assert environment["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] == protocol
    assert environment["OTEL_SERVICE_NAME"] == service


@pytest.mark.parametrize(
    ("vllm", "error"),
    [
        ('otlp_traces_endpoint = "172.18.0.1:4318"', "an http\\(s\\) URL"),
        ('otlp_traces_endpoint = "ftp://host/v1/traces"', "an http\\(s\\) URL"),
        ('otlp_traces_endpoint = "http://user:pw@host:4318/v1/traces"', "no credentials"),
        ('otlp_protocol = "json"', "otlp_protocol"),
        (
            f'otlp_traces_endpoint = "{URL}"\nargs = ["--otlp-traces-endpoint", "{URL}"]',
            "not in args too",
        ),
        (f'otlp_traces_endpoint = "{URL}"\nargs = ["--otlp_traces_endpoint={URL}"]', "not in args"),
    ],
)
def test_a_bad_or_second_endpoint_is_refused(tmp_path: Path, vllm: str, error: str) -> None:
    with pytest.raises(RecipeError, match=error):
        parsed(cpu_recipe(tmp_path, vllm))
