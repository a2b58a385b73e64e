"""The lease's pure rules on vLLM 0.33's clocks (``lease.local_deadline``); no vLLM import."""

from __future__ import annotations

import pytest

from vllm_nixl_hma.core import lease


def test_no_deadline_means_no_lease():
    assert lease.local_deadline(None, 3.0, last_heartbeat_local_s=10.0, extension_s=20.0) is None


def test_the_deadline_moves_onto_decodes_clock_by_the_handshake_offset():
    # prefill's clock runs 1000 s ahead of decode's
    assert lease.local_deadline(1030.0, 1000.0) == pytest.approx(30.0)
    assert lease.local_deadline(1030.0, -5.0) == pytest.approx(1035.0)


def test_a_posted_heartbeat_extends_by_prefills_extension_only_if_prefill_said_it():
    # posted at 25 s on decode's clock; prefill extends to at least 25 + 20
    assert lease.local_deadline(1030.0, 1000.0, 25.0, 20.0) == pytest.approx(45.0)
    # an old heartbeat never shortens the lease
    assert lease.local_deadline(1030.0, 1000.0, 1.0, 20.0) == pytest.approx(30.0)
    # a prefill that did not say its extension: heartbeats count for nothing
    assert lease.local_deadline(1030.0, 1000.0, 25.0, None) == pytest.approx(30.0)


@pytest.mark.parametrize(("now", "expected"), [(24.0, False), (25.0, False), (25.5, True)])
def test_a_read_within_the_margin_of_the_local_deadline_is_too_late(now, expected):
    deadline = lease.local_deadline(1030.0, 1000.0)
    assert lease.expired(deadline, now, margin_s=5.0) is expected


# --- the rules both releases' workers apply (lease.refuse_read, untrusted_read)


@pytest.mark.parametrize(
    ("now", "local_blocks", "refused"),
    [
        (94.0, [[3, 4], []], False),  # 6 s before the end: outside the 5 s margin
        (96.0, [[3, 4], []], True),  # 4 s before the end: inside it
        (200.0, [[3, 4], []], True),  # long after
        (200.0, [[], []], False),  # nothing to read, only prefill to notify
        (200.0, [], False),  # no group at all (a notify-only copy)
    ],
)
def test_a_read_starts_only_outside_the_margin_and_only_with_blocks_to_read(
    now, local_blocks, refused
):
    assert lease.refuse_read(100.0, now, 5.0, local_blocks) is refused


def test_no_deadline_refuses_nothing():
    assert lease.refuse_read(None, 1e12, 5.0, [[1]]) is False
    assert lease.untrusted_read(None, 1e12, 5.0) is False


@pytest.mark.parametrize(("finished", "untrusted"), [(94.9, False), (95.1, True)])
def test_a_finished_read_is_untrusted_inside_the_margin(finished, untrusted):
    assert lease.untrusted_read(100.0, finished, 5.0) is untrusted


def test_the_margin_comes_from_the_extra_config_or_the_default():
    assert lease.configured_margin_s(None) == 5.0
    assert lease.configured_margin_s({}) == 5.0
    assert lease.configured_margin_s({"lease_margin_s": "0.5"}) == 0.5


def test_only_requests_whose_params_carry_the_field_are_handed_to_the_workers():
    entries = [
        ("a", {lease.PARAM: 1.5, "other": 1}),
        ("b", {"other": 2}),  # no lease: nothing carried
        ("c", None),  # no kv_transfer_params at all
        (None, {lease.PARAM: 9.0}),  # no key (no remote request id): skipped
        ("d", {lease.PARAM: 0.0}),  # a falsy value is still carried
    ]
    assert lease.carried_by_request(entries, lease.PARAM) == {"a": 1.5, "d": 0.0}


def test_the_missing_attribute_warning_names_the_attribute_and_the_consequence():
    text = lease.missing_attribute_warning("vllm_nixl_hma_x", "reads are not checked")
    assert "vllm_nixl_hma_x" in text and text.endswith("; reads are not checked")


@pytest.mark.parametrize(
    ("deadline", "in_flight", "timeout", "reason"),
    [
        (1000.0, 1.0, 600.0, None),  # young read, lease far off
        (None, 1.0, 600.0, None),  # no lease (stock prefill), young read
        (1000.0, 600.0, 600.0, "timeout"),  # in flight read_timeout_s: given up
        (None, 599.9, 600.0, None),
        (None, 10_000.0, None, None),  # no limit configured, no lease: waits
        (104.9, 1.0, 600.0, "lease"),  # lease ends within the 5 s margin of now=100
        (105.1, 1.0, None, None),
        (104.9, None, None, "lease"),  # post time unknown: the lease still bounds it
    ],
)
def test_a_read_in_flight_is_given_up_at_the_lease_margin_or_after_the_timeout(
    deadline, in_flight, timeout, reason
):
    assert lease.abandon_read(deadline, 100.0, 5.0, in_flight, timeout) == reason


def test_the_read_timeout_comes_from_the_extra_config_or_the_default():
    assert lease.configured_read_timeout_s(None) == lease.DEFAULT_READ_TIMEOUT_S == 600.0
    assert lease.configured_read_timeout_s({"read_timeout_s": 30}) == 30.0
    assert lease.configured_read_timeout_s({"read_timeout_s": None}) is None


@pytest.mark.parametrize("value", [0, -1, "30", True, [30]])
def test_a_read_timeout_that_is_not_a_positive_number_names_the_key(value):
    with pytest.raises(ValueError, match="read_timeout_s"):
        lease.configured_read_timeout_s({"read_timeout_s": value})
