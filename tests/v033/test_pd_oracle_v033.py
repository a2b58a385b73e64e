"""Real KV bytes through real NIXL on vLLM 0.33 (issue #13, item 2).

The check harness as ``vllm-nixl-hma check`` runs it: one process per TP rank,
vLLM 0.33's own KV layout (one backing buffer, 4D views), the real connector
worker (ours from ``vllm_nixl_hma.v033``, or stock ``NixlConnector``), the real
side-channel handshake on 127.0.0.1 and NIXL READ over UCX.

* Ours: the whole default matrix (every embedded layout, prefill/decode TP
  1/1, 1/2, 2/1, 2/2, mid-block and boundary prompts) with 0 mismatched slots.
* Stock 0.33.0: the one-SSM-group Mamba2 hybrid (granite-4.0-h shaped) at
  prefill TP 2 -> decode TP 1 and 1 -> 2 gets conv state wrong and nothing
  else; at equal TP, and for two groups or GatedDeltaNet, it is right (so the
  harness is not simply hostile to it).
"""

from __future__ import annotations

import pytest

from tests.v033.cells import model_dirs, run_by_key
from vllm_nixl_hma.cli import DEFAULT_LAYOUTS, DEFAULT_TP_PAIRS
from vllm_nixl_hma.harness import coordinator
from vllm_nixl_hma.harness.model_shapes import installed_layouts

pytestmark = [pytest.mark.vllm033, pytest.mark.slow]

OURS_CELLS = [(layout, p, d) for layout in DEFAULT_LAYOUTS for p, d in DEFAULT_TP_PAIRS]
STOCK_WRONG = [("hybrid-1group", 2, 1), ("hybrid-1group", 1, 2)]
STOCK_RIGHT = [("hybrid-1group", 2, 2), ("hybrid", 2, 1), ("gdn", 1, 2)]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    dirs = model_dirs(tmp_path_factory.mktemp("models"))
    scenarios = [coordinator.Scenario("mid-block"), coordinator.Scenario("boundary")]
    return run_by_key(
        {
            (connector, layout, p_tp, d_tp): coordinator.Cell(
                layout, dirs[layout], p_tp, d_tp, connector, scenarios
            )
            for connector, cell_list in (
                ("NixlHMAConnector", OURS_CELLS),
                ("NixlConnector", STOCK_WRONG + STOCK_RIGHT),
            )
            for layout, p_tp, d_tp in cell_list
        },
        pool_size=4,
    )


def test_the_hybrids_are_granite_on_vllm_033():
    """vLLM 0.33 has no Bamba: the Mamba2 layouts are granite-4.0-h configs."""
    layouts = installed_layouts()
    assert layouts["hybrid-1group"]["architectures"] == ["GraniteMoeHybridForCausalLM"]
    assert layouts["hybrid-1group"]["mamba_n_groups"] == 1
    assert layouts["gdn"]["architectures"] == ["Qwen3NextForCausalLM"]


@pytest.mark.parametrize(("layout", "p_tp", "d_tp"), OURS_CELLS)
def test_ours_delivers_every_slot(results, layout, p_tp, d_tp):
    for result in results[("NixlHMAConnector", layout, p_tp, d_tp)]:
        assert result.error is None, result.error
        assert result.slots_checked > 100_000  # never "0 mismatches" because nothing was checked
        assert result.mismatched_slots == 0, result.examples
        assert result.requests == 3 and result.bytes > 0 and result.descriptors > 0


def test_mamba_cells_really_have_unequal_ratios(results):
    for layout, p_tp, d_tp in OURS_CELLS:
        if layout.startswith("hybrid") or layout == "gdn":
            for result in results[("NixlHMAConnector", layout, p_tp, d_tp)]:
                assert (result.local_ratio != result.remote_ratio) == (p_tp != d_tp)


@pytest.mark.parametrize(("layout", "p_tp", "d_tp"), STOCK_WRONG)
def test_stock_033_reads_a_replicated_groups_conv_state_wrong(results, layout, p_tp, d_tp):
    for result in results[("NixlConnector", layout, p_tp, d_tp)]:
        assert result.error is None, result.error
        assert result.mismatched_slots > 0
        # only the conv state (x, B, C) is misplaced: attention and SSM state arrive
        assert result.examples and all("conv state" in line for line in result.examples)


@pytest.mark.parametrize(("layout", "p_tp", "d_tp"), STOCK_RIGHT)
def test_stock_033_is_right_where_upstream_fixed_it(results, layout, p_tp, d_tp):
    for result in results[("NixlConnector", layout, p_tp, d_tp)]:
        assert result.error is None, result.error
        assert result.slots_checked > 100_000
        assert result.mismatched_slots == 0, result.examples


def test_ours_posts_upstreams_descriptors_and_nixl_merges_them(results):
    """The 0.33 glue keeps upstream's descriptor ids (one per kernel page; no
    page runs: NIXL >= 1.5 merges contiguous pages itself, test_nixl_merge),
    so at equal TP ours hands NIXL exactly stock's ids and NIXL moves fewer
    descriptors than it was given ids."""
    cell = ("hybrid-1group", 2, 2)
    ours, stock = results[("NixlHMAConnector", *cell)], results[("NixlConnector", *cell)]
    for ours_result, stock_result in zip(ours, stock, strict=True):
        assert ours_result.ids_posted == stock_result.ids_posted > 0
        assert ours_result.descriptors == stock_result.descriptors
        # the local kernel-per-logical ratio exceeds 1, so a block's pages merge
        assert ours_result.local_ratio > 1
        assert 0 < ours_result.descriptors < ours_result.ids_posted
