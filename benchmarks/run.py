"""Benchmarks (not part of the test suite): ``python benchmarks/run.py [--json] [--quick]``.

Read path: decode-side CPU time per request from the request's metadata to
the posted transfer: local and remote block expansion, alignment, descriptor
ids, NIXL ``make_prepped_xfer`` and ``transfer`` (the post; completion is
awaited outside the timer). ``us_*`` is the wall time the calling thread
(vLLM's step) spends there; ``thread_cpu_us_*`` its CPU time alone, which
leaves out what NIXL hands to its own threads (it does for large posts).
Ours against stock vLLM 0.21.0 ``NixlConnectorWorker`` on identical inputs
in the same run, each a real worker with real NIXL agents (UCX on loopback,
DRAM, vLLM's ``num_threads`` 4) set up by
``harness.read_path.build_live_read_path``: decode TP 1 reads prefill TP 1,
equal ratios (so stock reads the right blocks too), block ids drawn at
random from a pool twice the request (a fragmented cache); each worker runs
alone in the process, twice, ours first. Pages are small
(64 B dense, 256 B hybrid) so that time goes to descriptors, not bytes.

Transfer: one request of a hybrid layout with realistic pages (32 KiB kernel
pages, 9 per logical block, 8 layers, Mamba2 state 263.5 KiB per layer) read
through our worker and through stock's (each agent configured as its worker
configures it: ours splits reads over NIXL's threads, ``read_threads``),
against raw NIXL moving the same number of bytes between two agents with one
descriptor, and against ``numpy.copyto`` of the same bytes (memcpy). Medians
of repeated runs. ``post_ms_*`` is how long the calling thread (vLLM's step)
spends posting the read; the rest of the read runs on NIXL's threads.

Prints tables (stderr) and, with ``--json``, one JSON object on stdout:
``{"machine": ..., "read_path": [{"tokens", "ratio", "layout", "layers",
"descriptors_ours", "descriptors_stock", "us_ours", "us_stock",
"ratio_ours_over_stock", "thread_cpu_us_ours", "thread_cpu_us_stock"}],
"transfer": [{"tokens", "bytes", "descriptors_ours", "descriptors_stock",
"gbps_ours", "gbps_stock", "ours_over_stock", "post_ms_ours", "post_ms_stock",
"gbps_raw_nixl", "gbps_raw_nixl_scattered", "gbps_memcpy",
"efficiency_vs_raw"}]}``;
``gbps_raw_nixl_scattered`` is raw NIXL reading the same bytes in logical
pages (288 KiB) at random places: the cost of the scatter itself. ``BENCH_NIXL_THREADS`` overrides
``num_threads`` of every agent.

Harness (the only one on vLLM 0.33, whose workers the two above cannot build;
``--only harness`` runs it on 0.21.0 too): the check harness's real engines
(one process per rank, the release's own KV layout and connector worker, the
side-channel handshake), ours against stock in the same run, prefill TP 1 ->
decode TP 1 (equal ratios, so both read right and every slot is checked),
three requests of 1201 logical blocks each at random places of the cache, per
layout. ``ids_*``: descriptor ids decode hands to NIXL; ``nixl_descs_*``: the
descriptors NIXL reports it moved (its telemetry, after NIXL >= 1.5 merges
descriptors that are contiguous on both sides); ``post_ms_*``: the time
vLLM's step thread spends in the ``start_load_kv`` calls that post the reads
(``post_cpu_ms_*`` its CPU time); ``gbps_*``: bytes over the time from the
post to the last completion; raw NIXL and memcpy move the same bytes with one
descriptor. Medians of the repeats, after one warm-up batch that also does
the handshake. JSON key ``harness``.

Link (``--only link [--link-rate 10gbit ...]``, as root): one request of
70 MiB and more from a prefill host to a decode host across a rate-limited
link (network namespaces, as ``e2e --separate-hosts`` builds them): ours,
stock, raw NIXL and one TCP stream side by side against the link's rate;
``benchmarks/link.py`` says how. JSON key ``link``.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import platform
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_SSM_CONV_STATE_LAYOUT", "DS")
os.environ.setdefault("UCX_NET_DEVICES", "lo")

KERNEL_BLOCK_TOKENS = 16
NIXL_THREADS = int(os.environ.get("BENCH_NIXL_THREADS", "4"))
LAYOUTS = {"dense": ["full_attention"], "hybrid": ["full_attention", "mamba"]}
READ_PATH_PAGE_BYTES = {"dense": 64, "hybrid": 256}

#: the transfer benchmark's hybrid: 16 tokens x 2 KV heads x 256 dims x K,V x bf16
TRANSFER_PAGE_BYTES = 16 * 2 * 256 * 2 * 2
TRANSFER_RATIO = 9
TRANSFER_LAYERS = 8
#: Mamba2 state per layer: conv (x 1024 + B 128 + C 128 channels, 3 rows) and
#: SSM (16 heads x 64 x 128), bf16: 7.5 KiB + 256 KiB, within 9 kernel pages
TRANSFER_MAMBA_SHAPES = ((1280, 3), (16, 64, 128))


def draw_block_ids(rng, kinds, pool, logical_per_request):
    free = rng.choice(pool, logical_per_request + 1, replace=False).tolist()
    return [free[:logical_per_request] if k != "mamba" else [free[-1]] for k in kinds]


def count_descriptors(live):
    """Wrap make_prepped_xfer to remember the last call's descriptor count."""
    wrapper = live.worker.nixl_wrapper
    real = wrapper.make_prepped_xfer
    seen = {"descriptors": 0}

    def counting(operation, local_side, local_ids, remote_side, remote_ids, **kwargs):
        seen["descriptors"] = len(local_ids)
        return real(operation, local_side, local_ids, remote_side, remote_ids, **kwargs)

    wrapper.make_prepped_xfer = counting
    return seen


WORKERS = ("ours", "stock")


def worker_classes() -> dict[str, type]:
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.worker import NixlConnectorWorker

    from vllm_nixl_hma.v021.worker import NixlHMAConnectorWorker

    return {"ours": NixlHMAConnectorWorker, "stock": NixlConnectorWorker}


def draw_requests(kinds, pool, logical_per_request, count, seed) -> list:
    """``count`` (local, remote) block-id pairs, the same for every worker."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return [
        (
            draw_block_ids(rng, kinds, pool, logical_per_request),
            draw_block_ids(rng, kinds, pool, logical_per_request),
        )
        for _ in range(count)
    ]


def read_path_case(layout, tokens, ratio, layers, repeats, seed, rounds=2) -> dict:
    """Ours, then stock, each alone in the process (another live agent's UCX
    threads would perturb the timing), on the same requests, ``rounds``
    times over; medians over all rounds."""
    from vllm_nixl_hma.harness.read_path import build_live_read_path

    kinds = LAYOUTS[layout]
    logical_per_request = math.ceil(tokens / (ratio * KERNEL_BLOCK_TOKENS))
    pool = 2 * logical_per_request + 16
    requests = draw_requests(kinds, pool, logical_per_request, repeats, seed)
    classes = worker_classes()
    wall = {name: [] for name in WORKERS}
    cpu = {name: [] for name in WORKERS}
    descriptors = {}
    for _ in range(rounds):
        for name in WORKERS:
            live = build_live_read_path(
                classes[name],
                kinds,
                ratio,
                layers=layers,
                logical_blocks=pool,
                page_bytes=READ_PATH_PAGE_BYTES[layout],
                nixl_threads=NIXL_THREADS,
            )
            try:
                seen = count_descriptors(live)
                for index, (local, remote) in enumerate(requests):
                    cpu_started, wall_started = time.thread_time(), time.perf_counter()
                    live.read(f"r{index}", local, remote)
                    wall[name].append(time.perf_counter() - wall_started)
                    cpu[name].append(time.thread_time() - cpu_started)
                    live.wait(f"r{index}")
            finally:
                live.close()
            descriptors[name] = seen["descriptors"]
    us = {name: statistics.median(wall[name]) * 1e6 for name in WORKERS}
    cpu_us = {name: statistics.median(cpu[name]) * 1e6 for name in WORKERS}
    return {
        "tokens": tokens,
        "ratio": ratio,
        "layout": layout,
        "layers": layers,
        "descriptors_ours": descriptors["ours"],
        "descriptors_stock": descriptors["stock"],
        "us_ours": round(us["ours"], 1),
        "us_stock": round(us["stock"], 1),
        "ratio_ours_over_stock": round(us["ours"] / us["stock"], 3),
        "thread_cpu_us_ours": round(cpu_us["ours"], 1),
        "thread_cpu_us_stock": round(cpu_us["stock"], 1),
    }


def read_path_rows(quick: bool, progress) -> list[dict]:
    token_sizes = (8192, 131072) if quick else (8192, 32768, 131072)
    ratios = (1, 10) if quick else (1, 6, 10, 66)
    layer_counts = (8,) if quick else (8, 64)
    repeats = 5 if quick else 15
    rows = []
    for tokens in token_sizes:
        for ratio in ratios:
            for layout in LAYOUTS:
                for layers in layer_counts:
                    seed = tokens + ratio + layers
                    rows.append(read_path_case(layout, tokens, ratio, layers, repeats, seed))
                    progress(f"read path: {tokens} tokens r={ratio} {layout} {layers} layers")
    return rows


def wait_done(agent, handle, timeout_s: float = 120.0) -> None:
    """Poll a posted NIXL transfer until it ends; raise unless it ended DONE."""
    deadline = time.monotonic() + timeout_s
    while (state := agent.check_xfer_state(handle)) == "PROC":
        if time.monotonic() > deadline:
            raise TimeoutError(f"NIXL read did not finish in {timeout_s:.0f} s")
    if state != "DONE":
        raise RuntimeError(f"NIXL read ended {state}")


def timed(action, repeats: int) -> list[float]:
    """Seconds of ``repeats`` calls of ``action``, after one warm-up call."""
    action()
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        action()
        seconds.append(time.perf_counter() - started)
    return seconds


def memcpy_seconds(num_bytes: int, repeats: int) -> list[float]:
    """``numpy.copyto`` of ``num_bytes``: seconds of ``repeats`` copies after a warm-up."""
    import numpy as np

    source, target = np.ones(num_bytes, dtype=np.uint8), np.zeros(num_bytes, dtype=np.uint8)
    return timed(lambda: np.copyto(target, source), repeats)


class RawNixl:
    """Two NIXL agents configured as vLLM configures its own, one buffer
    each: a READ of ``num_bytes`` with one descriptor per side, or with
    descriptors of ``chunk_bytes`` at random places of buffers twice as large
    (the scatter of a request's pages, without a connector)."""

    def __init__(self, num_bytes: int):
        import uuid

        import torch
        from nixl._api import nixl_agent, nixl_agent_config

        config = nixl_agent_config(num_threads=NIXL_THREADS)
        self.reader = nixl_agent(f"raw-reader-{uuid.uuid4()}", config)
        self.owner = nixl_agent(f"raw-owner-{uuid.uuid4()}", config)
        self.num_bytes = num_bytes
        self.source = torch.ones(2 * num_bytes, dtype=torch.uint8)
        self.target = torch.zeros(2 * num_bytes, dtype=torch.uint8)
        self.registrations = [
            (self.owner, self.owner.register_memory(self.owner.get_reg_descs([self.source]))),
            (self.reader, self.reader.register_memory(self.reader.get_reg_descs([self.target]))),
        ]
        self.owner_name = self.reader.add_remote_agent(self.owner.get_agent_metadata())

    def scattered(self, chunk_bytes: int, rng) -> tuple:
        """(target, source) descriptor arrays: ``num_bytes`` in chunks at random slots."""
        import numpy as np

        count = self.num_bytes // chunk_bytes
        sides = []
        for tensor in (self.target, self.source):
            slots = rng.choice(2 * count, count, replace=False)
            descs = np.zeros((count + 1, 3), dtype=np.int64)
            descs[:count, 0] = tensor.data_ptr() + slots * chunk_bytes
            descs[:count, 1] = chunk_bytes
            # the remainder, past every slot
            descs[count] = (
                tensor.data_ptr() + 2 * count * chunk_bytes,
                self.num_bytes % chunk_bytes,
                0,
            )
            sides.append(descs if self.num_bytes % chunk_bytes else descs[:count])
        return tuple(sides)

    def read(self, scattered: tuple | None = None) -> None:
        if scattered is None:
            target_descs = self.reader.get_xfer_descs([self.target[: self.num_bytes]])
            source_descs = self.owner.get_xfer_descs([self.source[: self.num_bytes]])
        else:
            target_descs = self.reader.get_xfer_descs(scattered[0], "DRAM")
            source_descs = self.owner.get_xfer_descs(scattered[1], "DRAM")
        handle = self.reader.initialize_xfer("READ", target_descs, source_descs, self.owner_name)
        self.reader.transfer(handle)
        try:
            wait_done(self.reader, handle)
        finally:
            self.reader.release_xfer_handle(handle)

    def close(self) -> None:
        if not bool(self.target[: self.num_bytes].all()):
            raise RuntimeError("raw NIXL read did not move the bytes")
        self.reader.remove_remote_agent(self.owner_name)
        for agent, descs in self.registrations:
            agent.deregister_memory(descs)
        self.reader = self.owner = None


def transfer_requests(tokens: int, count: int, seed: int) -> tuple[int, int, list]:
    """The transfer benchmark's hybrid request of ``tokens``: (logical blocks
    per request, pool of logical blocks, ``count`` drawn (local, remote) ids)."""
    logical_per_request = math.ceil(tokens / (TRANSFER_RATIO * KERNEL_BLOCK_TOKENS))
    pool = 2 * logical_per_request + 2
    requests = draw_requests(LAYOUTS["hybrid"], pool, logical_per_request, count, seed)
    return logical_per_request, pool, requests


def live_transfer_path(worker_cls: type, pool: int):
    """A live read path with the transfer benchmark's realistic pages."""
    from vllm_nixl_hma.harness.read_path import build_live_read_path

    return build_live_read_path(
        worker_cls,
        LAYOUTS["hybrid"],
        TRANSFER_RATIO,
        layers=TRANSFER_LAYERS,
        logical_blocks=pool,
        page_bytes=TRANSFER_PAGE_BYTES,
        mamba_shapes=TRANSFER_MAMBA_SHAPES,
        nixl_threads=NIXL_THREADS,
    )


def transfer_case(tokens: int, repeats: int, seed: int) -> dict:
    """One hybrid request of ``tokens``: read through ours, then stock (each
    alone in the process, on the same requests), then raw NIXL and memcpy of
    the same bytes; one warm-up read each, then medians of ``repeats``."""
    import numpy as np

    logical_per_request, pool, requests = transfer_requests(tokens, repeats + 1, seed)
    classes = worker_classes()
    samples: dict[str, list[float]] = {}
    posts: dict[str, list[float]] = {}
    descriptors: dict[str, int] = {}
    num_bytes = 0
    for name in WORKERS:
        live = live_transfer_path(classes[name], pool)
        try:
            conv_bytes, ssm_bytes = live.worker._mamba_ssm_size
            attention_bytes = logical_per_request * TRANSFER_RATIO * TRANSFER_PAGE_BYTES
            num_bytes = TRANSFER_LAYERS * (attention_bytes + conv_bytes + ssm_bytes)
            samples[name], posts[name] = [], []
            seen = count_descriptors(live)
            for index, (local, remote) in enumerate(requests):
                started = time.perf_counter()
                live.read(f"r{index}", local, remote)
                posted = time.perf_counter()
                live.wait(f"r{index}")
                if index:  # the first read warms UCX up
                    samples[name].append(time.perf_counter() - started)
                    posts[name].append(posted - started)
            descriptors[name] = seen["descriptors"]
        finally:
            live.close()
    raw = RawNixl(num_bytes)
    rng = np.random.default_rng(seed)
    try:
        samples["raw"], samples["raw_scattered"] = [], []
        for index in range(repeats + 1):
            started = time.perf_counter()
            raw.read()
            if index:
                samples["raw"].append(time.perf_counter() - started)
            scattered = raw.scattered(TRANSFER_RATIO * TRANSFER_PAGE_BYTES, rng)
            started = time.perf_counter()
            raw.read(scattered)
            if index:
                samples["raw_scattered"].append(time.perf_counter() - started)
    finally:
        raw.close()
    samples["memcpy"] = memcpy_seconds(num_bytes, repeats)
    gbps = {name: num_bytes / statistics.median(s) / 1e9 for name, s in samples.items()}
    post_ms = {name: statistics.median(posts[name]) * 1e3 for name in WORKERS}
    return {
        "tokens": tokens,
        "bytes": num_bytes,
        "descriptors_ours": descriptors["ours"],
        "descriptors_stock": descriptors["stock"],
        "gbps_ours": round(gbps["ours"], 3),
        "gbps_stock": round(gbps["stock"], 3),
        "ours_over_stock": round(gbps["ours"] / gbps["stock"], 3),
        "post_ms_ours": round(post_ms["ours"], 2),
        "post_ms_stock": round(post_ms["stock"], 2),
        "gbps_raw_nixl": round(gbps["raw"], 3),
        "gbps_raw_nixl_scattered": round(gbps["raw_scattered"], 3),
        "gbps_memcpy": round(gbps["memcpy"], 3),
        "efficiency_vs_raw": round(gbps["ours"] / gbps["raw"], 3),
    }


def transfer_rows(quick: bool, progress) -> list[dict]:
    token_sizes = (2048, 8192) if quick else (2048, 8192, 32768)
    repeats = 3 if quick else 9
    rows = []
    for tokens in token_sizes:
        rows.append(transfer_case(tokens, repeats, tokens))
        progress(f"transfer: {rows[-1]['bytes'] / 2**20:.0f} MiB")
    return rows


#: (layout, --block-size of both engines): None is the attention backend's choice
HARNESS_CELLS = (("hybrid", None), ("gdn", None), ("dense", 128))


def harness_rows(quick: bool, progress) -> list[dict]:
    """Each layout through the check harness's real engines, ours then stock."""
    import tempfile
    from pathlib import Path

    import harness_cells  # benchmarks/harness_cells.py

    from vllm_nixl_hma.harness import coordinator
    from vllm_nixl_hma.harness.model_shapes import installed_layouts

    repeats = 2 if quick else 5
    scenarios = [coordinator.Scenario("mid-block")] + [
        coordinator.Scenario("long") for _ in range(repeats)
    ]
    layouts = installed_layouts()
    with tempfile.TemporaryDirectory(prefix="bench-harness-") as root:
        model_dirs = {
            layout: coordinator.model_dir_for(layouts[layout], Path(root))
            for layout, _ in HARNESS_CELLS
        }
        cells = harness_cells.one_to_one_cells(HARNESS_CELLS, model_dirs, scenarios)
        results = coordinator.run_cells(cells, progress)
    measured = harness_cells.measured_by_layout(results, HARNESS_CELLS, len(scenarios))
    return [harness_row(layout, measured[layout]) for layout, _ in HARNESS_CELLS]


def harness_row(layout: str, measured: dict[str, list]) -> dict:
    """One table row from ours' and stock's long batches, with raw NIXL and
    memcpy moving the same bytes per batch."""

    def median(name: str, value) -> float:
        return statistics.median(value(result) for result in measured[name])

    ours, stock = measured["ours"][0], measured["stock"][0]
    if ours.bytes != stock.bytes:
        raise RuntimeError(f"{layout}: ours moved {ours.bytes} B, stock {stock.bytes} B")
    num_bytes = ours.bytes
    repeats = len(measured["ours"])
    raw = RawNixl(num_bytes)
    try:
        raw_s = timed(raw.read, repeats)
    finally:
        raw.close()
    memcpy_s = memcpy_seconds(num_bytes, repeats)
    gbps = {name: num_bytes / median(name, lambda r: r.seconds) / 1e9 for name in measured}
    post_ms = {name: median(name, lambda r: r.post_ms) for name in measured}
    return {
        "layout": layout,
        "ratio": ours.local_ratio,
        "blocks_per_request": 1201,
        "bytes": num_bytes,
        "ids_ours": ours.ids_posted,
        "ids_stock": stock.ids_posted,
        "nixl_descs_ours": ours.descriptors,
        "nixl_descs_stock": stock.descriptors,
        "post_ms_ours": round(post_ms["ours"], 2),
        "post_ms_stock": round(post_ms["stock"], 2),
        "post_ours_over_stock": round(post_ms["ours"] / post_ms["stock"], 3),
        "post_cpu_ms_ours": round(median("ours", lambda r: r.post_cpu_ms), 2),
        "post_cpu_ms_stock": round(median("stock", lambda r: r.post_cpu_ms), 2),
        "gbps_ours": round(gbps["ours"], 3),
        "gbps_stock": round(gbps["stock"], 3),
        "ours_over_stock": round(gbps["ours"] / gbps["stock"], 3),
        "gbps_raw_nixl": round(num_bytes / statistics.median(raw_s) / 1e9, 3),
        "gbps_memcpy": round(num_bytes / statistics.median(memcpy_s) / 1e9, 3),
    }


#: NIXL merge: a logical block of ``run`` kernel pages of this many bytes
MERGE_PAGE_BYTES = 2048
MERGE_LOGICAL_BLOCKS = 4096


def nixl_merge_rows(quick: bool, progress) -> list[dict]:
    """Raw NIXL, no connector: the same read of 1201 logical blocks at random
    places, its ids given per kernel page (what vLLM 0.33 posts) or per
    logical block (what page runs would post), over strided lists of each
    unit, the two orders alternating. NIXL >= 1.5 merges ids that are
    contiguous on both sides, so the descriptors it moves (telemetry) are the
    same either way; this is why the 0.33 glue keeps upstream's descriptors.
    ``make_ms``: ``make_prepped_xfer`` alone (the cost of the ids);
    ``ms``: from it to completion."""
    import uuid

    import numpy as np
    import torch
    from nixl._api import nixl_agent, nixl_agent_config

    config = nixl_agent_config(num_threads=NIXL_THREADS, capture_telemetry=True)
    reader = nixl_agent(f"merge-reader-{uuid.uuid4()}", config)
    owner = nixl_agent(f"merge-owner-{uuid.uuid4()}", config)
    repeats = 6 if quick else 20
    rows = []
    for run in (2, 5, 16):
        num_bytes = MERGE_LOGICAL_BLOCKS * run * MERGE_PAGE_BYTES
        source = torch.ones(num_bytes, dtype=torch.uint8)
        target = torch.zeros(num_bytes, dtype=torch.uint8)
        registered = [
            (owner, owner.register_memory(owner.get_reg_descs([source]))),
            (reader, reader.register_memory(reader.get_reg_descs([target]))),
        ]
        owner_name = reader.add_remote_agent(owner.get_agent_metadata())
        lists = {
            name: [
                reader.prep_xfer_dlist(
                    agent_name,
                    np.array(
                        [[tensor.data_ptr(), unit, 0, unit, num_bytes // unit]], dtype=np.uint64
                    ),
                    mem_type="DRAM",
                )
                for agent_name, tensor in (("NIXL_INIT_AGENT", target), (owner_name, source))
            ]
            for name, unit in (("page", MERGE_PAGE_BYTES), ("run", run * MERGE_PAGE_BYTES))
        }
        rng = np.random.default_rng(run)
        measured: dict[str, list[tuple[float, float]]] = {name: [] for name in lists}
        descs: dict[str, tuple[int, int]] = {}
        try:
            for index in range(repeats + 2):
                blocks = [rng.choice(MERGE_LOGICAL_BLOCKS, 1201, replace=False) for _ in "lr"]
                for name in ("page", "run") if index % 2 else ("run", "page"):
                    if name == "page":
                        ids = [(b[:, None] * run + np.arange(run)).reshape(-1) for b in blocks]
                    else:
                        ids = blocks
                    timed = merge_read(reader, lists[name], [i.astype(np.int32) for i in ids])
                    descs[name] = (len(ids[0]), timed[2])
                    if index >= 2:  # two warm-up rounds
                        measured[name].append(timed[:2])
        finally:
            for handles in lists.values():
                for handle in handles:
                    reader.release_dlist_handle(handle)
            reader.remove_remote_agent(owner_name)
            for agent, descs_registered in registered:
                agent.deregister_memory(descs_registered)

        def median_ms(name: str, column: int, measured=measured) -> float:
            return round(statistics.median(m[column] for m in measured[name]) * 1e3, 3)

        rows.append(
            {
                "pages_per_block": run,
                "bytes": 1201 * run * MERGE_PAGE_BYTES,
                "ids_per_page": descs["page"][0],
                "ids_per_run": descs["run"][0],
                "nixl_descs_per_page": descs["page"][1],
                "nixl_descs_per_run": descs["run"][1],
                "make_ms_per_page": median_ms("page", 0),
                "make_ms_per_run": median_ms("run", 0),
                "ms_per_page": median_ms("page", 1),
                "ms_per_run": median_ms("run", 1),
            }
        )
        progress(f"nixl merge: {run} pages per block")
    return rows


def merge_read(reader, lists, ids) -> tuple[float, float, int]:
    """One READ: (seconds in make_prepped_xfer, seconds to completion, NIXL's descriptors)."""
    started = time.perf_counter()
    handle = reader.make_prepped_xfer("READ", lists[0], ids[0], lists[1], ids[1])
    made = time.perf_counter()
    try:
        reader.transfer(handle)
        wait_done(reader, handle)
        finished = time.perf_counter()
        return made - started, finished - started, reader.get_xfer_telemetry(handle).descCount
    finally:
        reader.release_xfer_handle(handle)


def print_table(title: str, rows: list[dict]) -> None:
    print(f"\n{title}", file=sys.stderr)
    columns = list(rows[0])
    widths = [max(len(c), *(len(str(r[c])) for r in rows)) for c in columns]
    print(" ".join(f"{c:>{w}}" for c, w in zip(columns, widths, strict=True)), file=sys.stderr)
    for row in rows:
        cells = (f"{row[c]!s:>{w}}" for c, w in zip(columns, widths, strict=True))
        print(" ".join(cells), file=sys.stderr)


def machine() -> str:
    return (
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, {platform.system()}"
    )


#: --only name -> (rows for the JSON, table title), in the order they run
BENCHMARKS = {
    "read_path": (read_path_rows, "read path (decode time per request, us)"),
    "transfer": (transfer_rows, "transfer (GB/s)"),
    "harness": (harness_rows, "harness (real engines, P TP 1 -> D TP 1, per batch)"),
    "nixl_merge": (nixl_merge_rows, "NIXL merge (raw NIXL, 1201 logical blocks per read)"),
    "link": (None, "link (one request across a rate-limited link between two hosts, GB/s)"),
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    parser.add_argument("--quick", action="store_true", help="fewer sizes and repeats")
    parser.add_argument(
        "--only",
        choices=tuple(BENCHMARKS),
        help="run one benchmark (default: read_path and transfer on vLLM 0.21.0, "
        "harness and nixl_merge on 0.33; link only when asked for: it needs root)",
    )
    parser.add_argument(
        "--link-rate",
        action="append",
        help="link: a rate of the link between the hosts, as tc reads it (repeatable; "
        "default 10gbit and 1gbit)",
    )
    args = parser.parse_args(argv)
    from vllm_nixl_hma import _compat
    from vllm_nixl_hma.cli import reserve_stdout

    json_stream = reserve_stdout()
    if args.only is not None:
        wanted = {args.only}
    elif _compat.adapter() == "v033":  # read_path and transfer build 0.21.0 workers
        wanted = {"harness", "nixl_merge"}
    else:
        wanted = {"read_path", "transfer"}

    def progress(line: str) -> None:
        print(f"[bench] {line}", file=sys.stderr, flush=True)

    result: dict = {"machine": machine(), "vllm": _compat.installed_vllm_version()}
    for name, (rows_of, title) in BENCHMARKS.items():
        if name in wanted and name == "link":
            import link  # benchmarks/link.py

            rates = tuple(args.link_rate or link.DEFAULT_LINK_RATES)
            rows_of = functools.partial(link.link_rows, rates=rates)
        if name in wanted:
            result[name] = rows_of(args.quick, progress)
            print_table(title, result[name])
    if args.json:
        print(json.dumps(result), file=json_stream)
    json_stream.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
