"""The connector's scheduler-side bookkeeping: keys by prefix and extras, loads and saves of full
blocks."""

from __future__ import annotations

import hashlib
import struct

import pytest
from lucia_kv.scheduling import (
    NO_EXTRAS,
    Extras,
    Scheduling,
    StepPlan,
    block_extras,
    chain,
    seed,
)

BS = 4


def test_a_key_names_its_whole_prefix() -> None:
    tokens = list(range(10))
    keys = chain(tokens, BS, b"s")
    assert len(keys) == 2  # only full blocks
    changed = chain([99, *tokens[1:]], BS, b"s")
    assert changed[0] != keys[0] and changed[1] != keys[1]  # a change in block 0 reaches 1
    later = chain([*tokens[:4], 99, *tokens[5:]], BS, b"s")
    assert later[0] == keys[0] and later[1] != keys[1]
    assert chain(tokens, BS, b"rank 1") != keys  # the seed is part of every key
    assert chain([*tokens, 10, 11], BS, b"s", start=keys) == chain([*tokens, 10, 11], BS, b"s")


def test_a_hit_loads_its_blocks_and_saves_only_new_ones() -> None:
    plan = Scheduling(BS, b"s")
    prompt = list(range(11))
    keys = plan.prompt_keys(prompt)
    assert len(keys) == 2  # 10 usable tokens: at least one is left for vLLM to compute
    assert plan.matched("r", 0, keys, hits=2) == 8
    plan.allocated("r", [7, 8, 9], external_tokens=8)
    step = plan.step([("r", [7, 8, 9], True, 8, 3)], {"r": prompt})
    assert [t.blocks for t in step.loads] == [((7, keys[0]), (8, keys[1]))]
    assert step.saves == []  # nothing new is full yet
    prompt.append(11)  # a decoded token fills block 2
    step = plan.step([("r", None, False, 11, 1)], {"r": prompt})
    assert step.loads == []
    assert [t.blocks for t in step.saves] == [((9, chain(prompt, BS, b"s")[2]),)]


def test_a_miss_saves_each_block_once_as_chunks_complete_it() -> None:
    plan = Scheduling(BS, b"s")
    prompt = list(range(100, 111))
    assert plan.matched("r", 0, plan.prompt_keys(prompt), hits=0) == 0
    plan.allocated("r", [3, 4, 5], external_tokens=0)
    first = plan.step([("r", [3, 4, 5], True, 0, 6)], {"r": prompt})  # a 6-token chunk
    second = plan.step([("r", None, False, 6, 5)], {"r": prompt})
    keys = chain(prompt, BS, b"s")
    assert [t.blocks for t in first.saves] == [((3, keys[0]),)]
    assert [t.blocks for t in second.saves] == [((4, keys[1]),)]
    assert first.loads == second.loads == []


def test_local_prefix_hits_are_neither_loaded_nor_saved_again() -> None:
    plan = Scheduling(BS, b"s")
    prompt = list(range(13))
    keys = plan.prompt_keys(prompt)
    assert plan.matched("r", 8, keys, hits=3) == 4  # vLLM already holds 8 tokens
    plan.allocated("r", [1, 2, 3, 4], external_tokens=4)
    step = plan.step([("r", [1, 2, 3, 4], True, 12, 1)], {"r": prompt})
    assert [t.blocks for t in step.loads] == [((3, keys[2]),)]
    assert step.saves == []


def test_finished_requests_reach_the_next_plan_once() -> None:
    plan = Scheduling(BS, b"s")
    plan.matched("r", 0, [], hits=0)
    plan.allocated("r", [1], external_tokens=0)
    plan.finished("r")
    plan.finished("r")
    assert plan.step([], {}).finished == ["r"]
    assert plan.step([], {}).finished == []


def test_blocks_recomputed_after_a_failed_load_are_saved_again() -> None:
    plan = Scheduling(BS, b"s")
    prompt = list(range(9))
    keys = plan.prompt_keys(prompt)
    plan.matched("r", 0, keys, hits=2)
    plan.allocated("r", [4, 5, 6], external_tokens=8)
    assert plan.step([("r", [4, 5, 6], True, 8, 1)], {"r": prompt}).saves == []
    # the load failed: vLLM computes the request again from its first token
    step = plan.step([("r", None, False, 0, 9)], {"r": prompt})
    assert [t.blocks for t in step.saves] == [((4, keys[0]), (5, keys[1]))]


# --- what a key is made of: the engine's seed and the request's extras ----------------------


def test_the_seed_names_the_parallel_layout_and_the_kv_dtype() -> None:
    assert seed(2, 1, "bfloat16") == b"tp2/pp1/kv-bfloat16"
    assert seed(1, 4, "fp8_e4m3") == b"tp1/pp4/kv-fp8_e4m3"


def _field(tag: bytes, value: bytes) -> bytes:
    return tag + len(value).to_bytes(4, "little") + value


def test_a_blocks_extras_are_tagged_length_prefixed_fields_of_what_touches_it() -> None:
    extras = Extras(
        salt="tenant-a",
        lora=("sql", "5e1f" * 16),
        mm=(("img1", 5, 6),),  # positions 5..10: blocks 1 and 2 of 4 tokens
        embeds=(b"e0" * 16, b"e1" * 16),
    )
    lora = _field(b"L", b"sql") + _field(b"D", b"5e1f" * 16)
    assert block_extras(extras, 0, BS) == lora + _field(b"S", b"tenant-a") + _field(
        b"E", b"e0" * 16
    )
    image = b"img1" + struct.pack("<qq", 5 - 4, 6)  # offset from the block's start, length
    assert block_extras(extras, 1, BS) == lora + _field(b"M", image) + _field(b"E", b"e1" * 16)
    image = b"img1" + struct.pack("<qq", 5 - 8, 6)
    assert block_extras(extras, 2, BS) == lora + _field(b"M", image)
    assert block_extras(extras, 3, BS) == lora
    assert block_extras(NO_EXTRAS, 0, BS) == b""


def test_the_chain_is_sha256_of_the_previous_key_the_tokens_and_the_blocks_extras() -> None:
    tokens = list(range(12))
    extras = Extras(salt="s1", mm=(("img", 4, 4),))
    previous = hashlib.sha256(b"lucia-kv chain v1\0" + b"tp1/pp1/kv-bfloat16").digest()
    expected = []
    for index, fields in enumerate(
        [
            _field(b"S", b"s1"),
            _field(b"M", b"img" + struct.pack("<qq", 0, 4)),
            b"",
        ]
    ):
        block = struct.pack("<4q", *tokens[index * 4 : index * 4 + 4])
        previous = hashlib.sha256(previous + block + fields).digest()
        expected.append(previous)
    assert chain(tokens, BS, seed(1, 1, "bfloat16"), extras=extras) == expected
    # without extras a key is the tokens' alone: the blocks stored before extras were keyed
    plain = hashlib.sha256(b"lucia-kv chain v1\0s").digest()
    plain = hashlib.sha256(plain + struct.pack("<4q", 0, 1, 2, 3)).digest()
    assert chain(tokens, BS, b"s")[0] == plain


IMAGE = ("sha-of-image-a", 5, 6)  # placeholder positions 5..10: blocks 1 and 2


@pytest.mark.parametrize(
    ("first", "second", "differs_from"),
    [
        (NO_EXTRAS, Extras(salt="tenant-b"), 0),
        (Extras(salt="tenant-a"), Extras(salt="tenant-b"), 0),
        (Extras(salt="tenant-a"), Extras(salt="tenant-a"), None),
        (NO_EXTRAS, Extras(lora=("sql", "/a/sql")), 0),
        (Extras(lora=("sql", "/a/sql")), Extras(lora=("chat", "/a/sql")), 0),
        (Extras(lora=("sql", "/a/sql")), Extras(lora=("sql", "/a/sql-v2")), 0),
        (Extras(lora=("sql", "/a/sql")), Extras(lora=("sql", "/a/sql")), None),
        (NO_EXTRAS, Extras(mm=(IMAGE,)), 1),
        (Extras(mm=(IMAGE,)), Extras(mm=(("sha-of-image-b", 5, 6),)), 1),
        (Extras(mm=(IMAGE,)), Extras(mm=(("sha-of-image-a", 6, 5),)), 1),
        (Extras(mm=(("a", 9, 2),)), Extras(mm=(("b", 9, 2),)), 2),
        (Extras(mm=(IMAGE,)), Extras(mm=(IMAGE,)), None),
        (Extras(embeds=(b"x", b"y", b"z")), Extras(embeds=(b"x", b"y", b"Z")), 2),
    ],
)
def test_same_tokens_other_extras_other_keys_from_the_first_block_they_touch(
    first: Extras, second: Extras, differs_from: int | None
) -> None:
    tokens = list(range(16))
    one, two = chain(tokens, BS, b"s", extras=first), chain(tokens, BS, b"s", extras=second)
    same = [a == b for a, b in zip(one, two, strict=True)]
    if differs_from is None:
        assert all(same)
    else:  # the chain carries a difference to every later block
        assert same == [i < differs_from for i in range(len(one))]


def test_a_lookup_and_the_saves_of_a_salted_request_use_the_same_keys() -> None:
    extras = Extras(salt="tenant-a", lora=("sql", "/a/sql"))
    plan = Scheduling(BS, b"s")
    prompt = list(range(13))
    keys = plan.prompt_keys(prompt, extras)
    assert keys == chain(prompt[:12], BS, b"s", extras=extras)
    assert keys != plan.prompt_keys(prompt)
    assert plan.matched("r", 0, keys, hits=0, extras=extras) == 0
    plan.allocated("r", [1, 2, 3, 4], external_tokens=0)
    step = plan.step([("r", [1, 2, 3, 4], True, 0, 13)], {"r": prompt}, {"r": extras})
    assert [t.blocks for t in step.saves] == [((1, keys[0]), (2, keys[1]), (3, keys[2]))]
    prompt.extend([13, 14, 15])  # decoded tokens fill block 3: chained with the same extras
    step = plan.step([("r", None, False, 13, 3)], {"r": prompt}, {"r": extras})
    assert [t.blocks for t in step.saves] == [((4, chain(prompt, BS, b"s", extras=extras)[3]),)]


def test_an_unkeyable_request_is_neither_looked_up_loaded_nor_saved_and_counted_once() -> None:
    plan = Scheduling(BS, b"s")
    prompt = list(range(9))
    plan.unkeyable("r")
    plan.unkeyable("r")  # asked again (the scheduler retries a request it could not place)
    plan.allocated("r", [1, 2, 3], external_tokens=0)
    step = plan.step([("r", [1, 2, 3], True, 0, 9)], {"r": prompt}, {"r": None})
    assert (step.loads, step.saves, step.unkeyable) == ([], [], 1)
    plan.finished("r")
    assert plan.step([], {}) == StepPlan()  # nothing held, nothing to release


def test_a_request_that_turns_unkeyable_saves_nothing_more_and_is_counted() -> None:
    plan = Scheduling(BS, b"s")
    prompt = list(range(9))
    plan.matched("r", 0, plan.prompt_keys(prompt), hits=0)
    plan.allocated("r", [1, 2, 3], external_tokens=0)
    first = plan.step([("r", [1, 2, 3], True, 0, 5)], {"r": prompt}, {"r": NO_EXTRAS})
    assert len(first.saves) == 1 and first.unkeyable == 0
    # a streaming session's next input brings an item with no stable name
    second = plan.step([("r", None, False, 5, 4)], {"r": prompt}, {"r": None})
    assert (second.saves, second.unkeyable) == ([], 1)
    plan.finished("r")
    assert plan.step([], {}).finished == ["r"], "its pinned blocks are still released"


@pytest.mark.parametrize(
    ("local_tokens", "extras"),
    [
        (0, NO_EXTRAS),  # vLLM skips its own prefix cache too: nothing computed yet
        (0, Extras(salt="tenant-a")),  # saved under the request's own keys
        (4, NO_EXTRAS),  # a block vLLM already holds: saved from the next one on
    ],
)
def test_a_request_told_to_skip_reads_matches_nothing_loads_nothing_and_is_saved(
    local_tokens: int, extras: Extras
) -> None:
    """vLLM has a prompt-logprobs request skip reading cached KV (its answer needs every
    prompt token computed): the tiers give it 0 tokens whatever they hold, and its full blocks
    are saved as any other request's; the plan counts it once, however often it is asked."""
    plan = Scheduling(BS, b"s")
    prompt = list(range(13))
    keys = chain(prompt, BS, b"s", extras=extras)
    assert plan.read_skipped("r", local_tokens, extras) == 0
    assert plan.read_skipped("r", local_tokens, extras) == 0  # retried: not placed at first
    plan.allocated("r", [1, 2, 3, 4], external_tokens=0)
    step = plan.step([("r", [1, 2, 3, 4], True, local_tokens, 13 - local_tokens)], {"r": prompt})
    saved = tuple((block_id, keys[block_id - 1]) for block_id in (1, 2, 3)[local_tokens // BS :])
    assert step.loads == []
    assert [t.blocks for t in step.saves] == [saved]
    assert (step.read_skipped, step.unkeyable) == (1, 0)
    assert plan.step([("r", None, False, 13, 1)], {"r": [*prompt, 9]}).read_skipped == 0
    plan.finished("r")
    assert plan.read_skipped("r", 0) == 0  # an id used again is a new request: counted again
    assert plan.step([], {}).read_skipped == 1
