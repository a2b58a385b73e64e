"""Benchmarks (not part of the test suite): ``python benchmarks/run.py [--json] [--quick]``.

Read path: decode-side CPU time per request from the request's metadata to
the posted transfer (local expansion, remote expansion, alignment, descriptor
ids), ours against stock vLLM 0.21.0 ``NixlConnectorWorker`` on identical
inputs in the same run. Both workers run their real read-path methods over
real vLLM KV cache specs, topology and TP mapping (harness/read_path.py);
only the NIXL agent is a stand-in whose ``make_prepped_xfer`` records the
descriptor count and returns, so NIXL's own preparation time is NOT in these
numbers (it depends on the descriptor count, which the table shows). Equal
ratios on both sides, so that stock computes the right blocks too.

Prints a table (stderr) and, with ``--json``, one JSON object on stdout:
``{"read_path": [{"tokens", "ratio", "layout", "layers", "descriptors_ours",
"descriptors_stock", "us_ours", "us_stock", "ratio_ours_over_stock"}]}``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_SSM_CONV_STATE_LAYOUT", "DS")

KERNEL_BLOCK_TOKENS = 16
LAYOUTS = {"dense": ["full_attention"], "hybrid": ["full_attention", "mamba"]}


class RecordingNixl:
    """Stands in for the NIXL agent: records descriptor counts, moves nothing."""

    def __init__(self) -> None:
        self.descriptors = 0

    def make_prepped_xfer(self, op, local_handle, local_ids, remote_handle, remote_ids, **kw):
        self.descriptors = len(local_ids)
        return 1

    def transfer(self, handle) -> None:
        return None

    def send_notif(self, *args, **kwargs) -> None:
        return None


def time_read_path(worker_cls, layout, tokens, ratio, layers, repeats, seed):
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import RemoteMeta, ReqMeta

    from vllm_nixl_hma.harness.read_path import REMOTE_ENGINE, build_read_path_worker

    kinds = LAYOUTS[layout]
    logical_per_request = math.ceil(tokens / (ratio * KERNEL_BLOCK_TOKENS))
    pool = 2 * logical_per_request + 16
    nixl = RecordingNixl()
    worker = build_read_path_worker(
        worker_cls,
        kinds,
        ratio,
        ratio,
        nixl,
        logical_blocks=pool,
        kernel_block_tokens=KERNEL_BLOCK_TOKENS,
        num_regions=layers,
    )
    rng = random.Random(seed)

    def ids():
        free = rng.sample(range(1, pool), logical_per_request + 1)
        return [free[:logical_per_request] if k != "mamba" else [free[-1]] for k in kinds]

    samples = []
    for _ in range(repeats):
        local, remote = ids(), ids()
        started = time.perf_counter()
        meta = ReqMeta(
            local_block_ids=local,
            local_physical_block_ids=[],
            tp_size=1,
            remote=RemoteMeta(
                block_ids=remote,
                host="127.0.0.1",
                port=1,
                engine_id=REMOTE_ENGINE,
                request_id="p",
            ),
        )
        meta.local_physical_block_ids = worker._logical_to_kernel_block_ids(meta.local_block_ids)
        worker._read_blocks_for_req("r", meta)
        samples.append(time.perf_counter() - started)
        worker._recving_transfers.clear()
    return statistics.median(samples) * 1e6, nixl.descriptors


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--quick", action="store_true", help="fewer sizes and repeats")
    args = parser.parse_args(argv)
    from vllm_nixl_hma.cli import reserve_stdout_for_json

    json_stream = reserve_stdout_for_json()

    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.worker import NixlConnectorWorker

    from vllm_nixl_hma.worker import NixlHMAConnectorWorker

    token_sizes = (8192, 131072) if args.quick else (8192, 32768, 131072)
    ratios = (1, 10) if args.quick else (1, 6, 10, 66)
    layer_counts = (8,) if args.quick else (8, 64)
    rows = []
    for tokens in token_sizes:
        for ratio in ratios:
            for layout in LAYOUTS:
                for layers in layer_counts:
                    repeats = 5 if args.quick else (7 if tokens * layers >= 131072 * 64 else 15)
                    us_ours, d_ours = time_read_path(
                        NixlHMAConnectorWorker, layout, tokens, ratio, layers, repeats, 1
                    )
                    us_stock, d_stock = time_read_path(
                        NixlConnectorWorker, layout, tokens, ratio, layers, repeats, 1
                    )
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
                    print(
                        f"[bench] {tokens} tokens r={ratio} {layout} {layers} layers",
                        file=sys.stderr,
                    )
    columns = list(rows[0])
    widths = [max(len(c), *(len(str(r[c])) for r in rows)) for c in columns]
    print(" ".join(f"{c:>{w}}" for c, w in zip(columns, widths, strict=True)), file=sys.stderr)
    for row in rows:
        print(
            " ".join(f"{row[c]!s:>{w}}" for c, w in zip(columns, widths, strict=True)),
            file=sys.stderr,
        )
    if args.json:
        print(json.dumps({"read_path": rows}), file=json_stream)
    json_stream.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
