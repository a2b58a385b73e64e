"""Decode-side prefix-cache hits on real bytes (#26): decode already holds a
prefix of each prompt and reads only the rest from prefill, through real
NIXL, with both engines keeping prefix caching (``mamba_prefix_caching``).

Hits end inside a prefill logical block, on a block boundary of both sides,
and one decode block before the end (``Scenario.decode_hits``); "no-hit"
reads the same prompts whole. "prefill-hit" is the other side's hit
(``Scenario.prefill_hits``): two requests begin with the first logical
blocks of a third on prefill (the same block ids, as prefill's prefix cache
hands them), decode holds nothing, and every slot must be what it would be
without the hit. Stock vLLM 0.21.0 pairs the hybrid's lists
from the tail: it reads other tokens' KV into decode's blocks, or asserts.

Both Mamba cache modes vLLM 0.21.0 offers the hybrid (Bamba) with prefix
caching run: ``align`` (the config hook's default) and ``all``. In ``all``
prefill's Mamba list holds a real block per logical block of the prompt's
last chunk, here pages holding other data, so a read of any but the last
(the running state) shows as wrong slots.
"""

from __future__ import annotations

import os

import pytest

from vllm_nixl_hma.harness import coordinator
from vllm_nixl_hma.harness.model_shapes import LAYOUTS

pytestmark = pytest.mark.slow

OURS_CELLS = [
    ("hybrid", 2, 1),
    ("hybrid", 1, 2),
    ("hybrid-1group", 1, 2),
    ("gdn", 2, 1),
    ("dense", 1, 2),
    ("swa", 2, 1),
]
STOCK_CELLS = [("hybrid", 2, 1), ("hybrid", 1, 2)]
#: cells run in Mamba cache mode 'all' as well (ours)
ALL_MODE_CELLS = [("hybrid", 2, 1), ("hybrid", 1, 2)]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    root = tmp_path_factory.mktemp("models")
    names = {layout for layout, _, _ in OURS_CELLS + STOCK_CELLS}
    model_dirs = {name: coordinator.model_dir_for(LAYOUTS[name], root) for name in names}
    scenarios = [
        coordinator.Scenario("decode-hit"),
        coordinator.Scenario("no-hit"),
        coordinator.Scenario("prefill-hit"),
    ]
    cells = [
        coordinator.Cell(
            layout,
            model_dirs[layout],
            p_tp,
            d_tp,
            connector,
            # stock's decode-hit rows are all its test reads
            scenarios if connector == "NixlHMAConnector" else scenarios[:1],
            prefix_caching=True,
            mamba_cache_mode=mode,
        )
        for connector, mode, cell_list in (
            ("NixlHMAConnector", None, OURS_CELLS),
            ("NixlConnector", None, STOCK_CELLS),
            ("NixlHMAConnector", "all", ALL_MODE_CELLS),
        )
        for layout, p_tp, d_tp in cell_list
    ]
    pool = coordinator.RankPool(3)
    by_cell = {}
    try:
        for cell in cells:
            rows = coordinator.run_cell(pool, cell, progress=lambda line: None)
            connector = cell.connector + ("/all" if cell.mamba_cache_mode == "all" else "")
            by_cell[(connector, cell.layout, cell.p_tp, cell.d_tp)] = {
                row.name: row for row in rows
            }
    finally:
        pool.close()
    return by_cell


@pytest.mark.parametrize(("layout", "p_tp", "d_tp"), OURS_CELLS)
def test_ours_reads_every_uncached_slot_right_after_a_decode_hit(results, layout, p_tp, d_tp):
    for row in results[("NixlHMAConnector", layout, p_tp, d_tp)].values():
        assert row.error is None, (row.name, row.error)
        assert row.slots_checked > 100_000, row.name
        assert row.mismatched_slots == 0, (row.name, row.examples)
        assert row.requests == 3


@pytest.mark.parametrize(("layout", "p_tp", "d_tp"), OURS_CELLS)
def test_a_prefill_hit_changes_nothing_decode_reads(results, layout, p_tp, d_tp):
    """Item 2 of #26: the shared blocks are read where they lie on prefill,
    into decode's own blocks at the same token positions."""
    row = results[("NixlHMAConnector", layout, p_tp, d_tp)]["prefill-hit"]
    assert row.error is None and row.requests == 3
    assert row.slots_checked > 100_000
    assert row.mismatched_slots == 0, row.examples


@pytest.mark.parametrize(("layout", "p_tp", "d_tp"), OURS_CELLS)
def test_a_decode_hit_reads_fewer_bytes_than_the_same_prompts_whole(results, layout, p_tp, d_tp):
    rows = results[("NixlHMAConnector", layout, p_tp, d_tp)]
    assert 0 < rows["decode-hit"].bytes < rows["no-hit"].bytes


def test_hybrid_cells_really_have_unequal_ratios(results):
    for layout, p_tp, d_tp in OURS_CELLS:
        if layout != "dense" and layout != "swa":
            row = results[("NixlHMAConnector", layout, p_tp, d_tp)]["decode-hit"]
            assert row.local_ratio != row.remote_ratio, (layout, p_tp, d_tp)


@pytest.mark.parametrize(("layout", "p_tp", "d_tp"), ALL_MODE_CELLS)
def test_mamba_cache_mode_all_reads_the_running_state_and_the_uncached_tail(
    results, layout, p_tp, d_tp
):
    rows = results[("NixlHMAConnector/all", layout, p_tp, d_tp)]
    for row in rows.values():
        assert row.error is None, (row.name, row.error)
        assert row.slots_checked > 100_000, row.name
        assert row.mismatched_slots == 0, (row.name, row.examples)
        assert row.local_ratio != row.remote_ratio
    assert 0 < rows["decode-hit"].bytes < rows["no-hit"].bytes


def test_stock_0_21_0_misreads_or_asserts_on_the_same_decode_hits(results):
    wrong = results[("NixlConnector", "hybrid", 2, 1)]["decode-hit"]
    assert wrong.error is None and wrong.slots_checked > 100_000
    assert wrong.mismatched_slots > 0  # other tokens' KV, and nothing said so
    refused = results[("NixlConnector", "hybrid", 1, 2)]["decode-hit"]
    assert refused.slots_checked == 0
    assert "assert num_local_blocks <= len(remote_group)" in (refused.error or "")
