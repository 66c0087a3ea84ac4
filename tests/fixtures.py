"""Fixtures against the real dockerd: a busybox base image, a git recipe repository, workers.

Everything a test creates is named with this run's id and labelled, and removed afterwards, so
leftovers of earlier runs on the same dockerd never matter.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import tomllib
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import docker
import pytest

from supervisor.host.protocol import request as host_request
from supervisor.protocol.documents import Requester
from tests.engine_dirs import EngineDirs
from tests.gguf_fixtures import add_model
from tests.gpu_recordings import fake_nvidia_smi
from tests.standin import (
    DEMO_REPO,
    busybox_image,
    free_port,
    git,
    inline_table,
    recipe_repository,
    toml_text,
    toml_value,
)

ROOT = Path(__file__).resolve().parents[1]
REPO_TEMPLATE = DEMO_REPO
REAL_TEMPLATE = ROOT / "tests" / "tensorfold-recipe"  # the real recipe's layout: prepare.sh builds
SHIPPED_RECIPE = ROOT / "recipes" / "spark-model.toml"
RUN_ID = uuid.uuid4().hex[:8]
TEST_LABEL = "lucia.test.run"
CLI = [sys.executable, "-m", "supervisor.cli"]
MACHINE_ENV = "LUCIA_MACHINE_FILE"
# A worker's memory settings unless its test names others: the host's memory with a small reserve.
# Never the settings of whoever runs the tests (root's ~/.config/lucia), and never the default
# reserves (18 GiB), which on this 24 GiB machine leave less than one engine whenever others run
# beside the tests (an operator's demo holds some 7 GiB). A memory test names a file of its own.
DEFAULT_MACHINE = 'limit = "unified"\nprofile = "gpu-server"\n'


def age(status: dict[str, Any]) -> float:
    """Seconds since the status was last written (its checkedAt)."""
    checked = datetime.fromisoformat(status["checkedAt"].replace("Z", "+00:00"))
    return (datetime.now(checked.tzinfo) - checked).total_seconds()


def state_since(status: dict[str, Any]) -> float:
    """When the status's state began, as a timestamp."""
    return datetime.fromisoformat(status["since"].replace("Z", "+00:00")).timestamp()


def http_status(url: str) -> int:
    """The HTTP status of a GET (an error status raises)."""
    with urllib.request.urlopen(url, timeout=5) as response:
        return int(response.status)


def http_text(url: str) -> str:
    """The body of a GET, as text."""
    with urllib.request.urlopen(url, timeout=5) as response:
        return str(response.read().decode())


@pytest.fixture(scope="session")
def client() -> Iterator[docker.DockerClient]:
    try:
        cli = docker.from_env(timeout=120)
        cli.ping()
    except docker.errors.DockerException as exc:
        pytest.fail(f"these tests need a running dockerd (scripts/machine.sh starts one): {exc}")
    yield cli
    _cleanup(cli)
    cli.close()


def _cleanup(cli: docker.DockerClient) -> None:
    for container in cli.containers.list(all=True, filters={"label": f"{TEST_LABEL}={RUN_ID}"}):
        container.remove(force=True)
    for container in cli.containers.list(all=True, filters={"name": f"lucia-t{RUN_ID}"}):
        container.remove(force=True)
    for network in cli.networks.list(filters={"label": f"{TEST_LABEL}={RUN_ID}"}):
        network.remove()
    for network in cli.networks.list(names=[f"lucia-test-{RUN_ID}"]):
        network.remove()
    for image in cli.images.list(filters={"reference": f"lucia-test-*{RUN_ID}*"}):
        for tag in image.tags:
            if RUN_ID in tag:
                cli.images.remove(tag, force=True)


@pytest.fixture(scope="session")
def base_image(client: docker.DockerClient, tmp_path_factory: pytest.TempPathFactory) -> str:
    """FROM scratch with Debian's static busybox: the only base these tests may use."""
    context = tmp_path_factory.mktemp("base")
    return busybox_image(client, context, f"lucia-test-busybox-{RUN_ID}:1", {TEST_LABEL: RUN_ID})


@dataclass
class RecipeRepo:
    path: Path

    @property
    def url(self) -> str:
        return f"file://{self.path}"

    def commit(self, message: str, changes: dict[str, str] | None = None) -> str:
        for name, text in (changes or {}).items():
            target = self.path / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text)
        git(self.path, "add", "-A")
        git(self.path, "commit", "-q", "--allow-empty", "-m", message)
        return git(self.path, "rev-parse", "HEAD")


def _repo(template: Path, path: Path) -> RecipeRepo:
    recipe_repository(path, template, "recipe 0.7.0")
    return RecipeRepo(path)


@pytest.fixture
def recipe_repo(tmp_path: Path) -> RecipeRepo:
    return _repo(REPO_TEMPLATE, tmp_path / "recipe-repo")


@pytest.fixture
def real_recipe_repo(tmp_path: Path) -> RecipeRepo:
    """A copy of tests/tensorfold-recipe: laid out like the public Spark recipe at its pin."""
    return _repo(REAL_TEMPLATE, tmp_path / "real-recipe-repo")


def shipped_recipe(repository: str, commit: str, network: str, port: int) -> str:
    """recipes/spark-model.toml changed only where this machine differs: [source], the network,
    the host port, no GPU line, no memlock ulimit (this dockerd refuses memlock=-1) and no
    [memory] figures (the Spark's 103 GiB do not fit here; tests/integration/test_memory_plan.py
    proves the refusal)."""
    text = SHIPPED_RECIPE.read_text()
    edits = [
        (r'(?m)^repository = ".*"$', f'repository = "{repository}"'),
        (r'(?m)^commit = "[0-9a-f]{40}"', f'commit = "{commit}"'),
        (r'(?m)^network = ".*"$', f'network = "{network}"'),
        (r"(?m)^port = 8888$", f"port = {port}"),
        (r'(?m)^gpus = "all"\n', ""),
        (r"memlock = -1, ", ""),
        (r"(?ms)^\[memory\]\n.*?(?=^\[)", ""),
    ]
    for pattern, replacement in edits:
        text, count = re.subn(pattern, replacement, text)
        assert count == 1, f"the shipped recipe no longer has {pattern}"
    return text


@dataclass
class Engine(EngineDirs):
    """One engine under test: its recipe, directories, and its worker processes."""

    name: str
    repo: RecipeRepo
    base: str
    root: Path
    port: int = field(default_factory=free_port)
    settings: dict[str, str] = field(default_factory=dict)
    build_args: dict[str, str] = field(default_factory=dict)
    prepare: bool = True
    requirement: str = "xgrammar>=0.2.8,<0.3"
    modules: tuple[str, ...] = ("xgrammar", "tensorfold")
    ready_timeout: float = 30
    stop_grace: float = 60
    commit: str = ""
    secrets: dict[str, str] = field(default_factory=dict)
    run_extra: dict[str, str] = field(default_factory=dict)
    kind: str = "tensorfold"
    router_image: str = ""
    load_on_startup: tuple[str, ...] = ()
    models_max: int = 2
    defaults: dict[str, Any] = field(default_factory=lambda: {"ctx-size": 4096})
    vllm_repository: str = ""  # the stand-in's images, tagged as the preflight names them
    nvidia_smi: str = ""  # a test nvidia-smi (tests/gpu_recordings.py)
    vllm: dict[str, Any] = field(default_factory=dict)  # [vllm] keys beyond the writer's
    vllm_model: str = "test/tiny-model"  # the Hugging Face id vLLM serves
    vllm_device: str = "gpu"  # cpu: the real vLLM CPU image (vllm_image) on a library model
    vllm_image: str = ""  # device cpu: the image
    vllm_guid: str = ""  # device cpu: the library model (models_dir/<guid>)
    revision: str = "0123456789abcdef0123456789abcdef01234567"
    tiers_extra: dict[str, Any] = field(default_factory=dict)  # [tiers] keys beyond the writer's
    layout: str = "demo"  # tensorfold: "demo" (a Dockerfile) or "real" (prepare.sh builds)
    recipe_text: str = ""  # written as it is, instead of the recipe made from the fields
    env: dict[str, str] = field(default_factory=dict)  # the worker's environment on top of ours
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    memory: dict[str, float] = field(default_factory=dict)  # the tensorfold [memory] section
    data_root: Path | None = None  # a data directory shared with other engines (the ledger)
    image: str = ""  # the image of a kind defined under tests/engines (its driver sets it)
    writer: Callable[[Engine], str] | None = None  # that kind's recipe text from these fields

    @property
    def data_dir(self) -> Path:
        return self.data_root or self.root / "data"

    @property
    def image_tag(self) -> str:
        return f"lucia-test-recipe-{RUN_ID}-{self.name}:v1"

    @property
    def network(self) -> str:
        return f"lucia-test-{RUN_ID}"

    @property
    def models_dir(self) -> Path:
        return self.root / "library"

    @property
    def cache_dir(self) -> Path:
        return self.root / "cache"

    @property
    def home(self) -> Path:
        """The worker's HOME (real layout): the shipped recipe's ~/.cache directories are here."""
        return self.root / "home"

    def write_recipe(self) -> Path:
        if self.recipe_text:
            self.recipe_path.write_text(self.recipe_text)
            return self.recipe_path
        if self.writer is not None:
            self.recipe_path.write_text(self.writer(self))
            return self.recipe_path
        if self.kind == "llama-router":
            return self._write_router_recipe()
        if self.kind == "vllm":
            return self._write_vllm_recipe()
        if self.layout == "real":
            return self._write_real_recipe()
        return self._write_tensorfold_recipe()

    def _write_real_recipe(self) -> Path:
        """The shipped recipe as shipped_recipe() changes it, with this test's image tag (so
        tests never share an image), grammar pin, settings (the fixture's knobs), secrets,
        timeouts and run extras."""
        data = tomllib.loads(shipped_recipe(self.repo.url, self.commit, self.network, self.port))
        data["name"] = self.name
        data["image"]["tag"] = self.image_tag
        data["grammar"] = {"requirement": self.requirement, "modules": list(self.modules)}
        data["settings"].update(
            {
                "IMAGE": self.image_tag,
                "TEST_DOWNLOAD_SECONDS": "0.3",
                "TEST_BUILD_LABEL": f"{TEST_LABEL}={RUN_ID}",
                "TEST_RUN_LABEL": f"{TEST_LABEL}={RUN_ID}",
                **self.settings,
            }
        )
        data["secrets"] = dict(self.secrets)
        extra = dict(self.run_extra)  # extra volumes come on top of the caches the recipe needs
        extra["volumes"] = data["run"]["volumes"] + extra.get("volumes", [])
        data["run"].update(
            {"ready_timeout": self.ready_timeout, "stop_grace": self.stop_grace, **extra}
        )
        self.recipe_path.write_text(toml_text(data))
        return self.recipe_path

    def _write_router_recipe(self) -> Path:
        self.models_dir.mkdir(exist_ok=True)
        settings = dict(self.settings)
        lines = [
            f'name = "{self.name}"',
            'engine = "llama-router"',
            'model = "gguf-library"',
            "[library]",
            f'models_dir = "{self.models_dir}"',
            f'cache_dir = "{self.cache_dir}"',
            "poll_seconds = 1",
            "[router]",
            f'image = "{self.router_image}"',
            f"models_max = {self.models_max}",
            "load_on_startup = " + json.dumps(list(self.load_on_startup)),
            "defaults = " + inline_table(self.defaults),
            "[settings]",
            *(f"{k} = {json.dumps(v)}" for k, v in settings.items()),
            "[secrets]",
            *(f"{k} = {json.dumps(v)}" for k, v in self.secrets.items()),
            "[run]",
            f'network = "{self.network}"',
            f"port = {self.port}",
            'metrics_path = "/metrics"',
            f"ready_timeout = {self.ready_timeout}",
            f"stop_grace = {self.stop_grace}",
            *(f"{k} = {toml_value(v)}" for k, v in self.run_extra.items()),
        ]
        self.recipe_path.write_text("\n".join(lines) + "\n")
        return self.recipe_path

    def _write_vllm_cpu_recipe(self) -> Path:
        """The real CPU server (recipes/vllm-cpu.toml's shape) on a Ready library model."""
        vllm = {
            "device": "cpu",
            "image": self.vllm_image,
            "kv_cache_gib": 1,
            "served_name": "tiny",
            "max_model_len": 1024,
            # eager: no torch.compile at start, which halves the tiny model's load here
            "args": ["--dtype", "bfloat16", "--enforce-eager"],
            **self.vllm,
        }
        lines = [
            f'name = "{self.name}"',
            'engine = "vllm"',
            'model = "tiny-llama"',
            "[vllm]",
            *(f"{k} = {toml_value(v)}" for k, v in vllm.items()),
            "[vllm.model.library]",
            f'models_dir = "{self.models_dir}"',
            f'guid = "{self.vllm_guid}"',
            # the KV tiers only when a test gives them (the shipped CPU recipe has none)
            *(
                ["[tiers]", *(f"{k} = {toml_value(v)}" for k, v in self.tiers_extra.items())]
                if self.tiers_extra
                else []
            ),
            "[settings]",
            *(
                f"{k} = {json.dumps(v)}"
                for k, v in {"HF_HUB_OFFLINE": "1", **self.settings}.items()
            ),
            "[secrets]",
            *(f"{k} = {json.dumps(v)}" for k, v in self.secrets.items()),
            "[run]",
            f'network = "{self.network}"',
            f"port = {self.port}",
            "container_port = 8000",
            'ready_path = "/health"',
            'metrics_path = "/metrics"',
            f"ready_timeout = {self.ready_timeout}",
            f"stop_grace = {self.stop_grace}",
            *(
                f"{k} = {toml_value(v)}"
                for k, v in {"shm_size": "512m", "memory": "4g", **self.run_extra}.items()
            ),
        ]
        self.recipe_path.write_text("\n".join(lines) + "\n")
        return self.recipe_path

    def _write_vllm_recipe(self) -> Path:
        if self.vllm_device == "cpu":
            return self._write_vllm_cpu_recipe()
        key = self.root / "kv.key"
        if not key.exists():
            key.write_text(os.urandom(32).hex() + "\n")  # the 64 hex digits a key must be
            key.chmod(0o600)
        settings = {"LOAD_DELAY": "1", **self.settings}
        secrets = {"LUCIA_KV_KEY": str(key), **self.secrets}
        vllm = {
            "repository": self.vllm_repository,
            "nvidia_smi": self.nvidia_smi,
            "served_name": "tiny",
            "max_model_len": 4096,
            **self.vllm,
        }
        lines = [
            f'name = "{self.name}"',
            'engine = "vllm"',
            'model = "test/tiny-model"',
            "[vllm]",
            *(f"{k} = {toml_value(v)}" for k, v in vllm.items()),
            "[vllm.model.hf]",
            f'id = "{self.vllm_model}"',
            f'revision = "{self.revision}"',
            "[tiers]",
            'shm_bytes = "16m"',
            "nvme = " + inline_table({"path": str(self.root / "kv-nvme"), "max_bytes": "1g"}),
            "hdd = " + inline_table({"path": str(self.root / "kv-hdd"), "max_bytes": "4g"}),
            *(f"{k} = {toml_value(v)}" for k, v in self.tiers_extra.items()),
            "[settings]",
            *(f"{k} = {json.dumps(v)}" for k, v in settings.items()),
            "[secrets]",
            *(f"{k} = {json.dumps(v)}" for k, v in secrets.items()),
            "[run]",
            f'network = "{self.network}"',
            f"port = {self.port}",
            "container_port = 8000",
            'ready_path = "/health"',
            'metrics_path = "/metrics"',
            f"ready_timeout = {self.ready_timeout}",
            f"stop_grace = {self.stop_grace}",
            *(
                f"{k} = {toml_value(v)}"
                for k, v in {
                    "shm_size": "64m",
                    "memory": "512m",
                    **self.run_extra,
                    # the HF cache the model download fills; extra volumes come on top of it
                    "volumes": [
                        {"source": str(self.root / "hf-cache"), "target": "/var/cache/huggingface"},
                        *self.run_extra.get("volumes", []),
                    ],
                }.items()
            ),
        ]
        self.recipe_path.write_text("\n".join(lines) + "\n")
        return self.recipe_path

    def _write_tensorfold_recipe(self) -> Path:
        settings = {
            "PORT": str(self.port),
            "MODEL_ID": "test/tiny-model",
            "SERVED_NAME": "tiny",
            "PARALLEL": "4",
            "CONTEXT": "200000",
            "TENSORFOLD_MEMORY_RESERVE_GIB": "4",
            "HF_CACHE": str(self.root / "hf-cache"),
            "READY_DELAY": "1",
            **self.settings,
        }
        build_args = {"BASE": self.base, **self.build_args}
        lines = [
            f'name = "{self.name}"',
            'engine = "tensorfold"',
            'model = "test/tiny-model"',
            "[source]",
            f'repository = "{self.repo.url}"',
            f'commit = "{self.commit}"',
            "[image]",
            f'tag = "{self.image_tag}"',
            "build_args = " + inline_table(build_args),
            "[prepare]",
            'commands = [["sh", "scripts/prepare.sh"]]' if self.prepare else "commands = []",
            "[grammar]",
            f'requirement = "{self.requirement}"',
            "modules = " + json.dumps(list(self.modules)),
            *(["[memory]", *(f"{k} = {v}" for k, v in self.memory.items())] if self.memory else []),
            "[settings]",
            *(f"{k} = {json.dumps(v)}" for k, v in settings.items()),
            "[secrets]",
            *(f"{k} = {json.dumps(v)}" for k, v in self.secrets.items()),
            "[run]",
            f'network = "{self.network}"',
            f"port = {self.port}",
            'ready_path = "/v1/models"',
            'metrics_path = "/metrics"',
            f"ready_timeout = {self.ready_timeout}",
            f"stop_grace = {self.stop_grace}",
            *(f"{k} = {toml_value(v)}" for k, v in self.run_extra.items()),
        ]
        self.recipe_path.write_text("\n".join(lines) + "\n")
        return self.recipe_path

    def worker_env(self) -> dict[str, str]:
        """The worker's environment: ours, the engine's own on top, and a machine file of its
        own unless one is named (never the memory settings of whoever runs the tests)."""
        env = {**os.environ, **self.env}
        if not env.get(MACHINE_ENV):
            machine = self.root / "machine.toml"
            machine.write_text(DEFAULT_MACHINE)
            env[MACHINE_ENV] = str(machine)
        return env

    def start_worker(self, *extra: str, heartbeat: float = 2.0) -> subprocess.Popen[bytes]:
        self.write_recipe()
        log = open(self.root / f"worker-{len(self.procs)}.log", "wb")  # noqa: SIM115
        proc = subprocess.Popen(
            [
                *CLI,
                "worker",
                self.name,
                "--recipe",
                str(self.recipe_path),
                "--data-dir",
                str(self.data_dir),
                "--state-dir",
                str(self.state_dir),
                "--heartbeat",
                str(heartbeat),
                *extra,
            ],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=self.worker_env(),
        )
        self.procs.append(proc)
        return proc

    def stop_worker(self, proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM) -> int:
        if proc.poll() is None:
            proc.send_signal(sig)
        return proc.wait(30)

    def up(
        self, *extra: str, timeout: float = 120
    ) -> tuple[subprocess.Popen[bytes], dict[str, Any]]:
        """A worker started and the engine requested running: the worker and the running
        status."""
        proc = self.start_worker(*extra)
        return proc, self.wait_state(self.request("running"), "running", timeout=timeout)

    def reload(self, **changes: Any) -> None:
        """The recipe changed (these fields set, then written) and the last worker told so,
        as `systemctl --user reload` does: SIGHUP."""
        for name, value in changes.items():
            assert hasattr(self, name), f"Engine has no field {name}"
            setattr(self, name, value)
        self.write_recipe()
        self.procs[-1].send_signal(signal.SIGHUP)

    def gateway(self) -> str:
        """The gateway address of the engine's Docker network: the only address it listens on."""
        with contextlib.closing(docker.from_env(timeout=30)) as cli:
            return str(cli.networks.get(self.network).attrs["IPAM"]["Config"][0]["Gateway"])

    def request(self, desired: str, by: Requester = "operator", wait_s: float | None = None) -> int:
        """The next generation, as an operator writes it (the CLI; with `wait_s`, its `--wait
        --timeout`, and the answer it waited for must have come), or as the gateway does
        (`by="gateway"`: a stop for idling, after which traffic may start it again)."""
        if by == "gateway":
            return host_request(self.data_dir, self.name, desired, "gateway")  # type: ignore[arg-type]
        waits = () if wait_s is None else ("--wait", "--timeout", f"{wait_s:g}")
        data = str(self.data_dir)
        # as the host application, which knows its engines: no recipe or status may exist yet
        out = subprocess.run(
            [*CLI, "request", self.name, desired, "--create", *waits, "--data-dir", data],
            cwd=ROOT,
            check=False,
            capture_output=True,
            text=True,
            timeout=None if wait_s is None else wait_s + 60,
        )
        assert out.returncode == 0, out.stdout + out.stderr
        return int(out.stdout.split()[0])

    def status(self) -> dict[str, Any] | None:
        try:
            return dict(json.loads((self.dir / "status.json").read_text()))
        except (FileNotFoundError, json.JSONDecodeError):
            return None

    def wait_status(
        self, check: Callable[[dict[str, Any]], bool], timeout: float = 60, what: str = "status"
    ) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        status = None
        while time.monotonic() < deadline:
            status = self.status()
            if status is not None and check(status):
                return status
            time.sleep(0.05)
        raise AssertionError(
            f"timed out waiting for {what}; last status: {status}; log: {self.log_tail()}"
        )

    def wait_state(self, generation: int, state: str, timeout: float = 60) -> dict[str, Any]:
        return self.wait_status(
            lambda s: s["generation"] == generation and s["state"] == state,
            timeout,
            f"generation {generation} {state}",
        )

    def log_tail(self, lines: int = 30) -> str:
        """The end of the last worker's log (worker-10.log comes after worker-9.log)."""
        logs = sorted(
            self.root.glob("worker-*.log"), key=lambda path: int(path.stem.removeprefix("worker-"))
        )
        return "\n".join(p.read_text(errors="replace")[-4000:] for p in logs[-1:])

    def file_sd(self) -> list[dict[str, Any]]:
        return list(json.loads((self.data_dir / "telemetry" / f"{self.name}.json").read_text()))


@pytest.fixture(scope="session")
def router_images(client: docker.DockerClient, llama_server_image: str) -> tuple[str, str]:
    """The real llama-server image, twice under different tags and ids (a label apart): an
    upgrade."""
    tags = []
    for version in (1, 2):
        tag = f"lucia-test-router-{RUN_ID}:{version}"
        client.images.build(
            fileobj=io.BytesIO(f"FROM {llama_server_image}\n".encode()),
            tag=tag,
            rm=True,
            labels={TEST_LABEL: RUN_ID, "version": str(version)},
        )
        tags.append(tag)
    return tags[0], tags[1]


@pytest.fixture(scope="session")
def vllm_images(client: docker.DockerClient, base_image: str) -> tuple[str, str]:
    """The vLLM stand-in twice (other ids), each under a repository of its own with the tag
    the preflight picks on a CUDA 12 host: `[vllm] repository` names one (as a mirror)."""
    repositories = []
    for version in (1, 2):
        repository = f"lucia-test-vllm{version}-{RUN_ID}"
        client.images.build(
            path=str(ROOT / "tests" / "vllm-standin"),
            tag=f"{repository}:v0.32.0-cu129",
            rm=True,
            buildargs={"BASE": base_image},
            labels={TEST_LABEL: RUN_ID, "version": str(version)},
        )
        repositories.append(repository)
    return repositories[0], repositories[1]


@pytest.fixture(scope="session")
def router_standin(client: docker.DockerClient, base_image: str) -> str:
    """The shell stand-in of llama-server (demo/llama-router), for the cases the real one
    cannot make: a model load that takes as long as a test says (LOAD_DELAY)."""
    tag = f"lucia-test-router-standin-{RUN_ID}:1"
    client.images.build(
        path=str(ROOT / "demo" / "llama-router"),
        tag=tag,
        rm=True,
        buildargs={"BASE": base_image},
        labels={TEST_LABEL: RUN_ID},
    )
    return tag


class EngineFactory:
    """Makes engines under one directory, and removes what each ran: workers, container, images.

    `make_engine` is one per test; tests/conformance/relay.py keeps one per module, for engines
    handed from case to case."""

    def __init__(
        self,
        client: docker.DockerClient,
        base_image: str,
        directory: Path,
        recipe_repo: Callable[[], RecipeRepo],
        request: pytest.FixtureRequest,
    ) -> None:
        self.client = client
        self.base_image = base_image
        self.directory = directory
        self.recipe_repo = recipe_repo
        self.request = request
        self.made: list[Engine] = []

    def __call__(self, **overrides: Any) -> Engine:
        request = self.request
        name = f"t{RUN_ID}-{len(self.made)}-{uuid.uuid4().hex[:4]}"
        root = self.directory / name
        root.mkdir()
        if overrides.get("kind") == "llama-router" and not overrides.get("router_image"):
            overrides["router_image"] = request.getfixturevalue("router_images")[0]
        if overrides.get("layout") == "real":
            repo = request.getfixturevalue("real_recipe_repo")
            overrides["env"] = {"HOME": str(root / "home"), **overrides.get("env", {})}
            (root / "home").mkdir()
        else:
            repo = self.recipe_repo()
        cpu = overrides.get("kind") == "vllm" and overrides.get("vllm_device") == "cpu"
        if cpu:
            overrides.setdefault("vllm_image", request.getfixturevalue("vllm_cpu_images")[0])
            overrides.setdefault("ready_timeout", 900)
            # the machine's memory, with a small reserve: the default reserves (18 GiB) on this
            # 24 GiB shared machine leave less than one 4 GiB engine whenever others run
            machine = root / "machine.toml"
            machine.write_text(DEFAULT_MACHINE)
            overrides["env"] = {MACHINE_ENV: str(machine), **overrides.get("env", {})}
            if not overrides.get("vllm_guid"):
                files = add_model(root / "library", "Ready")
                shutil.copytree(
                    request.getfixturevalue("tiny_llama_dir"), files, dirs_exist_ok=True
                )
                overrides["vllm_guid"] = files.parent.name
        elif overrides.get("kind") == "vllm" and "vllm_repository" not in overrides:
            overrides["vllm_repository"] = request.getfixturevalue("vllm_images")[0]
        if overrides.get("kind") == "vllm" and not cpu and "nvidia_smi" not in overrides:
            overrides["nvidia_smi"] = str(fake_nvidia_smi(root / "gpu", "h100"))
            # a GPU server's plan: the limit is the (recorded) GPU's memory
            machine = root / "machine.toml"
            machine.write_text('limit = "gpu"\n')
            overrides["env"] = {MACHINE_ENV: str(machine), **overrides.get("env", {})}
        engine = Engine(name=name, repo=repo, base=self.base_image, root=root, **overrides)
        engine.commit = engine.commit or git(engine.repo.path, "rev-parse", "HEAD")
        self.made.append(engine)
        return engine

    def discard(self, engine: Engine) -> None:
        """Its workers killed, its container and images removed."""
        for proc in engine.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for container in self.client.containers.list(all=True, filters={"name": engine.container}):
            container.remove(force=True)
        for image in (engine.image_tag + "-grammar", engine.image_tag):
            with contextlib.suppress(docker.errors.ImageNotFound):
                self.client.images.remove(image, force=True)

    def close(self) -> None:
        for engine in self.made:
            self.discard(engine)


def own_recipe_factory(
    client: docker.DockerClient, base_image: str, directory: Path, request: pytest.FixtureRequest
) -> EngineFactory:
    """An EngineFactory under `directory` on a recipe repository of its own (the template's,
    tagged `recipe 0.7.0`), for a module's engines."""
    recipe_repository(directory / "recipe-repo", REPO_TEMPLATE, "recipe 0.7.0")
    repo = RecipeRepo(directory / "recipe-repo")
    return EngineFactory(client, base_image, directory, lambda: repo, request)


@pytest.fixture
def make_engine(
    client: docker.DockerClient,
    base_image: str,
    recipe_repo: RecipeRepo,
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> Iterator[Callable[..., Engine]]:
    factory = EngineFactory(client, base_image, tmp_path, lambda: recipe_repo, request)
    yield factory
    factory.close()
