"""What per-request records and metrics cost decode's step (#27), measured (not
part of the test suite).

    $(bash tools/env.sh)/bin/python benchmarks/records.py [--json] [--quick]

Decode's step spends, per request it reads: posting the reads
(``_read_blocks_for_req``: expansion, pairing, descriptor ids, NIXL's post)
and, once NIXL says they are done, taking them (``_pop_done_transfers``:
NIXL's telemetry, the handles released). Records add to both: what is read is
noted as it is posted, ``_pop_done_transfers`` runs per request (so NIXL's
telemetry is known to be that request's), and each finished request becomes a
``DecodeRecord``, counted in the connector stats and, with
``transfer_records`` on, written as a JSON line (here to a file, as an
engine's log goes to one).

One real worker of ours (vLLM 0.21.0, real NIXL agents over UCX on loopback,
``harness.read_path.build_live_read_path``: decode TP 1 reads prefill TP 1),
batches of ``BATCH`` requests per step, alternately with records on and off
(off: the worker's own methods without the records mixin), on the same
requests, in one run; stock vLLM 0.21.0's worker on the same requests after
it, alone in the process. The wait for NIXL to finish is left out of the
timer (it is the link's, ``run.py`` measures it against raw NIXL and memcpy):
timed is the step thread's wall time in posting and in taking the finished
reads (and, on, making the records). Per request: the batch's time over
``BATCH``; medians. ``on_over_off`` is the cost ratio the issue bounds (at
most 1.05).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
# before vLLM is imported: the conv-state layout P/D needs (its Mamba reads)
os.environ.setdefault("VLLM_SSM_CONV_STATE_LAYOUT", "DS")
sys.path.insert(0, str(ROOT))

BATCH = 8
KERNEL_BLOCK_TOKENS = 16
LAYOUTS = {"dense": ["full_attention"], "hybrid": ["full_attention", "mamba"]}
PAGE_BYTES = {"dense": 64, "hybrid": 256}


def _requests(kinds, logical_per_request: int, count: int, seed: int) -> list:
    import numpy as np

    rng = np.random.default_rng(seed)
    pool = 2 * logical_per_request + 16

    def draw():
        free = rng.choice(pool, logical_per_request + 1, replace=False).tolist()
        return [free[:logical_per_request] if k != "mamba" else [free[-1]] for k in kinds]

    return [(draw(), draw()) for _ in range(count)]


def _wait_untimed(worker, request_ids, timeout_s: float = 60.0) -> None:
    """Until NIXL says every read of the batch ended (nothing is released)."""
    deadline = time.monotonic() + timeout_s
    for request_id in request_ids:
        for handle in worker._recving_transfers.get(request_id, []):
            while worker.nixl_wrapper.check_xfer_state(handle) == "PROC":
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{request_id} still in flight after {timeout_s} s")


def _meta(request_id: str):
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import RemoteMeta, ReqMeta

    from vllm_nixl_hma.harness.read_path import REMOTE_ENGINE

    return ReqMeta(
        local_block_ids=[],
        local_physical_block_ids=[],
        tp_size=1,
        remote=RemoteMeta(
            block_ids=[], host="127.0.0.1", port=1, engine_id=REMOTE_ENGINE, request_id=request_id
        ),
    )


def _step(live, batch, records: bool) -> float:
    """One step's worth: post the batch's reads, (untimed) wait, take them,
    and with ``records`` make each request's record. Returns seconds timed."""
    worker = live.worker
    ids = [request_id for request_id, _, _ in batch]
    started = time.perf_counter()
    for request_id, local, remote in batch:
        live.read(request_id, local, remote)
    posted = time.perf_counter() - started
    _wait_untimed(worker, ids)
    started = time.perf_counter()
    done = set()
    while not set(ids) <= done:  # one call takes them all: they are DONE
        result = worker._pop_done_transfers(worker._recving_transfers)
        done |= result[0] if isinstance(result, tuple) else result
    if records:
        for request_id in ids:
            worker._record_received(request_id, _meta(request_id), failed=False)
    taken = time.perf_counter() - started
    live.prefill_agent.get_new_notifs()  # prefill's side: drop the notifications
    return posted + taken


def _records_off(worker) -> None:
    """The worker's own methods without the records mixin's."""
    from vllm_nixl_hma.request_records import RequestRecords

    worker._note_read = lambda *args, **kwargs: None
    worker._pop_done_transfers = super(RequestRecords, worker)._pop_done_transfers


def _records_on(worker) -> None:
    for name in ("_note_read", "_pop_done_transfers"):
        worker.__dict__.pop(name, None)


def case(layout: str, tokens: int, ratio: int, layers: int, steps: int, seed: int) -> dict:
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.worker import NixlConnectorWorker

    from vllm_nixl_hma.harness.read_path import build_live_read_path
    from vllm_nixl_hma.transfer_stats import NixlHMAKVConnectorStats
    from vllm_nixl_hma.v021.worker import NixlHMAConnectorWorker

    kinds = LAYOUTS[layout]
    logical = math.ceil(tokens / (ratio * KERNEL_BLOCK_TOKENS))
    requests = _requests(kinds, logical, steps * BATCH, seed)
    seconds: dict[str, list[float]] = {"on": [], "off": [], "stock": []}
    for name, cls in (("ours", NixlHMAConnectorWorker), ("stock", NixlConnectorWorker)):
        live = build_live_read_path(
            cls, kinds, ratio, layers=layers, logical_blocks=2 * logical + 16,
            page_bytes=PAGE_BYTES[layout],
        )  # fmt: skip
        try:
            worker = live.worker
            if name == "ours":
                worker.xfer_stats = NixlHMAKVConnectorStats()
                worker.kv_transfer_config = SimpleNamespace(
                    enable_permute_local_kv=False,
                    kv_connector_extra_config={"transfer_records": True},
                    kv_load_failure_policy="fail",
                )
            for step in range(steps):
                batch = [(f"{name}-{step}-{i}", *requests[step * BATCH + i]) for i in range(BATCH)]
                if name == "stock":
                    seconds["stock"].append(_step(live, batch, records=False))
                    continue
                # on and off alternate, each step a fresh batch of the same requests
                for mode in ("on", "off") if step % 2 else ("off", "on"):
                    (_records_on if mode == "on" else _records_off)(worker)
                    tagged = [(f"{rid}-{mode}", local, remote) for rid, local, remote in batch]
                    seconds[mode].append(_step(live, tagged, records=mode == "on"))
                    worker.xfer_stats.reset()  # as vLLM's step hands the stats over
        finally:
            live.close()
    us = {mode: statistics.median(values) / BATCH * 1e6 for mode, values in seconds.items()}
    return {
        "layout": layout,
        "tokens": tokens,
        "ratio": ratio,
        "layers": layers,
        "us_per_request_off": round(us["off"], 1),
        "us_per_request_on": round(us["on"], 1),
        "us_per_request_stock": round(us["stock"], 1),
        "on_over_off": round(us["on"] / us["off"], 3),
        "on_over_stock": round(us["on"] / us["stock"], 3),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    from vllm_nixl_hma.request_records import RECORDS_LOGGER

    log_file = tempfile.NamedTemporaryFile("w", suffix=".log", delete=False)  # noqa: SIM115
    records_log = logging.getLogger(RECORDS_LOGGER)
    records_log.handlers[:] = [logging.StreamHandler(log_file)]
    records_log.propagate = False
    records_log.setLevel(logging.INFO)
    steps = 10 if args.quick else 30
    rows = []
    for tokens in (8192, 131072) if args.quick else (2048, 8192, 32768, 131072):
        for layout in LAYOUTS:
            for ratio in (1, 10):
                rows.append(case(layout, tokens, ratio, 8, steps, tokens + ratio))
                print(f"[records] {rows[-1]}", file=sys.stderr)
    log_file.close()
    lines = sum(1 for _ in open(log_file.name))  # noqa: SIM115
    Path(log_file.name).unlink()
    columns = ("layout", "tokens", "ratio", "us_per_request_off", "us_per_request_on",
               "us_per_request_stock", "on_over_off", "on_over_stock")  # fmt: skip
    print(" ".join(f"{c:>20}" for c in columns), file=sys.stderr)
    for row in rows:
        print(" ".join(f"{row[c]!s:>20}" for c in columns), file=sys.stderr)
    print(f"[records] {lines} JSON lines written; batch {BATCH} requests per step", file=sys.stderr)
    if args.json:
        print(json.dumps({"batch": BATCH, "records_written": lines, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
