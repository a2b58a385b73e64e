"""vllm_nixl_hma.core.positions: kernel blocks paired by token position
after a decode-side prefix-cache hit (#26), against a reference that places
every block of both sides on the prompt's token axis."""

from __future__ import annotations

import itertools
import math
import random

import numpy as np
import pytest

from vllm_nixl_hma.core.blocks import GroupKind, align_kernel_ids_by_group, logical_to_kernel_ids
from vllm_nixl_hma.core.errors import BlockAlignmentError
from vllm_nixl_hma.core.positions import (
    NULL_BLOCK_ID,
    TokenSpan,
    pair_by_token_position,
    span_for_prompt,
)

FULL = GroupKind.FULL_ATTENTION
SWA = GroupKind.SLIDING_WINDOW
MAMBA = GroupKind.MAMBA
KERNEL_TOKENS = 2


def side(num_logical: int, first_token: int, logical_tokens: int, ratio: int, rng):
    """One side's full-attention blocks: logical ids drawn at random, their
    kernel ids, and {kernel id: first token it holds} (the reference)."""
    logical = rng.sample(range(1, 400), num_logical)
    kernel = logical_to_kernel_ids(logical, ratio).tolist()
    first_token_of = {
        kid: first_token + position * (logical_tokens // ratio)
        for position, kid in enumerate(kernel)
    }
    return kernel, first_token_of


def decode_hit_sides(local_ratio, remote_ratio, prefill_tokens, hit, rng):
    """Decode's blocks after a hit of ``hit`` tokens, prefill's from token 0."""
    local_logical = KERNEL_TOKENS * local_ratio
    remote_logical = KERNEL_TOKENS * remote_ratio
    local = side(
        math.ceil(prefill_tokens / local_logical) - hit // local_logical,
        hit,
        local_logical,
        local_ratio,
        rng,
    )
    remote = side(math.ceil(prefill_tokens / remote_logical), 0, remote_logical, remote_ratio, rng)
    return local, remote


def cells():
    for local_ratio, remote_ratio in itertools.product((1, 2, 3, 5), repeat=2):
        local_logical = KERNEL_TOKENS * local_ratio
        for prefill_tokens in range(1, 3 * KERNEL_TOKENS * 5 + 2):
            for hit in range(0, prefill_tokens, local_logical):
                yield local_ratio, remote_ratio, prefill_tokens, hit


def test_every_read_block_pairs_with_the_block_of_the_same_tokens_exhaustive():
    rng = random.Random(26)
    checked = 0
    for local_ratio, remote_ratio, prefill_tokens, hit in cells():
        (local, local_at), (remote, remote_at) = decode_hit_sides(
            local_ratio, remote_ratio, prefill_tokens, hit, rng
        )
        span = TokenSpan(hit, prefill_tokens)
        (local_out,), (remote_out,) = pair_by_token_position(
            [local], [remote], [FULL], span, KERNEL_TOKENS, local_ratio, remote_ratio
        )
        pairs = dict(zip(local_out.tolist(), remote_out.tolist(), strict=True))
        # every local block holding a token in [hit, prefill_tokens) is read,
        # from the remote block holding the same tokens; no other is written
        wanted = {kid for kid, token in local_at.items() if token < prefill_tokens}
        assert set(pairs) == wanted, (local_ratio, remote_ratio, prefill_tokens, hit)
        for local_id, remote_id in pairs.items():
            assert local_at[local_id] == remote_at[remote_id]
        checked += 1
    assert checked > 500


def test_count_rules_misread_the_same_decode_hits():
    """The rules that look at list lengths only (``blocks``; vLLM 0.21.0 and
    0.33.0 pair from the tail) pair a decode hit at unequal ratios with the
    wrong tokens, or refuse it: the cells this module exists for."""
    rng = random.Random(7)
    misread = refused = 0
    for local_ratio, remote_ratio, prefill_tokens, hit in cells():
        if local_ratio == remote_ratio or hit == 0:
            continue
        (local, local_at), (remote, remote_at) = decode_hit_sides(
            local_ratio, remote_ratio, prefill_tokens, hit, rng
        )
        try:
            (local_out,), (remote_out,) = align_kernel_ids_by_group(
                [local], [remote], [FULL], local_ratio, remote_ratio
            )
        except BlockAlignmentError:
            refused += 1
            continue
        if any(
            local_at[a] != remote_at[b]
            for a, b in zip(local_out.tolist(), remote_out.tolist(), strict=True)
        ):
            misread += 1
    assert misread > 0 and refused > 0
    assert misread + refused > 100


def test_equal_ratios_pair_like_the_tail_rule():
    local = list(range(10, 16))  # tokens 8..19 at kernel 2, ratio 2
    remote = list(range(100, 110))  # tokens 0..19
    (local_out,), (remote_out,) = pair_by_token_position(
        [local], [remote], [FULL], TokenSpan(8, 20), KERNEL_TOKENS, 2, 2
    )
    assert local_out.tolist() == local
    assert remote_out.tolist() == remote[4:]


def test_padding_past_the_prompt_is_not_read():
    # 5 tokens: 3 kernel blocks; decode's logical block of 8 tokens pads one
    (local_out,), (remote_out,) = pair_by_token_position(
        [[1, 2, 3, 4]], [[7, 8, 9]], [FULL], TokenSpan(0, 5), KERNEL_TOKENS, 4, 3
    )
    assert local_out.tolist() == [1, 2, 3]
    assert remote_out.tolist() == [7, 8, 9]


@pytest.mark.parametrize(
    ("remote", "expected_state"),
    [
        ([42], 42),  # prefix caching off on prefill: one state block
        ([NULL_BLOCK_ID, NULL_BLOCK_ID, 42], 42),  # 'align': nulls, then the running state
        ([40, 41, 42], 42),  # 'all': a state per block boundary, the last running
    ],
)
def test_mamba_reads_prefill_running_state_into_decode_state_block(remote, expected_state):
    span = TokenSpan(4, 11)  # prefill: 11 tokens, logical blocks of 4 -> 3 blocks
    local_out, remote_out = pair_by_token_position(
        [[5, 6, 7, 8], [9]], [[1, 2, 3, 4, 5, 6], remote], [FULL, MAMBA], span, KERNEL_TOKENS, 2, 2
    )
    assert local_out[1].tolist() == [9]
    assert remote_out[1].tolist() == [expected_state]


@pytest.mark.parametrize(
    ("local", "remote", "field"),
    [
        ([9, 10], [42], "decode Mamba state block count"),
        ([9], [41, 42], "prefill Mamba state block count"),
        ([9], [42, NULL_BLOCK_ID, NULL_BLOCK_ID], "prefill Mamba state block of group 1"),
    ],
)
def test_mamba_lists_no_prompt_explains_are_refused(local, remote, field):
    with pytest.raises(BlockAlignmentError, match=field):
        pair_by_token_position(
            [[5, 6, 7, 8], local],
            [[1, 2, 3, 4, 5, 6], remote],
            [FULL, MAMBA],
            TokenSpan(4, 11),
            KERNEL_TOKENS,
            2,
            2,
        )


@pytest.mark.parametrize(
    ("local", "remote", "span", "field"),
    [
        # prefill sent one logical block too many for 11 tokens
        ([5, 6, 7, 8], list(range(8)), TokenSpan(4, 11), "prefill kernel block count"),
        # decode allocated one logical block fewer than its tokens need
        ([5, 6], list(range(6)), TokenSpan(4, 11), "decode kernel block count"),
        # a hit that is not whole decode logical blocks
        ([5, 6, 7, 8], list(range(6)), TokenSpan(2, 11), "local_hit_tokens"),
        # a hit as long as what prefill holds: nothing to read
        ([5, 6], list(range(6)), TokenSpan(12, 11), "local_hit_tokens"),
        ([5, 6], list(range(6)), TokenSpan(-4, 11), "local_hit_tokens"),
    ],
)
def test_attention_lists_no_prompt_explains_are_refused(local, remote, span, field):
    with pytest.raises(BlockAlignmentError, match=field):
        pair_by_token_position([local], [remote], [FULL], span, KERNEL_TOKENS, 2, 2)


def test_sliding_window_pairs_the_tail_at_equal_ratios_and_is_refused_otherwise():
    local_out, remote_out = pair_by_token_position(
        [[3, 4]], [[7, 8, 9]], [SWA], TokenSpan(0, 6), KERNEL_TOKENS, 1, 1
    )
    assert (local_out[0].tolist(), remote_out[0].tolist()) == ([3, 4], [8, 9])
    with pytest.raises(BlockAlignmentError, match="sliding-window group 0"):
        pair_by_token_position([[3, 4]], [[7, 8, 9]], [SWA], TokenSpan(0, 6), KERNEL_TOKENS, 2, 1)


def test_a_group_this_remote_rank_is_no_source_of_stays_empty():
    local_out, remote_out = pair_by_token_position(
        [[5, 6, 7, 8], []], [[1, 2, 3, 4, 5, 6], []], [FULL, MAMBA], TokenSpan(4, 11), 2, 2, 2
    )
    assert local_out[1].tolist() == remote_out[1].tolist() == []
    assert local_out[0].tolist() == [5, 6, 7, 8]
    assert remote_out[0].tolist() == [3, 4, 5, 6]


def test_group_count_and_empty_requests():
    assert pair_by_token_position([], [[1]], [FULL], TokenSpan(0, 2), KERNEL_TOKENS, 1, 1) == (
        [],
        [],
    )
    with pytest.raises(BlockAlignmentError, match="number of KV cache groups"):
        pair_by_token_position([[1]], [[1], [2]], [FULL], TokenSpan(0, 2), KERNEL_TOKENS, 1, 1)


def test_span_for_prompt_is_prefill_tokens_less_what_is_read():
    assert span_for_prompt(prefill_tokens=40, external_tokens=24) == TokenSpan(16, 40)
    assert np.array_equal(np.asarray([TokenSpan(0, 3).prefill_tokens]), [3])


# --- prefill's lists against the span's token count (#41) -------------------


def check_lists(lists, kinds, windows, prefill_tokens, kernel_tokens, ratio):
    from vllm_nixl_hma.core.positions import check_prefill_lists

    check_prefill_lists(lists, kinds, windows, TokenSpan(0, prefill_tokens), kernel_tokens, ratio)


@pytest.mark.parametrize(
    ("kinds", "windows", "tokens", "kernel_tokens", "ratio", "lengths"),
    [
        # 614 tokens in blocks of 128: 5 blocks, the last holding tokens 512..613
        pytest.param([FULL], [0], 614, 128, 1, [5], id="full-614-of-128"),
        pytest.param([FULL], [0], 512, 128, 1, [4], id="full-on-a-boundary"),
        # logical blocks of 128 as 2 kernel blocks of 64: 5 logical, 10 kernel ids
        pytest.param([FULL], [0], 614, 64, 2, [10], id="full-ratio-2"),
        # window 8: whole (5) or clipped to cdiv(8, 128) + 1 = 2 blocks
        pytest.param([SWA], [8], 614, 128, 1, [2, 5], id="window-8-of-128"),
        # window 300: whole (5) or cdiv(300, 128) + 1 = 4
        pytest.param([SWA], [300], 614, 128, 1, [4, 5], id="window-300-of-128"),
        # window 1024 covers the prompt: clipped to 9 is the whole list of 5
        pytest.param([SWA], [1024], 614, 128, 1, [5], id="window-longer-than-the-prompt"),
        # window 40, kernel 16, ratio 2: 32-token logical blocks, 10 of them for
        # 300 tokens (20 kernel ids), clipped cdiv(40, 32) + 1 = 3 (6 kernel ids)
        pytest.param([SWA], [40], 300, 16, 2, [6, 20], id="window-40-ratio-2"),
    ],
)
def test_prefill_lists_of_the_prompts_length_pass_and_no_other(
    kinds, windows, tokens, kernel_tokens, ratio, lengths
):
    for length in range(0, 25):
        lists = [list(range(100, 100 + length))]
        if length in lengths or length == 0:  # 0: a rank that is no source of the group
            check_lists(lists, kinds, windows, tokens, kernel_tokens, ratio)
        else:
            with pytest.raises(BlockAlignmentError) as refused:
                check_lists(lists, kinds, windows, tokens, kernel_tokens, ratio)
            assert refused.value.field == "prefill kernel block count of group 0"
            assert refused.value.local == " or ".join(str(n) for n in lengths)
            assert refused.value.remote == length


def test_prefill_lists_skip_mamba_and_check_every_attention_group():
    # a Mamba state list is checked where it pairs; the second group's cut
    # list is named by its index
    kinds, windows = [MAMBA, FULL, SWA], [0, 0, 8]
    check_lists([[7], [1, 2, 3], [2, 3]], kinds, windows, 40, 16, 1)
    check_lists([[7, 8, 9], [1, 2, 3], [1, 2, 3]], kinds, windows, 40, 16, 1)
    with pytest.raises(BlockAlignmentError, match="group 1: local='3', remote=1"):
        check_lists([[7], [1], [2, 3]], kinds, windows, 40, 16, 1)
    with pytest.raises(BlockAlignmentError, match="number of KV cache groups"):
        check_lists([[7], [1, 2, 3]], kinds, windows, 40, 16, 1)


def test_a_worker_holds_the_spans_of_requests_it_receives_until_upstream_forgets_them():
    from vllm_nixl_hma.core.positions import hold_spans

    held = {"waiting-for-handshake": TokenSpan(0, 40), "handshake-failed": TokenSpan(0, 50)}
    handed = {"new": TokenSpan(16, 60), "ticket-refused": TokenSpan(0, 70)}
    hold_spans(
        held,
        handed,
        receiving={"new"},
        in_flight={"waiting-for-handshake", "new"},
    )
    assert held == {"waiting-for-handshake": TokenSpan(0, 40), "new": TokenSpan(16, 60)}
    hold_spans(held, None, receiving=set(), in_flight=set())
    assert held == {}
