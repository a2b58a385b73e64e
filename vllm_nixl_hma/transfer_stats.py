"""The plugin's counters inside vLLM's own NIXL connector stats and /metrics
(#27), on vLLM 0.21.0 and 0.33 alike (both keep these classes at the same
path).

vLLM moves connector stats from each TP worker to the engine core, sums an
engine's ranks (``KVOutputAggregator``: ``aggregate``) and hands ``data`` to
the API server, which rebuilds the stats with the connector's
``build_kv_connector_stats`` (the interval's log line: ``reduce``) and feeds
``data`` to the connector's ``build_prom_metrics`` object (``observe``). Our
part of ``data`` is ``OutcomeCounts.as_data()``: lists that vLLM's own
``aggregate`` extends like its own. The metrics (docs: README, "Metrics"):

- ``vllm:nixl_hma_decode_requests_total{outcome, reason}``: one per request
  each decode TP rank read, refused, failed, let expire or handed back to be
  recomputed; every allowed pair is exported from the start at 0.
- ``vllm:nixl_hma_decode_request_bytes`` and
  ``vllm:nixl_hma_decode_request_transfer_seconds``: per request read (per
  rank), its bytes and NIXL transfer time summed over its reads.
- ``vllm:nixl_hma_prefill_requests_total{freed_by}``: requests prefill served,
  freed when every expected reader notified (``notified``) or when its lease
  ran out (``lease``).
- ``vllm:nixl_hma_decode_slow_reads_total``: reads each decode TP rank found
  still in flight ``slow_read_s`` after they were posted (``core.slow_reads``),
  counted while they are (#43).

Label values come from closed sets (``transfer_records.REASONS``): no request
or engine id ever becomes one. vLLM's labels (``model_name``, ``engine``)
come first, as on vLLM's own metrics.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import (
    NixlKVConnectorStats,
    NixlPromMetrics,
)
from vllm.logger import init_logger
from vllm.v1.metrics.utils import create_metric_per_engine

from vllm_nixl_hma.core.transfer_records import (
    DATA_KEYS,
    DECODE_BYTES,
    DECODE_OUTCOMES,
    DECODE_SLOW_READS,
    DECODE_TRANSFER_S,
    FREED_BY,
    PREFILL_FREED,
    REASONS,
    DecodeRecord,
    Outcome,
    OutcomeCounts,
    PrefillRecord,
    Reason,
)

__all__ = ["METRIC_NAMES", "NixlHMAKVConnectorStats", "NixlHMAPromMetrics"]

logger = init_logger(f"vllm.{__name__}")

DECODE_REQUESTS = "vllm:nixl_hma_decode_requests"
DECODE_REQUEST_BYTES = "vllm:nixl_hma_decode_request_bytes"
DECODE_REQUEST_TRANSFER_S = "vllm:nixl_hma_decode_request_transfer_seconds"
PREFILL_REQUESTS = "vllm:nixl_hma_prefill_requests"
DECODE_SLOW_READS_METRIC = "vllm:nixl_hma_decode_slow_reads"
#: as registered (prometheus_client adds ``_total`` to a counter's samples)
METRIC_NAMES = (
    DECODE_REQUESTS,
    DECODE_REQUEST_BYTES,
    DECODE_REQUEST_TRANSFER_S,
    PREFILL_REQUESTS,
    DECODE_SLOW_READS_METRIC,
)

#: 4 KiB .. 16 GiB, a factor 4 apart
_BYTES_BUCKETS = [float(4**i * 1024) for i in range(1, 13)]
_SECONDS_BUCKETS = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0]


@dataclass
class NixlHMAKVConnectorStats(NixlKVConnectorStats):
    """vLLM's ``NixlKVConnectorStats`` plus the plugin's per-request counts.

    vLLM's own keys and methods are untouched. ``reset`` adds our keys;
    ``is_empty`` also looks at them (vLLM's looks at its own keys only, so
    an interval with only refusals would be dropped before it is sent);
    ``aggregate`` tolerates a side without our keys; ``reduce`` adds two
    numbers to vLLM's interval log line. Remove when: never (ours)."""

    def reset(self) -> None:
        super().reset()
        for key in DATA_KEYS:
            self.data[key] = []

    def _lists(self) -> OutcomeCounts:
        """Our lists as ``OutcomeCounts`` sharing them (adding adds to ``data``)."""
        for key in DATA_KEYS:
            self.data.setdefault(key, [])
        return OutcomeCounts(
            self.data[DECODE_OUTCOMES],
            self.data[DECODE_BYTES],
            self.data[DECODE_TRANSFER_S],
            self.data[PREFILL_FREED],
            self.data[DECODE_SLOW_READS],
        )

    def record_request(self, record: DecodeRecord) -> None:
        self._lists().add(record)

    def count_requests(self, counts: Iterable[tuple[Outcome, Reason, int, float | None]]) -> None:
        """``record_request`` without records, for many requests at once
        (decode's step counts this way): ``OutcomeCounts.count_many``."""
        self._lists().count_many(counts)

    def record_prefill_request(self, record: PrefillRecord) -> None:
        self._lists().add_prefill(record)

    def record_slow_read(self) -> None:
        """A read found in flight past ``slow_read_s`` (``core.slow_reads``)."""
        self._lists().count_slow_read()

    def is_empty(self) -> bool:
        return super().is_empty() and not any(self.data.get(key) for key in DATA_KEYS)

    def aggregate(self, other: Any) -> NixlHMAKVConnectorStats:
        for key in DATA_KEYS:
            self.data.setdefault(key, [])
        super().aggregate(other)
        return self

    def reduce(self) -> dict[str, int | float]:
        reduced = dict(super().reduce())
        counts = self._lists().counts()
        read = counts.get("read/none", 0)
        reduced["NixlHMA requests read"] = read
        reduced["NixlHMA requests not read"] = sum(counts.values()) - read
        return reduced


class NixlHMAPromMetrics(NixlPromMetrics):
    """vLLM's NIXL metrics plus the plugin's (module docstring). ``observe``
    runs vLLM's part, then ours from the same ``data``; a malformed part of
    ours is logged and dropped, never exported."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict,
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        requests = self._counter_cls(
            name=DECODE_REQUESTS,
            documentation="KV reads of P/D requests per decode TP rank, by outcome "
            "(read, refused, failed, expired, recomputed) and reason (NixlHMAConnector).",
            labelnames=[*labelnames, "outcome", "reason"],
        )
        self.decode_requests = {
            engine: {
                f"{outcome.value}/{reason.value}": requests.labels(
                    *values, outcome.value, reason.value
                )
                for outcome, reasons in REASONS.items()
                for reason in sorted(reasons, key=lambda r: r.value)
            }
            for engine, values in per_engine_labelvalues.items()
        }
        self.decode_request_bytes = create_metric_per_engine(
            self._histogram_cls(
                name=DECODE_REQUEST_BYTES,
                documentation="Bytes one decode TP rank read for one P/D request "
                "(NixlHMAConnector).",
                buckets=_BYTES_BUCKETS,
                labelnames=labelnames,
            ),
            per_engine_labelvalues,
        )
        self.decode_request_transfer_s = create_metric_per_engine(
            self._histogram_cls(
                name=DECODE_REQUEST_TRANSFER_S,
                documentation="NIXL transfer time of one decode TP rank's reads for one "
                "P/D request, summed (NixlHMAConnector).",
                buckets=_SECONDS_BUCKETS,
                labelnames=labelnames,
            ),
            per_engine_labelvalues,
        )
        prefill = self._counter_cls(
            name=PREFILL_REQUESTS,
            documentation="P/D requests prefill served per TP rank, by how their blocks "
            "were freed: every reader notified, or the lease ran out (NixlHMAConnector).",
            labelnames=[*labelnames, "freed_by"],
        )
        self.prefill_requests = {
            engine: {freed_by: prefill.labels(*values, freed_by) for freed_by in FREED_BY}
            for engine, values in per_engine_labelvalues.items()
        }
        self.decode_slow_reads = create_metric_per_engine(
            self._counter_cls(
                name=DECODE_SLOW_READS_METRIC,
                documentation="KV reads per decode TP rank found still in flight "
                "slow_read_s after they were posted (NixlHMAConnector).",
                labelnames=labelnames,
            ),
            per_engine_labelvalues,
        )

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        super().observe(transfer_stats_data, engine_idx)
        try:
            counts = OutcomeCounts.from_data(transfer_stats_data)
        except ValueError as e:
            logger.error("NixlHMAConnector: dropped a malformed stats report: %s", e)
            return
        requests = self.decode_requests[engine_idx]
        for key in counts.outcomes:
            requests[key].inc()
        for value in counts.bytes_read:
            self.decode_request_bytes[engine_idx].observe(value)
        for value in counts.transfer_s:
            self.decode_request_transfer_s[engine_idx].observe(value)
        for freed_by in counts.prefill_freed:
            self.prefill_requests[engine_idx][freed_by].inc()
        if counts.slow_reads:
            self.decode_slow_reads[engine_idx].inc(len(counts.slow_reads))
