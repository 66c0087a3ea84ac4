"""What vLLM's own argument parser in the CPU image the tests run makes of a recipe's
`otlp_traces_endpoint`: the arguments and environment the engine gives the container
(tests/unit/test_vllm_tracing.py) parsed by the image's `vllm.entrypoints.launchers.cli_args`,
as its server parses them, into EngineArgs and the ObservabilityConfig that checks that
OpenTelemetry is installed there (it is: the image carries the SDK and both OTLP exporters)."""

from __future__ import annotations

from pathlib import Path

import docker
import pytest

from supervisor.engines.base import Endpoint
from supervisor.engines.vllm.engine import Vllm
from tests.fixtures import RUN_ID, TEST_LABEL
from tests.unit.test_vllm_cpu_device import NoDocker, cpu_recipe, parsed

pytestmark = pytest.mark.docker

URL = "http://172.18.0.1:4318/v1/traces"
PARSE = """
import os, sys
from vllm.config import ObservabilityConfig
from vllm.engine.arg_utils import EngineArgs
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.tracing.otel import get_span_exporter
from vllm.utils.argparse_utils import FlexibleArgumentParser

args = make_arg_parser(FlexibleArgumentParser()).parse_args(sys.argv[1:])
endpoint = EngineArgs.from_cli_args(args).otlp_traces_endpoint
ObservabilityConfig(otlp_traces_endpoint=endpoint)
exporter = get_span_exporter(endpoint)
print("endpoint", endpoint)
print("exporter", type(exporter).__module__)
print("service", os.environ["OTEL_SERVICE_NAME"])
"""


def test_vllms_parser_in_the_cpu_image_takes_the_recipes_endpoint(
    client: docker.DockerClient, vllm_cpu_image: str, tmp_path: Path
) -> None:
    (tmp_path / "library" / "g1" / "files").mkdir(parents=True)
    recipe = parsed(cpu_recipe(tmp_path, f'otlp_traces_endpoint = "{URL}"'))
    engine = Vllm("c", recipe, NoDocker(), tmp_path / "state")
    wanted = engine.prerequisites()
    assert wanted.image is not None
    environment = engine.run_spec(wanted.image, Endpoint("172.17.0.1", 8123)).environment
    tracing = {name: value for name, value in environment.items() if name.startswith("OTEL_")}
    output = client.containers.run(
        vllm_cpu_image,
        ["-c", PARSE, *engine.command()],
        entrypoint=["python3"],
        environment=tracing,
        labels={TEST_LABEL: RUN_ID},
        network_disabled=True,
        remove=True,
        stderr=False,
    ).decode()
    lines = dict(line.split(" ", 1) for line in output.splitlines() if " " in line)
    assert lines["endpoint"] == URL
    # OTLP/HTTP, as the gateway exports: vLLM's own default would be grpc
    assert lines["exporter"] == "opentelemetry.exporter.otlp.proto.http.trace_exporter"
    assert lines["service"] == "c"
