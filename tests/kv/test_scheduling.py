"""The connector's scheduler-side bookkeeping: keys by prefix, loads and saves of full blocks."""

from __future__ import annotations

from lucia_kv.scheduling import Scheduling, chain

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
