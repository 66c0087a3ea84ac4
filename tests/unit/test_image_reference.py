"""The image reference rule (Docker's grammar, `[host[:port]/]path[:tag][@digest]`), alone and
through the recipe fields that use it: a build tag, a pulled image, the vLLM mirror repository."""

from __future__ import annotations

import pytest

from supervisor.engines.llama_router.recipe import LlamaRouterRecipe
from supervisor.engines.loader import parse
from supervisor.engines.vllm.recipe import VllmRecipe
from supervisor.recipe import reference
from supervisor.recipe.schema import RecipeError
from tests.support import MINIMAL_RECIPE

DIGEST = "sha256:" + "0123456789abcdef" * 4

# (reference, a pulled image, a build tag, a repository)
ACCEPTED = [
    ("img", True, True, True),
    ("img:1", True, True, False),
    ("tensorfold-qwen38:v0.6.6", True, True, False),
    ("vllm/vllm-openai", True, True, True),
    ("vllm/vllm-openai:v0.32.0-cu129", True, True, False),
    ("ghcr.io/ggml-org/llama.cpp:server", True, True, False),
    ("localhost:5000/vllm/vllm-openai", True, True, True),
    ("localhost:5000/vllm/vllm-openai:v0.32.0", True, True, False),
    ("127.0.0.1:5000/vllm/vllm-openai", True, True, True),
    ("Registry.Example.COM:443/team/img:Tag_1", True, True, False),
    ("[::1]:5000/img:1", True, True, False),
    ("a:1/b", True, True, True),  # a host "a" with a port: Docker reads it so too
    ("a__b/c.d/e--f:x", True, True, False),
    (f"vllm/vllm-openai@{DIGEST}", True, False, False),
    (f"localhost:5000/vllm/vllm-openai:v0.32.0@{DIGEST}", True, False, False),
    ("img:" + "t" * 128, True, True, False),
]

REFUSED = [
    "",
    "Img With Spaces",
    "Img",  # upper case in the path
    "vllm/VLLM-openai",
    "img:",  # an empty tag
    "img:.1",  # a tag starting with a dot
    "img:" + "t" * 129,
    "/img",
    "img/",
    "a//b",
    "a..b",
    "a_-b",
    "-img",
    "img-",
    "localhost:/img",  # a colon without a port
    "localhost:99999/img",  # a port out of range
    "localhost:0/img",
    "local_host:5000/img",  # "_" is no host character, so this is a path with a port in it
    "img@sha256:abc",  # a digest too short
    "img@" + "0" * 64,  # a digest without its algorithm
    "img:1\n",
    "img\x00",
    "a" * 256,  # a name over 255 characters
    "ímg",
]


@pytest.mark.parametrize(("value", "pull", "build", "repo"), ACCEPTED, ids=[a[0] for a in ACCEPTED])
def test_accepted_forms(value: str, pull: bool, build: bool, repo: bool) -> None:
    for check, accepted in (
        (reference.image_reference, pull),
        (reference.image_tag, build),
        (reference.repository, repo),
    ):
        if accepted:
            assert check(value) == value
        else:
            with pytest.raises(ValueError, match="is not a valid image"):
                check(value)


@pytest.mark.parametrize("value", REFUSED, ids=[repr(v)[:40] for v in REFUSED])
def test_refused_forms(value: str) -> None:
    for check in (reference.image_reference, reference.image_tag, reference.repository):
        with pytest.raises(ValueError, match="is not a valid image") as info:
            check(value)
        assert "\n" not in str(info.value).replace("\\n", "")


VLLM = """
name = "v"
engine = "vllm"
[vllm]
served_name = "m"
max_model_len = 4096
repository = "{repository}"
[vllm.model.hf]
id = "org/model"
revision = "0123456789abcdef0123456789abcdef01234567"
[run]
port = 8000
"""


@pytest.mark.parametrize(
    "repository",
    [
        "localhost:5000/vllm/vllm-openai",
        "127.0.0.1:5000/vllm/vllm-openai",
        "mirror.example:8443/vllm/vllm-openai",
        "mirror.local/vllm",
    ],
)
def test_a_vllm_mirror_may_name_a_registry_with_a_port(repository: str) -> None:
    recipe = parse(VLLM.format(repository=repository))
    assert isinstance(recipe, VllmRecipe)
    assert recipe.preflight_choices().repository == repository


@pytest.mark.parametrize(
    ("repository", "why"),
    [
        ("localhost:5000/vllm/vllm-openai:v0.32.0", "no tag or digest"),  # the preflight picks it
        (f"vllm/vllm-openai@{DIGEST}", "no tag or digest"),
        ("localhost:5000/Vllm", "lower-case"),
        ("localhost:70000/vllm", "port 70000 is out of range"),
    ],
)
def test_a_vllm_mirror_with_a_tag_or_a_bad_name_is_refused(repository: str, why: str) -> None:
    with pytest.raises(RecipeError) as info:
        parse(VLLM.format(repository=repository), "v.toml")
    message = str(info.value)
    assert message.startswith("v.toml: ") and "vllm.repository" in message and why in message


def test_a_build_tag_takes_a_registry_port_but_no_digest() -> None:
    parse(MINIMAL_RECIPE.replace('tag = "img:1"', 'tag = "localhost:5000/img:1"'))
    with pytest.raises(RecipeError, match=r"image\.tag"):
        parse(MINIMAL_RECIPE.replace('tag = "img:1"', f'tag = "img@{DIGEST}"'))


def test_a_router_image_may_be_pinned_by_digest() -> None:
    text = f"""
name = "r"
engine = "llama-router"
[router]
image = "localhost:5000/llama.cpp:server@{DIGEST}"
[library]
models_dir = "/m"
cache_dir = "/c"
[run]
port = 18080
"""
    recipe = parse(text)
    assert isinstance(recipe, LlamaRouterRecipe)
    assert recipe.router.image.endswith(DIGEST)
