"""vLLM 0.33.0's Mamba2 conv-state offsets, against ``mamba_conv``'s (issue #13).

Runs in the vLLM 0.33 environment (``tools/env.sh v033``; tools/test.sh). It
feeds vLLM 0.33.0's own ``derive_mamba_conv_split`` a decode rank's
``MambaSpec`` and asks its ``remote_conv_offsets`` where, in each prefill
page, decode reads x, B and C; ``mamba_conv.conv_read_plan`` says where they
are. Arithmetic only: the real-bytes proof on 0.33 is still to come (#13).

With sharded SSM groups 0.33 agrees with ours. With one group (granite-4.0-h),
which every rank holds whole, it still reads B and C where sharded groups
would be, as 0.21.0 did: these tests fail the day upstream fixes that, and
the plugin's own conv plan can then be dropped on that release.
"""

from __future__ import annotations

import pytest

from vllm_nixl_hma.core import mamba_conv

pytestmark = pytest.mark.vllm033

CONV_ROWS = 3  # conv kernel 4
DTYPE_BYTES = 4  # float32
HEAD_DIM = 8


def mamba2(n_groups: int) -> mamba_conv.Mamba2State:
    return mamba_conv.Mamba2State(intermediate_size=64, n_groups=n_groups, d_state=16, num_heads=8)


def upstream_reads(model: mamba_conv.Mamba2State, p_tp: int, d_tp: int, d_rank: int):
    """Per part x, B, C: (prefill rank, offset, size) of each read into decode
    rank ``d_rank``'s part, in the order of the part's chunks, as vLLM 0.33.0
    registers them: ``remote_conv_offsets`` in every source rank's page, the
    ``p_idx``-th source filling the ``p_idx``-th chunk (base_worker.py)."""
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.ssm_conv_transfer_utils import (
        derive_mamba_conv_split,
    )
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import MambaSpec

    groups = mamba_conv.padded_n_groups(model.n_groups, d_tp)
    conv_channels = (model.intermediate_size + 2 * groups * model.d_state) // d_tp
    spec = MambaSpec(
        block_size=16,
        shapes=((conv_channels, CONV_ROWS), (model.num_heads // d_tp, HEAD_DIM, model.d_state)),
        dtypes=(torch.float32, torch.float32),
        mamba_type=MambaAttentionBackendEnum.MAMBA2,
    )
    split = derive_mamba_conv_split(spec, d_tp)
    tp_ratio = d_tp // p_tp if d_tp >= p_tp else -(p_tp // d_tp)
    offsets = split.remote_conv_offsets(d_rank % max(tp_ratio, 1), tp_ratio)
    sources = mamba_conv.source_p_ranks(p_tp, d_tp, d_rank)
    return {
        part: [(p_rank, offset, size) for p_rank in sources]
        for part, (offset, size) in zip("xBC", offsets, strict=True)
    }


def right_reads(model: mamba_conv.Mamba2State, p_tp: int, d_tp: int, d_rank: int):
    """The same, from ``mamba_conv.conv_read_plan`` (ordered by source rank)."""
    reads: dict[str, list[tuple[int, int, int]]] = {part: [] for part in "xBC"}
    for read in mamba_conv.conv_read_plan(model, CONV_ROWS, DTYPE_BYTES, p_tp, d_tp, d_rank):
        reads[read.component].append((read.p_rank, read.remote_offset_bytes, read.size_bytes))
    return reads


CASES = [(p_tp, d_tp, d_rank) for p_tp, d_tp in ((2, 1), (1, 2), (2, 2)) for d_rank in range(d_tp)]


@pytest.mark.parametrize(("p_tp", "d_tp", "d_rank"), CASES)
def test_sharded_groups_are_read_where_they_are(p_tp, d_tp, d_rank):
    model = mamba2(n_groups=2)
    upstream = upstream_reads(model, p_tp, d_tp, d_rank)
    right = right_reads(model, p_tp, d_tp, d_rank)
    assert upstream == right


@pytest.mark.parametrize(
    ("p_tp", "d_tp", "d_rank", "wrong_parts"),
    [(2, 1, 0, "BC"), (1, 2, 0, "C"), (1, 2, 1, "BC")],
)
def test_a_replicated_group_is_still_read_at_sharded_offsets(p_tp, d_tp, d_rank, wrong_parts):
    model = mamba2(n_groups=1)
    upstream = upstream_reads(model, p_tp, d_tp, d_rank)
    right = right_reads(model, p_tp, d_tp, d_rank)
    assert upstream["x"] == right["x"]
    for part in "BC":
        assert (upstream[part] == right[part]) == (part not in wrong_parts), (
            part,
            upstream[part],
            right[part],
        )
