"""vLLM 0.34.0's last-token pairing under our checks (#42), one method.

0.34.0 pairs decode's and prefill's lists across unequal block sizes from the
last of ``remote_num_tokens`` tokens, a number the client's
``kv_transfer_params`` carry. The 0.34 glue's ``_pair_blocks_by_last_token``
first requires that number to be the one decode's own scheduler derived (the
request's ``TokenSpan``) and prefill's lists to be as long as that prompt
needs, then runs upstream's. Here on a worker holding only what the method
reads (upstream's real method, real block arithmetic; no NIXL); the read path
around it runs on real bytes in ``check`` (unequal-ratio cells, ``--faults``).
Runs in the vLLM 0.34 environment.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm_nixl_hma import _compat
from vllm_nixl_hma.core.blocks import GroupKind
from vllm_nixl_hma.core.errors import BlockAlignmentError
from vllm_nixl_hma.core.positions import TokenSpan

pytestmark = [
    pytest.mark.vllm033,
    pytest.mark.skipif(_compat.adapter() != "v034", reason="vLLM 0.34.0's pairing"),
]

KERNEL_TOKENS = 16
#: one full-attention group; decode: 2 kernel blocks per logical block, prefill: 4
DECODE_RATIO, PREFILL_RATIO = 2, 4


def worker(span: TokenSpan | None):
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from vllm_nixl_hma.v034.worker import NixlHMAConnectorWorker

    spec = FullAttentionSpec(
        block_size=KERNEL_TOKENS * DECODE_RATIO,
        num_kv_heads=1,
        head_size=8,
        dtype=__import__("torch").float16,
    )
    w = NixlHMAConnectorWorker.__new__(NixlHMAConnectorWorker)
    w.__dict__.update(
        _token_spans={"req": span} if span else {},
        _request_being_paired="req",
        _group_kinds=(GroupKind.FULL_ATTENTION,),
        _group_windows=(0,),
        block_size=KERNEL_TOKENS,
        _physical_blocks_per_logical_kv_block=DECODE_RATIO,
        _group_spec_types=(FullAttentionSpec,),
        kv_cache_config=SimpleNamespace(transfer_groups=[SimpleNamespace(kv_cache_spec=spec)]),
    )
    return w


def kernel_ids(logical: list[int], ratio: int) -> list[int]:
    return [b * ratio + k for b in logical for k in range(ratio)]


# 100 tokens: 7 kernel blocks of 16. Decode: 4 logical blocks of 32 tokens
# (8 kernel ids, the last past token 99); prefill: 2 logical blocks of 64 (8 ids, too).
TOKENS = 100
DECODE = [kernel_ids([3, 5, 9, 11], DECODE_RATIO)]
PREFILL = [kernel_ids([2, 6], PREFILL_RATIO)]


def test_genuine_lists_pair_by_upstreams_rule():
    local, remote, covered = worker(TokenSpan(0, TOKENS))._pair_blocks_by_last_token(
        DECODE, PREFILL, TOKENS, 1, PREFILL_RATIO
    )
    # 7 kernel blocks hold the 100 tokens; each side drops its padding past them
    assert local == [DECODE[0][:7]] and remote == [PREFILL[0][:7]]
    assert covered == [range(0, 7)]


def test_a_remote_num_tokens_other_than_decodes_count_is_refused():
    with pytest.raises(BlockAlignmentError, match="remote_num_tokens: local=100, remote=164"):
        worker(TokenSpan(0, TOKENS))._pair_blocks_by_last_token(
            DECODE, PREFILL, TOKENS + 64, 1, PREFILL_RATIO
        )


def test_a_prefill_list_cut_short_is_refused():
    """Upstream pairs it from its end (the last 4 kernel ids of one logical block)."""
    cut = [PREFILL[0][:PREFILL_RATIO]]
    with pytest.raises(BlockAlignmentError):
        worker(TokenSpan(0, TOKENS))._pair_blocks_by_last_token(
            DECODE, cut, TOKENS, 1, PREFILL_RATIO
        )
    # without a span (vLLM's own tests build workers so) upstream's rule alone pairs it
    local, remote, _ = worker(None)._pair_blocks_by_last_token(
        DECODE, cut, TOKENS, 1, PREFILL_RATIO
    )
    assert len(remote[0]) == 3
