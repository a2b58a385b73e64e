"""Prefix caching of a Mamba hybrid in P/D, measured (not part of the test suite).

    $(bash tools/env.sh cpu)/bin/python benchmarks/prefix_caching.py [--json] [--quick]

(the engines run in vLLM's CPU build, this interpreter's; the check harness's
part runs in the main environment, ``bash tools/env.sh``, in a subprocess)

Two parts, side by side in one run, each printing a table with ratios:

Prefill (real engines, vLLM's CPU build): one engine of the embedded
GatedDeltaNet hybrid with ``NixlHMAConnector`` (``kv_both``), started once with
prefix caching (``--enable-prefix-caching``: Mamba cache mode ``align``) and
once without. Per conversation, turn 1 (``2*block + 1`` tokens) and then turn 2
(turn 1, its answer and a new message: one block more), each with
``max_tokens`` 1, as a prefill engine serves them. For turn 2: its wall time
(HTTP request to answer, the prefill step) and the tokens the engine computed
(prompt tokens less its prefix-cache hits, from vLLM's own
``vllm:prefix_cache_hits``). Medians over conversations that share nothing.

Decode reads (real bytes through NIXL, the check harness): the same prompts
read with a decode-side prefix-cache hit (``decode-hit``: hits inside a
prefill block, on a boundary of both sides, one block before the end) and
without (``no-hit``), hybrid layout, prefill TP 2 -> decode TP 1 and 1 -> 2
(unequal ratios); bytes, descriptors and seconds from posting to the last
completion, medians of the repeats; every slot is checked (0 mismatched, or
the row says so). Stock vLLM 0.21.0 cannot read a decode hit at unequal
ratios (it misreads or asserts: tests/integration/test_prefix_caching.py), so
there is no stock column; ``raw NIXL`` and ``memcpy`` of the same bytes would
measure the link, which ``run.py`` already does.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def measure_turns(engine, conversations: int, logs: Path) -> dict[str, list[float]]:
    """Turn 2 of ``conversations`` conversations on one engine: seconds,
    tokens computed and prompt tokens of each."""
    from vllm_nixl_hma.e2e import conversation
    from vllm_nixl_hma.e2e.models import VOCAB_SIZE
    from vllm_nixl_hma.e2e.servers import post_json

    block = engine.block_tokens()[0]
    if block is None:
        raise RuntimeError(f"the engine reported no block size; see {logs}")

    def send(ids: list[int]) -> float:
        body = {"model": "model", "prompt": ids, "max_tokens": 1, "temperature": 0.0}
        started = time.perf_counter()
        answer = post_json(engine.url, "/v1/completions", body, 300)
        if answer.status != 200:
            raise RuntimeError(f"HTTP {answer.status}: {answer.error}")
        return time.perf_counter() - started

    def hits() -> float:
        return conversation.counter(engine.get("/metrics")[1], "vllm:prefix_cache_hits")

    send(conversation.message_ids("warm-up", 2 * block + 1, VOCAB_SIZE))
    rows: dict[str, list[float]] = {"seconds": [], "computed": [], "tokens": []}
    for number in range(conversations):
        first = conversation.message_ids(f"bench-{number}", 2 * block + 1, VOCAB_SIZE)
        send(first)
        second = first + conversation.message_ids(f"bench-{number}-2", block, VOCAB_SIZE)
        before = hits()
        seconds = send(second)
        rows["seconds"].append(seconds)
        rows["computed"].append(len(second) - (hits() - before))
        rows["tokens"].append(len(second))
    return rows


def prefill_rows(conversations: int, progress) -> list[dict]:
    from vllm_nixl_hma.e2e.models import ensure_model
    from vllm_nixl_hma.e2e.run import PREFIX_CACHING_ARGS
    from vllm_nixl_hma.e2e.servers import EngineSpec, ServerSet
    from vllm_nixl_hma.harness.coordinator import free_port

    model = str(ensure_model("hybrid"))
    measured: dict[bool, dict[str, list[float]]] = {}
    logs = Path(tempfile.mkdtemp(prefix="bench-prefix-caching-"))
    for caching in (True, False):
        progress(f"prefill engine, prefix caching {'on' if caching else 'off'}")
        with ServerSet(logs) as servers:
            engine = servers.start_engine(
                EngineSpec(
                    f"prefill-{'cached' if caching else 'uncached'}",
                    model_dir=model,
                    port=free_port(),
                    connector="NixlHMAConnector",
                    side_channel_port=free_port(),
                    extra_args=PREFIX_CACHING_ARGS if caching else (),
                    extra_config={"progress_thread_delay_us": 1000},
                )
            )
            engine.wait_ready(900)
            measured[caching] = measure_turns(engine, conversations, logs)
    cached, uncached = measured[True], measured[False]
    seconds_on = statistics.median(cached["seconds"])
    seconds_off = statistics.median(uncached["seconds"])
    computed_on = statistics.median(cached["computed"])
    computed_off = statistics.median(uncached["computed"])
    return [
        {
            "turn": 2,
            "prompt_tokens": int(statistics.median(cached["tokens"])),
            "tokens_computed_cached": int(computed_on),
            "tokens_computed_uncached": int(computed_off),
            "computed_ratio": round(computed_on / computed_off, 3),
            "seconds_cached": round(seconds_on, 3),
            "seconds_uncached": round(seconds_off, 3),
            "seconds_ratio": round(seconds_on / seconds_off, 3),
            "conversations": conversations,
        }
    ]


def decode_rows(repeats: int, progress) -> list[dict]:
    from vllm_nixl_hma.harness import coordinator
    from vllm_nixl_hma.harness.model_shapes import LAYOUTS

    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    root = Path(tempfile.mkdtemp(prefix="bench-prefix-caching-models-"))
    model_dir = coordinator.model_dir_for(LAYOUTS["hybrid"], root)
    rows = []
    pool = coordinator.RankPool(3)
    try:
        for p_tp, d_tp in ((2, 1), (1, 2)):
            progress(f"decode reads, hybrid P_TP={p_tp} D_TP={d_tp}")
            scenarios = [
                coordinator.Scenario(name)
                for _ in range(repeats)
                for name in ("decode-hit", "no-hit")
            ]
            cell = coordinator.Cell(
                "hybrid", model_dir, p_tp, d_tp, "NixlHMAConnector", scenarios, prefix_caching=True
            )
            results = coordinator.run_cell(pool, cell, progress=lambda line: None)
            by_name: dict[str, list] = {"decode-hit": [], "no-hit": []}
            for result in results[2:]:  # the first pair also makes the handshake
                by_name[result.name].append(result)
            hit, whole = by_name["decode-hit"], by_name["no-hit"]

            def median(rows, field):
                return statistics.median(getattr(r, field) for r in rows)

            rows.append(
                {
                    "p_tp": p_tp,
                    "d_tp": d_tp,
                    "ratio_d_p": f"{results[0].local_ratio}/{results[0].remote_ratio}",
                    "bytes_hit": int(median(hit, "bytes")),
                    "bytes_whole": int(median(whole, "bytes")),
                    "bytes_ratio": round(median(hit, "bytes") / max(median(whole, "bytes"), 1), 3),
                    "descriptors_hit": int(median(hit, "descriptors")),
                    "descriptors_whole": int(median(whole, "descriptors")),
                    "seconds_hit": round(median(hit, "seconds"), 4),
                    "seconds_whole": round(median(whole, "seconds"), 4),
                    "mismatched_slots": sum(r.mismatched_slots for r in results),
                    "errors": sorted({r.error for r in results if r.error}),
                }
            )
    finally:
        pool.close()
    return rows


def decode_rows_in_main_environment(quick: bool, progress) -> list[dict]:
    """``decode_rows`` run by the main environment's interpreter (the check
    harness runs on vLLM's CUDA build with its CPU substitutions)."""
    import subprocess

    venv = (
        subprocess.run(
            ["bash", str(ROOT / "tools" / "env.sh")], check=True, capture_output=True, text=True
        )
        .stdout.strip()
        .splitlines()[-1]
    )
    command = [f"{venv}/bin/python", __file__, "--decode-reads-only"]
    if quick:
        command.append("--quick")
    progress(f"decode reads in {venv}")
    done = subprocess.run(command, check=True, capture_output=True, text=True, cwd=ROOT)
    return json.loads(done.stdout.strip().splitlines()[-1])


def print_table(title: str, rows: list[dict]) -> None:
    print(f"\n{title}", file=sys.stderr)
    if not rows:
        return
    keys = list(rows[0])
    widths = {k: max(len(k), *(len(str(r[k])) for r in rows)) for k in keys}
    print(" ".join(f"{k:>{widths[k]}}" for k in keys), file=sys.stderr)
    for row in rows:
        print(" ".join(f"{str(row[k]):>{widths[k]}}" for k in keys), file=sys.stderr)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    parser.add_argument("--quick", action="store_true", help="fewer conversations and repeats")
    parser.add_argument("--decode-reads-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    def progress(line: str) -> None:
        print(f"[bench] {line}", file=sys.stderr, flush=True)

    conversations, repeats = (2, 2) if args.quick else (5, 5)
    if args.decode_reads_only:
        print(json.dumps(decode_rows(repeats, progress)))
        return 0
    result = {
        "prefill": prefill_rows(conversations, progress),
        "decode_reads": decode_rows_in_main_environment(args.quick, progress),
    }
    print_table(
        "prefill, turn 2 of a conversation, prefix caching on against off (medians)",
        result["prefill"],
    )
    print_table(
        "decode reads of the same prompts, with a decode-side hit against whole (medians)",
        result["decode_reads"],
    )
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
