"""Run descriptors (``page_runs``) against vLLM 0.21.0's own descriptor builders.

The reference is upstream's ``_build_fa_local`` (one descriptor per K and V
half of each kernel page) and ``_compute_desc_ids``, run on a worker built
around real vLLM specs and topology: a run descriptor must cover exactly the
bytes of the upstream descriptors it replaces, and the Mamba ids must pick
the same descriptors as upstream's.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.worker import NixlConnectorWorker

from vllm_nixl_hma.core import blocks, page_runs
from vllm_nixl_hma.harness.read_path import build_read_path_worker

PAGE_BYTES = 256
LAYERS = 3


def upstream_fa_descs(ratio: int, logical_blocks: int, base_addrs: list[int]) -> np.ndarray:
    worker = build_read_path_worker(
        NixlConnectorWorker,
        ["full_attention"],
        ratio,
        ratio,
        nixl_wrapper=None,
        logical_blocks=logical_blocks,
        num_regions=2 * len(base_addrs),
    )
    worker.block_len_per_layer = [PAGE_BYTES] * len(base_addrs)
    worker.num_blocks = logical_blocks * ratio
    worker.device_id = 0
    return np.asarray(worker._build_fa_local(base_addrs, 1), dtype=np.int64)


@pytest.mark.parametrize(("ratio", "run_blocks"), [(1, 1), (4, 4), (6, 2), (6, 3), (10, 10)])
def test_each_run_covers_exactly_the_upstream_descriptors_it_replaces(ratio, run_blocks):
    logical_blocks = 5
    base_addrs = [1 << 20, 5 << 20, 9 << 20]
    kernel_blocks = logical_blocks * ratio
    upstream = upstream_fa_descs(ratio, logical_blocks, base_addrs)
    runs = page_runs.page_run_descs(base_addrs, [PAGE_BYTES] * 3, kernel_blocks, run_blocks, 0)
    runs_per_layer = kernel_blocks // run_blocks
    assert runs.shape == (LAYERS * runs_per_layer, 3)
    for layer in range(LAYERS):
        for run in range(runs_per_layer):
            kernel_ids = range(run * run_blocks, (run + 1) * run_blocks)
            replaced = upstream[
                [(2 * layer + half) * kernel_blocks + k for k in kernel_ids for half in (0, 1)]
            ]
            replaced = replaced[np.argsort(replaced[:, 0])]
            start, length, _ = runs[layer * runs_per_layer + run]
            # the replaced descriptors tile [start, start + length) without gap or overlap
            assert replaced[0, 0] == start
            assert np.array_equal(replaced[1:, 0], replaced[:-1, 0] + replaced[:-1, 1])
            assert replaced[-1, 0] + replaced[-1, 1] == start + length


def test_run_blocks_is_the_gcd_of_both_ratios():
    assert page_runs.run_blocks_for(6, 6) == 6
    assert page_runs.run_blocks_for(6, 10) == 2
    assert page_runs.run_blocks_for(66, 34) == 2
    assert page_runs.run_blocks_for(5, 3) == 1


@given(
    ratio=st.sampled_from([1, 2, 6, 10]),
    logical_ids=st.lists(st.integers(0, 500), min_size=0, max_size=40, unique=True),
)
def test_run_ids_of_expanded_logical_blocks_are_the_logical_ids(ratio, logical_ids):
    kernel_ids = blocks.logical_to_kernel_ids(np.asarray(logical_ids, dtype=np.int64), ratio)
    for run_blocks in {d for d in range(1, ratio + 1) if ratio % d == 0}:
        runs = page_runs.run_ids_of(kernel_ids, run_blocks)
        assert runs is not None
        expanded = (runs[:, None] * run_blocks + np.arange(run_blocks)).reshape(-1)
        assert np.array_equal(expanded, kernel_ids)


@pytest.mark.parametrize(
    "kernel_ids",
    [
        [6, 7, 8],  # partial run
        [7, 8, 9, 10, 11, 12],  # runs not aligned to 6
        [6, 7, 8, 9, 11, 10],  # out of order inside a run
        [0, 1, 2, 3, 4, 5, 12, 13, 14, 15, 16],  # second run cut short
    ],
)
def test_lists_that_are_not_whole_aligned_runs_have_no_run_ids(kernel_ids):
    assert page_runs.run_ids_of(np.asarray(kernel_ids, dtype=np.int64), 6) is None


def request_ids(groups, buffer=None):
    return page_runs.request_desc_ids(
        [(is_mamba, np.asarray(ids, dtype=np.int64)) for is_mamba, ids in groups],
        run_blocks=6,
        num_layers=3,
        runs_per_layer=10,
        logical_blocks=10,
        buffer=buffer,
    )


def test_request_ids_take_each_run_in_every_layer_then_mamba_blocks_in_every_region():
    ids = request_ids([(False, [24, 25, 26, 27, 28, 29, 6, 7, 8, 9, 10, 11]), (True, [7])])
    runs = [4, 1, 14, 11, 24, 21]
    mamba = [30 + region * 10 + 7 for region in range(12)]  # after 3 layers x 10 runs
    assert ids.dtype == np.int32
    assert ids.tolist() == runs + mamba


def test_request_ids_reuse_a_large_enough_buffer_and_ignore_a_small_one():
    buffer = np.full(100, -1, dtype=np.int32)
    ids = request_ids([(False, [6, 7, 8, 9, 10, 11])], buffer=buffer)
    assert ids.base is buffer and ids.tolist() == [1, 11, 21]
    ids = request_ids([(False, list(range(6 * 40)))], buffer=np.empty(3, dtype=np.int32))
    assert ids.size == 3 * 40


def test_request_ids_refuse_a_list_that_is_not_whole_runs():
    assert request_ids([(False, [6, 7, 8]), (True, [1])]) is None


@pytest.mark.parametrize("ratio", [1, 6])
def test_mamba_ids_pick_the_descriptors_upstream_picks(ratio):
    logical_blocks = 12
    worker = build_read_path_worker(
        NixlConnectorWorker,
        ["full_attention", "mamba"],
        ratio,
        ratio,
        nixl_wrapper=None,
        logical_blocks=logical_blocks,
        num_regions=2 * LAYERS,
    )
    worker.block_len_per_layer = [PAGE_BYTES] * LAYERS
    mamba_ids = [3, 7]
    upstream = worker._compute_desc_ids(
        [[], mamba_ids],
        dst_num_blocks=logical_blocks * ratio,
        block_size_ratio=None,
        physical_blocks_per_logical=ratio,
    )
    upstream_fa_descs_count = 2 * LAYERS * logical_blocks * ratio
    runs_per_layer = logical_blocks  # one run per logical block
    ours = page_runs.request_desc_ids(
        [(False, np.asarray([], dtype=np.int64)), (True, np.asarray(mamba_ids))],
        run_blocks=ratio,
        num_layers=LAYERS,
        runs_per_layer=runs_per_layer,
        logical_blocks=logical_blocks,
    )
    ours_fa_descs_count = LAYERS * runs_per_layer
    assert np.array_equal(
        ours - ours_fa_descs_count, np.asarray(upstream) - upstream_fa_descs_count
    )


def whole_pages(**overrides):
    arguments = dict(
        tp_ratio=1,
        block_size_ratio=1,
        local_page_bytes=[256, 256],
        remote_page_bytes=[256, 256],
        local_read_bytes_per_page=[256, 256],
        descs_per_page=2,
        run_blocks=1,
    )
    arguments.update(overrides)
    return page_runs.whole_page_refusal(**arguments)


def test_whole_pages_of_the_same_geometry_are_accepted():
    assert whole_pages() is None
    assert whole_pages(descs_per_page=1, run_blocks=6) is None


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        (dict(tp_ratio=2), "tp_ratio 2"),
        (dict(tp_ratio=-2), "tp_ratio -2"),
        (dict(block_size_ratio=2), "block_size_ratio 2"),
        (dict(remote_page_bytes=[256, 512]), "page bytes differ"),
        (dict(local_read_bytes_per_page=[128, 128]), "do not cover whole pages"),
        (dict(descs_per_page=1, run_blocks=1), "one descriptor per page already"),
    ],
)
def test_partial_page_reads_keep_upstream_descriptors(overrides, reason):
    assert reason in whole_pages(**overrides)
