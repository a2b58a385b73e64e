"""Properties of vllm_nixl_hma.core.blocks against the token-position reference.

Each property has an exhaustive test over small ranges and a hypothesis test
over large ones (ratios up to 66, mixed group kinds), as ndindex does for its
index arithmetic. The oracle is tests/reference.py, which knows nothing of
the code under test.
"""

from __future__ import annotations

import itertools
import math
import random

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from tests.reference import FULL, MAMBA, SWA, build_side, pairing_errors
from vllm_nixl_hma.core.blocks import (
    GroupKind,
    align_kernel_ids_by_group,
    check_alignable,
    logical_to_kernel_ids_by_group,
)
from vllm_nixl_hma.core.errors import BlockAlignmentError, IncompatibleRemoteError

GROUP_MIXES = [
    [FULL],
    [FULL, SWA],
    [FULL, MAMBA],
    [MAMBA, FULL, FULL],
    [FULL, SWA, MAMBA],
]


def pairing_errors_for(
    num_tokens: int,
    group_kinds: list[str],
    local_ratio: int,
    remote_ratio: int,
    kernel_block_tokens: int,
    seed: int,
    prefix_hit_logical_blocks: int = 0,
    window_tokens: int = 0,
) -> list[str]:
    """Allocate a request on both sides, run the code under test, judge by positions."""
    rng = random.Random(seed)
    local = build_side(
        num_tokens,
        group_kinds,
        local_ratio,
        kernel_block_tokens,
        rng,
        prefix_hit_logical_blocks=prefix_hit_logical_blocks,
        window_tokens=window_tokens,
    )
    remote = build_side(
        num_tokens, group_kinds, remote_ratio, kernel_block_tokens, rng, window_tokens=window_tokens
    )
    kinds = [GroupKind(kind) for kind in group_kinds]
    local_kernel = logical_to_kernel_ids_by_group(local.logical_ids_by_group, kinds, local_ratio)
    remote_kernel = logical_to_kernel_ids_by_group(remote.logical_ids_by_group, kinds, remote_ratio)
    local_paired, remote_paired = align_kernel_ids_by_group(
        local_kernel, remote_kernel, kinds, local_ratio, remote_ratio
    )
    return pairing_errors(local, remote, num_tokens, local_paired, remote_paired)


def accepted(group_kinds, local_ratio, remote_ratio, prefix_caching) -> bool:
    try:
        check_alignable(
            [GroupKind(k) for k in group_kinds], local_ratio, remote_ratio, prefix_caching
        )
    except IncompatibleRemoteError:
        return False
    return True


# --- pairing covers the same token positions -------------------------------


def test_pairing_matches_token_positions_exhaustive():
    """Ratios 1-8 on each side, prompts of up to 3 logical blocks of the larger side."""
    kernel_block_tokens = 2
    failures = []
    cases = 0
    paired = set()  # (kinds, local ratio, remote ratio) that went through pairing
    for local_ratio, remote_ratio in itertools.product(range(1, 9), repeat=2):
        largest_logical = max(local_ratio, remote_ratio) * kernel_block_tokens
        for kinds in GROUP_MIXES:
            if not accepted(kinds, local_ratio, remote_ratio, prefix_caching=False):
                continue
            paired.add((tuple(kinds), local_ratio, remote_ratio))
            for num_tokens in range(1, 3 * largest_logical + 1):
                cases += 1
                errors = pairing_errors_for(
                    num_tokens,
                    kinds,
                    local_ratio,
                    remote_ratio,
                    kernel_block_tokens,
                    cases,
                    window_tokens=3,
                )
                if errors:
                    failures.append((local_ratio, remote_ratio, kinds, num_tokens, errors[:2]))
    # Not vacuous: without a sliding window every ratio pair must have been
    # paired (the rule refuses unequal ratios only with a window or prefix caching)
    for kinds in GROUP_MIXES:
        expected = {
            (tuple(kinds), local, remote)
            for local, remote in itertools.product(range(1, 9), repeat=2)
            if SWA not in kinds or local == remote
        }
        assert {case for case in paired if case[0] == tuple(kinds)} == expected, kinds
    assert failures == []


def test_prefix_hits_with_equal_ratios_pair_with_remote_tail_exhaustive():
    """Prefix caching may stay on with equal ratios: every local hit size."""
    kernel_block_tokens = 2
    failures = []
    cases = 0
    for ratio in range(1, 9):
        logical_tokens = ratio * kernel_block_tokens
        for kinds in GROUP_MIXES:
            for num_tokens in range(1, 4 * logical_tokens + 1):
                for hit in range(math.ceil(num_tokens / logical_tokens)):
                    cases += 1
                    errors = pairing_errors_for(
                        num_tokens,
                        kinds,
                        ratio,
                        ratio,
                        kernel_block_tokens,
                        cases,
                        prefix_hit_logical_blocks=hit,
                        window_tokens=5,
                    )
                    if errors:
                        failures.append((ratio, kinds, num_tokens, hit, errors[:2]))
    assert failures == []


ratios = st.integers(min_value=1, max_value=66)


@st.composite
def unequal_ratio_cases(draw):
    """A hybrid (or dense) request under ratios that may differ: prefix
    caching off, no sliding window (check_alignable refuses both)."""
    local_ratio = draw(ratios)
    remote_ratio = draw(ratios)
    kinds = draw(st.sampled_from([[FULL], [FULL, MAMBA], [MAMBA, FULL, FULL]]))
    kernel_block_tokens = draw(st.sampled_from([1, 16, 64]))
    largest_logical = max(local_ratio, remote_ratio) * kernel_block_tokens
    num_tokens = draw(st.integers(min_value=1, max_value=40 * largest_logical))
    return num_tokens, kinds, local_ratio, remote_ratio, kernel_block_tokens


@given(case=unequal_ratio_cases(), seed=st.integers(0, 2**32))
# docs/design.md section 3: Qwen3.5-0.8B r=10 (TP2) vs r=6 (TP4);
# Nemotron-3-Nano r=66 (TP1) vs 34 (TP4)
@example(case=(100, [FULL, MAMBA], 10, 6, 64), seed=0)
@example(case=(100, [FULL, MAMBA], 6, 10, 64), seed=0)
@example(case=(640, [FULL, MAMBA], 10, 6, 64), seed=1)
@example(case=(384 * 2 + 1, [FULL, MAMBA], 6, 10, 64), seed=2)
@example(case=(66 * 64 * 3, [MAMBA, FULL, FULL], 66, 34, 64), seed=3)
@example(case=(34 * 64 + 1, [FULL, MAMBA], 34, 66, 64), seed=4)
def test_pairing_matches_token_positions_hypothesis(case, seed):
    num_tokens, kinds, local_ratio, remote_ratio, kernel_block_tokens = case
    assert accepted(kinds, local_ratio, remote_ratio, prefix_caching=False)
    assert (
        pairing_errors_for(num_tokens, kinds, local_ratio, remote_ratio, kernel_block_tokens, seed)
        == []
    )


@st.composite
def equal_ratio_cases(draw):
    """Equal ratios: prefix-cache hits and sliding windows are allowed."""
    ratio = draw(ratios)
    kinds = draw(st.sampled_from(GROUP_MIXES))
    kernel_block_tokens = draw(st.sampled_from([1, 16, 64]))
    logical_tokens = ratio * kernel_block_tokens
    num_tokens = draw(st.integers(min_value=1, max_value=40 * logical_tokens))
    hit = draw(st.integers(0, math.ceil(num_tokens / logical_tokens) - 1))
    window_tokens = draw(st.integers(1, 4 * logical_tokens))
    return num_tokens, kinds, ratio, kernel_block_tokens, hit, window_tokens


@given(case=equal_ratio_cases(), seed=st.integers(0, 2**32))
def test_prefix_hits_with_equal_ratios_hypothesis(case, seed):
    num_tokens, kinds, ratio, kernel_block_tokens, hit, window_tokens = case
    assert (
        pairing_errors_for(
            num_tokens,
            kinds,
            ratio,
            ratio,
            kernel_block_tokens,
            seed,
            prefix_hit_logical_blocks=hit,
            window_tokens=window_tokens,
        )
        == []
    )


# --- the reference can fail: it catches 0.21.0's expansion ------------------


def test_reference_flags_stock_0_21_0_expansion():
    """The oracle is not vacuous: 0.21.0's expansion with tail pairing fails
    docs/design.md section 3, row 1 (local r=10, remote r=6), and the seed snippet's tail rule
    fails the rounding case."""
    rng = random.Random(0)
    kinds = [FULL, MAMBA]
    # row 1: 500 tokens, kernel 64: local 1 logical (10 kernel), remote 2 logical (12 kernel)
    local = build_side(500, kinds, 10, 64, rng)
    remote = build_side(500, kinds, 6, 64, rng)
    assert len(remote.logical_ids_by_group[0]) == 2
    stock_remote = [lid * 6 + j for lid in remote.logical_ids_by_group[0] for j in range(10)]
    local_kernel = [lid * 10 + j for lid in local.logical_ids_by_group[0] for j in range(10)]
    stock_pairs = (
        [local_kernel, local.logical_ids_by_group[1]],
        [stock_remote[-len(local_kernel) :], remote.logical_ids_by_group[1]],
    )
    assert pairing_errors(local, remote, 500, *stock_pairs) != []

    # seed snippet: right expansion, but keeps the TAIL min_count blocks.
    # 700 tokens: local r=6 -> 2 logical, 12 kernel; remote r=10 -> 2 logical, 20 kernel
    local = build_side(700, kinds, 6, 64, rng)
    remote = build_side(700, kinds, 10, 64, rng)
    local_kernel = [lid * 6 + j for lid in local.logical_ids_by_group[0] for j in range(6)]
    remote_kernel = [lid * 10 + j for lid in remote.logical_ids_by_group[0] for j in range(10)]
    count = min(len(local_kernel), len(remote_kernel))
    tail_pairs = (
        [local_kernel[-count:], local.logical_ids_by_group[1]],
        [remote_kernel[-count:], remote.logical_ids_by_group[1]],
    )
    assert pairing_errors(local, remote, 700, *tail_pairs) != []


# --- what check_alignable refuses -------------------------------------------


@pytest.mark.parametrize("kinds", GROUP_MIXES)
def test_check_alignable_refuses_exactly_unequal_ratios_with_prefix_caching_or_window(kinds):
    for local_ratio, remote_ratio in itertools.product(range(1, 9), repeat=2):
        for prefix_caching in (False, True):
            expected_refusal = local_ratio != remote_ratio and (prefix_caching or SWA in kinds)
            assert accepted(kinds, local_ratio, remote_ratio, prefix_caching) is (
                not expected_refusal
            ), (kinds, local_ratio, remote_ratio, prefix_caching)


def test_unequal_ratios_with_prefix_hit_cannot_be_paired_by_counts():
    """Why check_alignable refuses prefix caching with unequal ratios: a local
    prefix hit removes leading blocks, and the leading-block rule then either
    refuses the counts or pairs the wrong positions; it never succeeds here."""
    outcomes = []
    for num_tokens in range(385, 1281, 7):
        try:
            errors = pairing_errors_for(
                num_tokens,
                [FULL, MAMBA],
                local_ratio=6,
                remote_ratio=10,
                kernel_block_tokens=64,
                seed=num_tokens,
                prefix_hit_logical_blocks=1,
            )
        except BlockAlignmentError:
            outcomes.append("refused")
        else:
            outcomes.append("wrong" if errors else "right")
    assert "right" not in outcomes
