"""Real KV bytes through real NIXL between prefill and decode engines.

One process per TP rank (gloo group per engine), vLLM's own layout code, the
real connector worker (ours, or stock vLLM 0.21.0 for comparison), the real
side-channel handshake on 127.0.0.1 and NIXL READ over UCX. A reduced version
of ``vllm-nixl-hma check``'s matrix (the full one runs as README's main job).
"""

from __future__ import annotations

import json
import os

import pytest

from vllm_nixl_hma.harness import coordinator
from vllm_nixl_hma.harness.model_shapes import LAYOUTS

pytestmark = pytest.mark.slow

OURS_CELLS = [
    ("hybrid", 2, 1),
    ("hybrid", 1, 2),
    ("hybrid-1group", 2, 1),
    ("hybrid-1group", 1, 2),
    ("dense", 1, 2),
    ("swa", 2, 1),
    ("gdn", 2, 1),
    ("gdn", 1, 2),
]
# Heterogeneous Mamba cells, where stock 0.21.0 must fail, and a homogeneous
# dense cell, where it must pass (the harness is not simply hostile to it).
STOCK_CELLS = [("hybrid", 2, 1), ("hybrid-1group", 1, 2), ("dense", 1, 2), ("gdn", 2, 1)]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    root = tmp_path_factory.mktemp("models")
    model_dirs = {name: coordinator.model_dir_for(LAYOUTS[name], root) for name in LAYOUTS}
    scenarios = [coordinator.Scenario("mid-block"), coordinator.Scenario("boundary")]
    cells = [
        coordinator.Cell(layout, model_dirs[layout], p_tp, d_tp, connector, scenarios)
        for connector, cell_list in (
            ("NixlHMAConnector", OURS_CELLS),
            ("NixlConnector", STOCK_CELLS),
        )
        for layout, p_tp, d_tp in cell_list
    ]
    pool = coordinator.RankPool(3)
    by_cell = {}
    try:
        for cell in cells:
            by_cell[(cell.connector, cell.layout, cell.p_tp, cell.d_tp)] = coordinator.run_cell(
                pool, cell, progress=lambda line: None
            )
    finally:
        pool.close()
    for process in pool.processes:
        assert not process.is_alive()
    return by_cell


@pytest.mark.parametrize(("layout", "p_tp", "d_tp"), OURS_CELLS)
def test_ours_delivers_every_slot(results, layout, p_tp, d_tp):
    for result in results[("NixlHMAConnector", layout, p_tp, d_tp)]:
        assert result.error is None, result.error
        assert result.slots_checked > 100_000  # never "0 mismatches" because nothing was checked
        assert result.mismatched_slots == 0, result.examples
        assert result.requests == 3 and result.bytes > 0 and result.descriptors > 0


def test_heterogeneous_cells_really_have_unequal_ratios(results):
    for layout, p_tp, d_tp in OURS_CELLS:
        if layout.startswith("hybrid") or layout == "gdn":
            for result in results[("NixlHMAConnector", layout, p_tp, d_tp)]:
                assert result.local_ratio != result.remote_ratio, (layout, p_tp, d_tp)


def test_stock_0_21_0_reads_wrong_kv_at_decode_ratio_above_prefills(results):
    """The oracle can fail: stock NixlConnector, ``hybrid`` 2 -> 1 (decode ratio 5,
    prefill 3), expands remote ids with decode's ratio; the reads succeed and the
    slots hold other positions' KV. Nothing but the oracle reports it."""
    for result in results[("NixlConnector", "hybrid", 2, 1)]:
        assert result.error is None, result.error  # not a harness or worker crash
        assert result.slots_checked > 100_000
        assert result.mismatched_slots > 0


def test_stock_0_21_0_asserts_at_decode_ratio_below_prefills(results):
    """``hybrid-1group`` 1 -> 2 (decode ratio 5, prefill 9): upstream's pairing
    asserts before any read; the check reports that error, and only that one."""
    for result in results[("NixlConnector", "hybrid-1group", 1, 2)]:
        assert result.slots_checked == 0
        assert (result.error or "").startswith("AssertionError"), result.error
        assert "assert num_local_blocks <= len(remote_group)" in result.error


def test_stock_0_21_0_refuses_gated_delta_net_and_the_check_reports_it(results):
    """vLLM 0.21.0 cannot move GatedDeltaNet state: its worker refuses to start.
    Run after ours in the same rank processes, so ours left upstream's code as it was."""
    for result in results[("NixlConnector", "gdn", 2, 1)]:
        assert result.slots_checked == 0
        assert "3-read conv transfer only supports Mamba2" in (result.error or "")


def test_stock_passes_the_homogeneous_dense_cell(results):
    for result in results[("NixlConnector", "dense", 1, 2)]:
        assert result.ok, (result.error, result.examples)


def test_results_serialise_to_the_documented_json_fields(results):
    row = next(iter(results.values()))[0].as_json()
    assert set(row) == {
        "name",
        "p_tp",
        "d_tp",
        "layout",
        "local_ratio",
        "remote_ratio",
        "requests",
        "slots_checked",
        "mismatched_slots",
        "bytes",
        "descriptors",
        "seconds",
        "error",
    }
    json.dumps(row)
