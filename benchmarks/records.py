"""What per-request records and metrics cost decode's step (#27), measured (not
part of the test suite).

    $(bash tools/env.sh)/bin/python benchmarks/records.py [--json] [--quick]

Decode's step spends, per request it reads: posting the reads
(``_read_blocks_for_req``: expansion, pairing, descriptor ids, NIXL's post)
and, once NIXL says they are done, taking them (``_pop_done_transfers``:
NIXL's telemetry, the handles released). Records add to both: what is read is
noted as it is posted, each finished read's NIXL telemetry is added to the
request whose handle it is, and each finished request is counted in the
connector stats and, with ``transfer_records`` on, handed (the step's at
once) to the records' writer thread, which builds the ``DecodeRecord`` and
writes it as a JSON line (here to a file, as an engine's log goes to one).

One real worker of ours (vLLM 0.21.0, real NIXL agents over UCX on loopback,
``harness.read_path.build_live_read_path``: decode TP 1 reads prefill TP 1),
batches of ``BATCH`` requests per step, on the same requests in one run, in
three modes whose order changes from step to step (``ORDERS``): records on, records off
(the worker's own methods without the records mixin) and off again (``off2``:
the same code as off, whose ratio to off is this machine's noise floor).
Stock vLLM 0.21.0's worker runs the same requests after it, alone. The wait
for NIXL to finish is left out of the timer (``run.py`` measures the link
against raw NIXL and memcpy), and so is the rest of a decode step
(``FORWARD_S``: the forward pass, during which the step thread waits on the
accelerator without the GIL). Timed: the step thread's wall time (and its CPU
time) in posting and taking the batch's reads and, on, counting and handing
over the records. Per request: the batch's time over ``BATCH``; medians.
``on_over_off`` is the ratio the issue bounds (at most 1.05): the median over
steps of on's time over off's in the same step. The writer's own CPU per
record is reported beside it: it runs in the same process, so whatever of it
falls inside a timed step is in that step's time.
"""

from __future__ import annotations

import argparse
import gc
import itertools
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
#: the rest of a decode step, untimed: the forward pass, during which the step
#: thread waits on the accelerator without the GIL (a few ms for a batch of 8)
FORWARD_S = 0.005
#: the modes of one step
MODES = ("on", "off", "off2")
#: their orders, one per step in turn: each mode runs in each place and after
#: each other mode equally often (what one mode leaves behind, such as the
#: writer's work, falls on each of the others alike)
ORDERS = tuple(itertools.permutations(MODES))
KERNEL_BLOCK_TOKENS = 16
#: both agents' progress threads wait this long between polls (NIXL's own, 0,
#: spins a core per agent: on a GPU server each worker's progress thread has
#: one to itself; on 2 CPUs two spinning threads would take the step thread's)
PROGRESS_DELAY_US = 1000
#: stock's steps at most (it is 10 to 20 times slower and not in the bound)
STOCK_STEPS = 20
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


def _step(live, batch, records: bool) -> tuple[float, float]:
    """One step's worth: post the batch's reads, (untimed) wait, take them,
    and with ``records`` count each request and hand its record over as
    ``get_finished`` does. Returns the seconds timed: the step thread's wall
    time and its CPU time."""
    worker = live.worker
    ids = [request_id for request_id, _, _ in batch]
    metas = {request_id: live.meta(request_id) for request_id in ids}  # the engine's, made before
    started, started_cpu = time.perf_counter(), time.thread_time()
    for request_id, local, remote in batch:
        live.read(request_id, local, remote)
    posted = time.perf_counter() - started
    posted_cpu = time.thread_time() - started_cpu
    _wait_untimed(worker, ids)
    started, started_cpu = time.perf_counter(), time.thread_time()
    done = set()
    while not set(ids) <= done:  # one call takes them all: they are DONE
        result = worker._pop_done_transfers(worker._recving_transfers)
        done |= result[0] if isinstance(result, tuple) else result
    if records:
        for request_id in ids:
            worker._record_received(request_id, metas[request_id], failed=False)
        worker._write_records()  # as get_finished ends
    taken = time.perf_counter() - started
    taken_cpu = time.thread_time() - started_cpu
    live.prefill_agent.get_new_notifs()  # prefill's side: drop the notifications
    time.sleep(FORWARD_S)  # the step's forward pass, untimed
    return posted + taken, posted_cpu + taken_cpu


def _records_off(worker) -> None:
    """The worker's own methods without the records mixin's (and its agent
    without the telemetry watch)."""
    from vllm_nixl_hma.request_records import RequestRecords

    worker._note_read = lambda *args, **kwargs: None
    worker._pop_done_transfers = super(RequestRecords, worker)._pop_done_transfers
    worker.nixl_wrapper.__dict__.pop("get_xfer_telemetry", None)
    worker.__dict__.pop("_telemetry_agent", None)


def _records_on(worker) -> None:
    """The records mixin's methods back, and its telemetry watch on the agent
    (an engine's worker installs it once, on its first step: not timed here)."""
    for name in ("_note_read", "_pop_done_transfers"):
        worker.__dict__.pop(name, None)
    worker._watch_telemetry()


def _ratios(seconds: dict[str, list[float]], mode: str, base: str = "off") -> list[float]:
    """``mode``'s time over ``base``'s, step by step: both ran on the same
    requests one after the other, so a slow spell of the machine (NIXL's and
    UCX's threads share its cores) weighs on both."""
    return [a / b for a, b in zip(seconds[mode], seconds[base], strict=True)]


def _paired_ratio(seconds: dict[str, list[float]], mode: str, base: str = "off") -> float:
    """The median over steps of ``_ratios``."""
    return statistics.median(_ratios(seconds, mode, base))


def _median_interval(values: list[float], z: float = 1.96) -> tuple[float, float]:
    """A 95 % confidence interval of the median of ``values`` (independent
    draws; distribution-free: the order statistics ``z`` standard errors of
    a binomial count either side of the middle)."""
    ordered = sorted(values)
    n = len(ordered)
    k = max(0, math.floor((n - z * math.sqrt(n)) / 2))
    return ordered[k], ordered[min(n - 1, n - 1 - k)]


def _steps(tokens: int, quick: bool) -> int:
    """Steps per mode: many for the small requests, whose steps are short and
    their ratio the noisiest (960 at 2048 tokens: a 95 % interval about 3 %
    wide, where 240 steps left one about 6 % wide); at least 60, so every
    cell's median has a narrow interval."""
    steps = max(60, min(960, 960 * 2048 // tokens))
    return 18 if quick else steps


def case(layout: str, tokens: int, ratio: int, layers: int, steps: int, seed: int) -> dict:
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.worker import NixlConnectorWorker

    from vllm_nixl_hma.harness.read_path import build_live_read_path
    from vllm_nixl_hma.transfer_stats import NixlHMAKVConnectorStats
    from vllm_nixl_hma.v021.worker import NixlHMAConnectorWorker

    kinds = LAYOUTS[layout]
    logical = math.ceil(tokens / (ratio * KERNEL_BLOCK_TOKENS))
    requests = _requests(kinds, logical, steps * BATCH, seed)
    seconds: dict[str, list[float]] = {mode: [] for mode in (*MODES, "stock")}
    cpu_seconds: dict[str, list[float]] = {mode: [] for mode in (*MODES, "stock")}
    from vllm_nixl_hma.request_records import RECORD_LOG

    writer_cpu_before, written_before = RECORD_LOG.writer_cpu_s, RECORD_LOG.written
    for name, cls in (("ours", NixlHMAConnectorWorker), ("stock", NixlConnectorWorker)):
        live = build_live_read_path(
            cls, kinds, ratio, layers=layers, logical_blocks=2 * logical + 16,
            page_bytes=PAGE_BYTES[layout], progress_delay_us=PROGRESS_DELAY_US,
        )  # fmt: skip
        gc.collect()
        gc.freeze()  # as vLLM freezes its heap once started (``freeze_gc_heap``)
        try:
            worker = live.worker
            if name == "ours":
                worker.xfer_stats = NixlHMAKVConnectorStats()
                worker.kv_transfer_config = SimpleNamespace(
                    enable_permute_local_kv=False,
                    kv_connector_extra_config={"transfer_records": True},
                    kv_load_failure_policy="fail",
                )
            for step in range(min(steps, STOCK_STEPS) if name == "stock" else steps):
                batch = [(f"{name}-{step}-{i}", *requests[step * BATCH + i]) for i in range(BATCH)]
                if name == "stock":
                    wall_s, cpu_s = _step(live, batch, records=False)
                    seconds["stock"].append(wall_s)
                    cpu_seconds["stock"].append(cpu_s)
                    continue
                # the modes take turns, each step a fresh batch of the same requests
                for mode in ORDERS[step % len(ORDERS)]:
                    (_records_on if mode == "on" else _records_off)(worker)
                    tagged = [(f"{rid}-{mode}", local, remote) for rid, local, remote in batch]
                    wall_s, cpu_s = _step(live, tagged, records=mode == "on")
                    seconds[mode].append(wall_s)
                    cpu_seconds[mode].append(cpu_s)
                    worker.xfer_stats.reset()  # as vLLM's step hands the stats over
        finally:
            live.close()
    RECORD_LOG.flush(60)
    writer_cpu_s = RECORD_LOG.writer_cpu_s - writer_cpu_before
    written = RECORD_LOG.written - written_before
    us = {mode: statistics.median(values) / BATCH * 1e6 for mode, values in seconds.items()}
    cpu_us = {mode: statistics.median(v) / BATCH * 1e6 for mode, v in cpu_seconds.items()}
    return {
        "layout": layout,
        "tokens": tokens,
        "ratio": ratio,
        "layers": layers,
        "steps": steps,
        "us_per_request_off": round(us["off"], 1),
        "us_per_request_on": round(us["on"], 1),
        "us_per_request_stock": round(us["stock"], 1),
        # the bound: on over off step by step, median
        "on_over_off": round(_paired_ratio(seconds, "on"), 3),
        "on_over_off_95": [round(r, 3) for r in _median_interval(_ratios(seconds, "on"))],
        # the same code twice: how far apart two modes land on this machine by chance
        "off2_over_off": round(_paired_ratio(seconds, "off2"), 3),
        "off2_over_off_95": [round(r, 3) for r in _median_interval(_ratios(seconds, "off2"))],
        # as if the writer thread's CPU per record fell on the step thread (it runs
        # while the step waits: here the forward's stand-in, in an engine the GPU)
        "on_with_writer_over_off": round(
            (us["on"] + writer_cpu_s / max(written, 1) * 1e6) / us["off"], 3
        ),
        "on_over_stock": round(us["on"] / us["stock"], 3),
        # the step thread's CPU time alone (what it spent, not what it waited for)
        "cpu_us_per_request_off": round(cpu_us["off"], 1),
        "cpu_us_per_request_on": round(cpu_us["on"], 1),
        "cpu_on_over_off": round(_paired_ratio(cpu_seconds, "on"), 3),
        "cpu_off2_over_off": round(_paired_ratio(cpu_seconds, "off2"), 3),
        # the records' writer thread: its CPU per record written
        "writer_cpu_us_per_record": round(writer_cpu_s / max(written, 1) * 1e6, 1),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    from vllm_nixl_hma.cli import reserve_stdout

    json_stream = reserve_stdout()  # vLLM logs to stdout: the JSON alone goes there
    from vllm_nixl_hma.request_records import RECORD_LOG, RECORDS_LOGGER

    log_file = tempfile.NamedTemporaryFile("w", suffix=".log", delete=False)  # noqa: SIM115
    records_log = logging.getLogger(RECORDS_LOGGER)
    records_log.handlers[:] = [logging.StreamHandler(log_file)]
    records_log.propagate = False
    records_log.setLevel(logging.INFO)
    rows = []
    for tokens in (8192, 131072) if args.quick else (2048, 8192, 32768, 131072):
        for layout in LAYOUTS:
            for ratio in (1, 10):
                steps = _steps(tokens, args.quick)
                rows.append(case(layout, tokens, ratio, 8, steps, tokens + ratio))
                print(f"[records] {rows[-1]}", file=sys.stderr)
    RECORD_LOG.flush(60)
    log_file.close()
    lines = sum(1 for _ in open(log_file.name))  # noqa: SIM115
    Path(log_file.name).unlink()
    columns = ("layout", "tokens", "ratio", "us_per_request_off", "us_per_request_on",
               "us_per_request_stock", "on_over_off", "on_over_off_95", "off2_over_off",
               "off2_over_off_95", "cpu_on_over_off", "cpu_off2_over_off", "on_over_stock",
               "writer_cpu_us_per_record", "on_with_writer_over_off")  # fmt: skip
    print(" ".join(f"{c[:14]:>14}" for c in columns), file=sys.stderr)
    for row in rows:
        cells = (row[c] if not isinstance(row[c], list) else "-".join(map(str, row[c]))
                 for c in columns)  # fmt: skip
        print(" ".join(f"{cell!s:>14}" for cell in cells), file=sys.stderr)
    print(f"[records] {lines} JSON lines written; batch {BATCH} requests per step", file=sys.stderr)
    if args.json:
        report = {
            "batch": BATCH,
            "forward_s": FORWARD_S,
            "progress_delay_us": PROGRESS_DELAY_US,
            "records_written": lines,
            "rows": rows,
        }
        print(json.dumps(report), file=json_stream)
    json_stream.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
