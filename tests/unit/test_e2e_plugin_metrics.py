"""Parsing the plugin's counters off /metrics and its records off a log,
and judging a fault cell by them (e2e/plugin_metrics.py, #27)."""

from __future__ import annotations

import pytest

from vllm_nixl_hma.core.transfer_records import DecodeRecord, Outcome, PrefillRecord, Reason
from vllm_nixl_hma.e2e import plugin_metrics

# /metrics as prometheus_client writes it: two DP ranks (vLLM's engine label)
METRICS = """\
# HELP vllm:nixl_hma_decode_requests_total KV reads of P/D requests
# TYPE vllm:nixl_hma_decode_requests_total counter
vllm:nixl_hma_decode_requests_total{engine="0",model_name="m",outcome="read",reason="none"} 3.0
vllm:nixl_hma_decode_requests_total{engine="1",model_name="m",outcome="read",reason="none"} 2.0
vllm:nixl_hma_decode_requests_total{engine="0",model_name="m",outcome="refused",reason="ticket"} 1.0
vllm:nixl_hma_decode_requests_total{engine="0",model_name="m",outcome="failed",reason="timeout"} 0.0
vllm:nixl_hma_decode_request_bytes_count{engine="0",model_name="m"} 5.0
vllm:nixl_hma_decode_request_bytes_sum{engine="0",model_name="m"} 5000.0
vllm:nixl_hma_decode_request_bytes_bucket{engine="0",le="4096.0",model_name="m"} 5.0
vllm:nixl_hma_prefill_requests_total{engine="0",freed_by="lease",model_name="m"} 1.0
vllm:nixl_bytes_transferred_sum{engine="0",model_name="m"} 5000.0
"""


def test_counters_are_summed_over_vllms_label_sets_and_zeros_left_out():
    assert plugin_metrics.counts_from_metrics(METRICS) == {
        "decode/read/none": 5,
        "decode/refused/ticket": 1,
        "decode_reads": 5,
        "decode_bytes": 5000,
        "prefill/lease": 1,
    }


def test_the_log_records_add_up_to_the_same_counts():
    lines = [
        DecodeRecord("a", Outcome.READ, bytes_read=1000).to_json(),
        DecodeRecord("b", Outcome.READ, bytes_read=4000).to_json(),
        DecodeRecord("c", Outcome.REFUSED, Reason.TICKET).to_json(),
        PrefillRecord("p", freed_by="lease").to_json(),
    ]
    log = "\n".join(
        [
            "INFO 12-03 [engine.py:1] unrelated line",
            *(
                f"(Worker pid=1) INFO 12-03 [request_records.py:2] transfer record {x}"
                for x in lines
            ),
        ]
    )
    counts = plugin_metrics.counts_from_log(log)
    assert counts == {
        "decode/read/none": 2,
        "decode/refused/ticket": 1,
        "decode_reads": 2,
        "decode_bytes": 5000,
        "prefill/lease": 1,
    }
    metrics = dict(counts, **{"decode/read/none": 1, "decode_reads": 1})
    assert not plugin_metrics.records_match(metrics, counts)
    with pytest.raises(ValueError):
        plugin_metrics.counts_from_log('transfer record {"event":"other"}')


def test_a_fault_cell_is_judged_by_the_broken_requests_own_class():
    grown = {"decode/failed/unreachable": 1, "decode/read/none": 1, "decode_reads": 1}
    assert plugin_metrics.fault_records_ok("side-channel-unreachable", "fail", grown, False)
    # the same count under recompute must say recomputed
    assert not plugin_metrics.fault_records_ok(
        "side-channel-unreachable", "recompute", grown, False
    )
    recomputed = {"decode/recomputed/unreachable": 1, "decode/read/none": 1}
    assert plugin_metrics.fault_records_ok(
        "side-channel-unreachable", "recompute", recomputed, False
    )
    # another fault's class, or nothing counted, is wrong
    assert not plugin_metrics.fault_records_ok("lease-expired", "fail", grown, False)
    assert not plugin_metrics.fault_records_ok(
        "lease-expired", "fail", {"decode/read/none": 2}, False
    )
    # under recompute the next request's recomputation may be counted beside
    # the fault's own; under fail, or without the fault's own, it may not
    both = {"decode/recomputed/lease": 1, "decode/recomputed/timeout": 1}
    assert plugin_metrics.fault_records_ok("lease-expired", "recompute", both, False)
    assert not plugin_metrics.fault_records_ok(
        "lease-expired", "recompute", {"decode/recomputed/timeout": 1}, False
    )
    assert not plugin_metrics.fault_records_ok(
        "lease-expired", "fail", {"decode/expired/lease": 1, "decode/failed/timeout": 1}, False
    )
    # a flap may deliver the KV whole
    assert plugin_metrics.fault_records_ok(
        "prefill-link-flap", "fail", {"decode/read/none": 2}, True
    )


def test_every_e2e_fault_has_its_classes():
    from vllm_nixl_hma.e2e import faults

    assert set(plugin_metrics.FAULT_REASONS) == set(faults.ALL_FAULTS)


def test_delta_keeps_what_grew():
    assert plugin_metrics.delta({"a": 1, "b": 2}, {"a": 1, "b": 5, "c": 1}) == {"b": 3, "c": 1}


class MetricsOnly:
    """A decode engine as ``run._with_records`` sees it: /metrics only."""

    def __init__(self, text: str):
        self.text = text

    def get(self, path: str):
        assert path == "/metrics"
        return 200, self.text


def test_a_fail_cell_whose_request_errored_is_judged_by_its_counters_too(monkeypatch):
    """Under ``fail`` the broken request is answered with an error by design:
    its cell is still judged (a cell skipped for its error left fail's
    ``records_ok`` None in the first e2e run through real engines)."""
    from vllm_nixl_hma.e2e import faults, run

    monkeypatch.setattr(run, "RECORDS_WAIT_S", 0.0)
    line = 'vllm:nixl_hma_decode_requests_total{{engine="0",outcome="{}",reason="{}"}} 1.0\n'
    before = {"decode/read/none": 3}
    cells = [
        faults.FaultResult("side-channel-unreachable", "fail", ok=True, error='{"code": 500}'),
        faults.FaultResult("lease-expired", "fail", ok=True, error='{"code": 500}'),
    ]
    right = MetricsOnly(
        line.format("read", "none").replace("1.0", "3.0") + line.format("failed", "unreachable")
    )
    judged = run._with_records(
        "side-channel-unreachable", cells[:1], {"fail": right}, {"fail": before}
    )
    assert judged[0].records == {"decode/failed/unreachable": 1}
    assert judged[0].records_ok is True and judged[0].ok is True
    wrong = MetricsOnly(
        line.format("read", "none").replace("1.0", "3.0") + line.format("refused", "ticket")
    )
    judged = run._with_records("lease-expired", cells[1:], {"fail": wrong}, {"fail": before})
    assert judged[0].records_ok is False and judged[0].ok is False


def test_each_reads_time_is_taken_off_the_log_and_the_slowest_found_over_engines():
    """e2e's report carries each read's transfer time (#43), so a stalled
    read (seconds) is told from a slow link in a run's report."""

    def log(*records):
        return "\n".join(
            f"(Worker pid=1) INFO 12-07 [record_log.py:150] transfer record {r.to_json()}"
            for r in records
        )

    decode = log(
        DecodeRecord("a", Outcome.READ, bytes_read=4000, transfer_s=0.05),
        DecodeRecord("b", Outcome.READ, bytes_read=8000, transfer_s=12.9),
        DecodeRecord("c", Outcome.FAILED, Reason.TIMEOUT, slow=True),
        PrefillRecord("p", freed_by="notified"),
    )
    # read_s (the request's wait) wins over transfer_s (NIXL's handles summed)
    other = log(DecodeRecord("d", Outcome.READ, bytes_read=100, transfer_s=3.0, read_s=0.7))
    reads = {
        "decode": plugin_metrics.reads_from_log(decode),
        "decode-recompute": plugin_metrics.reads_from_log(other),
    }
    assert [r["request_id"] for r in reads["decode"]] == ["a", "b", "c"]
    assert reads["decode"][2] == {
        "request_id": "c",
        "outcome": "failed",
        "reason": "timeout",
        "bytes_read": 0,
        "transfer_s": None,
        "read_s": None,
        "slow": True,
    }
    slowest = plugin_metrics.slowest_reads(reads, count=2)
    assert [(r["engine"], r["request_id"], r["seconds"]) for r in slowest] == [
        ("decode", "b", 12.9),
        ("decode-recompute", "d", 0.7),
    ]
