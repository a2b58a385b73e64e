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
