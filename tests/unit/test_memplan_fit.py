"""The plan's arithmetic and the refusal's wording, in tables (figures worked by hand)."""

from __future__ import annotations

from pathlib import Path

import pytest

from supervisor.engines.llama_router.plan import Options, RouterModel, options, plan
from supervisor.hw.meminfo import MeminfoUnreadable, parse_meminfo
from supervisor.library.ggufmeta import read_metadata
from supervisor.memplan.fit import Budget, Holding, check, check_now
from supervisor.memplan.kv import KvShape, Layer, shape
from supervisor.memplan.need import EngineNeed, figures, plan_model, planned_context
from supervisor.memplan.probe import ProbeFailed, parse_nvidia_smi
from tests.gguf_fixtures import write_model

G = 1024**3
MIB = 1024**2
# 3 layers x 2 heads x (16 + 16) x 2 = 384 B per token
TINY = KvShape("llama", 2048, 3, (Layer(2, 16, 16),) * 3)
# 4 layers x 8 heads x (128 + 128) x 2 = 16 KiB per token, native 131072
BIG = KvShape("llama", 131072, 4, (Layer(8, 128, 128),) * 4)


@pytest.mark.parametrize(
    ("kv", "room", "parallel", "context"),
    [
        (TINY, 384 * 1000, 1, 768),  # 1000 tokens fit: rounded down to 256 -> 768
        (TINY, 384 * 255, 1, 0),  # not even 256
        (TINY, 384 * 10_000, 1, 2048),  # native 2048 wins over 9984
        (TINY, 384 * 10_000, 4, 8192),  # 4 sequences x native 2048 = 8192 < 9984
        # 5000 -> 4096: 4 sequences of a multiple of 256 each (4864 would be 4 x 1216, which
        # llama-server pads to 4 x 1280 = 5120 cells, more than the room)
        (TINY, 384 * 5_000, 4, 4096),
        (TINY, 384 * 5_000, 2, 4096),  # 2 x 2048 = native, 4096 cells <= 5000
        (BIG, 10 * G, 1, 131072),  # 10 GiB / 16 KiB = 655360 > native 131072
        (BIG, 1 * G, 1, 65536),  # 1 GiB / 16 KiB = 65536 (a multiple of 256)
        (BIG, 1 * G + 16384 * 300, 1, 65792),  # 65836 -> 65792
        (BIG, -5, 1, 0),
    ],
)
def test_planned_context(kv: KvShape, room: int, parallel: int, context: int) -> None:
    assert planned_context(kv, room, parallel) == context


def test_planned_context_native_below_256_is_kept() -> None:
    tiny = KvShape("llama", 128, 3, (Layer(2, 16, 16),) * 3)
    assert planned_context(tiny, 10 * MIB) == 128  # 128 x 384 B fits; native is the cap


def test_plan_model_auto_and_fixed() -> None:
    # 10 GiB room, 2 GiB weights x 2 = 4 GiB, 6 GiB for KV: 6 GiB / 16 KiB = 393216 > native
    need = plan_model("big", 2 * G, BIG, 10 * G)
    assert need.context == 131072
    assert need.kv == 131072 * 16384 == 2 * G
    assert need.need == 4 * G + 2 * G
    # 5 GiB room: 1 GiB for KV -> 65536 tokens
    assert plan_model("big", 2 * G, BIG, 5 * G).context == 65536
    # a fixed context is taken as asked
    fixed = plan_model("big", 2 * G, BIG, 1, context=8192, parallel=2)
    assert (fixed.context, fixed.kv) == (8192, 8192 * 16384)
    # an embedding model counts at its file size
    embed = plan_model("e", 300 * MIB, KvShape("bert", 512, 12, (), True), 1)
    assert (embed.need, embed.kv, embed.multiplier) == (300 * MIB, 0, 1.0)


def _gib(value: float) -> int:
    return round(value * G)


def test_the_guides_refusal() -> None:
    need = EngineNeed("spark-model", (figures("qwen", _gib(40), 0, 200000, kv=_gib(23)),))
    assert need.need == _gib(103)
    budget = Budget(_gib(121.7), _gib(22), (Holding("llama-router", _gib(28.5)),))
    verdict = check(need, budget)
    assert not verdict.fits
    assert verdict.message == (
        "The model qwen does not fit after voice, OS, services, and runtime reservations: "
        "needs 103.0 GiB, 71.2 GiB left (limit 121.7, reserves 22.0, held by llama-router "
        "28.5). Lower CONTEXT or stop llama-router."
    )


@pytest.mark.parametrize(
    ("need_gib", "held", "fits", "tail"),
    [
        (71.2, [("llama-router", 28.5)], True, ""),
        (50, [], True, ""),
        (100, [], False, "(limit 121.7, reserves 22.0). Lower CONTEXT."),
        (
            60,
            [("a", 20), ("b", 20)],
            False,
            "(limit 121.7, reserves 22.0, held by a 20.0, b 20.0). Lower CONTEXT or stop a or b.",
        ),
    ],
)
def test_check(need_gib: float, held: list[tuple[str, float]], fits: bool, tail: str) -> None:
    need = EngineNeed("m", (figures("m", _gib(need_gib), 0, 0, multiplier=1.0),))
    budget = Budget(_gib(121.7), _gib(22), tuple(Holding(n, _gib(b)) for n, b in held))
    verdict = check(need, budget)
    assert verdict.fits is fits
    assert verdict.message.endswith(tail)


def test_check_now() -> None:
    need = EngineNeed("m", (figures("m", _gib(30), 0, 0, multiplier=1.0),))
    assert check_now(need, _gib(60), _gib(22)).fits  # 38 left
    refused = check_now(need, _gib(40), _gib(22))  # 18 left
    assert not refused.fits
    assert "needs 30.0 GiB, 18.0 GiB left (available 40.0, reserves 22.0)" in refused.message
    assert check_now(need, _gib(40), _gib(22), releasing=_gib(12)).fits  # 30 left


def test_router_plan(tmp_path: Path) -> None:
    small = shape(read_metadata(write_model(tmp_path / "s.gguf", context=4096)))  # 384 B/token
    models = [
        RouterModel("small", 100 * MIB, small),
        RouterModel("huge", 60 * G, small),  # 120 GiB with the multiplier: never fits
        RouterModel("embed", 50 * MIB, KvShape("bert", 512, 2, (), True)),
    ]
    room = 1 * G
    routed = plan("r", models, room, ["small", "embed"], Options(), multiplier=2.0)
    assert [m.name for m in routed.offered] == ["embed", "small"]
    assert [m.name for m in routed.unfit] == ["huge"]
    assert routed.contexts()["small"] == 4096  # alone: native
    together = {m.name: m for m in routed.startup.models}
    # room after weights: 1 GiB - 200 MiB - 50 MiB, shared by one KV model: still native
    assert together["small"].context == 4096
    assert routed.startup.need == 200 * MIB + 4096 * 384 + 50 * MIB


@pytest.mark.parametrize(
    ("defaults", "expected"),
    [
        ({}, Options("auto", 1, "f16", "f16")),
        ({"ctx-size": 8192, "parallel": 4}, Options(8192, 4, "f16", "f16")),
        ({"c": "auto", "np": 2, "cache-type-k": "q8_0"}, Options("auto", 2, "q8_0", "f16")),
    ],
)
def test_router_options(defaults: dict[str, str | int], expected: Options) -> None:
    assert options(defaults) == expected


@pytest.mark.parametrize(
    "defaults", [{"ctx-size": "big"}, {"parallel": 0}, {"cache-type-v": "q3"}, {"np": True}]
)
def test_router_options_refused(defaults: dict[str, str | int | bool]) -> None:
    with pytest.raises(ValueError):
        options(defaults)


def test_meminfo_and_nvidia_smi() -> None:
    text = "MemTotal:       24576000 kB\nMemFree: 1 kB\nMemAvailable:   12288000 kB\n"
    assert parse_meminfo(text) == (24576000 * 1024, 12288000 * 1024)
    with pytest.raises(MeminfoUnreadable):
        parse_meminfo("MemTotal: 5 kB\n")
    assert parse_nvidia_smi("81559, 80000\n81559, 1000\n") == (2 * 81559 * MIB, 81000 * MIB)
    for bad in ("", "N/A, 5\n", "1, 2, 3\n"):
        with pytest.raises(ProbeFailed):
            parse_nvidia_smi(bad)
