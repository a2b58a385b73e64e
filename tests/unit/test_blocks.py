"""Examples for vllm_nixl_hma.core.blocks: docs/design.md section 3, row by row."""

from __future__ import annotations

import numpy as np
import pytest

from vllm_nixl_hma.core.blocks import (
    GroupKind,
    align_kernel_ids_by_group,
    check_alignable,
    logical_to_kernel_ids,
    logical_to_kernel_ids_by_group,
)
from vllm_nixl_hma.core.errors import BlockAlignmentError, IncompatibleRemoteError

FULL = GroupKind.FULL_ATTENTION
SWA = GroupKind.SLIDING_WINDOW
MAMBA = GroupKind.MAMBA


def stock_0_21_0_remote_expansion(remote_logical_ids, remote_ratio, local_ratio):
    """What vLLM 0.21.0 computes: remote ratio as multiplier, LOCAL ratio as run length."""
    return [lid * remote_ratio + j for lid in remote_logical_ids for j in range(local_ratio)]


@pytest.mark.parametrize(
    ("local_ratio", "remote_ratio", "remote_logical_ids", "correct_remote_kernel_ids"),
    [
        # docs/design.md section 3, row 1: local r=10, remote r=6, remote logical [0, 1]
        (10, 6, [0, 1], list(range(12))),
        # docs/design.md section 3, row 2: local r=6, remote r=10, remote logical [0]
        (6, 10, [0], list(range(10))),
    ],
)
def test_remote_expansion_uses_remote_ratio_for_multiplier_and_run_length(
    local_ratio, remote_ratio, remote_logical_ids, correct_remote_kernel_ids
):
    ours = logical_to_kernel_ids(remote_logical_ids, remote_ratio).tolist()
    assert ours == correct_remote_kernel_ids
    # The 0.21.0 result of the same row differs (overlapping or short).
    assert stock_0_21_0_remote_expansion(remote_logical_ids, remote_ratio, local_ratio) != ours


def test_design_row1_stock_result_is_the_overlapping_list():
    """docs/design.md section 3, row 1: 0.21.0 gives [0..9] + [6..15] for remote
    [0, 1], local r=10, remote r=6."""
    assert stock_0_21_0_remote_expansion([0, 1], 6, 10) == list(range(10)) + list(range(6, 16))


def test_expansion_of_scattered_ids_keeps_order_and_runs():
    assert logical_to_kernel_ids([7, 2], 3).tolist() == [21, 22, 23, 6, 7, 8]
    assert logical_to_kernel_ids([], 4).tolist() == []
    assert logical_to_kernel_ids([5, 9], 1).tolist() == [5, 9]


def test_expansion_rejects_nonpositive_ratio():
    with pytest.raises(ValueError, match="physical_per_logical"):
        logical_to_kernel_ids([1], 0)


def test_mamba_groups_are_not_expanded():
    by_group = logical_to_kernel_ids_by_group([[1, 2], [5], [3]], [FULL, MAMBA, SWA], 4)
    assert [g.tolist() for g in by_group] == [[4, 5, 6, 7, 8, 9, 10, 11], [5], [12, 13, 14, 15]]


def test_expansion_rejects_wrong_group_count():
    with pytest.raises(BlockAlignmentError, match="number of KV cache groups"):
        logical_to_kernel_ids_by_group([[1]], [FULL, MAMBA], 2)


def test_align_keeps_leading_kernel_blocks_when_local_has_more():
    """docs/design.md section 3, 'The seed's snippet': local 12, remote 10 kernel blocks.

    Keeping the tail would pair local kernel block 2 with remote kernel block 0.
    """
    local = [np.arange(100, 112), np.array([7])]
    remote = [np.arange(200, 210), np.array([9])]
    local_out, remote_out = align_kernel_ids_by_group(local, remote, [FULL, MAMBA], 6, 10)
    assert local_out[0].tolist() == list(range(100, 110))
    assert remote_out[0].tolist() == list(range(200, 210))
    assert (local_out[1].tolist(), remote_out[1].tolist()) == ([7], [9])


def test_align_keeps_leading_kernel_blocks_when_remote_has_more():
    """docs/design.md section 3, row 1 after the fix: local r=10 (10 blocks),
    remote r=6 (12 blocks)."""
    local = [np.arange(10)]
    remote = [np.arange(12)]
    local_out, remote_out = align_kernel_ids_by_group(local, remote, [FULL], 10, 6)
    assert local_out[0].tolist() == list(range(10))
    assert remote_out[0].tolist() == list(range(10))


def test_align_rejects_count_difference_not_smaller_than_larger_ratio():
    with pytest.raises(BlockAlignmentError, match="kernel block count of group 0") as info:
        align_kernel_ids_by_group([np.arange(20)], [np.arange(10)], [FULL], 10, 6)
    assert (info.value.local, info.value.remote) == (20, 10)


def test_align_rejects_unequal_mamba_counts():
    with pytest.raises(BlockAlignmentError, match="Mamba state block count of group 1"):
        align_kernel_ids_by_group(
            [np.arange(6), np.array([1, 2])], [np.arange(6), np.array([3])], [FULL, MAMBA], 6, 6
        )


def test_align_equal_ratios_pairs_local_suffix_with_remote_tail():
    """0.21.0's rule, kept: a local prefix-cache hit of one logical block (r=2)."""
    local_out, remote_out = align_kernel_ids_by_group(
        [np.array([14, 15])], [np.array([0, 1, 2, 3])], [FULL], 2, 2
    )
    assert (local_out[0].tolist(), remote_out[0].tolist()) == ([14, 15], [2, 3])


def test_align_equal_ratios_rejects_local_longer_than_remote():
    with pytest.raises(BlockAlignmentError, match="never more"):
        align_kernel_ids_by_group([np.arange(4)], [np.arange(2)], [FULL], 2, 2)


def test_align_passes_full_prefix_hit_through():
    assert align_kernel_ids_by_group((), [np.arange(4)], [FULL], 2, 2) == ([], [])


def test_align_rejects_group_count_mismatch():
    with pytest.raises(BlockAlignmentError, match="number of KV cache groups"):
        align_kernel_ids_by_group([np.arange(2)], [np.arange(2)], [FULL, MAMBA], 2, 2)


def test_check_alignable_refuses_unequal_ratios_with_prefix_caching_naming_both_ratios():
    with pytest.raises(IncompatibleRemoteError) as info:
        check_alignable([FULL, MAMBA], 10, 6, local_prefix_caching=True)
    message = str(info.value)
    assert "local=10" in message and "remote=6" in message
    assert "--no-enable-prefix-caching" in message
    assert isinstance(info.value, RuntimeError)


def test_check_alignable_refuses_unequal_ratios_with_sliding_window():
    with pytest.raises(IncompatibleRemoteError, match="sliding-window"):
        check_alignable([FULL, SWA, MAMBA], 6, 10, local_prefix_caching=False)


@pytest.mark.parametrize("kinds", [[FULL], [FULL, SWA], [FULL, MAMBA], [FULL, SWA, MAMBA]])
def test_check_alignable_accepts_equal_ratios_with_anything(kinds):
    check_alignable(kinds, 6, 6, local_prefix_caching=True)


def test_check_alignable_accepts_unequal_ratios_without_prefix_caching():
    check_alignable([FULL, MAMBA], 66, 34, local_prefix_caching=False)


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, None])
def test_check_alignable_rejects_malformed_remote_ratio(bad):
    with pytest.raises(IncompatibleRemoteError, match="remote_physical_per_logical"):
        check_alignable([FULL, MAMBA], 6, bad, local_prefix_caching=False)
