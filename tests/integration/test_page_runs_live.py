"""Run descriptors on real NIXL: the same request read through our worker
(run descriptors) and through stock ``NixlConnectorWorker`` (one descriptor
per K/V half of each kernel page) lands the same bytes, and ours posts fewer
descriptors. Two NIXL agents in this process, DRAM caches, UCX on loopback.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.worker import NixlConnectorWorker

from vllm_nixl_hma import NixlHMAConnectorWorker
from vllm_nixl_hma.core.read_threads import DEFAULT_SPLIT_BATCH_SIZE
from vllm_nixl_hma.harness.read_path import REMOTE_ENGINE, build_live_read_path

LAYERS = 3
LOGICAL_BLOCKS = 24
PAGE_BYTES = 256


def read_once(worker_cls, kinds, ratio, local_ids, remote_ids, mocker):
    live = build_live_read_path(
        worker_cls,
        kinds,
        ratio,
        layers=LAYERS,
        logical_blocks=LOGICAL_BLOCKS,
        page_bytes=PAGE_BYTES,
    )
    try:
        generator = torch.Generator().manual_seed(7)
        for cache in live.remote_caches:
            cache.copy_(torch.randint(1, 256, cache.shape, dtype=torch.uint8, generator=generator))
        spy = mocker.spy(live.worker.nixl_wrapper, "make_prepped_xfer")
        live.read("request", local_ids, remote_ids)
        assert not live.worker._failed_recv_reqs
        live.wait("request", timeout_s=30)
        descriptors = sum(len(call.args[2]) for call in spy.call_args_list)
        return (
            [c.numpy().copy() for c in live.local_caches],
            [c.numpy().copy() for c in live.remote_caches],
            descriptors,
        )
    finally:
        live.close()


CASES = {
    "dense r1": (["full_attention"], 1, [[3, 9, 4]], [[17, 2, 11]]),
    "dense r6": (["full_attention"], 6, [[3, 9, 4]], [[17, 2, 11]]),
    # a local prefix-cache hit: the local list pairs with the remote tail
    "dense r6 prefix hit": (["full_attention"], 6, [[9, 4]], [[17, 2, 11]]),
    "hybrid r4": (["full_attention", "mamba"], 4, [[3, 9, 4], [20]], [[17, 2, 11], [6]]),
    # more run descriptors than our agent's split: NIXL reads it in chunks on several threads
    "dense r6 in chunks": (
        ["full_attention"],
        6,
        [[5, 1, 17, 3, 22, 9, 14, 12, 11, 7, 19, 2, 16]],
        [[8, 20, 4, 13, 1, 23, 6, 10, 15, 3, 18, 12, 21]],
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_run_descriptors_land_the_bytes_stock_lands_with_fewer_descriptors(case, mocker):
    kinds, ratio, local_ids, remote_ids = CASES[case]
    ours, remote, ours_descriptors = read_once(
        NixlHMAConnectorWorker, kinds, ratio, local_ids, remote_ids, mocker
    )
    stock, _, stock_descriptors = read_once(
        NixlConnectorWorker, kinds, ratio, local_ids, remote_ids, mocker
    )
    for layer in range(LAYERS):
        assert np.array_equal(ours[layer], stock[layer]), f"layer {layer} differs from stock"
        # and the attention pages are the remote's (the tails pair on a prefix hit)
        pairs = zip(local_ids[0][::-1], remote_ids[0][::-1], strict=False)
        logical_page = ratio * PAGE_BYTES
        for local_block, remote_block in pairs:
            got = ours[layer][local_block * logical_page : (local_block + 1) * logical_page]
            sent = remote[layer][remote_block * logical_page : (remote_block + 1) * logical_page]
            assert np.array_equal(got, sent)
    # one descriptor per logical block and layer instead of 2 * ratio;
    # Mamba blocks keep upstream's 4 per layer
    attention_blocks = len(local_ids[0])
    mamba_descriptors = 4 * LAYERS * len(local_ids[1]) if len(kinds) > 1 else 0
    assert ours_descriptors == LAYERS * attention_blocks + mamba_descriptors
    assert stock_descriptors == 2 * ratio * LAYERS * attention_blocks + mamba_descriptors
    if case.endswith("in chunks"):
        assert ours_descriptors > DEFAULT_SPLIT_BATCH_SIZE


def test_a_run_read_nixl_refuses_fails_the_request_before_any_byte_moves(mocker):
    live = build_live_read_path(
        NixlHMAConnectorWorker, ["full_attention"], 6, layers=LAYERS, logical_blocks=LOGICAL_BLOCKS
    )
    try:
        for cache in live.remote_caches:
            cache.fill_(9)
        mocker.patch.object(
            live.worker.nixl_wrapper, "make_prepped_xfer", side_effect=RuntimeError("NIXL_ERR_X")
        )
        live.read("request", [[3]], [[5]])
        assert live.worker._failed_recv_reqs == {"request"}
        assert not live.worker._recving_transfers.get("request")
        assert REMOTE_ENGINE in live.worker.__dict__["_failed_engine_ids"]
        assert all(not cache.any() for cache in live.local_caches)
    finally:
        live.close()
