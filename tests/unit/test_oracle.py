"""The oracle (vllm_nixl_hma.harness.oracle) on plain numpy arrays.

It must catch one wrong slot, a slot written where no request lives, a swap
between requests or heads, and never report "0 mismatches" for nothing.
"""

from __future__ import annotations

import numpy as np
import pytest

from vllm_nixl_hma.harness import oracle

KERNEL = 4
RATIO = 2


def caches():
    """A prefill and a decode rank sharing one tensor between an attention and a Mamba layer."""

    def one():
        pages = np.zeros((8, 2 * 2 * KERNEL * RATIO * 3), dtype=np.int16)  # 8 logical pages
        kv = pages.reshape(8 * RATIO, 2, 2, KERNEL, 3)  # [kernel blocks, K/V, heads, tokens, ch]
        conv = pages[:, :12].reshape(8, 4, 3)
        ssm = pages[:, 12:20].reshape(8, 2, 4)
        attention = [oracle.AttentionSlots(1, 0, kv, np.array([0, 1]))]
        mamba = [oracle.MambaSlots(0, 1, conv, ssm, np.arange(4), np.arange(2))]
        return pages, attention, mamba

    return one(), one()


def test_codes_are_deterministic_distinct_and_never_poison():
    a = oracle.slot_codes(2, 1, 2, np.arange(50_000))
    assert np.array_equal(a, oracle.slot_codes(2, 1, 2, np.arange(50_000)))
    assert not np.any(a == oracle.poison_value(2))
    assert len(np.unique(a)) > 30_000  # 16-bit codes: few collisions
    assert not np.array_equal(oracle.slot_codes(2, 1, 3, 7), oracle.slot_codes(2, 1, 2, 7))


def transfer_everything(p_pages, d_pages, p_ids, d_ids):
    for p_id, d_id in zip(p_ids, d_ids, strict=True):
        d_pages[d_id] = p_pages[p_id]


def test_a_faithful_copy_verifies_clean_and_counts_slots():
    (p_pages, p_attn, p_mamba), (d_pages, d_attn, d_mamba) = caches()
    request_p = oracle.RequestBlocks(0, 13, [[3, 5], [6]])
    request_d = oracle.RequestBlocks(0, 13, [[1, 4], [2]])
    oracle.poison(d_pages)
    oracle.fill(p_attn, p_mamba, [request_p], RATIO, KERNEL, [[0, 0]])
    transfer_everything(p_pages, d_pages, [3, 5, 6], [1, 4, 2])
    result = oracle.verify(d_attn, d_mamba, [request_d], RATIO, KERNEL, [[0, 0]], d_pages[None])
    assert result.mismatched_slots == 0
    # 13 tokens x 2 (K/V) x 2 heads x 3 channels + conv 12 + ssm 8 + 5 untouched pages
    assert result.slots_checked == 13 * 2 * 2 * 3 + 12 + 8 + 5 * d_pages.shape[1]
    assert result.pages_checked_poisoned == 5


def test_one_flipped_slot_is_one_mismatch():
    (p_pages, p_attn, p_mamba), (d_pages, d_attn, d_mamba) = caches()
    oracle.poison(d_pages)
    oracle.fill(
        p_attn, p_mamba, [oracle.RequestBlocks(0, 13, [[3, 5], [6]])], RATIO, KERNEL, [[0, 0]]
    )
    transfer_everything(p_pages, d_pages, [3, 5, 6], [1, 4, 2])
    d_attn[0].kv[4 * RATIO + 1, 1, 0, 0, 2] ^= 1  # V, head 0, token 12, channel 2
    result = oracle.verify(
        d_attn, d_mamba, [oracle.RequestBlocks(0, 13, [[1, 4], [2]])], RATIO, KERNEL, [[0, 0]]
    )
    assert result.mismatched_slots == 1


@pytest.mark.parametrize(
    "wrong", ["swapped blocks", "other request", "stray write", "nothing moved"]
)
def test_wrong_transfers_are_caught(wrong):
    (p_pages, p_attn, p_mamba), (d_pages, d_attn, d_mamba) = caches()
    oracle.poison(d_pages)
    requests_p = [
        oracle.RequestBlocks(0, 13, [[3, 5], [6]]),
        oracle.RequestBlocks(1, 13, [[0, 1], [2]]),
    ]
    oracle.fill(p_attn, p_mamba, requests_p, RATIO, KERNEL, [[0, 0], [0, 0]])
    sources = {"swapped blocks": [5, 3, 6], "other request": [0, 1, 2], "nothing moved": None}
    if wrong == "stray write":
        transfer_everything(p_pages, d_pages, [3, 5, 6, 0], [1, 4, 2, 7])
    elif sources[wrong] is not None:
        transfer_everything(p_pages, d_pages, sources[wrong], [1, 4, 2])
    result = oracle.verify(
        d_attn,
        d_mamba,
        [oracle.RequestBlocks(0, 13, [[1, 4], [2]])],
        RATIO,
        KERNEL,
        [[0, 0]],
        d_pages[None],
    )
    assert result.slots_checked > 0
    assert result.mismatched_slots > 0


def test_a_prefix_shared_on_prefill_is_the_owners_kv_on_both_sides():
    """A prefill-side prefix-cache hit (#26): request 1's first logical block
    is request 0's page 3 on prefill; decode reads it into its own page and
    must find request 0's codes there, and request 1's own after it."""
    (p_pages, p_attn, p_mamba), (d_pages, d_attn, d_mamba) = caches()
    oracle.poison(d_pages)
    owner = oracle.RequestBlocks(0, 13, [[3, 5], [6]])
    sharer = oracle.RequestBlocks(1, 13, [[3, 1], [2]], shared_tokens=KERNEL * RATIO)
    oracle.fill(p_attn, p_mamba, [owner, sharer], RATIO, KERNEL, [[0, 0], [0, 0]])
    assert sharer.code_request(0) == 0 and sharer.code_request(KERNEL * RATIO) == 1
    transfer_everything(p_pages, d_pages, [3, 1, 2], [4, 7, 0])
    decode_sharer = oracle.RequestBlocks(1, 13, [[4, 7], [0]], shared_tokens=KERNEL * RATIO)
    clean = oracle.verify(d_attn, d_mamba, [decode_sharer], RATIO, KERNEL, [[0, 0]])
    assert clean.slots_checked > 0 and clean.mismatched_slots == 0
    # the same bytes judged as if nothing were shared: the first block is wrong
    unshared = oracle.RequestBlocks(1, 13, [[4, 7], [0]])
    wrong = oracle.verify(d_attn, d_mamba, [unshared], RATIO, KERNEL, [[0, 0]])
    assert wrong.mismatched_slots == KERNEL * RATIO * 2 * 2 * 3  # every slot of block 0
