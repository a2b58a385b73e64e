"""Benchmarks (not part of the test suite): ``python benchmarks/run.py [--json] [--quick]``.

Read path: decode-side CPU time per request from the request's metadata to
the posted transfer: local and remote block expansion, alignment, descriptor
ids, NIXL ``make_prepped_xfer`` and ``transfer`` (the post; completion is
awaited outside the timer). Ours against stock vLLM 0.21.0
``NixlConnectorWorker`` on identical inputs in the same run, each a real
worker with real NIXL agents (UCX on loopback, DRAM) set up by
``harness.read_path.build_live_read_path``: decode TP 1 reads prefill TP 1,
equal ratios (so stock reads the right blocks too), block ids drawn at
random from a pool twice the request (a fragmented cache). Pages are small
(64 B dense, 256 B hybrid) so that time goes to descriptors, not bytes.

Transfer: one request of a hybrid layout with realistic pages (32 KiB kernel
pages, 9 per logical block, 8 layers, Mamba2 state 270 KiB per layer) read
through our worker and through stock's, against raw NIXL moving the same
number of bytes between the same two agents with one descriptor, and
against ``numpy.copyto`` of the same bytes (memcpy). Medians of repeated runs.

Prints tables (stderr) and, with ``--json``, one JSON object on stdout:
``{"machine": ..., "read_path": [{"tokens", "ratio", "layout", "layers",
"descriptors_ours", "descriptors_stock", "us_ours", "us_stock",
"ratio_ours_over_stock"}], "transfer": [{"bytes", "gbps_ours", "gbps_stock",
"gbps_raw_nixl", "gbps_memcpy", "efficiency_vs_raw"}]}``.
"""

from __future__ import annotations

import argparse
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
LAYOUTS = {"dense": ["full_attention"], "hybrid": ["full_attention", "mamba"]}
READ_PATH_PAGE_BYTES = {"dense": 64, "hybrid": 256}

#: the transfer benchmark's hybrid: 16 tokens x 2 KV heads x 256 dims x K,V x bf16
TRANSFER_PAGE_BYTES = 16 * 2 * 256 * 2 * 2
TRANSFER_RATIO = 9
TRANSFER_LAYERS = 8
#: Mamba2 state per layer: conv (x 1024 + B 128 + C 128 channels, 3 rows) and
#: SSM (16 heads x 64 x 128), bf16: 7.5 KiB + 256 KiB, within 9 kernel pages
TRANSFER_MAMBA_SHAPES = ((1280, 3), (16, 64, 128))


def request_meta(local_ids, remote_ids):
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import RemoteMeta, ReqMeta

    from vllm_nixl_hma.harness.read_path import REMOTE_ENGINE

    return ReqMeta(
        local_block_ids=local_ids,
        local_physical_block_ids=[],
        tp_size=1,
        remote=RemoteMeta(
            block_ids=remote_ids,
            host="127.0.0.1",
            port=1,
            engine_id=REMOTE_ENGINE,
            request_id="prefill-request",
        ),
    )


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


def time_read_path(worker_cls, layout, tokens, ratio, layers, repeats, seed):
    import numpy as np

    from vllm_nixl_hma.harness.read_path import build_live_read_path

    kinds = LAYOUTS[layout]
    logical_per_request = math.ceil(tokens / (ratio * KERNEL_BLOCK_TOKENS))
    pool = 2 * logical_per_request + 16
    live = build_live_read_path(
        worker_cls,
        kinds,
        ratio,
        layers=layers,
        logical_blocks=pool,
        page_bytes=READ_PATH_PAGE_BYTES[layout],
    )
    try:
        seen = count_descriptors(live)
        rng = np.random.default_rng(seed)
        samples = []
        for repeat in range(repeats):
            local = draw_block_ids(rng, kinds, pool, logical_per_request)
            remote = draw_block_ids(rng, kinds, pool, logical_per_request)
            started = time.perf_counter()
            meta = request_meta(local, remote)
            meta.local_physical_block_ids = live.worker._logical_to_kernel_block_ids(local)
            live.worker._read_blocks_for_req(f"r{repeat}", meta)
            samples.append(time.perf_counter() - started)
            live.wait(f"r{repeat}")
        return statistics.median(samples) * 1e6, seen["descriptors"]
    finally:
        live.close()


def read_path_rows(quick: bool, progress) -> list[dict]:
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.worker import NixlConnectorWorker

    from vllm_nixl_hma.worker import NixlHMAConnectorWorker

    token_sizes = (8192, 131072) if quick else (8192, 32768, 131072)
    ratios = (1, 10) if quick else (1, 6, 10, 66)
    layer_counts = (8,) if quick else (8, 64)
    rows = []
    for tokens in token_sizes:
        for ratio in ratios:
            for layout in LAYOUTS:
                for layers in layer_counts:
                    repeats = 3 if quick else 5
                    case = (layout, tokens, ratio, layers, repeats, tokens + ratio + layers)
                    us_ours, d_ours = time_read_path(NixlHMAConnectorWorker, *case)
                    us_stock, d_stock = time_read_path(NixlConnectorWorker, *case)
                    rows.append(
                        {
                            "tokens": tokens,
                            "ratio": ratio,
                            "layout": layout,
                            "layers": layers,
                            "descriptors_ours": d_ours,
                            "descriptors_stock": d_stock,
                            "us_ours": round(us_ours, 1),
                            "us_stock": round(us_stock, 1),
                            "ratio_ours_over_stock": round(us_ours / us_stock, 3),
                        }
                    )
                    progress(f"read path: {tokens} tokens r={ratio} {layout} {layers} layers")
    return rows


def connector_gbps(worker_cls, tokens, repeats, seed) -> tuple[int, float]:
    """(bytes per request, median GB/s) of reads through a connector worker."""
    import numpy as np

    from vllm_nixl_hma.harness.read_path import build_live_read_path

    kinds = LAYOUTS["hybrid"]
    logical_per_request = math.ceil(tokens / (TRANSFER_RATIO * KERNEL_BLOCK_TOKENS))
    pool = 2 * logical_per_request + 2
    live = build_live_read_path(
        worker_cls,
        kinds,
        TRANSFER_RATIO,
        layers=TRANSFER_LAYERS,
        logical_blocks=pool,
        page_bytes=TRANSFER_PAGE_BYTES,
        mamba_shapes=TRANSFER_MAMBA_SHAPES,
    )
    try:
        worker = live.worker
        conv_bytes, ssm_bytes = worker._mamba_ssm_size
        attention_bytes = logical_per_request * TRANSFER_RATIO * TRANSFER_PAGE_BYTES
        request_bytes = TRANSFER_LAYERS * (attention_bytes + conv_bytes + ssm_bytes)
        rng = np.random.default_rng(seed)
        samples = []
        for repeat in range(repeats + 1):  # the first read warms UCX up
            local = draw_block_ids(rng, kinds, pool, logical_per_request)
            remote = draw_block_ids(rng, kinds, pool, logical_per_request)
            meta = request_meta(local, remote)
            meta.local_physical_block_ids = worker._logical_to_kernel_block_ids(local)
            started = time.perf_counter()
            worker._read_blocks_for_req(f"r{repeat}", meta)
            live.wait(f"r{repeat}")
            if repeat:
                samples.append(time.perf_counter() - started)
        return request_bytes, request_bytes / statistics.median(samples) / 1e9
    finally:
        live.close()


def raw_nixl_gbps(num_bytes: int, repeats: int) -> float:
    """Two NIXL agents, one descriptor each side, READ of ``num_bytes``."""
    import uuid

    import torch
    from nixl._api import nixl_agent, nixl_agent_config

    config = nixl_agent_config(backends=["UCX"])
    reader = nixl_agent(f"raw-reader-{uuid.uuid4()}", config)
    owner = nixl_agent(f"raw-owner-{uuid.uuid4()}", config)
    source = torch.ones(num_bytes, dtype=torch.uint8)
    target = torch.zeros(num_bytes, dtype=torch.uint8)
    owner_reg = owner.register_memory(owner.get_reg_descs([source]))
    reader_reg = reader.register_memory(reader.get_reg_descs([target]))
    owner_name = reader.add_remote_agent(owner.get_agent_metadata())
    samples = []
    try:
        for repeat in range(repeats + 1):
            started = time.perf_counter()
            handle = reader.initialize_xfer(
                "READ",
                reader.get_xfer_descs([target]),
                owner.get_xfer_descs([source]),
                owner_name,
            )
            reader.transfer(handle)
            deadline = time.monotonic() + 120
            while (state := reader.check_xfer_state(handle)) == "PROC":
                if time.monotonic() > deadline:
                    raise TimeoutError("raw NIXL read did not finish in 120 s")
            reader.release_xfer_handle(handle)
            if state != "DONE":
                raise RuntimeError(f"raw NIXL read ended {state}")
            if repeat:
                samples.append(time.perf_counter() - started)
        if not bool(target.all()):
            raise RuntimeError("raw NIXL read did not move the bytes")
    finally:
        reader.remove_remote_agent(owner_name)
        reader.deregister_memory(reader_reg)
        owner.deregister_memory(owner_reg)
    return num_bytes / statistics.median(samples) / 1e9


def memcpy_gbps(num_bytes: int, repeats: int) -> float:
    import numpy as np

    source = np.ones(num_bytes, dtype=np.uint8)
    target = np.zeros(num_bytes, dtype=np.uint8)
    samples = []
    for repeat in range(repeats + 1):
        started = time.perf_counter()
        np.copyto(target, source)
        if repeat:
            samples.append(time.perf_counter() - started)
    return num_bytes / statistics.median(samples) / 1e9


def transfer_rows(quick: bool, progress) -> list[dict]:
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.worker import NixlConnectorWorker

    from vllm_nixl_hma.worker import NixlHMAConnectorWorker

    token_sizes = (2048, 8192) if quick else (2048, 8192, 32768)
    repeats = 3 if quick else 7
    rows = []
    for tokens in token_sizes:
        num_bytes, gbps_ours = connector_gbps(NixlHMAConnectorWorker, tokens, repeats, tokens)
        _, gbps_stock = connector_gbps(NixlConnectorWorker, tokens, repeats, tokens)
        gbps_raw = raw_nixl_gbps(num_bytes, repeats)
        gbps_memcpy = memcpy_gbps(num_bytes, repeats)
        rows.append(
            {
                "tokens": tokens,
                "bytes": num_bytes,
                "gbps_ours": round(gbps_ours, 3),
                "gbps_stock": round(gbps_stock, 3),
                "gbps_raw_nixl": round(gbps_raw, 3),
                "gbps_memcpy": round(gbps_memcpy, 3),
                "efficiency_vs_raw": round(gbps_ours / gbps_raw, 3),
            }
        )
        progress(f"transfer: {num_bytes / 2**20:.0f} MiB")
    return rows


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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    parser.add_argument("--quick", action="store_true", help="fewer sizes and repeats")
    parser.add_argument(
        "--only", choices=("read_path", "transfer"), help="run one of the two benchmarks"
    )
    args = parser.parse_args(argv)
    from vllm_nixl_hma.cli import reserve_stdout_for_json

    json_stream = reserve_stdout_for_json()

    def progress(line: str) -> None:
        print(f"[bench] {line}", file=sys.stderr, flush=True)

    result: dict = {"machine": machine()}
    if args.only in (None, "read_path"):
        result["read_path"] = read_path_rows(args.quick, progress)
        print_table("read path (decode CPU per request, us)", result["read_path"])
    if args.only in (None, "transfer"):
        result["transfer"] = transfer_rows(args.quick, progress)
        print_table("transfer (GB/s)", result["transfer"])
    if args.json:
        print(json.dumps(result), file=json_stream)
    json_stream.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
