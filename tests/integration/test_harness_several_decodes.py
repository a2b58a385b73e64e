"""Several decode engines reading from one prefill engine, as the ranks of a
data-parallel decode do against a TP prefill (#24 item 2): real vLLM workers,
real NIXL agents, every slot checked.

vLLM's CPU build cannot start the hybrid with data-parallel decode (its MoE
layer's ``all_gatherv`` is not implemented there, docs/measurements.md), so
the per-rank parts are proven here: each decode engine is named as vLLM names
DP rank k's engine (``<engine_id>_dp<k>``), handshakes with the same prefill
side channel, reads its own share of one batch, and prefill is notified of
every request by whichever engine read it (its lease never had to free one).
Ours on the dense model and on the hybrid at unequal ratios; stock beside
ours on the dense model.
"""

from __future__ import annotations

import pytest

from vllm_nixl_hma.harness import coordinator
from vllm_nixl_hma.harness.model_shapes import LAYOUTS

pytestmark = pytest.mark.slow

CELLS = [
    # (layout, prefill TP, decode TP per engine, connector)
    ("hybrid", 2, 1, "NixlHMAConnector"),
    ("dense", 2, 1, "NixlHMAConnector"),
    ("dense", 2, 1, "NixlConnector"),
]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Every cell in one pool of rank processes (each imports vLLM once)."""
    root = tmp_path_factory.mktemp("models")
    cells = [
        coordinator.Cell(
            layout,
            coordinator.model_dir_for(LAYOUTS[layout], root),
            p_tp=p_tp,
            d_tp=d_tp,
            connector=connector,
            # three requests: engine _dp0 reads two, engine _dp1 one
            scenarios=[coordinator.Scenario("mid-block")],
            decode_engines=2,
            hma=layout == "hybrid",
        )
        for layout, p_tp, d_tp, connector in CELLS
    ]
    found = coordinator.run_cells(cells, progress=lambda line: None)
    return dict(zip(CELLS, found, strict=True))


@pytest.mark.parametrize("cell", CELLS, ids=["-".join(map(str, cell)) for cell in CELLS])
def test_two_decode_engines_read_one_prefill_engine_every_slot_right(results, cell):
    result = results[cell]
    assert result.error is None, result.error
    assert result.requests == 3
    assert result.slots_checked > 0
    assert result.mismatched_slots == 0, result.examples
    # prefill released every request on the notification of the engine that read
    # it, none on its lease (with decode's notifications lost, all 3 went on the
    # lease: released_by_expiry 6, one per request and prefill rank)
    assert result.prefill_released == result.requests
    assert result.prefill_released_by_expiry == 0
    if cell[0] == "hybrid":
        assert result.local_ratio != result.remote_ratio
