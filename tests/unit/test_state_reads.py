"""Where decode reads a prefill rank's Mamba state, as both releases' glue
place it (``state_split.remote_state_reads``), and the remote rank both
``add_remote_agent`` overrides hand to it (``remote_rank``). No vLLM import.

The expected offsets are worked out by hand from the layout (docs/design.md
section 4): a Mamba2 layer with intermediate size 8, one SSM group of
d_state 4 (replicated at every TP), 2 heads of 10 bytes each, conv kernel 4
(3 rows), 1-byte conv dtype, DS conv layout (a part's channels one after
the other, each channel 3 bytes).
"""

from __future__ import annotations

import pytest

from vllm_nixl_hma.core import mamba_conv
from vllm_nixl_hma.core.remote_rank import RemoteRankBeingAdded
from vllm_nixl_hma.core.state_split import RemoteStateReads, StateSplit, remote_state_reads

MODEL = mamba_conv.Mamba2State(intermediate_size=8, n_groups=1, d_state=4, num_heads=2)
ROWS, HEAD_BYTES = 3, 10


def decode_split_at_tp1() -> StateSplit:
    # decode TP 1: x is 8 channels (24 bytes), B and C 4 each (12 bytes); 2 heads
    return StateSplit(
        model=MODEL,
        conv_rows=ROWS,
        conv_dtype_size=1,
        ssm_head_bytes=HEAD_BYTES,
        ssm_sizes=(48, 20),
        local_conv_offsets=[(0, 24), (24, 12), (36, 12)],
    )


def reads_from(remote_rank: int, **placement) -> RemoteStateReads:
    defaults = {
        "remote_num_kernel_blocks": 12,
        "remote_physical_per_logical": 4,
        "region_bases_and_kernel_strides": [(1000, 64), (5000, 64)],
    }
    defaults.update(placement)
    return remote_state_reads(
        decode_split_at_tp1(),
        remote_tp_size=2,
        remote_rank=remote_rank,
        local_tp_size=1,
        local_rank=0,
        # a prefill rank at TP 2 holds x 4 channels + B 4 + C 4 = 36 bytes of conv
        remote_conv_bytes_reported=36,
        **defaults,
    )


def test_decode_tp1_reads_its_half_of_x_b_c_and_one_head_from_each_prefill_rank():
    # prefill rank r's page: x at 0 (12 bytes), B at 12, C at 24 (12 each), SSM at 36.
    # Decode's local B (12 bytes) is split evenly between the two ranks read:
    # channels 0-1 (6 bytes) from rank 0, channels 2-3 from rank 1, which
    # holds them 2 channels (6 bytes) into its B.
    assert reads_from(0).reads == ((0, 12), (12, 6), (24, 6), (36, 10))
    assert reads_from(1).reads == ((0, 12), (18, 6), (30, 6), (36, 10))


def test_a_page_spans_the_remote_ratio_of_kernel_blocks():
    placed = reads_from(1)
    assert placed.num_logical_blocks == 3  # 12 kernel blocks, 4 per page
    assert placed.regions == ((1000, 256), (5000, 256))


def test_both_releases_formats_name_the_same_bytes():
    placed = reads_from(1)
    per_block = placed.per_block(device_id=7)
    strided = placed.strided(device_id=7)
    # 0.21: region, then read, then block; 0.33: one strided entry per region and read
    assert per_block[:3] == [(1000, 12, 7), (1256, 12, 7), (1512, 12, 7)]
    assert per_block[3] == (1018, 6, 7)
    assert strided[0] == (1000, 12, 7, 256, 3)
    assert strided[4] == (5000, 12, 7, 256, 3)
    expanded = [
        (addr + block * stride, size, device)
        for addr, size, device, stride, count in strided
        for block in range(count)
    ]
    assert expanded == per_block
    assert len(per_block) == 2 * 4 * 3


def test_a_conv_state_of_another_size_is_refused():
    with pytest.raises(RuntimeError, match=r"ssm_sizes\[0\]"):
        remote_state_reads(
            decode_split_at_tp1(),
            remote_tp_size=2,
            remote_rank=0,
            local_tp_size=1,
            local_rank=0,
            remote_conv_bytes_reported=48,  # decode's own size, not prefill's at TP 2
            remote_num_kernel_blocks=12,
            remote_physical_per_logical=4,
            region_bases_and_kernel_strides=[(1000, 64)],
        )


def test_the_rank_being_added_is_known_only_inside_add_remote_agent():
    worker = RemoteRankBeingAdded()
    with pytest.raises(RuntimeError, match="outside add_remote_agent"):
        worker._remote_rank_being_added()
    with worker._adding_remote_rank(3):
        assert worker._remote_rank_being_added() == 3
    with pytest.raises(ValueError), worker._adding_remote_rank(1):
        raise ValueError("upstream failed")
    assert worker._remote_tp_rank_being_added is None  # reset on failure too
