"""Unequal kernel-per-logical ratios without Mamba state, on vLLM 0.33 and 0.34 (#13, #42).

Prefill and decode started with different ``--block-size`` (128 and 64: the
attention kernel block is 64 on both, the ratio 2 on one side and 1 on the
other), real NIXL, every slot checked:

* dense, both directions: ours pairs leading kernel blocks and delivers every
  slot; stock 0.33.0 pairs decode's list with prefill's tail, which at prefill
  128 -> decode 64 puts KV into the wrong blocks and reports success, and at
  64 -> 128 lets an assert escape ``start_load_kv``;
* full + sliding window: a window clipped to whole logical blocks of
  different sizes cannot be paired by counts; on 0.33 ours refuses the
  prefill engine at the handshake (every request fails, nothing wrong is
  delivered), stock delivers wrong KV.

vLLM 0.34.0 pairs these lists from the prompt's last token
(``_pair_blocks_by_last_token``): stock delivers every slot of both models,
which is the proof that the 0.33 glue's leading-block pairing and its
handshake refusal are redundant there, and the 0.34 glue leaves both to
upstream (after its own checks of prefill's lists): every slot of both
models, also after decode-side prefix-cache hits.
"""

from __future__ import annotations

import pytest

from tests.v033.cells import model_dirs, run_by_key
from vllm_nixl_hma import _compat
from vllm_nixl_hma.harness import coordinator

pytestmark = [pytest.mark.vllm033, pytest.mark.slow]

CELLS = [("dense", 128, 64), ("dense", 64, 128), ("swa", 128, 64)]
#: vLLM 0.34.0 pairs by the prompt's last token (upstream since 0.34)
LAST_TOKEN = _compat.adapter() == "v034"


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    dirs = model_dirs(tmp_path_factory.mktemp("models"), ("dense", "swa"))
    Scenario = coordinator.Scenario
    scenarios = [Scenario("mid-block"), Scenario("boundary")]
    return run_by_key(
        {
            (connector, layout, p_block, d_block): coordinator.Cell(
                layout,
                dirs[layout],
                1,
                1,
                connector,
                scenarios,
                prefill_block_size=p_block,
                decode_block_size=d_block,
            )
            for connector in ("NixlHMAConnector", "NixlConnector")
            for layout, p_block, d_block in CELLS
        }
        | {
            # 0.34: prefix caching across block sizes, decode-side hits (ours)
            ("NixlHMAConnector", f"{layout}+prefix-caching", p_block, d_block): coordinator.Cell(
                layout,
                dirs[layout],
                1,
                1,
                "NixlHMAConnector",
                [Scenario("decode-hit"), Scenario("no-hit"), Scenario("prefill-hit")],
                prefill_block_size=p_block,
                decode_block_size=d_block,
                prefix_caching=True,
            )
            for layout, p_block, d_block in (CELLS if LAST_TOKEN else ())
        },
        pool_size=2,
    )


@pytest.mark.parametrize(("p_block", "d_block"), [(128, 64), (64, 128)])
def test_ours_pairs_a_dense_model_across_block_sizes(results, p_block, d_block):
    for result in results[("NixlHMAConnector", "dense", p_block, d_block)]:
        assert result.local_ratio != result.remote_ratio
        assert result.error is None, result.error
        assert result.slots_checked > 100_000
        assert result.mismatched_slots == 0, result.examples


@pytest.mark.skipif(LAST_TOKEN, reason="vLLM 0.33.0's count rule; 0.34 below")
def test_stock_033_misplaces_or_asserts_across_block_sizes(results):
    for result in results[("NixlConnector", "dense", 128, 64)]:
        assert result.error is None  # reported as delivered...
        assert result.silently_wrong_slots > 0  # ...in the wrong blocks
    for result in results[("NixlConnector", "dense", 64, 128)]:
        assert result.error is not None and result.error.startswith("AssertionError")


@pytest.mark.skipif(LAST_TOKEN, reason="vLLM 0.33.0's count rule; 0.34 below")
def test_ours_refuses_a_sliding_window_across_ratios_and_stock_misplaces_it(results):
    for result in results[("NixlHMAConnector", "swa", 128, 64)]:
        assert result.requests_failed == result.requests == 3
        assert result.silently_wrong_slots == 0
        assert result.remote_engines_registered == 0
    stock = results[("NixlConnector", "swa", 128, 64)]
    assert sum(result.silently_wrong_slots for result in stock) > 0


@pytest.mark.skipif(not LAST_TOKEN, reason="vLLM 0.34.0's last-token rule")
@pytest.mark.parametrize("connector", ["NixlConnector", "NixlHMAConnector"])
@pytest.mark.parametrize(("layout", "p_block", "d_block"), CELLS)
def test_on_034_both_deliver_every_slot_across_block_sizes(
    results, connector, layout, p_block, d_block
):
    """Upstream's last-token rule is right for these lists (stock), and ours
    no longer refuses the sliding window at the handshake."""
    for result in results[(connector, layout, p_block, d_block)]:
        assert result.local_ratio != result.remote_ratio
        assert result.error is None, result.error
        assert result.requests_failed == 0
        assert result.slots_checked > 100_000
        assert result.mismatched_slots == 0, result.examples


@pytest.mark.skipif(not LAST_TOKEN, reason="vLLM 0.34.0's last-token rule")
@pytest.mark.parametrize(("layout", "p_block", "d_block"), CELLS)
def test_on_034_ours_reads_only_the_uncached_tail_across_block_sizes(
    results, layout, p_block, d_block
):
    """Prefix caching kept across block sizes (0.33 refused it at the
    handshake): after a decode-side hit every slot right, fewer bytes read."""
    hit, whole, prefill_hit = results[
        ("NixlHMAConnector", f"{layout}+prefix-caching", p_block, d_block)
    ]
    for row in (hit, whole, prefill_hit):
        assert row.error is None and row.mismatched_slots == 0, (row.name, row.examples)
        assert row.slots_checked > 10_000
    assert 0 < hit.bytes < whole.bytes
