"""Per-request records on real NIXL (#27): several requests read in one step
and taken by one ``_pop_done_transfers`` call, as vLLM's step takes them;
each request's record carries its own reads' bytes and descriptors (NIXL's
telemetry of its own handles), and the records add up to what NIXL moved.
Two NIXL agents in this process, DRAM caches, UCX on loopback.
"""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest

from vllm_nixl_hma import NixlHMAConnectorWorker
from vllm_nixl_hma.harness.read_path import REMOTE_ENGINE, build_live_read_path
from vllm_nixl_hma.request_records import RECORD_LOG, RECORDS_LOGGER
from vllm_nixl_hma.transfer_stats import NixlHMAKVConnectorStats

LAYERS = 3
RATIO = 4
PAGE_BYTES = 256
LOGICAL_BLOCKS = 40

#: request id -> (local logical block ids, remote logical block ids); sizes differ
REQUESTS = {
    "one-block": ([[7]], [[30]]),
    "five-blocks": ([[1, 2, 3, 4, 5]], [[20, 9, 11, 3, 14]]),
    "twelve-blocks": (
        [[10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 21, 22]],
        [[26, 2, 4, 6, 8, 31, 33, 35, 37, 39, 16, 18]],  # never 0: vLLM's null block
    ),
}
# no two neighbours are contiguous on both sides: NIXL (>= 1.5) would merge them
# into one descriptor


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def record_lines():
    records_logger = logging.getLogger(RECORDS_LOGGER)
    handler = _Lines()
    records_logger.addHandler(handler)
    level = records_logger.level
    records_logger.setLevel(logging.INFO)
    yield handler.lines
    records_logger.removeHandler(handler)
    records_logger.setLevel(level)


def test_each_request_of_a_step_gets_its_own_reads_telemetry(record_lines):
    live = build_live_read_path(
        NixlHMAConnectorWorker,
        ["full_attention"],
        RATIO,
        layers=LAYERS,
        logical_blocks=LOGICAL_BLOCKS,
        page_bytes=PAGE_BYTES,
    )
    try:
        worker = live.worker
        worker.xfer_stats = NixlHMAKVConnectorStats()
        worker.kv_transfer_config = SimpleNamespace(
            enable_permute_local_kv=False,
            kv_connector_extra_config={"transfer_records": True},
            kv_load_failure_policy="fail",
        )
        for request_id, (local_ids, remote_ids) in REQUESTS.items():
            live.read(request_id, local_ids, remote_ids)
        for request_id in REQUESTS:  # every read ended, none taken yet
            for handle in worker._recving_transfers[request_id]:
                while worker.nixl_wrapper.check_xfer_state(handle) == "PROC":
                    pass
        done = worker._pop_done_transfers(worker._recving_transfers)  # one call, as a step
        assert done == set(REQUESTS)
        for request_id in REQUESTS:
            worker._record_received(request_id, live.meta(request_id), failed=False)
        worker._write_records()
        assert RECORD_LOG.flush(30)
        nixl_bytes = sum(worker.xfer_stats.data["bytes_transferred"])
        nixl_descriptors = sum(worker.xfer_stats.data["num_descriptors"])
        counted = worker.xfer_stats.data["hma_decode_outcomes"]
        counted_bytes = worker.xfer_stats.data["hma_decode_bytes"]
    finally:
        live.close()

    records = {}
    for line in record_lines:
        record = json.loads(line.removeprefix("transfer record "))
        records[record["request_id"]] = record
    assert set(records) == set(REQUESTS)
    for request_id, (local_ids, _) in REQUESTS.items():
        record = records[request_id]
        logical = len(local_ids[0])
        # the request's own bytes: its logical blocks' pages in every layer
        assert record["bytes_read"] == logical * RATIO * PAGE_BYTES * LAYERS, request_id
        # ours reads one descriptor per logical block and layer
        assert record["descriptors"] == logical * LAYERS, request_id
        assert record["kernel_blocks"] == logical * RATIO
        assert record["groups"] == 1 and record["remote_tp_ranks"] == [0]
        assert record["outcome"] == "read" and record["transfer_s"] > 0
        assert record["remote_engine_id"] == REMOTE_ENGINE
    assert sum(r["bytes_read"] for r in records.values()) == nixl_bytes
    assert sum(r["descriptors"] for r in records.values()) == nixl_descriptors
    assert counted == ["read/none"] * len(REQUESTS)
    assert sorted(counted_bytes) == sorted(r["bytes_read"] for r in records.values())
