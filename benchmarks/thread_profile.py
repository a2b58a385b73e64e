"""Which threads move a read: ``python benchmarks/thread_profile.py [PLAN ...]``.

Not part of the test suite. Reads the transfer benchmark's hybrid request
(``--tokens``, default 8192: 130 MiB) ``--reads`` times through one plan per
process (each plan alone, as in ``run.py``) and prints, per read, the wall
time, the time the caller spends in the post (``make_prepped_xfer`` and
``transfer``), the caller's CPU and the CPU of every other thread that
worked, in clock ticks of ``/proc/self/task/*/stat`` (10 ms on Linux).
Plans: ``ours`` (our worker, split ``read_threads.DEFAULT_SPLIT_BATCH_SIZE``),
``ours-nixl-default`` (our worker with NIXL's default split, 1024) and
``stock`` (vLLM 0.21.0's worker). README's Performance section has a run.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

PLANS = ("ours", "ours-nixl-default", "stock")
NIXL_DEFAULT_SPLIT = 1024


def thread_ticks() -> dict[str, int]:
    """user + system clock ticks of every thread of this process."""
    ticks = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended meanwhile
            continue
        ticks[tid] = int(fields[11]) + int(fields[12])
    return ticks


def profile(plan: str, tokens: int, reads: int) -> str:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import run as bench

    from vllm_nixl_hma.core import read_threads

    if plan == "ours-nixl-default":
        read_threads.DEFAULT_SPLIT_BATCH_SIZE = NIXL_DEFAULT_SPLIT
    worker_cls = bench.worker_classes()["stock" if plan == "stock" else "ours"]
    _, pool, requests = bench.transfer_requests(tokens, reads + 1, tokens)
    live = bench.live_transfer_path(worker_cls, pool)
    caller = str(threading.get_native_id())
    try:
        live.read("warm-up", *requests[0])
        live.wait("warm-up")
        before, started, posting = thread_ticks(), time.perf_counter(), 0.0
        for index, (local, remote) in enumerate(requests[1:]):
            post_started = time.perf_counter()
            live.read(f"r{index}", local, remote)
            posting += time.perf_counter() - post_started
            live.wait(f"r{index}")
        wall = time.perf_counter() - started
        after = thread_ticks()
    finally:
        live.close()
    others = sorted(
        (after[t] - before.get(t, 0) for t in after if t != caller and after[t] > before.get(t, 0)),
        reverse=True,
    )
    return (
        f"{plan:>17}  {wall / reads * 1e3:7.1f} ms/read  {posting / reads * 1e3:6.1f} ms posting"
        f"  caller {after[caller] - before[caller]:3d} ticks  other threads {others}"
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("plans", nargs="*", help=f"of {', '.join(PLANS)} (default: all)")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--reads", type=int, default=6)
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a child process runs one plan
    args = parser.parse_args(argv)
    unknown = sorted(set(args.plans) - set(PLANS))
    if unknown:
        parser.error(f"unknown plan(s) {unknown}; choose from {list(PLANS)}")
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    os.environ.setdefault("VLLM_SSM_CONV_STATE_LAYOUT", "DS")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.one:
        print(profile(args.one, args.tokens, args.reads), flush=True)
        return 0
    for plan in args.plans or PLANS:
        command = [sys.executable, __file__, "--one", plan, "--tokens", str(args.tokens)]
        command += ["--reads", str(args.reads)]
        done = subprocess.run(command, capture_output=True, text=True, timeout=600)
        if done.returncode:
            print(done.stderr[-2000:], file=sys.stderr)
            return done.returncode
        print(done.stdout.strip().splitlines()[-1])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
