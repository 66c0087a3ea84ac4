"""Recipe files: the shipped Spark recipe, and recipes that must be refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from supervisor.engines.loader import load, parse
from supervisor.engines.tensorfold import grammar
from supervisor.engines.tensorfold.recipe import Grammar
from supervisor.recipe.schema import RecipeError
from tests.support import MINIMAL_RECIPE

ROOT = Path(__file__).resolve().parents[2]
SPARK = ROOT / "recipes" / "spark-model.toml"


def test_the_spark_recipe_has_the_operators_values() -> None:
    recipe = load(SPARK)
    env = recipe.environment
    assert env["PARALLEL"] == "4"
    assert env["CONTEXT"] == "200000"
    assert env["TENSORFOLD_MEMORY_RESERVE_GIB"] == "4"
    assert env["PORT"] == "8888"
    assert recipe.run.port == 8888
    assert recipe.grammar.requirement == "xgrammar>=0.2.8,<0.3"
    assert recipe.grammar.modules == ["xgrammar", "tensorfold"]
    assert recipe.source.commit == "069c0e91491e1aa5409a34300db355c8273d6406"
    assert recipe.grammar_tag == "tensorfold-qwen38:v0.6.6-grammar"
    assert recipe.run.stop_grace == 60
    assert recipe.run.ready_path == "/v1/models"
    assert recipe.run.gpus == "all" and recipe.run.ipc == "host"
    assert recipe.run.ulimits == {"memlock": -1, "stack": 67108864}
    assert recipe.command[:3] == ["tensorfold", "serve", recipe.model]
    assert "--port" in recipe.command and "8888" in recipe.command


def test_the_spark_recipe_serves_as_start_sh_does() -> None:
    recipe = load(SPARK)
    assert recipe.image.from_ == "prepare"  # type: ignore[union-attr]
    assert recipe.prepare.commands == [["bash", "scripts/prepare.sh"]]  # type: ignore[union-attr]
    assert recipe.command[3:] == [
        "--host",
        "0.0.0.0",
        "--port",
        "8888",
        "--name",
        "Qwen3.8-Flash-Next",
        "--parallel",
        "4",
        "--context",
        "200000",
        "--kv-dtype",
        "int8",
        "--mtp-drafts",
        "6",
        "--mtp-confidence",
        "0.60",
        "--temperature",
        "1.0",
        "--top-p",
        "0.95",
        "--top-k",
        "20",
        "--max-tokens",
        "32768",
        "--vision",
        "--vision-max-images",
        "50",
        "--vision-image-tokens",
        "16384",
        "--thinking",
    ]
    env = recipe.environment
    assert {k: v for k, v in env.items() if k.startswith("TENSORFOLD_")} == {
        "TENSORFOLD_VISION_WORKSPACE_MIB": "0",
        "TENSORFOLD_IMAGE_TOKENS": "16384",
        "TENSORFOLD_VIDEO_TOKENS": "16384",
        "TENSORFOLD_MEMORY_RESERVE_GIB": "4",
        "TENSORFOLD_MTP_COPY": "1",
        "TENSORFOLD_NO_UPDATE_CHECK": "1",
    }
    assert env["HF_HUB_OFFLINE"] == "1" and env["PULL"] == "0"
    assert env["IMAGE"] == recipe.image.tag  # type: ignore[union-attr]
    assert [(v.source, v.target) for v in recipe.run.volumes] == [
        ("${HF_CACHE}", "/root/.cache/huggingface"),
        ("${KERNEL_CACHE}", "/cache"),
    ]
    assert env["KERNEL_CACHE"] == "~/.cache/tensorfold-qwen38"
    # start.sh's check: TensorFold's own parser on exactly the arguments it will serve with
    assert recipe.check_command[:2] == ["python", "-c"]
    assert "build_parser().parse_args(sys.argv[1:])" in recipe.check_command[2]
    assert recipe.check_command[3:] == recipe.command[1:]


MINIMAL = MINIMAL_RECIPE

BAD = [
    ("not toml", "name = ", "not valid TOML"),
    ("unknown key", MINIMAL + "\nsurprise = 1\n", "surprise"),
    (
        "short commit",
        MINIMAL.replace("0123456789abcdef0123456789abcdef01234567", "abc123"),
        "source.commit",
    ),
    ("unknown engine", MINIMAL.replace('engine = "tensorfold"', 'engine = "sglang"'), "engine"),
    ("port out of range", MINIMAL.replace("port = 8888", "port = 70000"), "run.port"),
    (
        "module name with code",
        MINIMAL.replace('["xgrammar"]', '["os; rm -rf /"]'),
        "not module names",
    ),
    (
        "dockerfile outside the checkout",
        MINIMAL.replace('tag = "img:1"', 'tag = "img:1"\ndockerfile = "../x"'),
        "inside the checkout",
    ),
    (
        "bad image tag",
        MINIMAL.replace('tag = "img:1"', 'tag = "Img With Spaces"'),
        "image reference",
    ),
    ("command names an unknown setting", MINIMAL + 'command = ["serve", "${NOPE}"]\n', "NOPE"),
    ("check names an unknown setting", MINIMAL + 'check = ["python", "${NOPE}"]\n', "NOPE"),
    (
        "volume names an unknown setting",
        MINIMAL + 'volumes = [{ source = "${NOPE}", target = "/a" }]\n',
        "NOPE",
    ),
    (
        "image from a prepare without commands",
        MINIMAL.replace('tag = "img:1"', 'tag = "img:1"\nfrom = "prepare"'),
        "prepare.commands",
    ),
    (
        "image from something else",
        MINIMAL.replace('tag = "img:1"', 'tag = "img:1"\nfrom = "x"'),
        "image.from",
    ),
    (
        "relative volume target",
        MINIMAL + 'volumes = [{ source = "/a", target = "rel" }]\n',
        "absolute",
    ),
    (
        "setting that is not an env name",
        MINIMAL + '[settings]\n"A-B" = "1"\n',
        "environment variable",
    ),
]


@pytest.mark.parametrize(("text", "needle"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_recipes_are_refused_naming_the_problem(text: str, needle: str) -> None:
    with pytest.raises(RecipeError) as info:
        parse(text, "bad.toml")
    message = str(info.value)
    assert message.startswith("bad.toml: ")
    assert needle in message
    assert "\n" not in message


def test_missing_recipe_file(tmp_path: Path) -> None:
    with pytest.raises(RecipeError, match="no such recipe file"):
        load(tmp_path / "nope.toml")


def test_minimal_recipe_defaults() -> None:
    recipe = parse(MINIMAL)
    assert recipe.run.stop_grace == 60
    assert recipe.run.network == "lucia"
    assert recipe.run.inner_port == 8888
    assert recipe.prepare.commands == []


PIN = Grammar(requirement="xgrammar>=0.2.8,<0.3", modules=["xgrammar", "tensorfold"])


def test_grammar_dockerfile_is_exec_form_and_never_the_engine_extra() -> None:
    text = grammar.dockerfile(PIN, "sha256:base")
    lines = text.splitlines()
    assert lines[0] == "FROM sha256:base"
    install = json.loads(lines[1].removeprefix("RUN "))
    check = json.loads(lines[2].removeprefix("RUN "))
    assert install[:4] == ["python", "-m", "pip", "install"]
    assert install[-1] == "xgrammar>=0.2.8,<0.3"
    assert "[grammar]" not in text
    assert check == ["python", "-c", "import xgrammar, tensorfold"]


@pytest.mark.parametrize(
    ("labels", "expected"),
    [
        (grammar.labels(PIN, "sha256:base"), True),
        ({**grammar.labels(PIN, "sha256:base"), "other": "x"}, True),
        (grammar.labels(PIN, "sha256:older"), False),
        (
            grammar.labels(
                Grammar(requirement="xgrammar==0.2.8", modules=["xgrammar", "tensorfold"]),
                "sha256:base",
            ),
            False,
        ),
        (
            grammar.labels(
                Grammar(requirement=PIN.requirement, modules=["xgrammar"]), "sha256:base"
            ),
            False,
        ),
        ({}, False),
    ],
)
def test_grammar_image_is_current_exactly_when_base_and_pin_match(
    labels: dict[str, str], expected: bool
) -> None:
    assert grammar.current(PIN, "sha256:base", labels) is expected


# --- vllm ---------------------------------------------------------------------------------------

VLLM = ROOT / "recipes" / "vllm.toml"
GIB = 1024**3

VLLM_MINIMAL = """
name = "v"
engine = "vllm"
[vllm]
served_name = "m"
max_model_len = 4096
[vllm.model.hf]
id = "org/model"
revision = "0123456789abcdef0123456789abcdef01234567"
[run]
port = 8000
"""


def test_the_shipped_vllm_recipe() -> None:
    from supervisor.engines.vllm.recipe import VllmRecipe

    recipe = load(VLLM)
    assert isinstance(recipe, VllmRecipe)
    v = recipe.vllm
    assert (v.channel, v.quantization, v.memory) == ("stable", "none", 90)
    assert recipe.model_argument == recipe.model == "meta-llama/Llama-3.2-1B-Instruct"
    assert recipe.model_revision == "9213176726f574b556790deb65791e0c5aa438b6"
    plan = recipe.tier_plan()
    buffers = 512 * 1024**2  # the tier plugin's staging buffer and write queue, by default
    assert (plan.shm_bytes, plan.shm_size, plan.memory) == (8 * GIB, 10 * GIB, 26 * GIB + buffers)
    assert [(d.name, d.max_bytes) for d in plan.disks] == [("nvme", 16 * GIB), ("hdd", 256 * GIB)]
    assert "LUCIA_KV_KEY" in recipe.secrets
    choices = recipe.preflight_choices()
    assert (choices.memory_share, choices.served_name, choices.port) == (90, "llama-3.2-1b", 8000)


def test_minimal_vllm_defaults() -> None:
    recipe = parse(VLLM_MINIMAL)
    assert recipe.engine == "vllm"
    choices = recipe.preflight_choices()  # type: ignore[union-attr]
    assert (choices.channel, choices.quantization, choices.memory_share) == ("stable", "none", 90)
    assert choices.prefix_caching and choices.revision == "0123456789abcdef0123456789abcdef01234567"
    assert recipe.tier_plan().disks == ()  # type: ignore[union-attr]


def test_a_library_model_is_served_from_its_mount() -> None:
    text = VLLM_MINIMAL.replace(
        '[vllm.model.hf]\nid = "org/model"\nrevision = "0123456789abcdef0123456789abcdef01234567"',
        '[vllm.model.library]\nmodels_dir = "/lib"\nguid = "abc-123"',
    )
    recipe = parse(text)
    assert recipe.model_argument == "/models/abc-123"  # type: ignore[union-attr]
    assert recipe.model_revision is None  # type: ignore[union-attr]


VM = VLLM_MINIMAL
KEYED = '[secrets]\nLUCIA_KV_KEY = "/run/kv.key"\n'
SHM_FITS = VM.replace("port = 8000", 'port = 8000\nshm_size = "10g"\nmemory = "26g"')
IPC_HOST_SHM = (
    SHM_FITS.replace("port = 8000", 'port = 8000\nipc = "host"')
    + '[tiers]\nshm_bytes = "8GiB"\n'
    + KEYED
)
VLLM_BAD = [
    ("channel", VM.replace("[vllm]\n", '[vllm]\nchannel = "beta"\n'), "vllm.channel"),
    (
        "quantization",
        VM.replace("[vllm]\n", '[vllm]\nquantization = "int4"\n'),
        "vllm.quantization",
    ),
    ("memory below 10", VM.replace("[vllm]\n", "[vllm]\nmemory = 9\n"), "vllm.memory"),
    ("memory above 95", VM.replace("[vllm]\n", "[vllm]\nmemory = 96\n"), "vllm.memory"),
    ("memory as a fraction", VM.replace("[vllm]\n", "[vllm]\nmemory = 0.9\n"), "vllm.memory"),
    (
        "nightly without its commit",
        VM.replace("[vllm]\n", '[vllm]\nchannel = "nightly"\n'),
        "nightly_commit",
    ),
    (
        "nightly with the short commit",
        VM.replace("[vllm]\n", '[vllm]\nchannel = "nightly"\nnightly_commit = "e68efc685ab1"\n'),
        "nightly_commit",
    ),
    (
        "nightly on another main commit",
        VM.replace(
            "[vllm]\n", '[vllm]\nchannel = "nightly"\nnightly_commit = "' + "a" * 40 + '"\n'
        ),
        "not the guide's pinned nightly: it must be the full 40-hex commit of vLLM main "
        "e68efc685ab1",
    ),
    (
        "revision a branch",
        VM.replace("0123456789abcdef0123456789abcdef01234567", "main"),
        "revision",
    ),
    ("revision a tag", VM.replace("0123456789abcdef0123456789abcdef01234567", "v1.0"), "revision"),
    ("both models", VM + '[vllm.model.library]\nmodels_dir = "/l"\nguid = "g"\n', "exactly one"),
    (
        "no model",
        VM.replace(
            '[vllm.model.hf]\nid = "org/model"\n'
            'revision = "0123456789abcdef0123456789abcdef01234567"',
            "",
        ),
        "vllm.model",
    ),
    ("hf id with a path", VM.replace('id = "org/model"', 'id = "../../etc"'), "id"),
    (
        "disk tier without the key",
        VM + '[tiers]\nnvme = { path = "/n", max_bytes = "16GiB" }\n',
        "cache key",
    ),
    (
        "hdd tier without the key",
        VM + '[tiers]\nhdd = { path = "/h", max_bytes = "16GiB" }\n',
        "cache key",
    ),
    # the shm offload seals its blocks too: without the key the plugin would stop vLLM
    ("shm tier without the key", SHM_FITS + '[tiers]\nshm_bytes = "8GiB"\n', "cache key"),
    ("relative tier path", VM + '[tiers]\nnvme = { path = "n", max_bytes = 1 }\n', "absolute"),
    ("tier size", VM + '[tiers]\nhdd = { path = "/h", max_bytes = "lots" }\n', "not a size"),
    ("shm offload without shm_size", VM + '[tiers]\nshm_bytes = "8GiB"\n' + KEYED, "run.shm_size"),
    (
        "shm offload larger than shm",
        VM.replace("port = 8000", 'port = 8000\nshm_size = "8g"\nmemory = "26g"')
        + '[tiers]\nshm_bytes = "8GiB"\n'
        + KEYED,
        "run.shm_size",
    ),
    (
        "memory limit below shm",
        VM.replace("port = 8000", 'port = 8000\nshm_size = "10g"\nmemory = "9g"')
        + '[tiers]\nshm_bytes = "8GiB"\n'
        + KEYED,
        "run.memory",
    ),
    (
        "unknown vllm key",
        VM.replace("[vllm]\n", "[vllm]\ngpu_memory_utilization = 0.9\n"),
        "unknown key",
    ),
    # the offload would be in the host's /dev/shm, which no prune ever reaches
    ("shm offload with the host's ipc", IPC_HOST_SHM, 'tiers.shm_bytes with run.ipc = "host"'),
]


@pytest.mark.parametrize(
    "tiers",
    [
        'shm_bytes = "8GiB"',
        'nvme = { path = "/n", max_bytes = "16GiB" }',
        'hdd = { path = "/h", max_bytes = "16GiB" }',
    ],
)
def test_any_tier_with_the_key_is_accepted(tiers: str) -> None:
    recipe = parse(SHM_FITS + f"[tiers]\n{tiers}\n" + KEYED)
    assert recipe.tiers.any and "LUCIA_KV_KEY" in recipe.secrets  # type: ignore[attr-defined]


def test_the_host_ipc_with_an_shm_offload_is_refused_naming_both_and_alone_is_accepted() -> None:
    with pytest.raises(RecipeError) as info:
        parse(IPC_HOST_SHM, "bad.toml")
    assert str(info.value) == (
        'bad.toml: Value error, tiers.shm_bytes with run.ipc = "host" puts the offload in the '
        "/dev/shm of the host, never pruned: remove run.ipc or tiers.shm_bytes"
    )
    disks = IPC_HOST_SHM.replace('shm_bytes = "8GiB"', 'nvme = { path = "/n", max_bytes = "1GiB" }')
    assert parse(disks).run.ipc == "host"  # the disk tiers are directories of their own
    assert parse(IPC_HOST_SHM.replace('ipc = "host"', 'ipc = "private"')).tiers.any  # type: ignore[attr-defined]


def test_the_data_parallel_size_reaches_the_namespace_and_the_plugin() -> None:
    text = SHM_FITS.replace("[vllm]\n", '[vllm]\nargs = ["--data-parallel-size", "2"]\n')
    recipe = parse(text + '[tiers]\nshm_bytes = "8GiB"\n' + KEYED)
    assert recipe.parallel().data == 2  # type: ignore[attr-defined]
    assert recipe.tier_plan().data_parallel == 2  # type: ignore[attr-defined]
    assert parse(VM).parallel().data == 1  # type: ignore[attr-defined]


def test_the_pinned_nightly_is_accepted() -> None:
    text = VM.replace(
        "[vllm]\n",
        '[vllm]\nchannel = "nightly"\nnightly_commit = "' + "e68efc685ab1" + "7" * 28 + '"\n',
    )
    assert parse(text, "nightly.toml").vllm.nightly_commit.startswith("e68efc685ab1")  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("text", "needle"), [b[1:] for b in VLLM_BAD], ids=[b[0] for b in VLLM_BAD]
)
def test_bad_vllm_recipes_are_refused(text: str, needle: str) -> None:
    with pytest.raises(RecipeError) as info:
        parse(text, "bad.toml")
    assert needle in str(info.value)
    assert "\n" not in str(info.value)


def _tiered(path: str) -> str:
    return VM + (
        f'[tiers]\nnvme = {{ path = "{path}", max_bytes = "1GiB" }}\n'
        f'[secrets]\nLUCIA_KV_KEY = "{path}/kv.key"\n'
    )


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("~/kv/nvme", "HOME/kv/nvme"),
        ("~", "HOME"),
        ("~/", "HOME/"),
        ("/srv/kv/nvme", "/srv/kv/nvme"),
        ("/srv/~/kv", "/srv/~/kv"),
        ("~root/kv", "ROOT/kv"),
    ],
)
def test_tier_paths_take_the_home_of_the_workers_user_as_secret_paths_do(
    path: str, expected: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Expanded when the recipe is loaded, as the user who loads it (the worker's)."""
    import pwd

    home = tmp_path / "operator"
    monkeypatch.setenv("HOME", str(home))
    recipe = parse(_tiered(path), "tiered.toml")
    want = expected.replace("HOME", str(home)).replace("ROOT", pwd.getpwnam("root").pw_dir)
    assert recipe.tiers.nvme.path == want  # type: ignore[attr-defined]
    (disk,) = recipe.tier_plan().disks  # type: ignore[attr-defined]
    assert disk.root == Path(want)
    secret = Path(recipe.secrets["LUCIA_KV_KEY"]).expanduser()
    assert secret == Path(want) / "kv.key", "the key file and the tier under the same home"


@pytest.mark.parametrize(
    ("path", "needle"),
    [
        ("kv/nvme", "'kv/nvme' must be an absolute path"),
        ("./~/kv", "'./~/kv' must be an absolute path"),
        ("~no-such-user-here/kv", "'~no-such-user-here/kv': no such user's home directory"),
    ],
)
def test_a_tier_path_neither_absolute_nor_under_a_home_is_refused(path: str, needle: str) -> None:
    with pytest.raises(RecipeError) as info:
        parse(_tiered(path), "bad.toml")
    assert str(info.value) == f"bad.toml: tiers.nvme.path: Value error, {needle}"
