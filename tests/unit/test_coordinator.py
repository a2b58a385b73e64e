"""Pure parts of the harness coordinator: block allocation and prompt lengths."""

from __future__ import annotations

import math
import random

import pytest

from vllm_nixl_hma.harness.coordinator import (
    Scenario,
    ScenarioResult,
    allocate,
    share_prefixes,
)

INFO = {
    "num_logical_blocks": 64,
    "logical_block_tokens": 80,
    "group_kinds": ["mamba", "full_attention", "sliding_window"],
    "sliding_window_by_group": [0, 0, 100],
}


def test_allocation_follows_the_scheduler_rules():
    blocks = allocate(INFO, [5, 400], random.Random(0))
    short, long = blocks
    assert [len(g) for g in short.logical_ids_by_group] == [1, 1, 1]
    # 400 tokens: 5 logical blocks; window 100 keeps cdiv(100, 80) + 1 = 3 trailing ones
    assert [len(g) for g in long.logical_ids_by_group] == [1, 5, 3]
    assert long.first_logical_index_by_group == [0, 0, 2]
    every_id = [i for b in blocks for g in b.logical_ids_by_group for i in g]
    assert len(every_id) == len(set(every_id)) and 0 not in every_id  # one pool, no null block


@pytest.mark.parametrize(("prefill", "decode"), [(80, 48), (48, 80), (144, 144), (16, 16)])
def test_mid_block_prompts_end_inside_a_block_on_both_sides(prefill, decode):
    for tokens in Scenario("mid-block").prompt_tokens(prefill, decode):
        assert tokens % prefill and tokens % decode


@pytest.mark.parametrize(("prefill", "decode"), [(80, 48), (48, 80), (144, 80)])
def test_boundary_prompts_end_on_a_block_boundary(prefill, decode):
    tokens = Scenario("boundary").prompt_tokens(prefill, decode)
    assert tokens[0] % decode == 0 and tokens[1] % prefill == 0
    assert any(t % math.lcm(prefill, decode) == 0 for t in tokens) or max(prefill, decode) in tokens


def test_a_result_that_checked_nothing_is_not_ok():
    assert not ScenarioResult("x", 1, 1, "dense").ok
    assert ScenarioResult("x", 1, 1, "dense", slots_checked=10).ok
    assert not ScenarioResult("x", 1, 1, "dense", slots_checked=10, mismatched_slots=1).ok
    assert not ScenarioResult("x", 1, 1, "dense", slots_checked=10, error="boom").ok


def test_free_ports_stay_below_the_ephemeral_range_and_do_not_repeat():
    """Ports the kernel hands out for port 0 (gloo pairs, UCX listeners) can take
    a side-channel port between choosing and binding it; prefill then waits
    forever for a listener that died on "Address already in use"."""
    from vllm_nixl_hma.harness.coordinator import _ephemeral_port_range, free_port

    low, _ = _ephemeral_port_range()
    ports = [free_port(random.Random(seed)) for seed in range(50)]
    assert all(1024 <= port < low for port in ports)
    assert len(set(ports)) == len(ports)


@pytest.mark.parametrize(("prefill", "decode"), [(80, 48), (48, 80), (144, 144)])
def test_prefill_hits_share_whole_logical_blocks_of_the_first_request(prefill, decode):
    hits = Scenario("prefill-hit").prefill_hits(prefill, decode)
    owner_tokens = hits[0][0]
    assert hits[0][1] == 0
    for prompt, shared in hits[1:]:
        assert 0 < shared < prompt and shared < owner_tokens and shared % prefill == 0
    assert Scenario("prefill-hit").prompt_tokens(prefill, decode) == [p for p, _ in hits]
    assert all(shared == 0 for _, shared in Scenario("mid-block").prefill_hits(prefill, decode))


def test_shared_prefixes_get_the_owners_full_attention_blocks_only():
    info = {**INFO, "logical_block_tokens": 16}
    blocks = share_prefixes(allocate(info, [80, 70, 40], random.Random(0)), info, [0, 32, 16])
    owner, two, one = (b.logical_ids_by_group for b in blocks)
    assert two[1][:2] == owner[1][:2] and two[1][2] not in owner[1]
    assert one[1][:1] == owner[1][:1] and one[1][1] not in owner[1]
    # Mamba state and sliding-window lists stay each request's own
    for group in (0, 2):
        assert not set(two[group]) & set(owner[group]) and not set(one[group]) & set(owner[group])
    with pytest.raises(ValueError, match="cannot share"):
        share_prefixes(allocate(info, [80, 70], random.Random(0)), info, [0, 20])
