"""The bound past which a read in flight is slow (core/slow_reads.py, #43)."""

from __future__ import annotations

import pytest

from vllm_nixl_hma.core import slow_reads


def test_absent_is_the_default_and_null_counts_none():
    assert slow_reads.configured_slow_read_s(None) == slow_reads.DEFAULT_SLOW_READ_S == 2.0
    assert slow_reads.configured_slow_read_s({"slow_read_s": 0.5}) == 0.5
    assert slow_reads.configured_slow_read_s({"slow_read_s": None}) is None
    assert not slow_reads.is_slow(100.0, None)


@pytest.mark.parametrize("value", [0, -1, True, "2", float("nan"), float("inf")])
def test_anything_else_is_refused_naming_key_and_value(value):
    with pytest.raises(ValueError, match=f"slow_read_s={value!r}"):
        slow_reads.configured_slow_read_s({"slow_read_s": value})


def test_slow_is_strictly_past_the_bound():
    assert not slow_reads.is_slow(2.0, 2.0)
    assert slow_reads.is_slow(2.01, 2.0)
    assert not slow_reads.is_slow(None, 2.0)  # a read whose post time is unknown


def test_the_warning_names_the_request_the_peer_and_nixls_state():
    line = slow_reads.describe(
        "req-9",
        3.25,
        2.0,
        engine_id="prefill-engine",
        remote_tp_ranks=[0, 1],
        kernel_blocks=18,
        handle_states=["PROC", "DONE"],
    )
    for part in ("req-9", "3.2 s", "slow_read_s 2", "18 kernel blocks", "prefill-engine"):
        assert part in line, part
    assert "[0, 1]" in line and "2 NIXL handle(s)" in line and "PROC, DONE" in line
