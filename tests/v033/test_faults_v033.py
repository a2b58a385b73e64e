"""Failing closed on vLLM 0.33, on real engines' workers and real NIXL (#13, items 3 and 4).

* Block lists that cannot be paired (the first request's attention list cut
  to one block, a list no rounding explains): ours fails that request alone,
  reported in ``failed_recving``, and the next batch arrives intact; stock
  0.33.0's pairing asserts escape ``start_load_kv`` (in an engine: the engine
  dies), and its next batch lands in pages of no request.
* Prefix caching with unequal kernel-per-logical ratios (a Mamba hybrid at
  prefill TP 2 -> decode TP 1): ours refuses at the handshake before the
  prefill engine is even registered; stock refuses too, but only after it
  registered the engine and loaded its agent. At equal TP prefix caching
  stays on and every slot arrives.
* Prefill's lease runs out and prefill reuses the blocks before decode reads
  (prefill TP 1 -> decode TP 1): ours fails every request, nothing wrong is
  delivered; stock 0.33.0 reads the reused blocks and reports success.
"""

from __future__ import annotations

import pytest

from tests.v033.cells import model_dirs, run_by_key
from vllm_nixl_hma import _compat
from vllm_nixl_hma.harness import coordinator

pytestmark = [pytest.mark.vllm033, pytest.mark.slow]

Scenario = coordinator.Scenario
UNPAIRABLE = [("hybrid", 2, 1), ("dense", 1, 1)]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    dirs = model_dirs(tmp_path_factory.mktemp("models"), ("hybrid", "dense"))
    cells = {}
    for connector in ("NixlHMAConnector", "NixlConnector"):
        for layout, p_tp, d_tp in UNPAIRABLE:
            cells[(connector, "unpairable", layout)] = coordinator.Cell(
                layout,
                dirs[layout],
                p_tp,
                d_tp,
                connector,
                [Scenario("mid-block", unpairable_first_request=True), Scenario("boundary")],
            )
        cells[(connector, "expired-lease", "1->1")] = coordinator.Cell(
            "hybrid", dirs["hybrid"], 1, 1, connector, [Scenario("mid-block")], expire_lease=True
        )
        # mamba_prefix_caching false: decode keeps the count rules
        cells[(connector, "prefix-caching", "2->1")] = coordinator.Cell(
            "hybrid",
            dirs["hybrid"],
            2,
            1,
            connector,
            [Scenario("mid-block")],
            prefix_caching=True,
            pair_by_position=False,
        )
        # decode-side prefix-cache hits at unequal ratios (#26)
        cells[(connector, "decode-hit", "2->1")] = coordinator.Cell(
            "hybrid",
            dirs["hybrid"],
            2,
            1,
            connector,
            [Scenario("decode-hit"), Scenario("no-hit"), Scenario("prefill-hit")],
            prefix_caching=True,
        )
    cells[("NixlHMAConnector", "decode-hit", "1->2")] = coordinator.Cell(
        "hybrid",
        dirs["hybrid"],
        1,
        2,
        "NixlHMAConnector",
        [Scenario("decode-hit"), Scenario("no-hit"), Scenario("prefill-hit")],
        prefix_caching=True,
    )
    cells[("NixlHMAConnector", "prefix-caching", "1->1")] = coordinator.Cell(
        "hybrid",
        dirs["hybrid"],
        1,
        1,
        "NixlHMAConnector",
        [Scenario("mid-block")],
        prefix_caching=True,
    )
    return run_by_key(cells, pool_size=3)


@pytest.mark.parametrize("layout", [layout for layout, _, _ in UNPAIRABLE])
def test_ours_fails_the_unpairable_request_alone(results, layout):
    faulty, next_batch = results[("NixlHMAConnector", "unpairable", layout)]
    assert faulty.error == "1 request(s) reported failed by the connector"
    assert faulty.requests_failed == 1
    assert faulty.slots_checked > 100_000
    assert faulty.silently_wrong_slots == 0  # the other two arrived intact
    assert all(line.startswith("req 0 ") for line in faulty.examples)  # only its slots are empty
    assert faulty.leaked_handles == 0
    assert next_batch.error is None and next_batch.mismatched_slots == 0
    assert next_batch.slots_checked > 100_000


@pytest.mark.parametrize("layout", [layout for layout, _, _ in UNPAIRABLE])
def test_stock_lets_the_pairing_assert_escape_or_reads_the_cut_list(results, layout):
    """Stock 0.33.0's pairing asserts escape ``start_load_kv``. vLLM 0.34.0
    pairs unequal ratios (the hybrid at 2 -> 1) from the last token instead,
    which takes a list cut short from its end: the cut request is reported
    delivered, its KV read from blocks of other tokens."""
    faulty, _ = results[("NixlConnector", "unpairable", layout)]
    if _compat.adapter() == "v034" and layout == "hybrid":
        assert faulty.error is None or "mismatched" in faulty.error, faulty.error
        assert faulty.requests_failed == 0
        assert faulty.silently_wrong_slots > 0
        assert all(line.startswith("req 0 ") for line in faulty.examples)
        return
    assert faulty.error is not None and faulty.error.startswith("AssertionError")
    assert faulty.slots_checked == 0  # the load command itself raised


def test_ours_refuses_prefix_caching_across_ratios_before_registering(results):
    (ours,) = results[("NixlHMAConnector", "prefix-caching", "2->1")]
    assert ours.local_ratio != ours.remote_ratio
    assert ours.requests_failed == 3 and ours.silently_wrong_slots == 0
    assert ours.remote_engines_registered == 0
    (stock,) = results[("NixlConnector", "prefix-caching", "2->1")]
    assert stock.requests_failed == 3
    assert stock.remote_engines_registered == 1  # registered and loaded, then refused


@pytest.mark.parametrize("cell", ["2->1", "1->2"])
def test_ours_reads_only_the_uncached_tail_after_a_decode_hit_across_ratios(results, cell):
    """Prefix caching of the hybrid at unequal ratios, paired by token
    position (``positions``): every slot right, fewer bytes than the same
    prompts read whole; and requests sharing a prefix's blocks on prefill
    (``prefill-hit``) read whole, every slot right."""
    hit, whole, prefill_hit = results[("NixlHMAConnector", "decode-hit", cell)]
    assert hit.local_ratio != hit.remote_ratio
    for row in (hit, whole, prefill_hit):
        assert row.error is None and row.mismatched_slots == 0, (row.name, row.examples)
        assert row.slots_checked > 100_000
    assert 0 < hit.bytes < whole.bytes


def test_stock_033_refuses_decode_hits_across_ratios(results):
    """0.33.0 refuses a Mamba hybrid with prefix caching across unequal
    ratios at handshake (after loading the remote agent): nothing read."""
    for row in results[("NixlConnector", "decode-hit", "2->1")]:
        assert row.requests_failed == 3 and row.silently_wrong_slots == 0, row.error
        assert row.bytes == 0


def test_ours_keeps_prefix_caching_at_equal_ratios(results):
    (ours,) = results[("NixlHMAConnector", "prefix-caching", "1->1")]
    assert ours.local_ratio == ours.remote_ratio
    assert ours.error is None and ours.mismatched_slots == 0
    assert ours.slots_checked > 100_000


def test_ours_refuses_to_read_past_prefills_lease_and_stock_reads_reused_blocks(results):
    (ours,) = results[("NixlHMAConnector", "expired-lease", "1->1")]
    assert ours.requests_failed == ours.requests == 3
    assert ours.silently_wrong_slots == 0
    (stock,) = results[("NixlConnector", "expired-lease", "1->1")]
    assert stock.error is None  # reported as delivered...
    assert stock.silently_wrong_slots > 0  # ...with another request's KV


def test_every_fault_of_the_check_is_handled_on_033(tmp_path):
    """``vllm-nixl-hma check --faults``'s list on vLLM 0.33, for ours, on every
    model kind (dense, sliding window with and without HMA, the hybrid):
    every request fails or is served intact, nothing wrong is delivered,
    nothing leaks (as judged for 0.33: ``faults.for_installed_vllm``). The
    mid-read kill stays in ``check --faults``, as on 0.21.0 (see
    tests/integration/test_faults.py)."""
    from vllm_nixl_hma.harness import faults

    ci_faults = tuple(f for f in faults.FAULTS if not f.kill_prefill_mid_read)
    results = faults.run_faults(ci_faults, "NixlHMAConnector", tmp_path, lambda line: None)
    assert [(r.name, r.model) for r in results] == [
        (f.name, kind.name) for f in ci_faults for kind in faults.MODEL_KINDS
    ]
    for result in results:
        assert result.ok, result
        assert result.silently_wrong_slots == 0
    failed = {(r.name, r.model): r.requests_failed for r in results}
    for kind in faults.MODEL_KINDS:  # our own refusals, on every kind
        assert failed[("expired-lease", kind.name)] == 3
        assert failed[("late-read", kind.name)] == 3
        assert failed[("unpairable", kind.name)] == 1
        # #26, #41: a span the lists do not fit (window-only: two blocks short)
        assert failed[("bad-token-span", kind.name)] == 1
