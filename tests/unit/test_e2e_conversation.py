"""The conversation of ``e2e --prefix-caching`` (#26): turn sizes, the
counters read from /metrics, and what makes a conversation pass."""

from __future__ import annotations

import pytest

from vllm_nixl_hma.e2e.conversation import (
    TURNS,
    Turn,
    conversation_ok,
    counter,
    message_ids,
    turn_message_lengths,
)


@pytest.mark.parametrize("decode_block", [16, 64, 256])
def test_every_turn_but_its_last_token_is_whole_decode_blocks(decode_block):
    answer = 8
    lengths = turn_message_lengths(decode_block, answer, 2040)
    total = 0
    for number, length in enumerate(lengths):
        total += length + (answer if number else 0)
        assert (total - 1) % decode_block == 0, (number, total)
    assert len(lengths) == TURNS


def test_fewer_turns_where_they_do_not_fit_and_none_below_two():
    assert len(turn_message_lengths(256, 8, 2040)) == 4
    assert len(turn_message_lengths(512, 8, 2040)) == 2
    with pytest.raises(ValueError, match="needs 2"):
        turn_message_lengths(1024, 8, 2040)
    with pytest.raises(ValueError, match="no message"):
        turn_message_lengths(8, 8, 2040)


def test_messages_differ_by_tag_and_are_stable():
    assert message_ids("1", 20, 500) == message_ids("1", 20, 500)
    assert message_ids("1", 20, 500) != message_ids("control", 20, 500)
    assert all(3 <= token < 500 for token in message_ids("2", 200, 500))


METRICS = """# HELP vllm:prefix_cache_hits_total Prefix cache hits, in tokens.
vllm:prefix_cache_hits_total{engine="0",model_name="model"} 512.0
vllm:prefix_cache_hits_total{engine="1",model_name="model"} 256.0
vllm:prefix_cache_hits_created{engine="0",model_name="model"} 1.7e9
vllm:external_prefix_cache_hits_total{engine="0",model_name="model"} 1023.0
"""


def test_counter_sums_label_sets_and_only_its_own_name():
    assert counter(METRICS, "vllm:prefix_cache_hits") == 768.0
    assert counter(METRICS, "vllm:external_prefix_cache_hits") == 1023.0
    assert counter(METRICS, "vllm:nixl_bytes_transferred") == 0.0


def turns_and_control(**last):
    turns = [
        Turn(1, 513, True, 200, decode_external_tokens=512, decode_kv_bytes_read=1000),
        Turn(
            2,
            769,
            True,
            200,
            prefill_prefix_hit_tokens=512,
            decode_prefix_hit_tokens=512,
            decode_external_tokens=256,
            decode_kv_bytes_read=600,
        ),
    ]
    for name, value in last.items():
        setattr(turns[-1], name, value)
    control = Turn(0, 769, True, 200, decode_external_tokens=768, decode_kv_bytes_read=1400)
    for turn in [*turns, control]:
        turn.record_reads(256)
    return turns, control


def test_a_conversation_that_hit_both_caches_and_read_less_passes():
    turns, control = turns_and_control()
    assert turns[-1].decode_blocks_read == 1 and control.decode_blocks_read == 3
    assert conversation_ok(turns, control)


@pytest.mark.parametrize(
    "broken",
    [
        {"match": False},
        {"http_status": 500},
        {"prefill_prefix_hit_tokens": 0},
        {"decode_prefix_hit_tokens": 0},
        {"decode_kv_bytes_read": 1400},  # as much as the control: nothing saved
        {"decode_kv_bytes_read": None},
        {"decode_kv_bytes_read": 0},
    ],
)
def test_each_missing_part_fails_it(broken):
    turns, control = turns_and_control(**broken)
    assert not conversation_ok(turns, control)


def test_no_turns_or_no_control_fails():
    turns, control = turns_and_control()
    assert not conversation_ok([], control)
    assert not conversation_ok(turns, None)
