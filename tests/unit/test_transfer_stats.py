"""The plugin's counts inside vLLM's NIXL connector stats and on /metrics
(transfer_stats.py, #27), with vLLM's own stats and Prometheus classes and
a real prometheus_client registry; on vLLM 0.21.0 and 0.33 (tools/test.sh)."""

from __future__ import annotations

import functools
import importlib
import pickle
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from vllm_nixl_hma import _compat
from vllm_nixl_hma.core.transfer_records import DecodeRecord, Outcome, PrefillRecord, Reason
from vllm_nixl_hma.transfer_stats import NixlHMAKVConnectorStats

LABELS = {"model_name": "m", "engine": "0"}


def connector_class():
    module = importlib.import_module(f"vllm_nixl_hma.{_compat.adapter()}.connector")
    return module.NixlHMAConnector


def read(request_id: str, bytes_read: int = 1000, transfer_s: float = 0.004) -> DecodeRecord:
    return DecodeRecord(
        request_id, Outcome.READ, bytes_read=bytes_read, descriptors=4, transfer_s=transfer_s
    )


def test_an_interval_of_refusals_only_is_sent():
    """vLLM's own is_empty looks at its keys only: an interval in which every
    request was refused would be dropped on the worker and never counted."""
    stats = NixlHMAKVConnectorStats()
    assert stats.is_empty()
    stats.record_request(DecodeRecord("r", Outcome.REFUSED, Reason.HANDSHAKE))
    assert not stats.is_empty()
    sent = stats.clone_and_reset()  # what the worker hands vLLM each step
    assert stats.is_empty() and not sent.is_empty()


def test_ranks_and_intervals_add_up_as_vllm_aggregates_them():
    rank0, rank1 = NixlHMAKVConnectorStats(), NixlHMAKVConnectorStats()
    rank0.record_request(read("a", 100))
    rank0.record_request(DecodeRecord("b", Outcome.FAILED, Reason.TRANSFER))
    rank1.record_request(read("a", 300))
    rank1.record_prefill_request(PrefillRecord("p", ("agent",), 1))
    # the worker process -> engine core hop pickles the stats object
    total = pickle.loads(pickle.dumps(rank0)).aggregate(pickle.loads(pickle.dumps(rank1)))
    # the engine core -> API server hop carries ``data`` only
    rebuilt = connector_class().build_kv_connector_stats(data=total.data)
    assert isinstance(rebuilt, NixlHMAKVConnectorStats)
    reduced = rebuilt.reduce()
    assert reduced["NixlHMA requests read"] == 2
    assert reduced["NixlHMA requests not read"] == 1
    assert connector_class().build_kv_connector_stats().is_empty()


def test_a_side_without_our_keys_aggregates():
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import NixlKVConnectorStats

    ours = NixlHMAKVConnectorStats()
    ours.record_request(read("a"))
    vllms = NixlKVConnectorStats()
    vllms.record_failed_transfer()
    ours.aggregate(vllms)
    assert ours.data["num_failed_transfers"] == [1]
    assert ours.data["hma_decode_outcomes"] == ["read/none"]


@pytest.fixture
def prom():
    registry = CollectorRegistry()
    types = {
        Gauge: functools.partial(Gauge, registry=registry),
        Counter: functools.partial(Counter, registry=registry),
        Histogram: functools.partial(Histogram, registry=registry),
    }
    config = SimpleNamespace(kv_transfer_config=None)
    metrics = connector_class().build_prom_metrics(
        config, types, ["model_name", "engine"], {0: ["m", "0"]}
    )
    return metrics, registry


def sample(registry, name, **labels):
    return registry.get_sample_value(name, {**LABELS, **labels})


def test_every_outcome_and_reason_is_exported_from_the_start(prom):
    _, registry = prom
    for outcome, reason in [("read", "none"), ("refused", "stock_peer"), ("expired", "lease")]:
        value = sample(
            registry, "vllm:nixl_hma_decode_requests_total", outcome=outcome, reason=reason
        )
        assert value == 0.0
    # a pair no outcome admits is not a series
    assert (
        sample(registry, "vllm:nixl_hma_decode_requests_total", outcome="read", reason="lease")
        is None
    )
    assert sample(registry, "vllm:nixl_hma_prefill_requests_total", freed_by="lease") == 0.0


def test_observe_counts_each_request_once_per_record_beside_vllms_own_metrics(prom):
    metrics, registry = prom
    stats = NixlHMAKVConnectorStats()
    stats.record_request(read("a", 1000, 0.004))
    stats.record_request(read("b", 3000, 0.002))
    stats.record_request(DecodeRecord("c", Outcome.RECOMPUTED, Reason.LEASE))
    stats.record_prefill_request(PrefillRecord("p", (), 1, freed_by="lease"))
    stats.record_failed_transfer()  # vLLM's own
    metrics.observe(stats.data, 0)
    counter = "vllm:nixl_hma_decode_requests_total"
    assert sample(registry, counter, outcome="read", reason="none") == 2.0
    assert sample(registry, counter, outcome="recomputed", reason="lease") == 1.0
    assert sample(registry, "vllm:nixl_hma_decode_request_bytes_count") == 2.0
    assert sample(registry, "vllm:nixl_hma_decode_request_bytes_sum") == 4000.0
    seconds = sample(registry, "vllm:nixl_hma_decode_request_transfer_seconds_sum")
    assert seconds == pytest.approx(0.006)
    assert sample(registry, "vllm:nixl_hma_prefill_requests_total", freed_by="lease") == 1.0
    assert sample(registry, "vllm:nixl_num_failed_transfers_total") == 1.0


def test_a_malformed_report_is_not_exported(prom):
    metrics, registry = prom
    data = NixlHMAKVConnectorStats().data
    data["hma_decode_outcomes"] = ["read/lease"]  # no outcome admits that pair
    metrics.observe(data, 0)
    counter = "vllm:nixl_hma_decode_requests_total"
    assert sample(registry, counter, outcome="read", reason="none") == 0.0


def test_transfer_records_takes_a_bool_only():
    from vllm_nixl_hma.request_records import records_enabled

    assert records_enabled(None) is False
    assert records_enabled({"transfer_records": True}) is True
    with pytest.raises(ValueError, match="transfer_records"):
        records_enabled({"transfer_records": "yes"})
