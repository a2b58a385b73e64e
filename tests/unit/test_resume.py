"""core.resume: where a request whose KV did not arrive may resume (issue #41)."""

from __future__ import annotations

import pytest

from vllm_nixl_hma.core.resume import holds_context, resume_tokens

# 16-token blocks; a 40-token window at a 300-token prompt: vLLM holds the
# blocks of the window only, null blocks (0) before it
WINDOW_ONLY = [0] * 16 + [21, 22, 23]


def test_full_attention_resumes_where_the_scheduler_says():
    # every block held, nothing skipped: the first invalid block's start is sound
    assert resume_tokens([5, 6, 7, 8], 0, 32, 16) == 32


def test_a_window_over_null_blocks_resumes_at_zero():
    # upstream's point: the window's first block (16 * 16 = 256); its window
    # starts at token 256 - 40 + 1 = 217, in block 13: a null block
    assert not holds_context(WINDOW_ONLY, 217, 256, 16)
    assert resume_tokens(WINDOW_ONLY, 217, 256, 16) == 0


def test_a_window_wholly_inside_held_blocks_keeps_its_point():
    # a decode-side prefix hit that holds the window: tokens [217, 256) in
    # blocks 13..15, all held
    blocks = [0] * 13 + [31, 32, 33, 21, 22]
    assert holds_context(blocks, 217, 256, 16)
    assert resume_tokens(blocks, 217, 256, 16) == 256


def test_a_window_shorter_than_a_block_needs_its_last_block_only():
    # window 8 at point 256: tokens [249, 256), block 15
    assert resume_tokens([0] * 15 + [9, 10], 249, 256, 16) == 256
    assert resume_tokens([0] * 16 + [10], 249, 256, 16) == 0


def test_a_point_past_the_blocks_held_is_not_sound():
    assert resume_tokens([3, 4], 0, 48, 16) == 0


def test_token_zero_needs_nothing():
    assert resume_tokens([], 0, 0, 16) == 0
    assert holds_context([0, 0], 0, 0, 16)


def test_a_block_size_must_be_positive():
    with pytest.raises(ValueError, match="block_tokens"):
        holds_context([1], 0, 16, 0)
