"""Per-request transfer records and outcome counts (core/transfer_records.py, #27)."""

from __future__ import annotations

import json

import pytest

from vllm_nixl_hma.core.transfer_records import (
    DECODE_BYTES,
    DECODE_OUTCOMES,
    DECODE_SLOW_READS,
    DECODE_TRANSFER_S,
    PREFILL_FREED,
    REASON_ATTR,
    REASONS,
    DecodeRecord,
    Outcome,
    OutcomeCounts,
    PrefillRecord,
    Reason,
    outcome_of,
    reason_of_handshake_error,
)


def read(request_id: str = "r1", bytes_read: int = 4096, transfer_s: float = 0.002):
    return DecodeRecord(
        request_id,
        Outcome.READ,
        remote_engine_id="prefill-0",
        remote_host="10.0.0.2",
        local_tp_rank=0,
        remote_tp_ranks=(0, 1),
        groups=2,
        kernel_blocks=12,
        descriptors=40,
        bytes_read=bytes_read,
        posted_at_s=1_800_000_000.25,
        post_s=0.0001,
        transfer_s=transfer_s,
    )


def test_a_read_is_one_json_line_with_every_field_an_operator_asks_for():
    line = read().to_json()
    assert "\n" not in line
    row = json.loads(line)
    assert row == {
        "event": "decode_read",
        "request_id": "r1",
        "outcome": "read",
        "reason": "none",
        "remote_engine_id": "prefill-0",
        "remote_host": "10.0.0.2",
        "local_tp_rank": 0,
        "remote_tp_ranks": [0, 1],
        "groups": 2,
        "kernel_blocks": 12,
        "descriptors": 40,
        "bytes_read": 4096,
        "posted_at_s": 1_800_000_000.25,
        "post_s": 0.0001,
        "transfer_s": 0.002,
        "read_s": None,
        "slow": False,
        "detail": None,
    }


@pytest.mark.parametrize(
    ("outcome", "reason"),
    [
        (Outcome.READ, Reason.LEASE),
        (Outcome.REFUSED, Reason.NONE),
        (Outcome.REFUSED, Reason.TRANSFER),  # a transfer that failed was not refused
        (Outcome.FAILED, Reason.TICKET),
        (Outcome.EXPIRED, Reason.UNPAIRABLE),
        (Outcome.RECOMPUTED, Reason.NONE),
    ],
)
def test_an_outcome_takes_only_its_own_reasons(outcome, reason):
    with pytest.raises(ValueError, match=f"{outcome.value}.*{reason.value}"):
        DecodeRecord("r", outcome, reason)


def test_every_reason_belongs_to_some_outcome_and_recomputes_cover_every_non_read():
    used = set().union(*REASONS.values())
    assert used == set(Reason)
    not_read = REASONS[Outcome.REFUSED] | REASONS[Outcome.FAILED] | REASONS[Outcome.EXPIRED]
    assert REASONS[Outcome.RECOMPUTED] == not_read


def test_a_refusal_read_nothing():
    DecodeRecord("r", Outcome.REFUSED, Reason.TICKET, detail="ticket expired")
    with pytest.raises(ValueError, match="refused request read nothing"):
        DecodeRecord("r", Outcome.REFUSED, Reason.UNPAIRABLE, descriptors=3, bytes_read=96)


@pytest.mark.parametrize(
    "bad",
    [
        {"bytes_read": -1},
        {"descriptors": 1.5},
        {"groups": True},
        {"remote_tp_ranks": (0, -1)},
        {"transfer_s": float("nan")},
        {"post_s": -0.1},
    ],
)
def test_impossible_numbers_are_refused(bad):
    with pytest.raises(ValueError):
        DecodeRecord("r", Outcome.READ, **bad)


def test_a_prefill_record_says_who_read_and_how_the_blocks_were_freed():
    row = json.loads(PrefillRecord("p1", ("agent-a", "agent-b"), 2, "notified", 0.3).to_json())
    assert row == {
        "event": "prefill_served",
        "request_id": "p1",
        "readers": ["agent-a", "agent-b"],
        "readers_expected": 2,
        "freed_by": "notified",
        "held_s": 0.3,
    }
    PrefillRecord("p2", ("agent-a",), 2, "lease", 480.0)  # one reader never came
    with pytest.raises(ValueError, match="1 of 2 expected readers"):
        PrefillRecord("p3", ("agent-a",), 2, "notified")
    with pytest.raises(ValueError, match="freed_by"):
        PrefillRecord("p4", freed_by="gc")


def test_counts_add_up_per_outcome_and_reason_and_merge_as_vllm_sums_ranks():
    rank0 = OutcomeCounts.of(
        [
            read("a", 100, 0.001),
            read("b", 300, 0.003),
            DecodeRecord("c", Outcome.REFUSED, Reason.HANDSHAKE),
            DecodeRecord("d", Outcome.EXPIRED, Reason.LEASE),
        ]
    )
    rank0.add_prefill(PrefillRecord("p", ("agent-a",), 1))
    rank1 = OutcomeCounts.of(
        [read("a", 100, 0.002), DecodeRecord("c", Outcome.REFUSED, Reason.HANDSHAKE)]
    )
    rank1.add_prefill(PrefillRecord("q", (), 1, freed_by="lease"))
    total = OutcomeCounts().merge(rank0).merge(rank1)
    assert total.by_outcome() == {
        (Outcome.READ, Reason.NONE): 3,
        (Outcome.REFUSED, Reason.HANDSHAKE): 2,
        (Outcome.EXPIRED, Reason.LEASE): 1,
    }
    assert total.counts() == {"read/none": 3, "refused/handshake": 2, "expired/lease": 1}
    assert total.prefill_counts() == {"notified": 1, "lease": 1}
    assert sorted(total.bytes_read) == [100, 100, 300]
    assert sorted(total.transfer_s) == [0.001, 0.002, 0.003]
    assert OutcomeCounts().is_empty() and not total.is_empty()
    only_prefill = OutcomeCounts()
    only_prefill.add_prefill(PrefillRecord("p", ("agent-a",), 1))
    assert not only_prefill.is_empty()


def test_counts_travel_as_lists_that_vllms_list_extending_aggregate_sums():
    """vLLM's NixlKVConnectorStats.aggregate extends every list of the other
    side's data into its own: doing that to two ``as_data`` dicts must give
    the merged counts."""
    a = OutcomeCounts.of([read("a"), DecodeRecord("b", Outcome.FAILED, Reason.TIMEOUT)])
    b = OutcomeCounts.of([read("c", 7, 0.5)])
    b.count_slow_read()  # a read found slow travels the same way (#43)
    data = a.as_data()
    for key, values in b.as_data().items():
        assert isinstance(data[key], list)
        data[key].extend(values)
    assert OutcomeCounts.from_data(data) == OutcomeCounts().merge(a).merge(b)


def test_counts_cross_a_process_boundary_and_malformed_ones_are_refused():
    counts = OutcomeCounts.of([read(), DecodeRecord("x", Outcome.FAILED, Reason.TRANSFER)])
    counts.count_slow_read()
    data = json.loads(json.dumps(counts.as_data()))  # strings, numbers and lists only
    assert OutcomeCounts.from_data(data) == counts
    assert OutcomeCounts.from_data(None).is_empty()
    # vLLM's own keys beside ours are not ours to check
    assert OutcomeCounts.from_data({**data, "transfer_duration": [0.1]}) == counts
    for bad in (
        {DECODE_OUTCOMES: ["read/lease"]},
        {DECODE_OUTCOMES: ["gone/none"]},
        {DECODE_BYTES: [-5]},
        {DECODE_BYTES: [True]},
        {DECODE_TRANSFER_S: [float("inf")]},
        {PREFILL_FREED: ["gc"]},
        {DECODE_SLOW_READS: [2]},
        {DECODE_SLOW_READS: [True]},
    ):
        with pytest.raises(ValueError):
            OutcomeCounts.from_data(bad)


@pytest.mark.parametrize("reason", [r for r in Reason if r is not Reason.NONE])
def test_the_policy_decides_between_the_reasons_own_outcome_and_recomputed(reason):
    fail = outcome_of(reason, recompute=False)
    assert fail is not Outcome.RECOMPUTED and reason in REASONS[fail]
    assert outcome_of(reason, recompute=True) is Outcome.RECOMPUTED
    with pytest.raises(ValueError):
        outcome_of(Reason.NONE, recompute=False)


def test_a_handshake_error_is_classed_by_its_own_reason_then_by_its_type():
    from vllm_nixl_hma.core.errors import IncompatibleRemoteError

    refused = IncompatibleRemoteError("block_size", 16, 32, "set the same --block-size")
    assert reason_of_handshake_error(refused) is Reason.HANDSHAKE
    setattr(refused, REASON_ATTR, Reason.STOCK_PEER)
    assert reason_of_handshake_error(refused) is Reason.STOCK_PEER
    assert reason_of_handshake_error(TimeoutError("no answer")) is Reason.UNREACHABLE
    assert reason_of_handshake_error(ConnectionRefusedError()) is Reason.UNREACHABLE


def test_zmq_errors_are_unreachable_and_upstreams_own_refusals_are_handshake():
    """0.33's upstream handshake raises ``RuntimeError`` when prefill's
    compatibility hash or engine id differs (a refusal of what prefill
    sent, as the mismatched-layout fault shows on 0.33), and ZeroMQ's
    ``Again`` when the side channel does not answer in time."""
    zmq = pytest.importorskip("zmq")

    assert reason_of_handshake_error(zmq.Again()) is Reason.UNREACHABLE
    assert reason_of_handshake_error(zmq.ZMQError(111)) is Reason.UNREACHABLE
    hash_refusal = RuntimeError("NIXL compatibility hash mismatch. Local: a, Remote: b.")
    assert reason_of_handshake_error(hash_refusal) is Reason.HANDSHAKE
    assert reason_of_handshake_error(ValueError("bad metadata")) is Reason.HANDSHAKE


def test_nixls_own_errors_in_a_handshake_are_transfer_failures():
    """Loading prefill's agent with its data path cut raised NIXL's
    ``nixlBackendError`` (NIXL_ERR_BACKEND) in the dense e2e run across
    hosts: NIXL could not set up the read, not a refusal of prefill's record."""
    from nixl import _bindings as bindings  # whichever wheel's (nixl_cu12, nixl_cu13)

    assert reason_of_handshake_error(bindings.nixlBackendError("NIXL_ERR_BACKEND")) is (
        Reason.TRANSFER
    )
    assert reason_of_handshake_error(bindings.nixlRemoteDisconnectError("x")) is Reason.TRANSFER
    assert reason_of_handshake_error(RuntimeError("NIXL_ERR_BACKEND")) is Reason.HANDSHAKE


def test_a_slow_read_alone_is_something_to_report_and_its_record_says_so():
    """A read found past ``slow_read_s`` is counted while still in flight:
    an interval with nothing else must still be sent (#43)."""
    counts = OutcomeCounts()
    counts.count_slow_read()
    assert not counts.is_empty()
    assert json.loads(read().to_json())["slow"] is False
    assert json.loads(DecodeRecord("s", Outcome.READ, slow=True).to_json())["slow"] is True
    with pytest.raises(ValueError):
        DecodeRecord("s", Outcome.READ, slow=1)
