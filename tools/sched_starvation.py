"""Reproduce, without vLLM, NIXL or UCX, the starvation behind #43's stalled reads.

One session runs the load: processes that call ``sched_yield`` in a loop,
spin, and work or sleep in short bursts (``--load``; the default ``ybwwss``
is the mix a decode engine runs while it polls a read: vLLM's shared-memory
queue readers yield, NIXL's worker threads spin, ZMQ and progress threads
wake and sleep). Another process, the sleeper, sleeps 1 ms at a time and
records its longest wait for a core. With the kernel's session autogroups
(``/proc/sys/kernel/sched_autogroup_enabled`` 1) the load and the sleeper
are scheduled as two groups; on the kernel of this project's 2-core host
(6.18.44) the sleeper then waited 1.2, 12.1 and 0.05 s in three runs of 30 s;
with the sleeper in the load's session (``--same-session``) at most 0.016 s,
and with autogroups off at most 0.03 s (docs/faults.md, "Slow and stalled
reads").

    python tools/sched_starvation.py [--runs 3] [--seconds 30] [--same-session]

Each run prints the sleeper's longest wait; exit status 1 when one is over
``--limit-s`` (1 s). Nothing here needs root; the load takes every core for
``--seconds``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

AUTOGROUP = Path("/proc/sys/kernel/sched_autogroup_enabled")
#: y: sched_yield loop; b: spin; w: 2000 additions then a 50 us sleep; s: 200 us sleeps
MODES = "ybws"


def load(mode: str, seconds: float) -> None:
    end = time.monotonic() + seconds
    x = 0
    while time.monotonic() < end:
        if mode == "y":
            os.sched_yield()
        elif mode == "b":
            x += 1
        elif mode == "w":
            for _ in range(2000):
                x += 1
            time.sleep(0.00005)
        else:
            time.sleep(0.0002)


def sleeper(seconds: float) -> None:
    longest, last = 0.0, time.monotonic()
    end = last + seconds
    while last < end:
        time.sleep(0.001)
        now = time.monotonic()
        longest, last = max(longest, now - last), now
    print(json.dumps({"longest_wait_s": round(longest, 3)}))


def one_run(mix: str, seconds: float, same_session: bool) -> float:
    me = [sys.executable, os.path.abspath(__file__)]
    # the load: a session of its own, every process of the mix in it; with
    # same_session its first process also runs the sleeper
    load_cmd = [*me, "--role", "load", "--load", mix, "--seconds", str(seconds + 2)]
    if same_session:
        load_cmd.append("--same-session")
    starter = subprocess.Popen(load_cmd, start_new_session=True, stdout=subprocess.PIPE, text=True)
    try:
        if same_session:
            out = starter.communicate(timeout=seconds + 60)[0]
        else:
            time.sleep(0.5)
            out = subprocess.run(
                [*me, "--role", "sleeper", "--seconds", str(seconds)],
                start_new_session=True,
                capture_output=True,
                text=True,
                check=True,
                timeout=seconds + 60,
            ).stdout
    finally:
        if starter.poll() is None:
            starter.wait(timeout=seconds + 60)
    return json.loads(out.strip().splitlines()[-1])["longest_wait_s"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--role", choices=("main", "load", "sleeper"), default="main")
    parser.add_argument("--load", default="ybwwss", help=f"one letter per process, of {MODES}")
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--limit-s", type=float, default=1.0)
    parser.add_argument("--same-session", action="store_true")
    args = parser.parse_args(argv)
    if args.role == "sleeper":
        sleeper(args.seconds)
        return 0
    if args.role == "load":
        import multiprocessing

        procs = [multiprocessing.Process(target=load, args=(m, args.seconds)) for m in args.load]
        for p in procs:
            p.start()
        if args.same_session:
            time.sleep(0.5)
            sleeper(args.seconds - 2.5)
        for p in procs:
            p.join()
        return 0
    if any(m not in MODES for m in args.load):
        parser.error(f"--load {args.load!r}: letters of {MODES} only")
    autogroup = AUTOGROUP.read_text().strip() if AUTOGROUP.exists() else "absent"
    print(
        f"kernel {os.uname().release}, sched_autogroup_enabled {autogroup}, load {args.load}, "
        f"sleeper in {'the same' if args.same_session else 'another'} session"
    )
    worst = []
    for index in range(1, args.runs + 1):
        worst.append(one_run(args.load, args.seconds, args.same_session))
        print(f"run {index}: the sleeper's longest wait for a core {worst[-1]} s", flush=True)
    return 1 if max(worst) > args.limit_s else 0


if __name__ == "__main__":
    raise SystemExit(main())
